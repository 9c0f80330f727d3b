// train_gpt's data and tokenizer (Note [the trainer's data and tokenizer]): --data as text, a directory of
// text or a token file; --tokenizer byte | bpe:N | gpt2:DIR, or the one a resumed checkpoint or a token
// file's sidecar fixes; --data-export.
//   const train_gpt::TrainingData d = train_gpt::load_training_data(o, resumed_record);   // d.tok, *d.ds
#pragma once

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <typegrad/data/dataset.hpp>
#include <typegrad/data/token_file.hpp>
#include <typegrad/data/tokenizer.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/train/run.hpp>

#include "options.hpp"

namespace train_gpt {

using tg::train::Clock;
using tg::train::seconds_since;

// Note [the trainer's data and tokenizer]
// --data is a text file, a directory of text files (concatenated in sorted order) or a token file (docs/
// data.md; told apart by its magic), by default the fortunes corpus. The tokenizer comes, first match wins,
// from the checkpoint a run resumes (so a resumed run tokenizes as it did; a --tokenizer of another kind is
// an error), from a token file's sidecar, or from --tokenizer: "byte", "gpt2:DIR", or "bpe:N", a byte-level
// BPE trained on the text's first 1 - val_fraction (the train part, so validation text is unseen) and
// cached by corpus hash and N next to the data (in the user's cache directory for the fortunes corpus, or
// when the data's directory is not writable). The tokenizer's JSON is saved in every checkpoint, with the
// model's shape, so `generate` rebuilds both from the file. --data-export writes the tokens of a text
// --data as a token file with the tokenizer in its sidecar, and the trainer exits.

struct TrainingData {
  tg::data::AnyTokenizer tok;
  std::optional<tg::data::TextDataset> ds;
  std::vector<std::int32_t> tokens;  // a text corpus's tokens (for --data-export); empty for a token file
};

/// The tokenizer a resumed checkpoint was trained with (byte-level when it records none: older files).
inline std::optional<tg::data::AnyTokenizer> checkpoint_tokenizer(const std::optional<tg::io::TrainStateRecord>& resumed) {
  if (!resumed) return std::nullopt;
  if (resumed->tokenizer_json.empty()) return tg::data::AnyTokenizer{};
  return tg::data::AnyTokenizer::from_json(resumed->tokenizer_json);
}

/// The --tokenizer a checkpoint's run used ("byte" for checkpoints from before the flag).
inline std::string tokenizer_setting(const std::string& config_json) {
  const auto j = nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false);
  if (j.is_object())
    if (auto it = j.find("tokenizer"); it != j.end() && it->is_string()) return it->get<std::string>();
  return "byte";
}

/// Reads --data and builds the tokenizer (Note [the trainer's data and tokenizer]); prints what it did.
inline TrainingData load_training_data(const Options& o, const std::optional<tg::io::TrainStateRecord>& resumed) {
  namespace fs = std::filesystem;
  TrainingData d;
  const tg::data::TokenizerSpec spec = tg::data::parse_tokenizer_spec(o.tokenizer);
  std::optional<tg::data::AnyTokenizer> fixed = checkpoint_tokenizer(resumed);
  if (fixed && o.tokenizer_given && spec.kind != fixed->kind())
    throw tg::Error("--tokenizer ", o.tokenizer, ": the checkpoint being resumed was trained with another tokenizer (",
                    fixed->describe(), "); resume without --tokenizer");
  if (!o.data.empty() && !fs::is_directory(o.data) && tg::data::is_token_file(o.data)) {
    if (!o.data_export.empty()) throw tg::Error("--data-export: '", o.data, "' is already a token file; export from a text --data");
    // The tokenizer: the checkpoint's, else the sidecar's, else --tokenizer (which cannot train BPE without text).
    const fs::path sidecar = tg::data::token_file_tokenizer_path(o.data);
    std::optional<tg::data::AnyTokenizer> file_tok;
    if (fs::exists(sidecar)) {
      std::ifstream f(sidecar, std::ios::binary);
      std::stringstream text;
      text << f.rdbuf();
      if (!f.good() && !f.eof()) throw tg::Error("--data: cannot read the tokenizer sidecar '", sidecar.string(), "'");
      try {
        file_tok = tg::data::AnyTokenizer::from_json(text.str());
      } catch (const tg::Error& e) {
        throw tg::Error("--data: the tokenizer sidecar '", sidecar.string(), "' is damaged: ", e.what());
      }
    }
    if (fixed) d.tok = *fixed;
    else if (file_tok) d.tok = *file_tok;
    else if (spec.kind == "bpe")
      throw tg::Error("--tokenizer ", o.tokenizer, ": a BPE is trained on text, but --data '", o.data,
                      "' is a token file without a tokenizer sidecar; pass the tokenizer its ids were made with (byte or gpt2:DIR)");
    else d.tok = tg::data::make_tokenizer(o.tokenizer);
    if (file_tok && o.tokenizer_given && !fixed && spec.kind != file_tok->kind())
      throw tg::Error("--tokenizer ", o.tokenizer, ": the token file '", o.data, "' was written with another tokenizer (",
                      file_tok->describe(), "); drop --tokenizer to use it");
    if (file_tok && file_tok->to_json() != d.tok.to_json())
      throw tg::Error("--data: the token file '", o.data, "' was written with ", file_tok->describe(),
                      ", not the checkpoint's tokenizer (", d.tok.describe(), ")");
    const auto t0 = Clock::now();
    d.ds = tg::data::TextDataset::from_token_file(o.data, d.tok.vocab_size(), o.val_fraction, o.seq);
    std::printf("data: token file %s, %lld tokens, mapped and checked in %.2f s\n", o.data.c_str(),
                static_cast<long long>(d.ds->size()), seconds_since(t0));
    return d;
  }
  // A text corpus.
  std::string text, source;
  fs::path cache_near;  // where a BPE of this text is cached
  std::string stem = "corpus";
  if (o.data.empty()) {
    text = tg::data::load_fortunes_corpus();
    source = "fortunes corpus '" + std::string(tg::data::kFortunesDir) + "'";
    cache_near = tg::data::user_cache_dir();
    stem = "fortunes";
  } else if (fs::is_directory(o.data)) {
    text = tg::data::read_text_directory(o.data);
    source = "directory '" + o.data + "' (" + std::to_string(tg::data::list_text_files(o.data).size()) + " files)";
    const fs::path dir = fs::absolute(o.data).lexically_normal();
    cache_near = tg::data::default_bpe_cache_dir(dir.has_filename() ? dir : dir.parent_path());  // beside the directory, not in it
    stem = (dir.has_filename() ? dir : dir.parent_path()).filename().string();
  } else {
    text = tg::data::read_text_file(o.data);
    source = "file '" + o.data + "'";
    cache_near = tg::data::default_bpe_cache_dir(o.data);
    stem = fs::path(o.data).filename().string();
  }
  if (fixed) {
    d.tok = *fixed;
  } else if (spec.kind == "bpe") {
    // Trained on the part of the text that becomes the train split (the validation text stays unseen).
    const auto train_bytes = static_cast<std::size_t>(static_cast<double>(text.size()) * (1.0 - o.val_fraction));
    tg::data::BpeCacheResult res;
    d.tok = tg::data::make_tokenizer(o.tokenizer, {std::string_view(text).substr(0, train_bytes), cache_near, stem}, &res);
    std::printf("bpe: %s %s %s (%.2f s)\n", d.tok.describe().c_str(), res.from_cache ? "read from" : "trained and cached in",
                res.cache_file.c_str(), res.seconds);
  } else {
    d.tok = tg::data::make_tokenizer(o.tokenizer);
  }
  const auto t0 = Clock::now();
  d.tokens = d.tok.encode(text);
  const double encode_s = seconds_since(t0);
  if (d.tok.kind() != "byte")
    std::printf("data: %s, %.2f MB -> %lld tokens (%.2f bytes/token) in %.2f s\n", source.c_str(), static_cast<double>(text.size()) / 1e6,
                static_cast<long long>(d.tokens.size()), static_cast<double>(text.size()) / static_cast<double>(std::max<std::size_t>(1, d.tokens.size())),
                encode_s);
  if (!o.data_export.empty()) return d;  // the caller writes the file; no split or context check
  d.ds.emplace(std::move(d.tokens), o.val_fraction, o.seq, source);
  d.tokens = {};
  return d;
}

/// --data-export: the text corpus's tokens as a token file (docs/data.md) with the tokenizer in its sidecar.
inline int export_tokens(const Options& o, const TrainingData& d) {
  const auto t0 = Clock::now();
  tg::data::write_token_file(o.data_export, d.tokens, d.tok.vocab_size(), d.tok.to_json());
  std::printf("wrote %s: %lld tokens of %s (%s), tokenizer in %s (%.2f s); train with --data %s\n", o.data_export.c_str(),
              static_cast<long long>(d.tokens.size()), o.data.empty() ? "the fortunes corpus" : o.data.c_str(), d.tok.describe().c_str(),
              tg::data::token_file_tokenizer_path(o.data_export).c_str(), seconds_since(t0), o.data_export.c_str());
  return 0;
}

}  // namespace train_gpt

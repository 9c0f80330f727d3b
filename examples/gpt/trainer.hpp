// The trainer's pieces shared by its two translation units: options, data and checkpoint helpers, and the
// training loop, generic over the device (train_gpt.cpp: the CPU path and main(); train_gpt_cuda.cpp: the
// GPU path, compiled once for fp32 and bf16).
//   train_gpt::Run r{...};  return train_gpt::train<tg::cpu>(r, model, opt, amp, [] {});
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numeric>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <typegrad/amp/amp.hpp>
#include <typegrad/detail/cuda/runtime.hpp>
#include <typegrad/data/dataset.hpp>
#include <typegrad/data/prefetch.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/data/token_file.hpp>
#include <typegrad/data/tokenizer.hpp>
#include <typegrad/io/model_config.hpp>
#include <typegrad/io/scaler_state.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/generate.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "guards.hpp"

namespace train_gpt {

struct Options {
  std::string data;         // a text file, a directory of text files or a token file (docs/data.md); "": fortunes
  std::string tokenizer = "byte";  // byte | bpe:N | gpt2:DIR (docs/tokenizers.md)
  bool tokenizer_given = false;    // --tokenizer was on the command line (a resumed run otherwise keeps its own)
  std::string data_export;         // write --data's tokens to this token file and exit
  std::string model = "tiny";
  std::int64_t batch = 16;
  std::int64_t seq = 64;
  std::int64_t grad_accum = 1;
  std::int64_t steps = 2000;
  float lr = 2e-3f;
  float min_lr = -1.f;  // default: lr / 10
  std::int64_t warmup = 50;
  std::string schedule = "cosine";
  std::string optimizer = "adamw";
  float weight_decay = 0.1f;
  double clip = 1.0;
  std::uint64_t seed = 1337;
  int threads = 0;
  std::int64_t eval_every = 250;
  std::int64_t eval_batches = 8;
  std::int64_t sample_every = 0;
  std::int64_t sample_tokens = 200;
  float temperature = 0.8f;
  std::int64_t top_k = 40;
  double top_p = 1.0;
  float dropout = 0.0f;
  double val_fraction = 0.1;
  std::string log;
  std::string prompt = "\n";
  // checkpoints (docs/checkpoints.md)
  std::string save_dir;
  std::int64_t save_every = 0;  // 0: only at the end
  std::int64_t keep = 3;
  std::string resume;     // a checkpoint file, or a directory (its latest)
  std::string init_from;  // weights only (safetensors)
  std::string checkpoint = "none";
  std::string precision = "fp32";
  std::string device = "cpu";
  // guards (Note [the trainer's guards])
  bool share_save_dir = false;           // a fresh run may write beside another run's checkpoints
  bool resume_fallback = false;          // --resume DIR: fall back to the newest intact checkpoint
  bool allow_nonfinite_weights = false;  // load weights holding NaN / inf
  std::string on_nonfinite = "stop";     // stop | skip (Note [non-finite steps without a scaler])
  std::string log_errors = "stop";       // stop | warn
  std::string run_id;                    // filled by run_policy (Note [runs own their checkpoints])
  std::string model_json;                // filled by run_policy: the model's shape, saved in checkpoints (generate reads it)
  std::string tokenizer_json;            // filled by run_policy: the tokenizer, saved in checkpoints
  std::string plot;                      // a .png or .svg drawn from --log at the end (scripts/plot_log.py)
};

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

inline std::string human_bytes(std::int64_t b) {
  char buf[32];
  if (b >= (1ll << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ll << 30));
  else std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return buf;
}
inline std::string human_time(double s) {
  char buf[32];
  const int m = static_cast<int>(s) / 60;
  std::snprintf(buf, sizeof buf, "%dm%02ds", m, static_cast<int>(s) % 60);
  return buf;
}

inline tg::optim::Schedule make_schedule(const Options& o, std::int64_t steps) {
  using namespace tg::optim;
  const float min_lr = o.min_lr >= 0 ? o.min_lr : o.lr / 10;
  const std::int64_t decay_steps = std::max<std::int64_t>(1, steps - o.warmup);
  auto with_warmup = [&](auto decay) -> Schedule {
    if (o.warmup > 0) return Warmup{o.warmup}.then(decay);
    return decay;
  };
  if (o.schedule == "cosine") return with_warmup(Cosine{o.lr, decay_steps, min_lr});
  if (o.schedule == "linear") return with_warmup(LinearDecay{o.lr, decay_steps, min_lr});
  if (o.schedule == "constant") return with_warmup(Constant{o.lr});
  if (o.schedule == "invsqrt") return with_warmup(InverseSqrt{o.lr, std::max<std::int64_t>(1, o.warmup)});
  throw tg::Error("--schedule: unknown schedule '", o.schedule, "' (expected cosine, linear, constant or invsqrt)");
}

// The settings of each --optimizer, shared by the CPU optimizer (make_optimizer) and the GPU one
// (make_device_optimizer), so both devices run one configuration. `weight_decay` is what the matrices get:
// default_groups gives it to the decay group and 0 to the rest, the device optimizers decide the same way
// (Note [which parameters decay]).
inline tg::optim::AdamWOptions adam_options(const Options& o) {
  return {.lr = o.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = o.weight_decay};
}
inline tg::optim::SgdOptions sgd_options(const Options& o) {
  return {.lr = o.lr, .momentum = 0.9f, .dampening = 0.f, .nesterov = true, .weight_decay = o.weight_decay};
}
inline tg::optim::LambOptions lamb_options(const Options& o) {
  return {.lr = o.lr, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-6f, .weight_decay = o.weight_decay};
}
inline tg::optim::AdafactorOptions adafactor_options(const Options& o) {
  tg::optim::AdafactorOptions a;  // the paper's defaults, with --lr as the step size and decoupled decay
  a.lr = o.lr;
  a.relative_step = false;
  a.weight_decay = o.weight_decay;
  return a;
}
[[noreturn]] inline void unknown_optimizer(const Options& o) {
  throw tg::Error("--optimizer: unknown optimizer '", o.optimizer, "' (expected adamw, adam, sgd, lamb or adafactor)");
}

inline std::unique_ptr<tg::optim::Optimizer> make_optimizer(const Options& o, const std::vector<tg::optim::Param>& params) {
  using namespace tg::optim;
  auto groups = default_groups(params, o.weight_decay);
  if (o.optimizer == "adamw") return std::make_unique<AdamW>(groups, adam_options(o));
  if (o.optimizer == "adam") {
    const AdamWOptions a = adam_options(o);  // L2 decay (Adam's) with the same numbers
    return std::make_unique<Adam>(groups, AdamOptions{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay});
  }
  if (o.optimizer == "sgd") return std::make_unique<Sgd>(groups, sgd_options(o));
  if (o.optimizer == "lamb") return std::make_unique<Lamb>(groups, lamb_options(o));
  if (o.optimizer == "adafactor") return std::make_unique<Adafactor>(groups, adafactor_options(o));
  unknown_optimizer(o);
}

/// make_optimizer's optimizer on device D (Note [device optimizers]): the same settings and decay groups,
/// the same state names.
template <tg::Device D>
std::unique_ptr<tg::optim::DeviceOptimizer<D>> make_device_optimizer(const Options& o,
                                                                     std::vector<tg::optim::BasicParam<D>> params) {
  using namespace tg::optim;
  if (o.optimizer == "adamw" || o.optimizer == "adam")
    return std::make_unique<DeviceAdam<D>>(std::move(params), adam_options(o), o.optimizer == "adamw");
  if (o.optimizer == "sgd") return std::make_unique<DeviceSgd<D>>(std::move(params), sgd_options(o));
  if (o.optimizer == "lamb") return std::make_unique<DeviceLamb<D>>(std::move(params), lamb_options(o));
  if (o.optimizer == "adafactor") return std::make_unique<DeviceAdafactor<D>>(std::move(params), adafactor_options(o));
  unknown_optimizer(o);
}

/// `t` on the host (a copy when it lives on a device).
template <class T, class D>
tg::Tensor<T> to_host(const tg::Tensor<T, D>& t) {
  if constexpr (std::is_same_v<D, tg::cpu>) return t;
  else return t.template to<tg::cpu>();
}

/// A validation result: the mean cross-entropy per token (nats) and the same loss per byte of text, in bits.
struct Eval {
  double loss = 0;
  double bits_per_byte = 0;
};

/// Mean cross-entropy over `batches` sequential validation batches (no tape), and bits per byte: the
/// batches' summed loss over ln 2 times the bytes their target tokens decode to (`token_bytes[id]`), so runs
/// with different tokenizers compare (a byte-level run's bits per byte is its loss / ln 2).
template <class Model>
Eval evaluate(const Model& model, const tg::data::TextDataset& ds, std::int64_t batch, std::int64_t seq, std::int64_t batches,
              const std::vector<std::int32_t>& token_bytes) {
  tg::NoGrad no_grad;
  auto sampler = tg::data::BatchSampler::sequential(ds.validation(), batch, seq);
  const std::int64_t n = std::max<std::int64_t>(1, std::min(batches, sampler.num_batches()));
  double total = 0, nats = 0, bytes = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto b = sampler.next();
    const double mean = static_cast<double>(tg::cross_entropy(model.template forward<tg::fp32>(b.inputs), b.targets).item());
    total += mean;
    nats += mean * static_cast<double>(b.targets.numel());
    for (std::int64_t k = 0; k < b.targets.numel(); ++k) bytes += token_bytes[static_cast<std::size_t>(b.targets.data()[k])];
  }
  return {total / static_cast<double>(n), bytes > 0 ? nats / (std::log(2.0) * bytes) : 0.0};
}

// Note [trained positions]
// A model is built with block_size = max(the preset's, --seq) positions, but a run trains only positions
// 0 .. --seq - 1: the rest keep their random initial embeddings, and a sample whose window reaches them
// degrades into noise there (a tiny GPT trained at --seq 64 sampled with its 128-position window did, past
// character 64). So the trainer counts the positions training reached (the largest --seq of the run,
// across resumes: "trained_positions" in the checkpoint's state), prints it in the header, and samples
// over a sliding window of at most that many positions.

/// `tokens` tokens sampled after `prompt` (temperature, top-k, top-p; Note [sampling the next token]) with a
/// KV cache over a window of at most `window` positions, the positions training reached (Note [trained
/// positions], Note [the decoding window]); returns the prompt and the continuation as text.
template <class Model, class Tok>
std::string generate(const Model& model, const Tok& tok, const std::string& prompt, std::int64_t tokens, float temperature,
                     std::int64_t top_k, tg::Generator& gen, std::int64_t window, double top_p = 1.0) {
  TG_CHECK(window >= 1, "generate: the window must be at least 1 position, got ", window);
  std::vector<std::int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids = tok.encode("\n");
  tg::nn::Decoder dec(model, window);
  dec.set_prompt(ids);
  const tg::nn::SamplingOptions opts{std::max(temperature, 1e-4f), top_k, top_p};
  for (std::int64_t s = 0; s < tokens; ++s) ids.push_back(dec.next(opts, gen));
  return tok.decode(std::span<const std::int32_t>(ids));
}

// ---- data and tokenizer -----------------------------------------------------------------------------

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

// ---- checkpoints ----------------------------------------------------------------------------------
// The settings that decide what a run computes (not where it writes), as JSON for the checkpoint.
inline std::string run_config_json(const Options& o) {
  auto str = [](const std::string& v) {
    std::string out = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += c;
      }
    }
    return out + "\"";
  };
  auto num = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  std::ostringstream j;
  j << "{\"data\":" << str(o.data) << ",\"tokenizer\":" << str(o.tokenizer) << ",\"model\":" << str(o.model) << ",\"batch\":" << o.batch << ",\"seq\":" << o.seq
    << ",\"grad_accum\":" << o.grad_accum << ",\"steps\":" << o.steps << ",\"lr\":" << num(o.lr) << ",\"min_lr\":" << num(o.min_lr)
    << ",\"warmup\":" << o.warmup << ",\"schedule\":" << str(o.schedule) << ",\"optimizer\":" << str(o.optimizer)
    << ",\"weight_decay\":" << num(o.weight_decay) << ",\"clip\":" << num(o.clip) << ",\"seed\":" << o.seed
    << ",\"dropout\":" << num(o.dropout) << ",\"val_fraction\":" << num(o.val_fraction)
    << ",\"precision\":" << str(o.precision) << "}";
  return j.str();
}

/// Everything the loop needs to continue exactly (Note [training-state checkpoints]).
struct LoopState {
  tg::optim::Schedule& schedule;
  tg::data::PrefetchingSampler& sampler;  // the train split's batches, prepared ahead on a thread
  tg::Generator& init_gen;
  tg::Generator& dropout_gen;
  tg::Generator& sample_gen;
  tg::optim::GradAccumRuntime& accum;
  double& loss_ema;
  std::int64_t& tokens_done;
  std::int64_t& nonfinite_skipped;  // steps skipped under --on-nonfinite skip (the run's total, across resumes)
  std::int64_t& trained_positions;  // Note [trained positions]
};

inline void save_checkpoint(tg::io::CheckpointDir& dir, const Options& o, std::int64_t step, const std::vector<tg::optim::Param>& params,
                     const tg::optim::Optimizer& opt, const LoopState& s, const std::optional<tg::io::ScalerStateRecord>& scaler) {
  tg::io::TrainStateRecord r;
  r.step = step;
  r.schedule_step = s.schedule.step();
  r.sampler = s.sampler.position();
  r.generators = {{"init", tg::io::record_of(s.init_gen)}, {"dropout", tg::io::record_of(s.dropout_gen)},
                  {"sample", tg::io::record_of(s.sample_gen)}};
  r.grad_accum = tg::io::GradAccumRecord{s.accum.n(), s.accum.micro_index(), s.accum.steps()};
  r.scalars = {{"loss_ema", s.loss_ema}, {"tokens_done", static_cast<double>(s.tokens_done)},
               {"nonfinite_skipped", static_cast<double>(s.nonfinite_skipped)},
               {"trained_positions", static_cast<double>(s.trained_positions)}};
  r.scaler = scaler;
  r.config_json = run_config_json(o);
  r.run_id = o.run_id;
  r.model_json = o.model_json;
  r.tokenizer_json = o.tokenizer_json;
  const auto t0 = Clock::now();
  const std::string path = dir.save(params, opt, r);
  std::printf("%ssaved %s (%.0f ms)\n", isatty(fileno(stdout)) ? "\n" : "", path.c_str(), seconds_since(t0) * 1e3);
}

/// A whole non-negative number below 2^53 (a count saved as a double), or an error naming the field.
inline std::int64_t count_field(const std::string& path, const char* name, double v) {
  if (!(std::isfinite(v) && v >= 0 && v < 9007199254740992.0 && v == std::floor(v)))
    throw tg::Error("--resume: ", path, ": state field '", name, "' must be a whole number from 0 to 2^53, got ", v);
  return static_cast<std::int64_t>(v);
}

/// Checks a checkpoint's positions against each other and against this run before anything is restored
/// (Note [the trainer's guards]): a record that passed its checksums can still hold numbers no run of these
/// settings reaches (a hand-edited or foreign file).
inline void validate_resume_record(const Options& o, const std::string& path, const tg::io::TrainStateRecord& r,
                                   const LoopState& s) {
  auto bad = [&](auto&&... parts) { throw tg::Error("--resume: ", path, ": ", parts...); };
  if (r.step > o.steps)
    bad("the checkpoint is at step ", r.step, ", beyond --steps ", o.steps, " (raise --steps to continue that run)");
  if (!r.grad_accum || r.grad_accum->n != o.grad_accum)
    bad("saved with --grad-accum ", r.grad_accum ? r.grad_accum->n : 0, ", this run uses ", o.grad_accum);
  if (r.grad_accum->micro_index != 0) bad("saved in the middle of an accumulation (micro_index ", r.grad_accum->micro_index, ")");
  // Steps taken and skipped add up to the step counter; the schedule and the accumulator count the taken ones.
  const std::int64_t skipped_scaler = r.scaler ? r.scaler->skipped_steps : 0;
  if (r.schedule_step > r.step || r.grad_accum->steps != r.schedule_step)
    bad("inconsistent counters: step ", r.step, ", schedule step ", r.schedule_step, ", accumulator steps ", r.grad_accum->steps);
  if (r.scaler && (r.scaler->steps != r.step || skipped_scaler > r.step || !(std::isfinite(r.scaler->scale) && r.scaler->scale > 0)))
    bad("inconsistent loss-scaler state: step ", r.step, ", scaler steps ", r.scaler->steps, ", skipped ", skipped_scaler,
        ", scale ", r.scaler->scale);
  std::uint64_t batches = 0;
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(r.step), static_cast<std::uint64_t>(o.grad_accum), &batches) ||
      r.sampler.counter != batches)
    bad("the sampler has drawn ", r.sampler.counter, " batches, but ", r.step, " steps of ", o.grad_accum, " micro-batches draw ",
        r.step * o.grad_accum);
  for (const auto& [name, g] : r.generators) {
    if (name == "init" && g.offset != s.init_gen.offset())
      bad("generator 'init' is at offset ", g.offset, ", a model built from the seed draws ", s.init_gen.offset());
    if (g.offset > (std::uint64_t{1} << 62)) bad("generator '", name, "' is at offset ", g.offset, ", beyond any run's draws");
  }
  const auto scalar = [&](const char* name) -> std::optional<double> {
    auto it = r.scalars.find(name);
    return it == r.scalars.end() ? std::nullopt : std::optional<double>(it->second);
  };
  if (auto v = scalar("tokens_done")) {
    const std::int64_t tokens = count_field(path, "tokens_done", *v), per_step = o.batch * o.seq * o.grad_accum;
    // With the same settings every step (taken or skipped) consumed per_step tokens.
    if (tg::io::config_differences(r.config_json, run_config_json(o)).empty() && tokens != r.step * per_step)
      bad("state field 'tokens_done' is ", tokens, ", but ", r.step, " steps of ", per_step, " tokens make ", r.step * per_step);
  }
  const std::int64_t skipped_nonfinite = count_field(path, "nonfinite_skipped", scalar("nonfinite_skipped").value_or(0));
  if (r.schedule_step + skipped_scaler + skipped_nonfinite != r.step)
    bad("inconsistent counters: step ", r.step, " is not the ", r.schedule_step, " steps taken plus the ",
        skipped_scaler + skipped_nonfinite, " skipped");
  if (auto v = scalar("loss_ema"); v && !std::isfinite(*v)) bad("state field 'loss_ema' is ", *v);
  if (auto v = scalar("trained_positions")) count_field(path, "trained_positions", *v);
}

/// --resume's checkpoint (a file, or a directory's newest; Note [runs own their checkpoints]) and its record,
/// read before the data (the record fixes the tokenizer) and the model.
inline tg::io::ResumeChoice choose_checkpoint(const Options& o) {
  tg::io::ResumeChoice choice;
  try {
    choice = tg::io::choose_resume(o.resume, o.resume_fallback);
  } catch (const tg::Error& e) {
    if (o.resume_fallback || std::string(e.what()).find("is damaged") == std::string::npos) throw;
    throw tg::Error(e.what(), " (--resume-fallback resumes from the newest intact checkpoint instead)");
  }
  for (const auto& [bad_path, why] : choice.skipped)
    std::printf("warning: --resume-fallback: passing over the damaged %s: %s\n", bad_path.c_str(), why.c_str());
  if (!choice.record) choice.record = tg::io::read_train_state_record(choice.path);
  return choice;
}

/// Loads the checkpoint `choice` into the model and optimizer, restores the loop's positions and hands back
/// the loss scaler's state (if the run had one); returns the step reached. Sets `run_id` to the resumed run's.
inline std::int64_t resume_from(const Options& o, const tg::io::ResumeChoice& choice, const std::vector<tg::optim::Param>& params,
                                tg::optim::Optimizer& opt, const LoopState& s, std::optional<tg::io::ScalerStateRecord>& scaler,
                                std::string& run_id) {
  const std::string& path = choice.path;
  validate_resume_record(o, path, *choice.record, s);  // before anything changes
  tg::io::TrainStateRecord r;
  try {
    r = tg::io::load_train_state(path, params, opt, {.allow_non_finite = o.allow_nonfinite_weights});
  } catch (const tg::io::NonFiniteTensor& e) {
    throw tg::io::NonFiniteTensor(e.what(), " (--allow-nonfinite-weights loads it anyway)");
  }
  for (const auto& d : tg::io::config_differences(r.config_json, run_config_json(o)))
    std::printf("warning: resuming with a different setting, the run will not repeat the original: %s\n", d.c_str());
  s.schedule.set_step(r.schedule_step);
  s.sampler.set_position(r.sampler);
  for (auto [name, gen] : {std::pair{"init", &s.init_gen}, {"dropout", &s.dropout_gen}, {"sample", &s.sample_gen}}) {
    auto it = r.generators.find(name);
    TG_CHECK(it != r.generators.end(), "--resume: ", path, " has no state for the '", name, "' generator");
    tg::io::restore(*gen, it->second);
  }
  s.accum.restore(r.grad_accum->steps, r.grad_accum->micro_index);
  if (auto it = r.scalars.find("loss_ema"); it != r.scalars.end()) s.loss_ema = it->second;
  if (auto it = r.scalars.find("tokens_done"); it != r.scalars.end()) s.tokens_done = static_cast<std::int64_t>(it->second);
  if (auto it = r.scalars.find("nonfinite_skipped"); it != r.scalars.end()) s.nonfinite_skipped = static_cast<std::int64_t>(it->second);
  if (auto it = r.scalars.find("trained_positions"); it != r.scalars.end())  // positions an earlier --seq reached
    s.trained_positions = std::max(s.trained_positions, static_cast<std::int64_t>(it->second));
  scaler = r.scaler;
  run_id = r.run_id;  // "" for a checkpoint saved before run ids: the run goes on owning the files without one
  std::printf("resumed from %s at step %lld of %lld (run %s)\n", path.c_str(), static_cast<long long>(r.step),
              static_cast<long long>(o.steps), r.run_id.empty() ? "without an id, saved before run ids" : r.run_id.c_str());
  if (std::filesystem::is_directory(o.resume))
    if (const auto others = tg::io::CheckpointDir(o.resume).other_runs(r.run_id); !others.empty())
      std::printf("note: %s also holds %zu checkpoint(s) of other runs (the newest: %s); this run is %s\n", o.resume.c_str(),
                  others.size(), others.back().second.c_str(), r.run_id.empty() ? "the one without an id" : r.run_id.c_str());
  if (r.step == o.steps) std::printf("note: the checkpoint is at the last step (--steps %lld): nothing left to train\n", static_cast<long long>(o.steps));
  return r.step;
}

// Note [training on a GPU]
// The CPU objects are the run's reference: the host model (nn::GPT) is built from the seed, --init-from and
// --resume load into it and its optimizer, and checkpoints are written from them. With --device cuda the
// loop trains a copy on the GPU (nn::BasicGPT<cuda>, built from the host model after any loading) with the
// device optimizer of --optimizer (make_device_optimizer: DeviceAdam, DeviceSgd, DeviceLamb or
// DeviceAdafactor, with make_optimizer's settings; state loaded from the host optimizer; Note [device
// optimizers]); before each checkpoint the weights and optimizer state are copied back into the host model
// and optimizer and saved as a CPU run saves them, so a GPU checkpoint resumes on the CPU and the other way
// round, for every optimizer. The generators, sampler, schedule and accumulator are host objects on both
// devices. The GPU loop runs amp::MixedPrecision<Policy, its default scaler, cuda> where the CPU loop runs
// the CPU one: 16-bit compute reads per-step bf16/fp16 copies of the GPU masters, converted on the GPU
// after each optimizer step that was taken (Note [master weights and per-step copies]); the copies are
// built after the host state (so any --init-from / --resume) and the optimizer state reached the GPU, so
// they start fresh. fp16's DynamicScaler unscales and checks the GPU gradients in one launch
// (amp::detail::unscale_grads), and clipping sums the squares on the GPU (clip_grad_norm(DeviceOptimizer)).

/// A checkpoint's loss-scaler state into `scaler` (tg::io::restore_scaler), with the warning when this run's
/// precision has no scaler to take it.
template <class Scaler>
void restore_scaler_or_warn(Scaler& scaler, const std::optional<tg::io::ScalerStateRecord>& saved) {
  if (!tg::io::restore_scaler(scaler, saved))
    std::printf("warning: the checkpoint has a loss scaler's state; this run's precision uses none\n");
}

/// The host side of a run, shared by the CPU and GPU loops.
struct Run {
  const Options& o;
  const tg::data::AnyTokenizer& tok;
  const tg::data::TextDataset& ds;
  const tg::nn::GPTConfig& config;
  const std::vector<tg::optim::Param>& params;  // the host model's
  tg::optim::Optimizer& host_opt;
  tg::optim::Schedule& schedule;
  tg::optim::GradAccumRuntime& accum;
  tg::data::PrefetchingSampler& sampler;  // the train split's batches, prepared ahead on a thread
  tg::Generator& dropout_gen;
  tg::Generator& sample_gen;
  const LoopState& loop_state;
  std::optional<tg::io::CheckpointDir>& ckpts;
  double& loss_ema;
  std::int64_t& tokens_done;
  std::int64_t& nonfinite_skipped;
  std::int64_t& trained_positions;
  std::int64_t start_step;
};

/// scripts/plot_log.py's path: $TG_PLOT_SCRIPT, else the source tree's (compiled in).
inline std::string plot_script() {
  if (const char* env = std::getenv("TG_PLOT_SCRIPT"); env && *env) return env;
#ifdef TG_PLOT_SCRIPT_DEFAULT
  return TG_PLOT_SCRIPT_DEFAULT;
#else
  return "scripts/plot_log.py";
#endif
}

/// Draws --log into --plot with matplotlib (scripts/plot_log.py, run with /usr/bin/python3); throws with the
/// tool's message when it fails.
inline void draw_plot(const Options& o, std::int64_t tokens_per_step) {
  const std::string script = plot_script(), title = "train_gpt --model " + o.model + " (" + o.precision + ", run " + o.run_id + ")";
  const std::string tps = std::to_string(tokens_per_step);
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) throw tg::Error("--plot: cannot start the plotting tool: ", std::strerror(errno));
  if (pid == 0) {
    const char* argv[] = {"/usr/bin/python3", script.c_str(), o.log.c_str(), o.plot.c_str(), "--title", title.c_str(),
                          "--tokens-per-step", tps.c_str(), nullptr};
    ::execv(argv[0], const_cast<char* const*>(argv));
    std::fprintf(stderr, "plot_log: error: cannot run /usr/bin/python3: %s\n", std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw tg::Error("--plot: drawing '", o.plot, "' from '", o.log, "' failed (", script, ", exit ",
                    WIFEXITED(status) ? WEXITSTATUS(status) : -1, "; its message is above; it needs Debian's python3-matplotlib)");
}

/// The training loop on device D: `model` and `opt` live there; `sync_host()` copies their weights and
/// optimizer state into the host model and optimizer before a checkpoint is written from those.
template <class D, class Model, class Opt, class Amp, class SyncHost>
int train(Run& r, const Model& model, Opt& opt, Amp& amp, SyncHost&& sync_host) {
  const Options& o = r.o;
  const auto& tok = r.tok;
  const auto& ds = r.ds;
  const auto& config = r.config;
  const auto& params = r.params;
  auto& schedule = r.schedule;
  auto& accum = r.accum;
  auto& sampler = r.sampler;
  auto& dropout_gen = r.dropout_gen;
  auto& sample_gen = r.sample_gen;
  auto& ckpts = r.ckpts;
  double& loss_ema = r.loss_ema;
  std::int64_t& tokens_done = r.tokens_done;
  std::int64_t& nonfinite_skipped = r.nonfinite_skipped;
  // Note [trained positions]: samples never use a position that no training step reached.
  const std::int64_t window = std::min(config.block_size, r.trained_positions);
  const std::int64_t start_step = r.start_step;
  RunLog log(o.log, start_step, o.log_errors == "warn");  // a resumed run continues its log after start_step
  accum.on_non_finite(o.on_nonfinite == "skip" ? tg::optim::OnNonFinite::skip : tg::optim::OnNonFinite::stop);
  constexpr bool kScalerChecks = decltype(amp.scaler)::scales_loss;  // fp16: the scaler skips inf/NaN steps itself
  const bool tty = isatty(fileno(stdout));
  std::printf("typegrad %s | data: %s (%lld train / %lld val tokens)\n", TG_VERSION_STRING, ds.source().c_str(),
              static_cast<long long>(ds.train_size()), static_cast<long long>(ds.val_size()));
  std::printf("tokenizer: %s\n", tok.describe().c_str());
  const std::vector<std::int32_t> token_bytes = tok.token_byte_lengths();  // for bits per byte
  const std::string where = std::is_same_v<D, tg::cuda> ? "GPU: " + tg::backend::cuda::device_description()
                                                         : std::to_string(tg::backend::cpu::num_threads()) + " threads";
  std::printf("model %s: L=%lld H=%lld C=%lld T=%lld V=%lld, %.2fM parameters | %s, %s schedule, lr %.2g, batch %lldx%lld x%lld accum, %s\n",
              o.model.c_str(), (long long)config.n_layer, (long long)config.n_head, (long long)config.n_embd,
              (long long)config.block_size, (long long)config.vocab_size, tg::nn::count_parameters(params) / 1e6,
              o.optimizer.c_str(), o.schedule.c_str(), o.lr, (long long)o.batch, (long long)o.seq, (long long)o.grad_accum,
              where.c_str());
  std::printf("device %s | activation checkpointing: %s | positions trained: %lld of %lld (samples use a window of %lld)\n",
              o.device.c_str(), tg::checkpoint_mode_name(model.checkpoint()), (long long)r.trained_positions,
              (long long)config.block_size, (long long)window);
  std::printf("precision %s (Note [precision policies]; loss scaler: %s)\n", o.precision.c_str(), decltype(amp.scaler)::kind());
  const double uniform = std::log(static_cast<double>(config.vocab_size));
  std::printf("baseline: a uniform guess over %lld tokens costs ln %lld = %.3f nats/token (loss: nats/token; bpb: bits per byte of text)\n",
              (long long)config.vocab_size, (long long)config.vocab_size, uniform);
  std::fflush(stdout);  // the header before the first evaluation, which takes a while on a large model
  const Eval eval0 = evaluate(model, ds, o.batch, o.seq, o.eval_batches, token_bytes);
  const double val0 = eval0.loss;
  std::printf("step 0: val loss %.4f (%.3f bpb)\n", val0, eval0.bits_per_byte);

  const auto t_start = Clock::now();
  double last_val = val0, best_val = val0, last_bpb = eval0.bits_per_byte, best_bpb = eval0.bits_per_byte;
  double train_time = 0;
  for (std::int64_t step = start_step + 1; step <= o.steps; ++step) {
    const auto t0 = Clock::now();
    double step_loss = 0;
    const std::int64_t skipped_before = accum.skipped_steps();
    for (std::int64_t m = 0; m < o.grad_accum; ++m) {
      const auto b = sampler.next();
      const auto loss = amp.loss(amp.forward(model, b.inputs, dropout_gen, true), b.targets);  // fp32 loss
      const double micro_loss = static_cast<double>(loss.item());
      step_loss += micro_loss / static_cast<double>(o.grad_accum);
      accum.note_loss(micro_loss);  // Note [non-finite steps without a scaler]
      accum.scale(loss, amp.scaler).backward();
      // After each optimizer step, refresh the low-precision weight copies (once per step, not per micro-batch).
      try {
        if (accum.micro_step(opt, schedule, o.clip > 0 ? std::optional<double>(o.clip) : std::nullopt, amp.scaler))
          amp.after_step(accum);
      } catch (const tg::optim::NonFiniteStep& e) {
        const auto newest = ckpts ? ckpts->latest() : std::nullopt;
        throw tg::optim::NonFiniteStep(
            "step ", step, ": ", e.what(), "; training stopped, nothing was saved after step ", step - 1,
            newest ? " (the newest checkpoint is " + *newest + ")" : std::string(),
            ". Lower --lr, or pass --on-nonfinite skip to skip such steps");
      }
    }
    if (!kScalerChecks) nonfinite_skipped += accum.skipped_steps() - skipped_before;
    const double dt = seconds_since(t0);
    train_time += dt;
    tokens_done += o.batch * o.seq * o.grad_accum;
    loss_ema = step == 1 ? step_loss : 0.9 * loss_ema + 0.1 * step_loss;
    const double tok_s = static_cast<double>(o.batch * o.seq * o.grad_accum * (step - start_step)) / train_time;
    const double left = train_time / static_cast<double>(step - start_step) * static_cast<double>(o.steps - step);
    const auto mem = tg::allocator<D>().stats();
    const float lr_used = schedule.lr_at(schedule.step() - 1);
    char line[320];
    std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %6.3f | %6.1f ms | %7.0f tok/s | mem %s | left %s",
                  (long long)step, (long long)o.steps, step_loss, lr_used, accum.last_grad_norm(), dt * 1e3, tok_s,
                  human_bytes(mem.bytes_in_use).c_str(), human_time(left).c_str());
    if constexpr (decltype(amp.scaler)::scales_loss)  // fp16: the loss scale and the steps skipped for inf/NaN
      std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | scale %g | skipped %lld",
                    amp.scaler.scale(), (long long)amp.scaler.state().skipped_steps);  // the run's total, across resumes
    else if (nonfinite_skipped > 0)  // --on-nonfinite skip
      std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | skipped %lld (non-finite)",
                    (long long)nonfinite_skipped);
    const bool eval_now = o.eval_every > 0 && (step % o.eval_every == 0 || step == o.steps);
    if (tty) std::printf("\r%s\x1b[K", line);
    if (!tty && (step % 10 == 0 || step == 1 || step == o.steps)) std::printf("%s\n", line);
    if (eval_now) {
      const Eval e = evaluate(model, ds, o.batch, o.seq, o.eval_batches, token_bytes);
      last_val = e.loss;
      last_bpb = e.bits_per_byte;
      best_val = std::min(best_val, last_val);
      best_bpb = std::min(best_bpb, last_bpb);
      std::printf("%sstep %lld: val loss %.4f (%.3f bpb) (train loss ema %.4f)\n", tty ? "\n" : "", (long long)step, last_val,
                  last_bpb, loss_ema);
    }
    if (o.sample_every > 0 && step % o.sample_every == 0 && step != o.steps)
      std::printf("%s--- sample at step %lld ---\n%s\n---\n", tty ? "\n" : "", (long long)step,
                  generate(model, tok, o.prompt, o.sample_tokens / 2, o.temperature, o.top_k, sample_gen, window, o.top_p).c_str());
    if (log.is_open()) {
      std::ostringstream l;
      l << "{\"step\":" << step << ",\"loss\":" << step_loss << ",\"lr\":" << lr_used << ",\"grad_norm\":" << accum.last_grad_norm()
        << ",\"ms\":" << dt * 1e3 << ",\"tokens_per_s\":" << tok_s << ",\"bytes_in_use\":" << mem.bytes_in_use
        << ",\"loss_scale\":" << amp.scaler.scale() << ",\"skipped_steps\":" << amp.scaler.state().skipped_steps + nonfinite_skipped;
      if (eval_now) l << ",\"val_loss\":" << last_val << ",\"val_bpb\":" << last_bpb;
      l << "}";
      log.write(step, l.str());
    }
    if (ckpts && ((o.save_every > 0 && step % o.save_every == 0) || step == o.steps)) {
      sync_host();
      save_checkpoint(*ckpts, o, step, params, r.host_opt, r.loop_state, tg::io::scaler_record(amp.scaler));
    }
    std::fflush(stdout);
  }
  if (tty) std::printf("\n");
  const auto t_sample = Clock::now();
  const auto sample = generate(model, tok, o.prompt, o.sample_tokens, o.temperature, o.top_k, sample_gen, window, o.top_p);
  const double sample_s = seconds_since(t_sample);
  std::printf("\n--- sample (temperature %.2f, top-k %lld, top-p %.2f, window %lld positions; %.0f tokens/s with a KV cache) ---\n%s\n---\n",
              o.temperature, (long long)o.top_k, o.top_p, (long long)window, static_cast<double>(o.sample_tokens) / std::max(sample_s, 1e-9),
              sample.c_str());
  const auto mem = tg::allocator<D>().stats();
  std::printf("\nsummary\n");
  std::printf("  steps             %lld (%lld tokens)\n", (long long)o.steps, (long long)tokens_done);
  std::printf("  train loss (ema)  %.4f\n", loss_ema);
  std::printf("  val loss          %.4f at the end, %.4f best, %.4f at step 0 (ln %lld = %.4f)\n", last_val, best_val, val0,
              (long long)config.vocab_size, uniform);
  std::printf("  val bits/byte     %.4f at the end, %.4f best, %.4f at step 0 (%s)\n", last_bpb, best_bpb, eval0.bits_per_byte,
              tok.describe().c_str());
  const std::int64_t steps_run = std::max<std::int64_t>(1, o.steps - start_step);  // in this process (after --resume)
  std::printf("  speed             %.1f ms/step, %.0f tokens/s\n", train_time / static_cast<double>(steps_run) * 1e3,
              static_cast<double>(o.batch * o.seq * o.grad_accum * steps_run) / std::max(train_time, 1e-9));
  std::printf("  memory            peak %s, reserved %s, %lld system allocations\n", human_bytes(mem.peak_bytes).c_str(),
              human_bytes(mem.bytes_reserved).c_str(), (long long)mem.system_allocations);
  std::printf("  wall time         %s\n", human_time(seconds_since(t_start)).c_str());
  if (!o.log.empty()) std::printf("  log               %s\n", o.log.c_str());
  if (!o.plot.empty()) {
    draw_plot(o, o.batch * o.seq * o.grad_accum);
    std::printf("  plot              %s\n", o.plot.c_str());
  }
  return 0;
}

/// The GPU half of run<Policy> (train_gpt_cuda.cpp; Note [training on a GPU]): copies `model` (after any
/// --init-from / --resume) and the host optimizer's state to the GPU and trains there.
template <class Policy>
int train_on_cuda(Run& r, const tg::nn::GPT& model, const std::optional<tg::io::ScalerStateRecord>& saved_scaler);
extern template int train_on_cuda<tg::amp::fp32_policy>(Run&, const tg::nn::GPT&,
                                                        const std::optional<tg::io::ScalerStateRecord>&);
extern template int train_on_cuda<tg::amp::bf16_mixed>(Run&, const tg::nn::GPT&,
                                                      const std::optional<tg::io::ScalerStateRecord>&);
extern template int train_on_cuda<tg::amp::fp16_mixed>(Run&, const tg::nn::GPT&,
                                                      const std::optional<tg::io::ScalerStateRecord>&);

}  // namespace train_gpt

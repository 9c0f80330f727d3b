// Text datasets: text files (one, a list, a directory, or the Debian fortunes corpus) tokenized into one
// token stream, split into train (the first part) and validation (the last val_fraction of the stream).
//   auto ds = tg::data::TextDataset::from_text(tg::data::load_fortunes_corpus(), tg::data::ByteTokenizer{}, 0.1, 256);
//   tg::data::BatchSampler train(ds.train(), 8, 256, /*seed=*/1);   // see data/sampler.hpp
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/data/tokenizer.hpp"

namespace tg::data {

// ---- reading text ----------------------------------------------------------------------------------

/// The bytes of a file; throws naming the path when it is missing, a directory, unreadable or empty.
std::string read_text_file(const std::filesystem::path& path);
/// The files' bytes concatenated exactly, in the given order (each must be non-empty).
std::string read_text_files(const std::vector<std::filesystem::path>& paths);
/// The regular files directly inside `dir` (not subdirectories, not hidden "." files), in sorted order.
std::vector<std::filesystem::path> list_text_files(const std::filesystem::path& dir);
/// read_text_files(list_text_files(dir)); throws when `dir` is missing or holds no file.
std::string read_text_directory(const std::filesystem::path& dir);

/// Where Debian's `fortunes` package installs its English fortunes.
inline constexpr std::string_view kFortunesDir = "/usr/share/games/fortunes";
/// The corpus files of a fortunes directory: regular files without an extension (skips the .dat indexes,
/// the .u8 links and subdirectories such as "off"), in sorted order. Throws, naming the package to
/// install, when the directory is absent or holds none.
std::vector<std::filesystem::path> fortune_files(const std::filesystem::path& dir = kFortunesDir);
/// One fortune file's text with its lone "%" separator lines removed: fortunes are separated by one
/// empty line instead, and the text ends with a newline.
std::string strip_fortune_separators(std::string_view text);
/// The default corpus: the fortune files concatenated in sorted order, separators stripped (about 2.7 MB
/// with the full `fortunes` package).
std::string load_fortunes_corpus(const std::filesystem::path& dir = kFortunesDir);

// ---- the token stream and its splits ---------------------------------------------------------------

/// A contiguous range [begin, begin + size) of a shared token stream (a split keeps the stream alive).
struct TokenSplit {
  std::shared_ptr<const std::vector<std::int32_t>> stream;
  std::int64_t begin = 0;
  std::int64_t size = 0;
  std::span<const std::int32_t> tokens() const {
    return stream ? std::span<const std::int32_t>(stream->data() + begin, static_cast<std::size_t>(size))
                  : std::span<const std::int32_t>();
  }
};

/// A tokenized text. The stream's last floor(n * val_fraction) tokens are the validation split, the rest
/// the train split. With context T > 0 the train split, and the validation split when val_fraction > 0,
/// must each hold at least T + 1 tokens (one window of inputs plus its shifted targets), else it throws.
class TextDataset {
 public:
  TextDataset(std::vector<std::int32_t> tokens, double val_fraction = 0.1, std::int64_t context = 0,
              std::string source = "token stream");

  template <Tokenizer Tok>
  static TextDataset from_text(std::string_view text, const Tok& tok, double val_fraction = 0.1, std::int64_t context = 0,
                               std::string source = "text") {
    TG_CHECK(!text.empty(), "TextDataset: ", source, " is empty");
    return TextDataset(tok.encode(text), val_fraction, context, std::move(source));
  }
  template <Tokenizer Tok>
  static TextDataset from_file(const std::filesystem::path& path, const Tok& tok, double val_fraction = 0.1,
                               std::int64_t context = 0) {
    return from_text(read_text_file(path), tok, val_fraction, context, "file '" + path.string() + "'");
  }
  template <Tokenizer Tok>
  static TextDataset from_files(const std::vector<std::filesystem::path>& paths, const Tok& tok, double val_fraction = 0.1,
                                std::int64_t context = 0) {
    return from_text(read_text_files(paths), tok, val_fraction, context, std::to_string(paths.size()) + " files");
  }
  template <Tokenizer Tok>
  static TextDataset from_directory(const std::filesystem::path& dir, const Tok& tok, double val_fraction = 0.1,
                                    std::int64_t context = 0) {
    return from_text(read_text_directory(dir), tok, val_fraction, context, "directory '" + dir.string() + "'");
  }
  /// The default corpus (load_fortunes_corpus) tokenized.
  template <Tokenizer Tok>
  static TextDataset fortunes(const Tok& tok, double val_fraction = 0.1, std::int64_t context = 0,
                              const std::filesystem::path& dir = kFortunesDir) {
    return from_text(load_fortunes_corpus(dir), tok, val_fraction, context, "fortunes corpus '" + dir.string() + "'");
  }

  const std::vector<std::int32_t>& tokens() const { return *tokens_; }
  std::int64_t size() const { return static_cast<std::int64_t>(tokens_->size()); }
  std::int64_t train_size() const { return train_size_; }
  std::int64_t val_size() const { return size() - train_size_; }
  double val_fraction() const { return val_fraction_; }
  const std::string& source() const { return source_; }
  TokenSplit train() const { return {tokens_, 0, train_size_}; }
  TokenSplit validation() const { return {tokens_, train_size_, val_size()}; }
  /// Throws unless both splits (validation only when val_fraction > 0) hold at least context + 1 tokens.
  void require_context(std::int64_t context) const;

 private:
  std::shared_ptr<const std::vector<std::int32_t>> tokens_;
  std::int64_t train_size_ = 0;
  double val_fraction_ = 0;
  std::string source_;
};

}  // namespace tg::data

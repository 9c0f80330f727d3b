// Text datasets: text files (one, a list, a directory, or the Debian fortunes corpus) tokenized into one
// token stream, or a pre-tokenized token file (data/token_file.hpp) mmapped as one, split into train (the
// first part) and validation (the last val_fraction of the stream).
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

/// Note [token streams]
/// A TokenStream is the whole tokenized corpus, immutable once made, in one of two stores: an in-memory
/// std::vector<std::int32_t> (a tokenized text), or a read-only view of tokens stored as little-endian
/// uint16 or uint32 (a token file's mmap, data/token_file.hpp; the view keeps the mapping alive through a
/// shared owner). Readers never see the store: at(i) gives one id, copy_window(start, n, out) widens n
/// consecutive ids to int64 (the sampler's inputs and targets), so a batch is bit-identical whichever store
/// holds the same ids. Streams are shared (std::shared_ptr<const TokenStream>) by a dataset and its splits,
/// and being immutable they may be read from several threads at once (the prefetching sampler's worker).
class TokenStream {
 public:
  /// How the ids are stored: int32 (in memory), uint16 (llm.c's version-1 files), uint32 (version 2).
  enum class Kind : std::uint8_t { int32, uint16, uint32 };

  /// An in-memory stream owning `tokens`.
  explicit TokenStream(std::vector<std::int32_t> tokens);
  /// A read-only view of `n` ids of `kind` at `data` (not int32), kept valid by `owner` (e.g. a mapping).
  /// The ids must already be known to be in [0, 2^31) (token files check them when opened).
  TokenStream(const void* data, std::int64_t n, Kind kind, std::shared_ptr<const void> owner);

  std::int64_t size() const { return size_; }
  Kind kind() const { return kind_; }
  /// Bytes per stored id: 4 (int32 in memory), 2 (uint16) or 4 (uint32).
  int width() const { return kind_ == Kind::uint16 ? 2 : 4; }
  /// True for an in-memory (int32) stream, whose ids int32_tokens() can see directly.
  bool in_memory() const { return kind_ == Kind::int32; }
  /// Id i; throws when i is outside [0, size()).
  std::int32_t at(std::int64_t i) const;
  /// out[k] = id start + k for k in [0, n); throws unless [start, start + n) lies in [0, size()).
  void copy_window(std::int64_t start, std::int64_t n, std::int64_t* out) const;
  /// The ids of an in-memory stream; throws for a file-backed one (use at / copy_window there).
  std::span<const std::int32_t> int32_tokens() const;
  /// The in-memory stream's vector; throws for a file-backed one.
  const std::vector<std::int32_t>& vector() const;

 private:
  std::vector<std::int32_t> owned_;  // Kind::int32
  std::shared_ptr<const void> owner_;  // keeps a view's bytes alive
  const void* data_ = nullptr;
  std::int64_t size_ = 0;
  Kind kind_ = Kind::int32;
};

/// A contiguous range [begin, begin + size) of a shared token stream (a split keeps the stream alive).
struct TokenSplit {
  std::shared_ptr<const TokenStream> stream;
  std::int64_t begin = 0;
  std::int64_t size = 0;
  /// The split's ids of an in-memory stream (throws for a file-backed stream; use at / copy_window).
  std::span<const std::int32_t> tokens() const {
    return stream ? stream->int32_tokens().subspan(static_cast<std::size_t>(begin), static_cast<std::size_t>(size))
                  : std::span<const std::int32_t>();
  }
  /// Id i of the split (relative to begin).
  std::int32_t at(std::int64_t i) const {
    TG_CHECK(stream && i >= 0 && i < size, "TokenSplit::at: index ", i, " outside the split's ", size, " tokens");
    return stream->at(begin + i);
  }
};

/// A tokenized text. The stream's last floor(n * val_fraction) tokens are the validation split, the rest
/// the train split. With context T > 0 the train split, and the validation split when val_fraction > 0,
/// must each hold at least T + 1 tokens (one window of inputs plus its shifted targets), else it throws.
/// The stream is in memory (from text) or a token file's mapping (from_token_file); splits, samplers and
/// batches behave the same for both.
class TextDataset {
 public:
  TextDataset(std::vector<std::int32_t> tokens, double val_fraction = 0.1, std::int64_t context = 0,
              std::string source = "token stream");
  /// A dataset over an existing stream (e.g. TokenFile::stream()); the same split rule and checks.
  TextDataset(std::shared_ptr<const TokenStream> stream, double val_fraction = 0.1, std::int64_t context = 0,
              std::string source = "token stream");
  /// The token file at `path` (data/token_file.hpp), mmapped and checked against `vocab_size` (0: the
  /// vocabulary its header records), not loaded into memory. Source: "token file '<path>'".
  static TextDataset from_token_file(const std::filesystem::path& path, std::int64_t vocab_size, double val_fraction = 0.1,
                                     std::int64_t context = 0);

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

  /// The ids of an in-memory dataset (throws for a token file's: use stream()).
  const std::vector<std::int32_t>& tokens() const { return tokens_->vector(); }
  const TokenStream& stream() const { return *tokens_; }
  const std::shared_ptr<const TokenStream>& shared_stream() const { return tokens_; }
  std::int64_t size() const { return tokens_->size(); }
  std::int64_t train_size() const { return train_size_; }
  std::int64_t val_size() const { return size() - train_size_; }
  double val_fraction() const { return val_fraction_; }
  const std::string& source() const { return source_; }
  TokenSplit train() const { return {tokens_, 0, train_size_}; }
  TokenSplit validation() const { return {tokens_, train_size_, val_size()}; }
  /// Throws unless both splits (validation only when val_fraction > 0) hold at least context + 1 tokens.
  void require_context(std::int64_t context) const;

 private:
  std::shared_ptr<const TokenStream> tokens_;
  std::int64_t train_size_ = 0;
  double val_fraction_ = 0;
  std::string source_;
};

}  // namespace tg::data

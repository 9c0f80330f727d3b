// Token files: a tokenized corpus stored once (llm.c's .bin format: a 1 KiB header, then uint16 ids) and
// read back through mmap, without loading or copying it, as a TextDataset's stream.
//   tg::data::write_token_file("corpus.bin", ds.tokens(), tok.vocab_size(), tokenizer_json);   // --data-export
//   auto ds = tg::data::TextDataset::from_token_file("corpus.bin", tok.vocab_size(), 0.1, 1024);  // --data
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "typegrad/data/dataset.hpp"

namespace tg::data {

/// Note [token files]
/// The format is llm.c's (dev/data/data_common.py), so files written by its GPT-2 data scripts (e.g.
/// fineweb_train_000001.bin, tinyshakespeare_val.bin) read here with the GPT-2 tokenizer, and files written
/// here read in llm.c. A header of 256 little-endian int32 (1024 bytes), then the ids:
///   [0] magic 20240520
///   [1] version: 1 = uint16 ids (GPT-2 sized vocabularies), 2 = uint32 ids (llm.c's LLaMA-3 files; read only)
///   [2] number of tokens n (> 0); the file is exactly 1024 + n * width bytes
///   [3] typegrad: the vocabulary size the ids were written for (0 = not recorded, as in llm.c's files)
///   [4] typegrad: the largest id in the file (meaningful only when [3] > 0)
///   [5] typegrad: 1 when a tokenizer sidecar "<file>.tokenizer.json" was written with the file, else 0
///   [6..255] zero
/// llm.c reads only [0..2] and ignores the rest, so the extras keep the files compatible both ways.
/// The sidecar holds the tokenizer the ids mean (an opaque string to this library; the GPT trainer stores
/// its tokenizer's JSON), so a file can be read back with the tokenizer it was written with.
///
/// Writing (write_token_file) checks every id against the vocabulary, writes the sidecar first and then the
/// data file, each to a temporary in the same directory renamed over the path (Note [atomic file
/// replacement] in io/safetensors.hpp), so a crash never leaves a half-written file under either name.
///
/// Opening (open_token_file) maps the file read-only and checks, naming the file: the magic, the version,
/// the size against the count (truncated or padded), count > 0, and every id against the vocabulary (the
/// caller's; with 0, the header's). The id scan is a parallel max-reduction over the mapping, memory- (or
/// disk-) bandwidth bound; it drops the pages it mapped as it goes (madvise MADV_DONTNEED: they stay in the
/// page cache), so the open adds neither a copy nor the file's pages to the process's resident memory.
/// Ids a vocabulary does not cover would index past the model's embedding, so they are an error, never
/// clamped; so is a file whose header records a larger vocabulary than the caller's (other ids than the
/// caller's tokenizer produces).

inline constexpr std::int32_t kTokenFileMagic = 20240520;
inline constexpr std::int64_t kTokenFileHeaderBytes = 1024;  // 256 x int32
/// The most ids a version-1 (uint16) file can hold a vocabulary for.
inline constexpr std::int64_t kTokenFileMaxVocab = 65536;

/// The parsed header (Note [token files]).
struct TokenFileHeader {
  std::int32_t version = 0;     ///< 1: uint16 ids, 2: uint32 ids
  std::int64_t count = 0;       ///< number of tokens
  std::int64_t vocab_size = 0;  ///< the vocabulary recorded by the writer; 0 = not recorded (llm.c)
  std::int64_t max_id = -1;     ///< the largest id recorded by the writer; -1 = not recorded
  bool has_tokenizer = false;   ///< a sidecar "<file>.tokenizer.json" was written with the file
};

/// The sidecar holding the tokenizer of the token file at `path`: "<path>.tokenizer.json".
std::filesystem::path token_file_tokenizer_path(const std::filesystem::path& path);

/// True when `path` is a readable file whose first 4 bytes are the token-file magic (tells a token file
/// from a text file; never throws).
bool is_token_file(const std::filesystem::path& path);

/// Writes `tokens` as a version-1 token file at `path` (replacing it atomically), recording vocab_size, the
/// largest id and, when `tokenizer_json` is not empty, the sidecar holding it. Throws naming the path when
/// vocab_size is outside [1, 65536], there are no tokens or more than 2^31 - 1, an id is outside
/// [0, vocab_size) (naming its position and id), or the write fails (with strerror).
void write_token_file(const std::filesystem::path& path, std::span<const std::int32_t> tokens, std::int64_t vocab_size,
                      std::string_view tokenizer_json = {});

/// An opened token file: the read-only mapping (shared by its stream(), which keeps it alive) and what its
/// header and sidecar say. Copies share the mapping.
class TokenFile {
 public:
  const std::filesystem::path& path() const { return path_; }
  const TokenFileHeader& header() const { return header_; }
  /// Number of tokens.
  std::int64_t size() const { return stream_->size(); }
  /// Bytes per stored id (2 or 4).
  int width() const { return stream_->width(); }
  /// The vocabulary the ids were checked against (the caller's, or with 0 the header's).
  std::int64_t vocab_size() const { return vocab_size_; }
  /// The largest id in the file (found by the open's scan).
  std::int32_t max_id() const { return max_id_; }
  /// The sidecar's text when the file has one ("<file>.tokenizer.json").
  const std::optional<std::string>& tokenizer_json() const { return tokenizer_json_; }
  /// The ids as a stream over the mapping (for TextDataset).
  const std::shared_ptr<const TokenStream>& stream() const { return stream_; }
  /// A dataset over the file: TextDataset(stream(), val_fraction, context, "token file '<path>'").
  TextDataset dataset(double val_fraction = 0.1, std::int64_t context = 0) const;

 private:
  friend TokenFile open_token_file(const std::filesystem::path&, std::int64_t);
  std::filesystem::path path_;
  TokenFileHeader header_;
  std::int64_t vocab_size_ = 0;
  std::int32_t max_id_ = -1;
  std::optional<std::string> tokenizer_json_;
  std::shared_ptr<const TokenStream> stream_;
};

/// Maps the token file at `path` read-only (no copy) and validates it (Note [token files]) against
/// `vocab_size` (0: the vocabulary its header records; a file recording none then needs one given). Every
/// error names the file and what was expected and found; IO errors add strerror.
TokenFile open_token_file(const std::filesystem::path& path, std::int64_t vocab_size = 0);

}  // namespace tg::data

// Tokenizers: ByteTokenizer (the default; token = byte, vocab 256), ByteBpeTokenizer (a byte-level BPE trained
// here, train_byte_bpe), Gpt2BpeTokenizer (GPT-2's byte-level BPE) and AnyTokenizer (a runtime choice of the three,
// from a spec "byte" | "bpe:N" | "gpt2:DIR", saved in checkpoints as a JSON string). See docs/tokenizers.md.
//   tg::data::ByteTokenizer tok;  auto ids = tok.encode("hello");        // {104, 101, 108, 108, 111}
//   auto bpe = tg::data::Gpt2BpeTokenizer("gpt2/vocab.json", "gpt2/merges.txt");  bpe.decode(bpe.encode(s)) == s;
//   auto any = tg::data::make_tokenizer("bpe:2048", {.text = corpus, .cache_dir = dir});  any.to_json();
#pragma once

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "typegrad/core/error.hpp"

namespace tg::data {

/// What TextDataset and the trainer need from a tokenizer. The tokenizers below model it.
template <class T>
concept Tokenizer = requires(const T& t, std::string_view text, std::span<const std::int32_t> ids) {
  { t.encode(text) } -> std::same_as<std::vector<std::int32_t>>;
  { t.decode(ids) } -> std::same_as<std::string>;
  { t.vocab_size() } -> std::convertible_to<std::int64_t>;
};

// ---- ByteTokenizer ---------------------------------------------------------------------------------

/// Token = byte value (0..255). encode/decode round-trip any byte string exactly (invalid UTF-8, NULs).
class ByteTokenizer {
 public:
  static constexpr std::int32_t kVocabSize = 256;
  std::int64_t vocab_size() const { return kVocabSize; }
  std::vector<std::int32_t> encode(std::string_view text) const {
    std::vector<std::int32_t> ids(text.size());
    for (std::size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
    return ids;
  }
  std::string decode(std::span<const std::int32_t> ids) const {
    std::string out(ids.size(), '\0');
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TG_CHECK(ids[i] >= 0 && ids[i] < kVocabSize, "ByteTokenizer::decode: id ", ids[i], " at position ", i,
               " is out of range [0, ", kVocabSize, ")");
      out[i] = static_cast<char>(static_cast<unsigned char>(ids[i]));
    }
    return out;
  }
  /// The byte tokenizer has no end-of-text token.
  std::optional<std::int32_t> eot_id() const { return std::nullopt; }
};

// ---- GPT-2 byte-level BPE ----------------------------------------------------------------------------

/// GPT-2's byte-to-unicode table (Radford et al. 2019, encoder.py `bytes_to_unicode`): the printable bytes
/// '!'..'~', '¡'..'¬', '®'..'ÿ' map to the code point of the same value; the other 68 bytes map, in byte
/// order, to U+0100, U+0101, ... (so space 0x20 -> U+0120 'Ġ', newline 0x0A -> U+010A 'Ċ').
char32_t gpt2_byte_to_unicode(std::uint8_t byte);
/// The inverse of gpt2_byte_to_unicode; -1 for a code point outside the table's image.
int gpt2_unicode_to_byte(char32_t cp);

/// Note [GPT-2 pre-tokenization]
/// GPT-2 splits text with the regex
///   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
/// before BPE, so merges never cross the pieces. gpt2_pre_tokenize implements that alternation by hand
/// (first alternative that matches wins; `\s+(?!\S)` backtracks one whitespace so "a   b" splits as
/// "a", "  ", " b"). The character classes are exact for ASCII; for other code points they are an
/// approximation with a small table: Unicode White_Space is whitespace; Latin-1 superscript digits and
/// vulgar fractions are numbers; C1 controls, Latin-1 punctuation/symbols (¡..¿, ×, ÷), combining marks
/// (U+0300..U+036F), General Punctuation (U+2010..U+205E), currency, arrows/math/box-drawing/dingbats
/// (U+2190..U+2BFF), CJK punctuation (U+3001..U+303F), fullwidth ASCII punctuation and emoji
/// (U+1F000..U+1FAFF) are "other"; every remaining code point >= 0x80 is a letter (so non-ASCII digits
/// and some rare symbols are classified as letters). Bytes that are not valid UTF-8 are single letters.
/// The pieces partition the input exactly (their concatenation is the input), whatever the bytes.
std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text);
/// The pieces of gpt2_pre_tokenize(text), in order, to f, computed about chunk_bytes at a time so memory stays
/// bounded for large texts (Note [pre-tokenization in chunks], src/data/bpe_train.cpp).
void gpt2_pre_tokenize_each(std::string_view text, const std::function<void(std::string_view)>& f,
                            std::size_t chunk_bytes = std::size_t{1} << 20);

/// GPT-2's tokenizer from `vocab.json` (token string -> id) and `merges.txt` (an optional "#version"
/// first line, then one merge "a b" per line; rank = line order, lower merges first). The vocabulary must
/// hold the 256 byte symbols and, for each merge, both symbols and their concatenation. `<|endoftext|>`
/// is a special token when the vocabulary has it: encode maps its literal occurrences to its id (use
/// encode_ordinary to treat it as text). Copies share the (thread-safe) cache of encoded pieces.
class Gpt2BpeTokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  Gpt2BpeTokenizer(const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt);
  /// The same tokenizer from the contents of vocab.json and merges.txt (same validation and errors; the
  /// messages name "vocab.json text" / "merges.txt text" instead of a path). `source`, when given, is kept as
  /// source() (e.g. the path the texts were once read from).
  static Gpt2BpeTokenizer from_strings(std::string_view vocab_json_text, std::string_view merges_text,
                                       std::string_view source = {});

  /// max id + 1 (GPT-2: 50257).
  std::int64_t vocab_size() const;
  std::int64_t num_merges() const;
  std::vector<std::int32_t> encode(std::string_view text) const;
  /// encode without special tokens: "<|endoftext|>" in the text is encoded as ordinary text.
  std::vector<std::int32_t> encode_ordinary(std::string_view text) const;
  std::string decode(std::span<const std::int32_t> ids) const;
  std::optional<std::int32_t> eot_id() const;
  /// The id of a vocabulary string (in its byte-to-unicode form, e.g. "Ġhello"), if present.
  std::optional<std::int32_t> token_id(std::string_view token) const;
  /// The vocabulary string of an id (in its byte-to-unicode form); throws for an unknown id.
  const std::string& token_string(std::int32_t id) const;
  /// The bytes an id decodes to ("<|endoftext|>" for the end-of-text token); throws for an unknown id.
  const std::string& token_bytes(std::int32_t id) const;
  /// Whether the vocabulary has this id (ids may have gaps).
  bool contains(std::int32_t id) const;
  /// Where the tables came from: the vocab.json path, or from_strings' `source` (possibly empty).
  const std::string& source() const;
  /// A vocab.json (compact JSON object, token string -> id) and a merges.txt ("#version: 0.2", then the merges
  /// in rank order) regenerated from the loaded tables: from_strings(vocab_json(), merges_text()) encodes and
  /// decodes exactly as this tokenizer.
  std::string vocab_json() const;
  std::string merges_text() const;

  struct Impl;

 private:
  explicit Gpt2BpeTokenizer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<Impl> impl_;
};

// ---- byte-level BPE trained here ---------------------------------------------------------------------

/// A byte-level BPE over raw bytes (no byte-to-unicode table): id b < 256 is the byte b, id 256 + k is merge k,
/// the concatenation of the pair merges()[k] of earlier ids. encode splits the text with gpt2_pre_tokenize,
/// then within each piece repeatedly merges the adjacent pair of lowest rank (Note [byte BPE encoding]);
/// decode concatenates the tokens' bytes, so decode(encode(s)) == s for every byte string. No end-of-text
/// token. Copies share the tables and a thread-safe cache of encoded pieces.
class ByteBpeTokenizer {
 public:
  using Merge = std::pair<std::int32_t, std::int32_t>;
  static constexpr std::int64_t kMaxVocabSize = 65536;  // so ids fit the uint16 token files

  /// No merges: the byte tokenizer.
  ByteBpeTokenizer();
  /// Merge k must pair ids < 256 + k, no pair may repeat, and 256 + merges.size() <= kMaxVocabSize; throws
  /// naming the merge at fault otherwise.
  explicit ByteBpeTokenizer(std::vector<Merge> merges);

  /// 256 + num_merges().
  std::int64_t vocab_size() const;
  std::int64_t num_merges() const;
  const std::vector<Merge>& merges() const;
  /// The byte string of a token; throws for an id outside [0, vocab_size()).
  const std::string& token_bytes(std::int32_t id) const;
  std::vector<std::int32_t> encode(std::string_view text) const;
  /// Throws, naming the id and its position, for an id outside [0, vocab_size()).
  std::string decode(std::span<const std::int32_t> ids) const;
  std::optional<std::int32_t> eot_id() const { return std::nullopt; }

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/// Trains a byte-level BPE on `text` (Note [byte BPE training]): gpt2_pre_tokenize, count the distinct pieces,
/// then repeatedly add the merge of the most frequent adjacent pair (counted over the pieces weighted by their
/// frequency; ties: the smaller (left id, right id)) until vocab_size tokens. Training stops early when no pair
/// occurs twice, so the result may have fewer tokens than asked: its vocab_size() / num_merges() say how many
/// were learned. Deterministic: the same text and vocab_size give the same merges. Throws for an empty text or
/// a vocab_size outside [257, 65536].
ByteBpeTokenizer train_byte_bpe(std::string_view text, std::int64_t vocab_size);

// ---- a runtime choice ----------------------------------------------------------------------------------

/// One of the three tokenizers, chosen at run time (the trainer's --tokenizer). to_json() holds everything
/// needed to rebuild it exactly (checkpoints store it), from_json() rebuilds it.
class AnyTokenizer {
 public:
  /// The byte tokenizer.
  AnyTokenizer() = default;
  AnyTokenizer(ByteTokenizer t) : tok_(t) {}  // NOLINT(google-explicit-constructor): a tokenizer is one
  AnyTokenizer(ByteBpeTokenizer t) : tok_(std::move(t)) {}  // NOLINT(google-explicit-constructor)
  AnyTokenizer(Gpt2BpeTokenizer t) : tok_(std::move(t)) {}  // NOLINT(google-explicit-constructor)

  std::vector<std::int32_t> encode(std::string_view text) const;
  std::string decode(std::span<const std::int32_t> ids) const;
  std::int64_t vocab_size() const;
  std::optional<std::int32_t> eot_id() const;
  /// "byte", "bpe" or "gpt2".
  std::string_view kind() const;
  /// One human line, e.g. "byte-level BPE, 2048 tokens (1792 merges)".
  std::string describe() const;
  /// The bytes a token decodes to (byte: the byte; gpt2: "<|endoftext|>" for its end-of-text token).
  std::string token_bytes(std::int32_t id) const;
  /// token_bytes(id).size() for every id (0 for ids absent from a gpt2 vocabulary). For bits per byte:
  /// bpb = sum of the loss (nats) over the targets / (ln 2 * sum of the byte lengths of the targets).
  std::vector<std::int32_t> token_byte_lengths() const;
  /// A JSON object as text: {"format": "typegrad-tokenizer", "version": 1, "kind": ..., then for bpe
  /// "merges": [[left, right], ...], for gpt2 "vocab_json" and "merges_txt" (vocab_json() and merges_text()) and
  /// "source" when known}.
  std::string to_json() const;
  /// Rebuilds a tokenizer from to_json()'s text (unknown extra members are ignored); throws saying what is
  /// wrong for malformed JSON, a missing or mistyped member, an unknown kind or invalid tables.
  static AnyTokenizer from_json(std::string_view json);

  const std::variant<ByteTokenizer, ByteBpeTokenizer, Gpt2BpeTokenizer>& variant() const { return tok_; }

 private:
  std::variant<ByteTokenizer, ByteBpeTokenizer, Gpt2BpeTokenizer> tok_;
};

/// A parsed tokenizer spec: "byte", "bpe:N" (257 <= N <= 65536) or "gpt2:DIR".
struct TokenizerSpec {
  std::string kind;             // "byte", "bpe" or "gpt2"
  std::int64_t vocab_size = 0;  // bpe: N
  std::filesystem::path dir;    // gpt2: DIR
};
/// Parses a spec without touching files or text (so a trainer can reject a bad flag before loading data);
/// throws naming the spec and the accepted forms.
TokenizerSpec parse_tokenizer_spec(std::string_view spec);

/// A 64-bit hash of a byte string (multiply-rotate mix over little-endian 8-byte words, then the length and
/// a murmur3 finalizer; not cryptographic). Stable across platforms and versions: BPE cache names use it.
std::uint64_t corpus_hash(std::string_view text);

/// The outcome of load_or_train_bpe.
struct BpeCacheResult {
  AnyTokenizer tok;
  std::filesystem::path cache_file;  // read or written; empty when no cache directory was given
  bool from_cache = false;
  double seconds = 0;  // loading or training time
};

/// The BPE of train_byte_bpe(text, vocab_size), cached as cache_dir/<cache_stem>.bpe-<N>-<16 hex digits of
/// corpus_hash(text)>.json: read when present and sound, else trained and written atomically (temp file, then
/// rename). A damaged cache file (unparsable, failed checksum, other corpus or N) is reported on stderr and
/// retrained, never trusted. An empty cache_dir trains without caching. Errors writing the cache are warnings.
BpeCacheResult load_or_train_bpe(std::string_view text, std::int64_t vocab_size, const std::filesystem::path& cache_dir,
                                 std::string_view cache_stem = "corpus");

/// The user's cache directory for typegrad: $XDG_CACHE_HOME/typegrad, else $HOME/.cache/typegrad, else
/// <temp dir>/typegrad; created if absent (throws naming it when it cannot be).
std::filesystem::path user_cache_dir();
/// Where to cache the BPE of a data file: the directory holding it when that is writable, else user_cache_dir().
/// For a directory of text files (a trailing '/' is ignored) that is its parent: the cache sits beside it, not in
/// it, so it is never read back as a text file.
std::filesystem::path default_bpe_cache_dir(const std::filesystem::path& data_path);

/// What bpe:N trains on, and where it caches (see load_or_train_bpe).
struct BpeTraining {
  std::string_view text;
  std::filesystem::path cache_dir;  // empty: no cache
  std::string cache_stem = "corpus";
};

/// The tokenizer of a spec (parse_tokenizer_spec): "byte"; "bpe:N" trains on `bpe.text` through
/// load_or_train_bpe (when `bpe_result` is given it receives the details: cache file, from cache, seconds);
/// "gpt2:DIR" loads DIR/vocab.json and DIR/merges.txt. Throws naming the spec or the missing path.
AnyTokenizer make_tokenizer(std::string_view spec, const BpeTraining& bpe = {}, BpeCacheResult* bpe_result = nullptr);

}  // namespace tg::data

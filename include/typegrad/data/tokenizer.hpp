// Tokenizers: ByteTokenizer (the default; token = byte, vocab 256) and Gpt2BpeTokenizer (GPT-2's byte-level BPE).
//   tg::data::ByteTokenizer tok;  auto ids = tok.encode("hello");        // {104, 101, 108, 108, 111}
//   auto bpe = tg::data::Gpt2BpeTokenizer("gpt2/vocab.json", "gpt2/merges.txt");  bpe.decode(bpe.encode(s)) == s;
#pragma once

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "typegrad/core/error.hpp"

namespace tg::data {

/// What TextDataset and the trainer need from a tokenizer. Both tokenizers below model it.
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

/// GPT-2's tokenizer from `vocab.json` (token string -> id) and `merges.txt` (an optional "#version"
/// first line, then one merge "a b" per line; rank = line order, lower merges first). The vocabulary must
/// hold the 256 byte symbols and, for each merge, both symbols and their concatenation. `<|endoftext|>`
/// is a special token when the vocabulary has it: encode maps its literal occurrences to its id (use
/// encode_ordinary to treat it as text). Copies share the (thread-safe) cache of encoded pieces.
class Gpt2BpeTokenizer {
 public:
  static constexpr std::string_view kEndOfText = "<|endoftext|>";

  Gpt2BpeTokenizer(const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt);

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

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace tg::data

// GPT-2 byte-level BPE (include/typegrad/data/tokenizer.hpp): byte-to-unicode table, hand-written
// pre-tokenizer (Note [GPT-2 pre-tokenization]), vocab.json / merges.txt loading, rank-ordered merging.
#include <algorithm>
#include <array>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "typegrad/data/tokenizer.hpp"

namespace tg::data {

// ---- byte <-> unicode ---------------------------------------------------------------------------

namespace {

bool gpt2_printable(unsigned b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); }

struct ByteTable {
  std::array<char32_t, 256> to_cp{};
  std::array<std::int16_t, 512> from_cp{};  // image is within [0, 0x144)
  ByteTable() {
    from_cp.fill(-1);
    unsigned next = 256;
    for (unsigned b = 0; b < 256; ++b) {
      to_cp[b] = gpt2_printable(b) ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
      from_cp[to_cp[b]] = static_cast<std::int16_t>(b);
    }
  }
};
const ByteTable& byte_table() {
  static const ByteTable t;
  return t;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

constexpr char32_t kInvalid = 0xFFFFFFFFu;

/// Decodes one code point at s[i]: strict UTF-8 (no overlongs, surrogates or > U+10FFFF); an invalid
/// sequence yields kInvalid with length 1, so every byte belongs to exactly one unit.
char32_t next_code_point(std::string_view s, std::size_t i, std::size_t& len) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  len = 1;
  if (b0 < 0x80) return b0;
  int n;
  char32_t cp, min;
  if ((b0 & 0xE0) == 0xC0) n = 1, cp = b0 & 0x1F, min = 0x80;
  else if ((b0 & 0xF0) == 0xE0) n = 2, cp = b0 & 0x0F, min = 0x800;
  else if ((b0 & 0xF8) == 0xF0) n = 3, cp = b0 & 0x07, min = 0x10000;
  else return kInvalid;
  if (i + static_cast<std::size_t>(n) >= s.size()) return kInvalid;  // truncated sequence
  for (int k = 1; k <= n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + static_cast<std::size_t>(k)]);
    if ((b & 0xC0) != 0x80) return kInvalid;
    cp = (cp << 6) | (b & 0x3F);
  }
  if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return kInvalid;
  len = static_cast<std::size_t>(n) + 1;
  return cp;
}

// ---- the character classes of Note [GPT-2 pre-tokenization] ----------------------------------------

enum class CharClass { space, letter, number, other };

bool is_unicode_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

CharClass classify(char32_t c) {
  if (c == kInvalid) return CharClass::letter;
  if (is_unicode_space(c)) return CharClass::space;
  if (c < 0x80) {
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) return CharClass::letter;
    if (c >= '0' && c <= '9') return CharClass::number;
    return CharClass::other;
  }
  if (c == 0xB2 || c == 0xB3 || c == 0xB9 || (c >= 0xBC && c <= 0xBE)) return CharClass::number;  // ² ³ ¹ ¼ ½ ¾
  if (c <= 0x9F || (c >= 0xA1 && c <= 0xBF) || c == 0xD7 || c == 0xF7) {
    return c == 0xAA || c == 0xB5 || c == 0xBA ? CharClass::letter : CharClass::other;  // ª µ º are letters
  }
  if (c >= 0x0300 && c <= 0x036F) return CharClass::other;  // combining marks (\p{M}, not \p{L})
  if ((c >= 0x2010 && c <= 0x205E) || (c >= 0x20A0 && c <= 0x20CF) || (c >= 0x2190 && c <= 0x2BFF) ||
      (c >= 0x3001 && c <= 0x303F) || (c >= 0xFF01 && c <= 0xFF0F) || (c >= 0xFF1A && c <= 0xFF20) ||
      (c >= 0x1F000 && c <= 0x1FAFF))
    return CharClass::other;
  if (c >= 0x2070 && c <= 0x2089 && c != 0x2071 && c != 0x207F) return CharClass::number;  // super/subscript digits
  if (c >= 0xFF10 && c <= 0xFF19) return CharClass::number;                                  // fullwidth digits
  return CharClass::letter;
}

struct Unit {
  std::size_t pos, len;
  char32_t cp;
  CharClass cls;
};

}  // namespace

char32_t gpt2_byte_to_unicode(std::uint8_t byte) { return byte_table().to_cp[byte]; }
int gpt2_unicode_to_byte(char32_t cp) { return cp < 512 ? byte_table().from_cp[cp] : -1; }

std::vector<std::string_view> gpt2_pre_tokenize(std::string_view text) {
  std::vector<Unit> u;
  u.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    std::size_t len;
    const char32_t cp = next_code_point(text, i, len);
    u.push_back({i, len, cp, classify(cp)});
    i += len;
  }
  const std::size_t n = u.size();
  std::vector<std::string_view> pieces;
  auto emit = [&](std::size_t a, std::size_t b) {  // units [a, b)
    const std::size_t begin = u[a].pos, end = b < n ? u[b].pos : text.size();
    pieces.push_back(text.substr(begin, end - begin));
  };
  auto run_of = [&](std::size_t j, CharClass cls) {
    while (j < n && u[j].cls == cls) ++j;
    return j;
  };
  auto ascii_at = [&](std::size_t j, char c) { return j < n && u[j].cp == static_cast<char32_t>(c); };

  std::size_t i = 0;
  while (i < n) {
    // 's|'t|'re|'ve|'m|'ll|'d
    if (u[i].cp == '\'') {
      std::size_t len = 0;
      if (ascii_at(i + 1, 's') || ascii_at(i + 1, 't') || ascii_at(i + 1, 'm') || ascii_at(i + 1, 'd')) len = 2;
      else if ((ascii_at(i + 1, 'r') && ascii_at(i + 2, 'e')) || (ascii_at(i + 1, 'v') && ascii_at(i + 2, 'e')) ||
               (ascii_at(i + 1, 'l') && ascii_at(i + 2, 'l')))
        len = 3;
      if (len) {
        emit(i, i + len);
        i += len;
        continue;
      }
    }
    // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
    const std::size_t s = u[i].cp == ' ' && i + 1 < n && u[i + 1].cls != CharClass::space ? i + 1 : i;
    if (u[s].cls != CharClass::space) {
      const std::size_t e = run_of(s, u[s].cls);
      emit(i, e);
      i = e;
      continue;
    }
    // `\s+(?!\S)` then `\s+`: a whitespace run followed by a non-space gives back its last unit
    // (which then prefixes the next piece), unless the run is a single unit.
    const std::size_t e = run_of(i, CharClass::space);
    const std::size_t end = (e < n && e - i >= 2) ? e - 1 : e;
    emit(i, end);
    i = end;
  }
  return pieces;
}

// ---- the tokenizer ------------------------------------------------------------------------------

struct Gpt2BpeTokenizer::Impl {
  std::string vocab_path, merges_path;  // names for messages
  std::string source;                   // source()
  std::unordered_map<std::string, std::int32_t> vocab;
  std::vector<std::string> id_token;   // "" for ids absent from vocab.json
  std::vector<std::string> id_bytes;   // the bytes each id decodes to
  std::vector<bool> id_present;
  std::array<std::int32_t, 256> byte_id{};
  struct Merge {
    std::int32_t rank, merged;
  };
  std::unordered_map<std::uint64_t, Merge> merges;  // key (a << 32) | b
  std::int64_t num_merges = 0;
  std::vector<std::pair<std::int32_t, std::int32_t>> merge_list;  // the merges' symbol ids in rank order
  std::optional<std::int32_t> eot;

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>> cache;
  static constexpr std::size_t kCacheLimit = 1u << 18;

  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }

  /// BPE of one pre-tokenized piece (Sennrich et al. 2016; GPT-2 encoder.py `bpe`): start from the byte
  /// symbols, repeatedly merge every occurrence of the adjacent pair of lowest rank until none is a merge.
  std::vector<std::int32_t> bpe(std::string_view piece) const {
    std::vector<std::int32_t> w(piece.size());
    for (std::size_t i = 0; i < piece.size(); ++i) w[i] = byte_id[static_cast<unsigned char>(piece[i])];
    std::vector<std::int32_t> next;
    while (w.size() >= 2) {
      std::int32_t best = std::numeric_limits<std::int32_t>::max(), a = -1, b = -1, merged = -1;
      for (std::size_t i = 0; i + 1 < w.size(); ++i) {
        auto it = merges.find(key(w[i], w[i + 1]));
        if (it != merges.end() && it->second.rank < best)
          best = it->second.rank, a = w[i], b = w[i + 1], merged = it->second.merged;
      }
      if (merged < 0) break;
      next.clear();
      for (std::size_t i = 0; i < w.size();) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) {
          next.push_back(merged);
          i += 2;
        } else {
          next.push_back(w[i++]);
        }
      }
      w.swap(next);
    }
    return w;
  }

  void encode_ordinary(std::string_view text, std::vector<std::int32_t>& out) const {
    for (std::string_view piece : gpt2_pre_tokenize(text)) {
      if (piece.size() == 1) {
        out.push_back(byte_id[static_cast<unsigned char>(piece[0])]);
        continue;
      }
      std::string k(piece);
      {
        std::lock_guard<std::mutex> lock(cache_mu);
        auto it = cache.find(k);
        if (it != cache.end()) {
          out.insert(out.end(), it->second.begin(), it->second.end());
          continue;
        }
      }
      std::vector<std::int32_t> ids = bpe(piece);
      out.insert(out.end(), ids.begin(), ids.end());
      std::lock_guard<std::mutex> lock(cache_mu);
      if (cache.size() >= kCacheLimit) cache.clear();
      cache.emplace(std::move(k), std::move(ids));
    }
  }
};

namespace {

std::string read_whole_file(const std::filesystem::path& path, const char* what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw Error("Gpt2BpeTokenizer: ", what, " '", path.string(), "' does not exist");
  if (std::filesystem::is_directory(path, ec))
    throw Error("Gpt2BpeTokenizer: ", what, " '", path.string(), "' is a directory, expected a file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("Gpt2BpeTokenizer: cannot open ", what, " '", path.string(), "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error("Gpt2BpeTokenizer: error reading ", what, " '", path.string(), "'");
  return ss.str();
}

/// Printable form of a symbol for messages.
std::string single_quoted(std::string_view s) { return "'" + std::string(s) + "'"; }

}  // namespace

namespace {

/// Fills m's tables from the texts of vocab.json and merges.txt; messages name m.vocab_path / m.merges_path.
void load_tables(Gpt2BpeTokenizer::Impl& m, std::string_view vtext, std::string_view mtext) {
  using Impl = Gpt2BpeTokenizer::Impl;
  constexpr std::string_view kEndOfText = Gpt2BpeTokenizer::kEndOfText;
  // ---- vocab.json ----
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(vtext);
  } catch (const nlohmann::json::parse_error& e) {
    const std::size_t upto = std::min<std::size_t>(e.byte > 0 ? e.byte - 1 : 0, vtext.size());
    const auto line = 1 + std::count(vtext.begin(), vtext.begin() + static_cast<std::ptrdiff_t>(upto), '\n');
    throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ":", line, ": malformed JSON (", e.what(), ")");
  }
  if (!j.is_object())
    throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": expected a JSON object mapping token strings to ids, got a JSON ",
                j.type_name());
  if (j.empty()) throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": the vocabulary is empty");
  std::int64_t max_id = -1;
  m.vocab.reserve(j.size());
  for (auto it = j.begin(); it != j.end(); ++it) {
    const auto& v = it.value();
    if (!v.is_number_integer())
      throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": token ", single_quoted(it.key()), " has id ", v.dump(),
                  ", expected a non-negative integer");
    const auto id = v.get<std::int64_t>();
    if (id < 0 || id > std::numeric_limits<std::int32_t>::max())
      throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": token ", single_quoted(it.key()), " has id ", id,
                  ", expected an integer in [0, 2^31)");
    m.vocab.emplace(it.key(), static_cast<std::int32_t>(id));
    max_id = std::max(max_id, id);
  }
  m.id_token.assign(static_cast<std::size_t>(max_id + 1), std::string());
  m.id_bytes.assign(static_cast<std::size_t>(max_id + 1), std::string());
  m.id_present.assign(static_cast<std::size_t>(max_id + 1), false);
  for (const auto& [tok, id] : m.vocab) {
    const auto i = static_cast<std::size_t>(id);
    if (m.id_present[i])
      throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": id ", id, " is used by both ", single_quoted(m.id_token[i]), " and ",
                  single_quoted(tok));
    m.id_present[i] = true;
    m.id_token[i] = tok;
    // Decoded bytes: each code point through the inverse byte table. A token outside the table's image
    // (an added literal token) decodes to its own UTF-8 text.
    std::string bytes;
    bool mapped = true;
    for (std::size_t p = 0; p < tok.size();) {
      std::size_t len;
      const char32_t cp = next_code_point(tok, p, len);
      const int b = cp == kInvalid ? -1 : gpt2_unicode_to_byte(cp);
      if (b < 0) {
        mapped = false;
        break;
      }
      bytes += static_cast<char>(static_cast<unsigned char>(b));
      p += len;
    }
    m.id_bytes[i] = mapped && tok != kEndOfText ? bytes : tok;
  }
  for (unsigned b = 0; b < 256; ++b) {
    std::string sym;
    append_utf8(sym, gpt2_byte_to_unicode(static_cast<std::uint8_t>(b)));
    auto it = m.vocab.find(sym);
    if (it == m.vocab.end()) {
      std::ostringstream hex;
      hex << std::hex << b;
      throw Error("Gpt2BpeTokenizer: ", m.vocab_path, ": the vocabulary lacks the byte symbol ", single_quoted(sym),
                  " of byte 0x", hex.str(), " (a byte-level BPE vocabulary holds all 256)");
    }
    m.byte_id[b] = it->second;
  }
  if (auto it = m.vocab.find(std::string(kEndOfText)); it != m.vocab.end()) m.eot = it->second;

  // ---- merges.txt ----
  std::size_t pos = 0;
  std::int64_t line_no = 0;
  std::int32_t rank = 0;
  while (pos < mtext.size()) {
    std::size_t eol = mtext.find('\n', pos);
    if (eol == std::string::npos) eol = mtext.size();
    std::string_view line(mtext.data() + pos, eol - pos);
    pos = eol + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line_no == 1 && line.starts_with("#version")) continue;
    if (line.empty()) continue;
    const std::size_t sp = line.find(' ');
    if (sp == std::string_view::npos || sp == 0 || sp + 1 == line.size() || line.find(' ', sp + 1) != std::string_view::npos)
      throw Error("Gpt2BpeTokenizer: ", m.merges_path, ":", line_no, ": expected two symbols separated by one space, got ",
                  single_quoted(line));
    const std::string a(line.substr(0, sp)), b(line.substr(sp + 1));
    auto ia = m.vocab.find(a), ib = m.vocab.find(b);
    for (const auto* s : {&a, &b})
      if (m.vocab.find(*s) == m.vocab.end())
        throw Error("Gpt2BpeTokenizer: ", m.merges_path, ":", line_no, ": merge ", single_quoted(line), " refers to symbol ",
                    single_quoted(*s), ", which is not in the vocabulary ", m.vocab_path);
    auto iab = m.vocab.find(a + b);
    if (iab == m.vocab.end())
      throw Error("Gpt2BpeTokenizer: ", m.merges_path, ":", line_no, ": merge ", single_quoted(line), " produces ",
                  single_quoted(a + b), ", which is not in the vocabulary ", m.vocab_path);
    m.merges.try_emplace(Impl::key(ia->second, ib->second), Impl::Merge{rank, iab->second});  // first rank wins
    m.merge_list.emplace_back(ia->second, ib->second);
    ++rank;
  }
  m.num_merges = rank;
}

}  // namespace

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::filesystem::path& vocab_json, const std::filesystem::path& merges_txt)
    : impl_(std::make_shared<Impl>()) {
  impl_->vocab_path = vocab_json.string();
  impl_->merges_path = merges_txt.string();
  impl_->source = impl_->vocab_path;
  const std::string vtext = read_whole_file(vocab_json, "vocab file");
  const std::string mtext = read_whole_file(merges_txt, "merges file");
  load_tables(*impl_, vtext, mtext);
}

Gpt2BpeTokenizer Gpt2BpeTokenizer::from_strings(std::string_view vocab_json_text, std::string_view merges_text,
                                                std::string_view source) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::string(source);
  impl->vocab_path = "vocab.json text";
  impl->merges_path = "merges.txt text";
  if (!source.empty()) {
    impl->vocab_path += " of " + impl->source;
    impl->merges_path += " of " + impl->source;
  }
  load_tables(*impl, vocab_json_text, merges_text);
  return Gpt2BpeTokenizer(std::move(impl));
}

std::int64_t Gpt2BpeTokenizer::vocab_size() const { return static_cast<std::int64_t>(impl_->id_token.size()); }
std::int64_t Gpt2BpeTokenizer::num_merges() const { return impl_->num_merges; }
std::optional<std::int32_t> Gpt2BpeTokenizer::eot_id() const { return impl_->eot; }

std::optional<std::int32_t> Gpt2BpeTokenizer::token_id(std::string_view token) const {
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

const std::string& Gpt2BpeTokenizer::token_string(std::int32_t id) const {
  TG_CHECK(id >= 0 && id < vocab_size() && impl_->id_present[static_cast<std::size_t>(id)],
           "Gpt2BpeTokenizer::token_string: id ", id, " is not in the vocabulary ", impl_->vocab_path);
  return impl_->id_token[static_cast<std::size_t>(id)];
}

const std::string& Gpt2BpeTokenizer::token_bytes(std::int32_t id) const {
  TG_CHECK(id >= 0 && id < vocab_size() && impl_->id_present[static_cast<std::size_t>(id)],
           "Gpt2BpeTokenizer::token_bytes: id ", id, " is not in the vocabulary ", impl_->vocab_path);
  return impl_->id_bytes[static_cast<std::size_t>(id)];
}

bool Gpt2BpeTokenizer::contains(std::int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->id_present[static_cast<std::size_t>(id)];
}

const std::string& Gpt2BpeTokenizer::source() const { return impl_->source; }

std::string Gpt2BpeTokenizer::vocab_json() const {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t i = 0; i < impl_->id_token.size(); ++i)
    if (impl_->id_present[i]) j[impl_->id_token[i]] = static_cast<std::int64_t>(i);
  return j.dump();
}

std::string Gpt2BpeTokenizer::merges_text() const {
  std::string out = "#version: 0.2\n";
  for (const auto& [a, b] : impl_->merge_list) {
    out += impl_->id_token[static_cast<std::size_t>(a)];
    out += ' ';
    out += impl_->id_token[static_cast<std::size_t>(b)];
    out += '\n';
  }
  return out;
}

std::vector<std::int32_t> Gpt2BpeTokenizer::encode_ordinary(std::string_view text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 1);
  impl_->encode_ordinary(text, out);
  return out;
}

std::vector<std::int32_t> Gpt2BpeTokenizer::encode(std::string_view text) const {
  if (!impl_->eot) return encode_ordinary(text);
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 1);
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t hit = text.find(kEndOfText, pos);
    const std::size_t end = hit == std::string_view::npos ? text.size() : hit;
    impl_->encode_ordinary(text.substr(pos, end - pos), out);
    if (hit == std::string_view::npos) break;
    out.push_back(*impl_->eot);
    pos = hit + kEndOfText.size();
  }
  return out;
}

std::string Gpt2BpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  const Impl& m = *impl_;
  std::string out;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (id < 0 || id >= vocab_size())
      throw Error("Gpt2BpeTokenizer::decode: id ", id, " at position ", i, " is out of range [0, ", vocab_size(),
                  ") of the vocabulary ", m.vocab_path);
    if (!m.id_present[static_cast<std::size_t>(id)])
      throw Error("Gpt2BpeTokenizer::decode: id ", id, " at position ", i, " is not in the vocabulary ", m.vocab_path);
    out += m.id_bytes[static_cast<std::size_t>(id)];
  }
  return out;
}

}  // namespace tg::data

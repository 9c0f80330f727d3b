// Byte-level BPE trained here (include/typegrad/data/tokenizer.hpp): ByteBpeTokenizer, train_byte_bpe, the
// runtime choice AnyTokenizer with its JSON form, tokenizer specs ("byte" | "bpe:N" | "gpt2:DIR") and the BPE
// cache (load_or_train_bpe, default_bpe_cache_dir, corpus_hash).
#include <algorithm>
#include <atomic>
#include <bit>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <mutex>
#include <queue>
#include <sstream>
#include <unistd.h>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "typegrad/data/tokenizer.hpp"

namespace tg::data {

namespace {

constexpr std::int64_t kMinBpeVocab = 257;

std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
}
std::int32_t key_left(std::uint64_t k) { return static_cast<std::int32_t>(k >> 32); }
std::int32_t key_right(std::uint64_t k) { return static_cast<std::int32_t>(k & 0xFFFFFFFFu); }

/// Transparent string hash, so the piece cache is searched with a string_view without building a string.
struct PieceHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

std::string hex16(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Note [pre-tokenization in chunks]
// gpt2_pre_tokenize holds ~24 bytes of state per input byte, too much for a corpus of gigabytes at once, so
// gpt2_pre_tokenize_each (and with it the BPE) pre-tokenizes about chunk_bytes (1 MiB) at a time. A cut at
// position p gives the same pieces as the whole text when text[p-1] is '\n' and text[p-2], text[p] are printable
// ASCII (0x21..0x7E): the whitespace run before p is the single '\n' (so `\s+(?!\S)` has nothing to give back,
// which needs the lookahead past p), no letter, number, punctuation or contraction piece spans a newline, and an
// ASCII byte is a code point of its own (so the cut does not split a UTF-8 sequence). Texts without such a point
// are taken whole.
void gpt2_pre_tokenize_each(std::string_view text, const std::function<void(std::string_view)>& f,
                            std::size_t chunk_bytes) {
  TG_CHECK(chunk_bytes >= 2, "gpt2_pre_tokenize_each: chunk_bytes ", chunk_bytes, " is below 2");
  auto graph = [](char c) { return c >= 0x21 && c <= 0x7E; };
  while (!text.empty()) {
    std::size_t cut = text.size();
    if (text.size() / 2 >= chunk_bytes) {
      for (std::size_t p = chunk_bytes; p + 1 < text.size(); ++p)
        if (text[p - 1] == '\n' && graph(text[p - 2]) && graph(text[p])) {
          cut = p;
          break;
        }
    }
    for (std::string_view piece : gpt2_pre_tokenize(text.substr(0, cut))) f(piece);
    text.remove_prefix(cut);
  }
}

// ---- ByteBpeTokenizer ---------------------------------------------------------------------------------

struct ByteBpeTokenizer::Impl {
  std::vector<Merge> merges;
  std::vector<std::string> bytes;                       // per id: the bytes it decodes to
  std::unordered_map<std::uint64_t, std::int32_t> rank;  // pair_key(left, right) -> merge index

  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<std::int32_t>, PieceHash, std::equal_to<>> cache;
  static constexpr std::size_t kCacheLimit = 1u << 18;

  std::int32_t rank_of(std::int32_t a, std::int32_t b) const {
    auto it = rank.find(pair_key(a, b));
    return it == rank.end() ? -1 : it->second;
  }

  // Note [byte BPE encoding]
  // Standard BPE (Sennrich et al. 2016) merges, within a piece, every occurrence of the adjacent pair of lowest
  // rank, left to right, until no adjacent pair is a merge. Merging one occurrence at a time, always the
  // leftmost among those of lowest rank, gives the same result: the pairs a merge creates involve the new id
  // 256 + k, and merges of it have ranks above k, so no pair of a lower rank can appear later. That is done
  // here with the symbols in a linked list over byte positions and a min-heap of (rank, left position),
  // invalidated lazily: an entry is used only if its position still starts a pair of that rank. O(n log n)
  // per piece, so long pieces (runs of spaces, ASCII art) do not cost O(n^2).
  void bpe(std::string_view piece, std::vector<std::int32_t>& out) const {
    const auto n = static_cast<std::int32_t>(piece.size());
    std::vector<std::int32_t> sym(static_cast<std::size_t>(n)), prev(static_cast<std::size_t>(n)),
        next(static_cast<std::size_t>(n));
    using Entry = std::pair<std::int32_t, std::int32_t>;  // (rank, position)
    std::priority_queue<Entry, std::vector<Entry>, std::greater<>> heap;
    for (std::int32_t i = 0; i < n; ++i) {
      sym[static_cast<std::size_t>(i)] = static_cast<unsigned char>(piece[static_cast<std::size_t>(i)]);
      prev[static_cast<std::size_t>(i)] = i - 1;
      next[static_cast<std::size_t>(i)] = i + 1;
    }
    for (std::int32_t i = 0; i + 1 < n; ++i)
      if (const std::int32_t r = rank_of(sym[static_cast<std::size_t>(i)], sym[static_cast<std::size_t>(i + 1)]);
          r >= 0)
        heap.emplace(r, i);
    auto at = [](std::vector<std::int32_t>& v, std::int32_t i) -> std::int32_t& {
      return v[static_cast<std::size_t>(i)];
    };
    while (!heap.empty()) {
      const auto [r, i] = heap.top();
      heap.pop();
      if (at(sym, i) < 0) continue;  // merged into its left neighbour
      const std::int32_t j = at(next, i);
      if (j >= n || rank_of(at(sym, i), at(sym, j)) != r) continue;  // stale
      at(sym, i) = 256 + r;
      at(sym, j) = -1;
      const std::int32_t k = at(next, j);
      at(next, i) = k;
      if (k < n) at(prev, k) = i;
      if (const std::int32_t p = at(prev, i); p >= 0)
        if (const std::int32_t rp = rank_of(at(sym, p), at(sym, i)); rp >= 0) heap.emplace(rp, p);
      if (k < n)
        if (const std::int32_t rk = rank_of(at(sym, i), at(sym, k)); rk >= 0) heap.emplace(rk, i);
    }
    for (std::int32_t i = 0; i < n; i = at(next, i)) out.push_back(at(sym, i));
  }

  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) const {
    if (piece.size() == 1 || merges.empty()) {
      for (char c : piece) out.push_back(static_cast<unsigned char>(c));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(cache_mu);
      if (auto it = cache.find(piece); it != cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const std::size_t start = out.size();
    bpe(piece, out);
    std::vector<std::int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
    std::lock_guard<std::mutex> lock(cache_mu);
    if (cache.size() >= kCacheLimit) cache.clear();
    cache.emplace(std::string(piece), std::move(ids));
  }
};

ByteBpeTokenizer::ByteBpeTokenizer() : ByteBpeTokenizer(std::vector<Merge>{}) {}

ByteBpeTokenizer::ByteBpeTokenizer(std::vector<Merge> merges) {
  TG_CHECK(static_cast<std::int64_t>(merges.size()) <= kMaxVocabSize - 256, "ByteBpeTokenizer: ", merges.size(),
           " merges make a vocabulary of ", 256 + merges.size(), " tokens, more than the maximum ", kMaxVocabSize);
  auto impl = std::make_shared<Impl>();
  impl->bytes.reserve(256 + merges.size());
  for (int b = 0; b < 256; ++b) impl->bytes.emplace_back(1, static_cast<char>(b));
  impl->rank.reserve(merges.size());
  for (std::size_t k = 0; k < merges.size(); ++k) {
    const auto [a, b] = merges[k];
    const std::int64_t limit = 256 + static_cast<std::int64_t>(k);
    for (const std::int32_t id : {a, b})
      TG_CHECK(id >= 0 && id < limit, "ByteBpeTokenizer: merge ", k, " (", a, ", ", b, ") refers to id ", id,
               ", expected an id in [0, ", limit, ") (a byte or an earlier merge)");
    const bool fresh = impl->rank.emplace(pair_key(a, b), static_cast<std::int32_t>(k)).second;
    TG_CHECK(fresh, "ByteBpeTokenizer: merge ", k, " (", a, ", ", b, ") repeats merge ", impl->rank.at(pair_key(a, b)));
    impl->bytes.push_back(impl->bytes[static_cast<std::size_t>(a)] + impl->bytes[static_cast<std::size_t>(b)]);
  }
  impl->merges = std::move(merges);
  impl_ = std::move(impl);
}

std::int64_t ByteBpeTokenizer::vocab_size() const { return 256 + num_merges(); }
std::int64_t ByteBpeTokenizer::num_merges() const { return static_cast<std::int64_t>(impl_->merges.size()); }
const std::vector<ByteBpeTokenizer::Merge>& ByteBpeTokenizer::merges() const { return impl_->merges; }

const std::string& ByteBpeTokenizer::token_bytes(std::int32_t id) const {
  TG_CHECK(id >= 0 && id < vocab_size(), "ByteBpeTokenizer::token_bytes: id ", id, " is out of range [0, ",
           vocab_size(), ")");
  return impl_->bytes[static_cast<std::size_t>(id)];
}

std::vector<std::int32_t> ByteBpeTokenizer::encode(std::string_view text) const {
  std::vector<std::int32_t> out;
  out.reserve(text.size() / 3 + 1);
  gpt2_pre_tokenize_each(text, [&](std::string_view piece) { impl_->encode_piece(piece, out); });
  return out;
}

std::string ByteBpeTokenizer::decode(std::span<const std::int32_t> ids) const {
  const auto v = vocab_size();
  std::string out;
  out.reserve(ids.size() * 3);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int32_t id = ids[i];
    if (id < 0 || id >= v)
      throw Error("ByteBpeTokenizer::decode: id ", id, " at position ", i, " is out of range [0, ", v, ")");
    out += impl_->bytes[static_cast<std::size_t>(id)];
  }
  return out;
}

// ---- training -------------------------------------------------------------------------------------------

// Note [byte BPE training]
// The text is split by gpt2_pre_tokenize (Note [pre-tokenization in chunks]) and the distinct pieces counted (a piece
// of frequency f weighs f in every pair count); pieces of one byte hold no pair and are dropped. The pieces are sorted
// so everything after is independent of hash-map order. State:
//   * the words: each piece's current symbols, in one flat array (a word shrinks in place as it merges);
//   * count[pair]: the weighted number of adjacent occurrences over all words;
//   * where[pair]: the words that may hold the pair (a superset: entries go stale, and are checked);
//   * a max-heap of (count, pair) with lazy invalidation: an entry is used only if its count is the pair's
//     current count. Every change of a count pushes the new value, so the valid entry of each pair is in the
//     heap and the first valid entry popped is the true maximum. Ties go to the smaller (left, right).
// A merge of (a, b) into id 256 + k rewrites only the words in where[(a, b)]: for each, the pairs of its old
// symbols are counted out and those of its new symbols counted in (words are short, so recounting the word
// is as cheap as patching the neighbours, and has no special cases such as "a a a"). The deltas of one merge
// are summed per pair, applied, and the changed pairs pushed. Training stops at the asked vocabulary or when
// the best pair occurs fewer than twice (a merge seen once compresses nothing it was not trained on).

namespace {

struct HeapEntry {
  std::int64_t count;
  std::uint64_t key;
};
struct HeapLess {  // max-heap on count, then the smaller key on top
  bool operator()(const HeapEntry& x, const HeapEntry& y) const {
    return x.count < y.count || (x.count == y.count && x.key > y.key);
  }
};

}  // namespace

ByteBpeTokenizer train_byte_bpe(std::string_view text, std::int64_t vocab_size) {
  TG_CHECK(vocab_size >= kMinBpeVocab && vocab_size <= ByteBpeTokenizer::kMaxVocabSize, "train_byte_bpe: vocab_size ",
           vocab_size, " is outside [", kMinBpeVocab, ", ", ByteBpeTokenizer::kMaxVocabSize,
           "] (256 byte tokens plus at least one merge; at most 65536 so ids fit uint16 token files)");
  TG_CHECK(!text.empty(), "train_byte_bpe: the training text is empty");

  // Distinct pieces, sorted, with their frequencies.
  std::vector<std::pair<std::string_view, std::int64_t>> pieces;
  {
    std::unordered_map<std::string_view, std::int64_t> freq;
    gpt2_pre_tokenize_each(text, [&](std::string_view p) {
      if (p.size() >= 2) ++freq[p];
    });
    pieces.assign(freq.begin(), freq.end());
  }
  std::sort(pieces.begin(), pieces.end());

  const auto num_words = pieces.size();
  std::vector<std::int32_t> syms;
  std::vector<std::size_t> offset(num_words);
  std::vector<std::int32_t> len(num_words);
  std::vector<std::int64_t> weight(num_words);
  for (std::size_t w = 0; w < num_words; ++w) {
    offset[w] = syms.size();
    len[w] = static_cast<std::int32_t>(pieces[w].first.size());
    weight[w] = pieces[w].second;
    for (char c : pieces[w].first) syms.push_back(static_cast<unsigned char>(c));
  }

  std::unordered_map<std::uint64_t, std::int64_t> count;
  std::unordered_map<std::uint64_t, std::vector<std::int32_t>> where;
  auto note_where = [&](std::uint64_t key, std::int32_t w) {
    auto& v = where[key];
    if (v.empty() || v.back() != w) v.push_back(w);
  };
  for (std::size_t w = 0; w < num_words; ++w) {
    const std::int32_t* s = syms.data() + offset[w];
    for (std::int32_t i = 0; i + 1 < len[w]; ++i) {
      const std::uint64_t key = pair_key(s[i], s[i + 1]);
      count[key] += weight[w];
      note_where(key, static_cast<std::int32_t>(w));
    }
  }
  std::vector<HeapEntry> heap_store;
  heap_store.reserve(count.size());
  for (const auto& [key, c] : count) heap_store.push_back({c, key});
  std::priority_queue<HeapEntry, std::vector<HeapEntry>, HeapLess> heap(HeapLess{}, std::move(heap_store));

  const std::int64_t target_merges = vocab_size - 256;
  std::vector<ByteBpeTokenizer::Merge> merges;
  merges.reserve(static_cast<std::size_t>(target_merges));
  std::vector<std::int32_t> stamp(num_words, -1);  // the last merge that rewrote each word
  std::vector<std::pair<std::uint64_t, std::int64_t>> deltas;
  std::vector<std::int32_t> scratch;

  while (static_cast<std::int64_t>(merges.size()) < target_merges && !heap.empty()) {
    const HeapEntry top = heap.top();
    heap.pop();
    const auto it = count.find(top.key);
    if (it == count.end() || it->second != top.count) continue;  // stale
    if (top.count < 2) break;
    const std::int32_t a = key_left(top.key), b = key_right(top.key);
    const auto k = static_cast<std::int32_t>(merges.size());
    const std::int32_t merged = 256 + k;
    merges.emplace_back(a, b);

    std::vector<std::int32_t> words = std::move(where[top.key]);
    where.erase(top.key);
    deltas.clear();
    for (const std::int32_t w : words) {
      const auto wi = static_cast<std::size_t>(w);
      if (stamp[wi] == k) continue;
      std::int32_t* s = syms.data() + offset[wi];
      const std::int32_t n = len[wi];
      bool holds = false;
      for (std::int32_t i = 0; i + 1 < n && !holds; ++i) holds = s[i] == a && s[i + 1] == b;
      if (!holds) continue;
      stamp[wi] = k;
      const std::int64_t f = weight[wi];
      for (std::int32_t i = 0; i + 1 < n; ++i) deltas.emplace_back(pair_key(s[i], s[i + 1]), -f);
      scratch.clear();
      for (std::int32_t i = 0; i < n;) {
        if (i + 1 < n && s[i] == a && s[i + 1] == b) {
          scratch.push_back(merged);
          i += 2;
        } else {
          scratch.push_back(s[i++]);
        }
      }
      const auto m = static_cast<std::int32_t>(scratch.size());
      std::copy(scratch.begin(), scratch.end(), s);
      len[wi] = m;
      for (std::int32_t i = 0; i + 1 < m; ++i) {
        const std::uint64_t key = pair_key(s[i], s[i + 1]);
        deltas.emplace_back(key, f);
        if (s[i] == merged || s[i + 1] == merged) note_where(key, w);
      }
    }
    std::sort(deltas.begin(), deltas.end());
    for (std::size_t i = 0; i < deltas.size();) {
      const std::uint64_t key = deltas[i].first;
      std::int64_t d = 0;
      for (; i < deltas.size() && deltas[i].first == key; ++i) d += deltas[i].second;
      if (d == 0) continue;
      auto& c = count[key];
      c += d;
      if (c == 0) {
        count.erase(key);
        where.erase(key);
      } else {
        heap.push({c, key});
      }
    }
    TG_CHECK(!count.contains(top.key), "train_byte_bpe: internal error: merge ", k, " (", a, ", ", b,
             ") left occurrences of its pair");
  }
  return ByteBpeTokenizer(std::move(merges));
}

// ---- corpus_hash ------------------------------------------------------------------------------------------

std::uint64_t corpus_hash(std::string_view text) {
  // Each little-endian 8-byte word w (the last one zero-padded) is folded in as h = rotl(h ^ w * K1, 31) * K2
  // (both steps are bijections of h, so no two states collide on one word); then the length is mixed in and
  // murmur3's fmix64 spreads every input bit over the result.
  constexpr std::uint64_t K1 = 0x9E3779B97F4A7C15ull, K2 = 0xC2B2AE3D27D4EB4Full;
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const std::size_t n = text.size();
  std::uint64_t h = 0x243F6A8885A308D3ull;
  auto load = [&](std::size_t i, std::size_t m) {
    std::uint64_t w = 0;
    for (std::size_t j = 0; j < m; ++j) w |= static_cast<std::uint64_t>(p[i + j]) << (8 * j);
    return w;
  };
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) h = std::rotl(h ^ (load(i, 8) * K1), 31) * K2;
  if (i < n) h = std::rotl(h ^ (load(i, n - i) * K1), 31) * K2;
  h ^= static_cast<std::uint64_t>(n);
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

// ---- AnyTokenizer -------------------------------------------------------------------------------------------

std::vector<std::int32_t> AnyTokenizer::encode(std::string_view text) const {
  return std::visit([&](const auto& t) { return t.encode(text); }, tok_);
}
std::string AnyTokenizer::decode(std::span<const std::int32_t> ids) const {
  return std::visit([&](const auto& t) { return t.decode(ids); }, tok_);
}
std::int64_t AnyTokenizer::vocab_size() const {
  return std::visit([](const auto& t) { return static_cast<std::int64_t>(t.vocab_size()); }, tok_);
}
std::optional<std::int32_t> AnyTokenizer::eot_id() const {
  return std::visit([](const auto& t) { return t.eot_id(); }, tok_);
}

std::string_view AnyTokenizer::kind() const {
  switch (tok_.index()) {
    case 0: return "byte";
    case 1: return "bpe";
    default: return "gpt2";
  }
}

std::string AnyTokenizer::describe() const {
  std::ostringstream s;
  if (const auto* b = std::get_if<ByteBpeTokenizer>(&tok_)) {
    s << "byte-level BPE, " << b->vocab_size() << " tokens (" << b->num_merges() << " merges)";
  } else if (const auto* g = std::get_if<Gpt2BpeTokenizer>(&tok_)) {
    s << "GPT-2 BPE, " << g->vocab_size() << " tokens (" << g->num_merges() << " merges";
    if (g->eot_id()) s << ", end-of-text id " << *g->eot_id();
    s << ")";
    if (!g->source().empty()) s << " from " << g->source();
  } else {
    s << "bytes, 256 tokens";
  }
  return s.str();
}

std::string AnyTokenizer::token_bytes(std::int32_t id) const {
  if (const auto* b = std::get_if<ByteBpeTokenizer>(&tok_)) return b->token_bytes(id);
  if (const auto* g = std::get_if<Gpt2BpeTokenizer>(&tok_)) return g->token_bytes(id);
  TG_CHECK(id >= 0 && id < ByteTokenizer::kVocabSize, "AnyTokenizer::token_bytes: id ", id,
           " is out of range [0, 256) of the byte tokenizer");
  return std::string(1, static_cast<char>(static_cast<unsigned char>(id)));
}

std::vector<std::int32_t> AnyTokenizer::token_byte_lengths() const {
  std::vector<std::int32_t> out(static_cast<std::size_t>(vocab_size()), 1);
  if (const auto* b = std::get_if<ByteBpeTokenizer>(&tok_)) {
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<std::int32_t>(b->token_bytes(static_cast<std::int32_t>(i)).size());
  } else if (const auto* g = std::get_if<Gpt2BpeTokenizer>(&tok_)) {
    for (std::size_t i = 0; i < out.size(); ++i) {
      const auto id = static_cast<std::int32_t>(i);
      out[i] = g->contains(id) ? static_cast<std::int32_t>(g->token_bytes(id).size()) : 0;
    }
  }
  return out;
}

std::string AnyTokenizer::to_json() const {
  nlohmann::json j = nlohmann::json::object();
  j["format"] = "typegrad-tokenizer";
  j["version"] = 1;
  j["kind"] = std::string(kind());
  if (const auto* b = std::get_if<ByteBpeTokenizer>(&tok_)) {
    nlohmann::json m = nlohmann::json::array();
    for (const auto& [l, r] : b->merges()) m.push_back(nlohmann::json::array({l, r}));
    j["merges"] = std::move(m);
  } else if (const auto* g = std::get_if<Gpt2BpeTokenizer>(&tok_)) {
    if (!g->source().empty()) j["source"] = g->source();
    j["vocab_json"] = g->vocab_json();
    j["merges_txt"] = g->merges_text();
  }
  return j.dump();
}

namespace {

const nlohmann::json& member(const nlohmann::json& j, const char* name, nlohmann::json::value_t type,
                             const char* what) {
  auto it = j.find(name);
  if (it == j.end()) throw Error("AnyTokenizer::from_json: the member \"", name, "\" is missing (expected ", what, ")");
  const bool ok = type == nlohmann::json::value_t::number_integer ? it->is_number_integer() : it->type() == type;
  if (!ok)
    throw Error("AnyTokenizer::from_json: the member \"", name, "\" is a JSON ", it->type_name(), ", expected ", what);
  return *it;
}

}  // namespace

AnyTokenizer AnyTokenizer::from_json(std::string_view json) {
  using V = nlohmann::json::value_t;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error("AnyTokenizer::from_json: malformed JSON (", json.size(), " bytes): ", e.what());
  }
  if (!j.is_object()) throw Error("AnyTokenizer::from_json: expected a JSON object, got a JSON ", j.type_name());
  const auto& format = member(j, "format", V::string, "\"typegrad-tokenizer\"");
  if (format.get<std::string>() != "typegrad-tokenizer")
    throw Error("AnyTokenizer::from_json: \"format\" is ", format.dump(), ", expected \"typegrad-tokenizer\"");
  const auto& version = member(j, "version", V::number_integer, "the integer 1");
  if (version.get<std::int64_t>() != 1)
    throw Error("AnyTokenizer::from_json: version ", version.dump(), " is not supported (this build reads version 1)");
  const std::string kind = member(j, "kind", V::string, "\"byte\", \"bpe\" or \"gpt2\"").get<std::string>();
  if (kind == "byte") return AnyTokenizer(ByteTokenizer{});
  if (kind == "bpe") {
    const auto& m = member(j, "merges", V::array, "an array of [left id, right id] pairs");
    std::vector<ByteBpeTokenizer::Merge> merges;
    merges.reserve(m.size());
    for (std::size_t k = 0; k < m.size(); ++k) {
      const auto& p = m[k];
      const bool ok = p.is_array() && p.size() == 2 && p[0].is_number_integer() && p[1].is_number_integer();
      if (!ok)
        throw Error("AnyTokenizer::from_json: merge ", k, " is ", p.dump(), ", expected a pair [left id, right id]");
      const auto l = p[0].get<std::int64_t>(), r = p[1].get<std::int64_t>();
      for (const std::int64_t id : {l, r})
        if (id < 0 || id >= ByteBpeTokenizer::kMaxVocabSize)
          throw Error("AnyTokenizer::from_json: merge ", k, " is ", p.dump(), ": id ", id, " is outside [0, ",
                      ByteBpeTokenizer::kMaxVocabSize, ")");
      merges.emplace_back(static_cast<std::int32_t>(l), static_cast<std::int32_t>(r));
    }
    return AnyTokenizer(ByteBpeTokenizer(std::move(merges)));
  }
  if (kind == "gpt2") {
    const auto& v = member(j, "vocab_json", V::string, "the text of vocab.json");
    const auto& m = member(j, "merges_txt", V::string, "the text of merges.txt");
    std::string source;
    if (auto it = j.find("source"); it != j.end() && it->is_string()) source = it->get<std::string>();
    return AnyTokenizer(
        Gpt2BpeTokenizer::from_strings(v.get_ref<const std::string&>(), m.get_ref<const std::string&>(), source));
  }
  throw Error("AnyTokenizer::from_json: unknown kind \"", kind, "\" (expected \"byte\", \"bpe\" or \"gpt2\")");
}

// ---- specs ---------------------------------------------------------------------------------------------------

namespace {

constexpr const char* kSpecForms = "accepted forms: byte, bpe:N (N an integer in [257, 65536]), gpt2:DIR";

}  // namespace

TokenizerSpec parse_tokenizer_spec(std::string_view spec) {
  TokenizerSpec out;
  if (spec == "byte") {
    out.kind = "byte";
  } else if (spec.starts_with("bpe:")) {
    const std::string_view n = spec.substr(4);
    std::int64_t v = 0;
    const auto [end, ec] = std::from_chars(n.data(), n.data() + n.size(), v);
    if (n.empty() || ec != std::errc() || end != n.data() + n.size())
      throw Error("tokenizer spec '", spec, "': N = '", n, "' is not an integer; ", kSpecForms);
    if (v < kMinBpeVocab || v > ByteBpeTokenizer::kMaxVocabSize)
      throw Error("tokenizer spec '", spec, "': vocabulary size ", v, " is outside [", kMinBpeVocab, ", ",
                  ByteBpeTokenizer::kMaxVocabSize, "] (256 byte tokens plus at least one merge; ids must fit uint16); ",
                  kSpecForms);
    out.kind = "bpe";
    out.vocab_size = v;
  } else if (spec.starts_with("gpt2:")) {
    if (spec.size() == 5) throw Error("tokenizer spec '", spec, "': DIR is empty; ", kSpecForms);
    out.kind = "gpt2";
    out.dir = std::filesystem::path(std::string(spec.substr(5)));
  } else {
    throw Error("tokenizer spec '", spec, "' is not recognized; ", kSpecForms);
  }
  return out;
}

AnyTokenizer make_tokenizer(std::string_view spec, const BpeTraining& bpe, BpeCacheResult* bpe_result) {
  const TokenizerSpec s = parse_tokenizer_spec(spec);
  if (s.kind == "byte") return AnyTokenizer(ByteTokenizer{});
  if (s.kind == "bpe") {
    TG_CHECK(!bpe.text.empty(), "tokenizer spec '", spec,
             "': the BPE needs a training text, and the text given is empty");
    BpeCacheResult r = load_or_train_bpe(bpe.text, s.vocab_size, bpe.cache_dir, bpe.cache_stem);
    AnyTokenizer tok = r.tok;
    if (bpe_result) *bpe_result = std::move(r);
    return tok;
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(s.dir, ec))
    throw Error("tokenizer spec '", spec, "': the directory '", s.dir.string(), "' ",
                std::filesystem::exists(s.dir, ec) ? "is not a directory" : "does not exist",
                " (expected one holding GPT-2's vocab.json and merges.txt)");
  for (const char* f : {"vocab.json", "merges.txt"})
    if (!std::filesystem::is_regular_file(s.dir / f, ec))
      throw Error("tokenizer spec '", spec, "': '", (s.dir / f).string(), "' does not exist (GPT-2's ", f,
                  " is expected there)");
  return AnyTokenizer(Gpt2BpeTokenizer(s.dir / "vocab.json", s.dir / "merges.txt"));
}

// ---- the BPE cache --------------------------------------------------------------------------------------------

namespace {

/// The cache file's JSON: the tokenizer's to_json() members plus what it was trained on and a checksum of the
/// tokenizer (corpus_hash of its to_json()), so a damaged or foreign file is never trusted.
std::string cache_json(const AnyTokenizer& tok, std::string_view text, std::int64_t vocab_size) {
  const std::string tj = tok.to_json();
  nlohmann::json j = nlohmann::json::parse(tj);
  j["corpus_hash"] = hex16(corpus_hash(text));
  j["corpus_bytes"] = text.size();
  j["requested_vocab_size"] = vocab_size;
  j["checksum"] = hex16(corpus_hash(tj));
  return j.dump();
}

/// The tokenizer in a cache file; throws saying what is wrong.
AnyTokenizer read_cache(const std::filesystem::path& file, std::string_view text, std::int64_t vocab_size) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw Error("cannot open it");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw Error("error reading it");
  const std::string body = ss.str();
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error("malformed JSON: ", e.what());
  }
  if (!j.is_object()) throw Error("not a JSON object");
  auto str = [&](const char* k) {
    auto it = j.find(k);
    if (it == j.end() || !it->is_string()) throw Error("the member \"", k, "\" is missing or not a string");
    return it->get<std::string>();
  };
  auto num = [&](const char* k) {
    auto it = j.find(k);
    if (it == j.end() || !it->is_number_integer()) throw Error("the member \"", k, "\" is missing or not an integer");
    return it->get<std::int64_t>();
  };
  if (str("corpus_hash") != hex16(corpus_hash(text)) || num("corpus_bytes") != static_cast<std::int64_t>(text.size()))
    throw Error("it was trained on another corpus");
  if (num("requested_vocab_size") != vocab_size)
    throw Error("it was trained for vocab_size ", num("requested_vocab_size"), ", not ", vocab_size);
  const std::string checksum = str("checksum");
  AnyTokenizer tok = AnyTokenizer::from_json(body);
  if (tok.kind() != "bpe") throw Error("it holds a '", tok.kind(), "' tokenizer, not a BPE");
  if (tok.vocab_size() > vocab_size) throw Error("it holds ", tok.vocab_size(), " tokens, more than ", vocab_size);
  if (hex16(corpus_hash(tok.to_json())) != checksum) throw Error("its checksum does not match its merges");
  return tok;
}

void write_atomically(const std::filesystem::path& file, const std::string& bytes) {
  static std::atomic<int> counter{0};
  std::filesystem::path tmp = file;
  tmp += ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++);
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) throw Error("cannot create '", tmp.string(), "'");
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) {
      std::error_code ec;
      std::filesystem::remove(tmp, ec);
      throw Error("error writing '", tmp.string(), "'");
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp, file, ec);
  if (ec) {
    std::error_code ec2;
    std::filesystem::remove(tmp, ec2);
    throw Error("cannot rename '", tmp.string(), "' to '", file.string(), "': ", ec.message());
  }
}

}  // namespace

BpeCacheResult load_or_train_bpe(std::string_view text, std::int64_t vocab_size, const std::filesystem::path& cache_dir,
                                 std::string_view cache_stem) {
  TG_CHECK(vocab_size >= kMinBpeVocab && vocab_size <= ByteBpeTokenizer::kMaxVocabSize,
           "load_or_train_bpe: vocab_size ", vocab_size, " is outside [", kMinBpeVocab, ", ",
           ByteBpeTokenizer::kMaxVocabSize, "]");
  TG_CHECK(!text.empty(), "load_or_train_bpe: the training text is empty");
  const auto t0 = std::chrono::steady_clock::now();
  BpeCacheResult r;
  if (!cache_dir.empty()) {
    TG_CHECK(!cache_stem.empty() && cache_stem.find('/') == std::string_view::npos, "load_or_train_bpe: cache stem '",
             cache_stem, "' must be a non-empty file name without '/'");
    r.cache_file = cache_dir / (std::string(cache_stem) + ".bpe-" + std::to_string(vocab_size) + "-" +
                                hex16(corpus_hash(text)) + ".json");
    std::error_code ec;
    if (std::filesystem::exists(r.cache_file, ec)) {
      try {
        r.tok = read_cache(r.cache_file, text, vocab_size);
        r.from_cache = true;
        r.seconds = seconds_since(t0);
        return r;
      } catch (const Error& e) {
        std::cerr << "typegrad: warning: ignoring the BPE cache file '" << r.cache_file.string() << "': " << e.what()
                  << "; retraining\n";
      }
    }
  }
  r.tok = AnyTokenizer(train_byte_bpe(text, vocab_size));
  r.seconds = seconds_since(t0);
  if (!r.cache_file.empty()) {
    try {
      std::error_code ec;
      std::filesystem::create_directories(cache_dir, ec);
      if (ec) throw Error("cannot create the directory '", cache_dir.string(), "': ", ec.message());
      write_atomically(r.cache_file, cache_json(r.tok, text, vocab_size));
    } catch (const Error& e) {
      std::cerr << "typegrad: warning: could not write the BPE cache file '" << r.cache_file.string()
                << "': " << e.what() << "\n";
    }
  }
  return r;
}

std::filesystem::path user_cache_dir() {
  namespace fs = std::filesystem;
  fs::path base;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) base = fs::path(xdg) / "typegrad";
  else if (const char* home = std::getenv("HOME"); home && *home) base = fs::path(home) / ".cache" / "typegrad";
  else base = fs::temp_directory_path() / "typegrad";
  std::error_code ec;
  fs::create_directories(base, ec);
  if (ec || !fs::is_directory(base, ec))
    throw Error("user_cache_dir: cannot create the cache directory '", base.string(), "'",
                ec ? ": " + ec.message() : "");
  return base;
}

std::filesystem::path default_bpe_cache_dir(const std::filesystem::path& data_path) {
  namespace fs = std::filesystem;
  TG_CHECK(!data_path.empty(), "default_bpe_cache_dir: the data path is empty");
  fs::path p = fs::absolute(data_path).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();  // "dir/" -> "dir"
  const fs::path dir = p.parent_path();
  std::error_code ec;
  if (fs::is_directory(dir, ec) && ::access(dir.c_str(), W_OK | X_OK) == 0) return dir;
  return user_cache_dir();
}

}  // namespace tg::data

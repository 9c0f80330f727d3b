// Tests of the trained byte-level BPE and the runtime tokenizer choice (include/typegrad/data/tokenizer.hpp):
// train_byte_bpe (merges, tie-breaking, determinism, compression, early stop), ByteBpeTokenizer (encode against a
// plain reference BPE, round trips, errors), Gpt2BpeTokenizer::from_strings, AnyTokenizer (round trips and JSON
// for byte / bpe / gpt2), tokenizer specs, the BPE cache and corpus_hash.
//   ./build/cpu/tests/test_tokenizers --gtest_filter='BpeCache*'
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "typegrad/core/random.hpp"
#include "typegrad/data/dataset.hpp"
#include "typegrad/data/tokenizer.hpp"

#include "data/fixtures.hpp"

namespace {

namespace fs = std::filesystem;
using tg::data::AnyTokenizer;
using tg::data::ByteBpeTokenizer;
using tg::data::ByteTokenizer;
using tg::data::Gpt2BpeTokenizer;
using Merges = std::vector<ByteBpeTokenizer::Merge>;

static_assert(tg::data::Tokenizer<ByteBpeTokenizer>);
static_assert(tg::data::Tokenizer<AnyTokenizer>);

// ---- helpers ---------------------------------------------------------------------------------------

/// Temporary directories named tg_test_tokenizers_*.
struct TempDir : data_fixtures::TempDir {
  TempDir() : data_fixtures::TempDir("tg_test_tokenizers") {}
};

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

using data_fixtures::error_of;

#define EXPECT_HAS(msg, part) \
  EXPECT_NE((msg).find(part), std::string::npos) << "missing '" << (part) << "' in: " << (msg)

using data_fixtures::json_string;
using data_fixtures::sym;
using data_fixtures::utf8;

/// A small GPT-2 style vocab.json / merges.txt: the 256 byte symbols (id = byte value), merges for
/// "the", " the", "in", "ing", " a", then <|endoftext|>.
struct TinyGpt2 {
  TempDir dir;
  fs::path vocab, merges;
  TinyGpt2() {
    const std::vector<std::pair<std::string, std::string>> ms = {
        {"t", "h"}, {"th", "e"}, {sym(" "), "the"}, {"i", "n"}, {"in", "g"}, {sym(" "), "a"}};
    std::string v = "{";
    for (int b = 0; b < 256; ++b)
      v += json_string(sym(std::string(1, static_cast<char>(b)))) + ": " + std::to_string(b) + ",\n";
    int id = 256;
    for (const auto& [a, c] : ms) v += json_string(a + c) + ": " + std::to_string(id++) + ",\n";
    v += "\"<|endoftext|>\": " + std::to_string(id) + "}\n";
    std::string m = "#version: 0.2\n";
    for (const auto& [a, c] : ms) m += a + " " + c + "\n";
    vocab = dir.write("vocab.json", v);
    merges = dir.write("merges.txt", m);
  }
  Gpt2BpeTokenizer load() const { return Gpt2BpeTokenizer(vocab, merges); }
};

/// Texts every tokenizer must round-trip exactly.
std::vector<std::string> round_trip_strings() {
  std::vector<std::string> s = {
      "",
      "a",
      "hello world, the thing is singing",
      "  leading and trailing  \n\n\t",
      "don't you'll we've I'm they'd it's",
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E\xE3\x81\xAE\xE6\x96\x87\xE7\xAB\xA0",  // 日本語の文章
      "\xF0\x9F\x8E\x89\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD party \xF0\x9F\xA6\x80",   // 🎉👍🏽 party 🦀
      "e\xCC\x81t\xCC\x88 combining marks a\xCC\x8A",                               // é ẗ å (combining)
      "\xFF\xFE invalid \xC3 utf8 \xE2\x82 \xED\xA0\x80 \xF4\x90\x80\x80 \x80\x80",
      std::string("nul\0byte\0\0 and more\0", sizeof "nul\0byte\0\0 and more\0" - 1),
      "<|endoftext|>between<|endoftext|>",
      std::string(3000, ' ') + "x" + std::string(2000, 'a'),
  };
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  s.push_back(all);
  // random bytes, biased toward ASCII text
  for (auto& r : data_fixtures::random_texts(11, 40, 80, " \n\ttheingsa\'.,")) s.push_back(r);
  return s;
}

/// An English-like training text that needs no installed corpus.
std::string synthetic_text() {
  const char* words[] = {"the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "then", "the", "cat",
                         "sings", "singing", "thing", "things", "in", "a", "house", "with", "mouse", "running"};
  tg::Generator gen(3);
  std::string t;
  for (int i = 0; i < 20000; ++i) {
    t += words[gen.next_u64() % (sizeof words / sizeof words[0])];
    t += (gen.next_u64() % 9 == 0) ? ".\n" : " ";
  }
  return t;
}

/// The fortunes corpus, or "" when the `fortunes` package is absent.
const std::string& fortunes() {
  static const std::string text = [] {
    try {
      return tg::data::load_fortunes_corpus();
    } catch (const tg::Error&) {
      return std::string();
    }
  }();
  return text;
}
#define NEED_FORTUNES()                                                                                       \
  if (fortunes().empty()) GTEST_SKIP() << "the fortunes corpus (" << tg::data::kFortunesDir                 \
                                       << ") is absent; install the Debian package `fortunes`"

/// The BPE of 2048 tokens on the first 90% of the fortunes corpus (trained once).
const ByteBpeTokenizer& fortunes_bpe() {
  static const ByteBpeTokenizer tok = tg::data::train_byte_bpe(fortunes().substr(0, fortunes().size() * 9 / 10), 2048);
  return tok;
}

/// Plain reference BPE (GPT-2 encoder.py `bpe`): per piece, merge every occurrence of the lowest-rank adjacent
/// pair, left to right, until none is a merge.
std::vector<std::int32_t> reference_encode(const Merges& merges, std::string_view text) {
  std::map<std::pair<std::int32_t, std::int32_t>, std::int32_t> rank;
  for (std::size_t k = 0; k < merges.size(); ++k) rank.emplace(merges[k], static_cast<std::int32_t>(k));
  std::vector<std::int32_t> out;
  for (std::string_view piece : tg::data::gpt2_pre_tokenize(text)) {
    std::vector<std::int32_t> w;
    for (char c : piece) w.push_back(static_cast<unsigned char>(c));
    while (w.size() >= 2) {
      std::int32_t best = -1;
      for (std::size_t i = 0; i + 1 < w.size(); ++i)
        if (auto it = rank.find({w[i], w[i + 1]}); it != rank.end() && (best < 0 || it->second < best))
          best = it->second;
      if (best < 0) break;
      std::vector<std::int32_t> next;
      const auto [a, b] = merges[static_cast<std::size_t>(best)];
      for (std::size_t i = 0; i < w.size();) {
        if (i + 1 < w.size() && w[i] == a && w[i + 1] == b) next.push_back(256 + best), i += 2;
        else next.push_back(w[i++]);
      }
      w.swap(next);
    }
    out.insert(out.end(), w.begin(), w.end());
  }
  return out;
}

/// Plain reference trainer: recount every pair of every distinct piece before each merge; take the highest
/// count, ties to the smaller (left, right); stop below two occurrences.
Merges reference_train(std::string_view text, std::int64_t vocab_size) {
  std::map<std::string, std::int64_t> freq;
  for (std::string_view p : tg::data::gpt2_pre_tokenize(text)) ++freq[std::string(p)];
  std::vector<std::pair<std::vector<std::int32_t>, std::int64_t>> words;
  for (const auto& [p, f] : freq) {
    std::vector<std::int32_t> w;
    for (char c : p) w.push_back(static_cast<unsigned char>(c));
    words.emplace_back(std::move(w), f);
  }
  Merges merges;
  while (256 + static_cast<std::int64_t>(merges.size()) < vocab_size) {
    std::map<std::pair<std::int32_t, std::int32_t>, std::int64_t> count;
    for (const auto& [w, f] : words)
      for (std::size_t i = 0; i + 1 < w.size(); ++i) count[{w[i], w[i + 1]}] += f;
    std::pair<std::int32_t, std::int32_t> best{-1, -1};
    std::int64_t best_count = 1;
    for (const auto& [pair, c] : count)  // ascending pairs: the first of the highest count wins
      if (c > best_count) best = pair, best_count = c;
    if (best.first < 0) break;
    const auto id = 256 + static_cast<std::int32_t>(merges.size());
    merges.push_back(best);
    for (auto& [w, f] : words) {
      std::vector<std::int32_t> next;
      for (std::size_t i = 0; i < w.size();) {
        if (i + 1 < w.size() && w[i] == best.first && w[i + 1] == best.second) next.push_back(id), i += 2;
        else next.push_back(w[i++]);
      }
      w.swap(next);
    }
  }
  return merges;
}

// ---- pre-tokenization in chunks -------------------------------------------------------------------------

std::vector<std::string_view> chunked_pieces(std::string_view text, std::size_t chunk_bytes) {
  std::vector<std::string_view> out;
  tg::data::gpt2_pre_tokenize_each(text, [&](std::string_view p) { out.push_back(p); }, chunk_bytes);
  return out;
}

TEST(Gpt2PreTokenizeEach, ChunksGiveTheSamePiecesAsTheWholeText) {
  // Lines that end in spaces, blank lines, contractions, NBSP / ideographic spaces and invalid UTF-8 around
  // the newlines: every cut that is not safe would change a piece.
  std::string text;
  for (const auto& s : round_trip_strings()) text += s + "\n" + s + " \n\n'sx\n\xC2\xA0\nq\n\xE3\x80\x80\n\xC3\nz\n";
  text += synthetic_text();
  const auto whole = tg::data::gpt2_pre_tokenize(text);
  for (std::size_t chunk : std::vector<std::size_t>{2, 3, 7, 64, 1000, 100000, std::size_t{1} << 20}) {
    const auto pieces = chunked_pieces(text, chunk);
    ASSERT_EQ(pieces.size(), whole.size()) << "chunk " << chunk;
    for (std::size_t i = 0; i < whole.size(); ++i)  // the same views of the same bytes
      ASSERT_TRUE(pieces[i].data() == whole[i].data() && pieces[i].size() == whole[i].size())
          << "chunk " << chunk << " piece " << i;
  }
  EXPECT_TRUE(chunked_pieces("", 16).empty());
  EXPECT_HAS(error_of([] { chunked_pieces("abc", 1); }), "chunk_bytes 1");
}

TEST(Gpt2PreTokenizeEach, FortunesChunksGiveTheSamePieces) {
  NEED_FORTUNES();
  const auto whole = tg::data::gpt2_pre_tokenize(fortunes());
  for (std::size_t chunk : {std::size_t{4096}, std::size_t{1} << 20}) {
    const auto pieces = chunked_pieces(fortunes(), chunk);
    ASSERT_EQ(pieces.size(), whole.size());
    EXPECT_TRUE(std::equal(pieces.begin(), pieces.end(), whole.begin(), [](std::string_view a, std::string_view b) {
      return a.data() == b.data() && a.size() == b.size();
    }));
  }
}

// ---- training -----------------------------------------------------------------------------------------

TEST(TrainByteBpe, LearnsTheTextbookMergesWithSmallestPairTieBreak) {
  // One piece "aaabdaaabac": (a,a) occurs 4 times (overlapping), then (a,b) and (aa,a) tie at 2 and the smaller
  // pair (97, 98) wins; then (aa, ab) twice; then every pair occurs once and training stops early.
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe("aaabdaaabac", 300);
  EXPECT_EQ(tok.merges(), (Merges{{97, 97}, {97, 98}, {256, 257}}));
  EXPECT_EQ(tok.num_merges(), 3);
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.token_bytes(258), "aaab");
  EXPECT_EQ(tok.encode("aaabdaaabac"), (std::vector<std::int32_t>{258, 'd', 258, 'a', 'c'}));
}

TEST(TrainByteBpe, WeighsPiecesByFrequencyAndNeverCrossesPieces) {
  // Pieces "ab", " ab", " ab", " cd": (a,b) 3 times, then (' ', ab) twice; (b,' ') never counts (pieces).
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe("ab ab ab cd", 1000);
  EXPECT_EQ(tok.merges(), (Merges{{'a', 'b'}, {' ', 256}}));
  EXPECT_EQ(tok.encode(" ab ab"), (std::vector<std::int32_t>{257, 257}));
}

TEST(TrainByteBpe, MatchesThePlainReferenceTrainer) {
  const std::string text = synthetic_text();
  EXPECT_EQ(tg::data::train_byte_bpe(text, 320).merges(), reference_train(text, 320));
  EXPECT_EQ(tg::data::train_byte_bpe(text, 5000).merges(), reference_train(text, 5000));  // to the early stop
  std::string mixed;
  for (const auto& s : round_trip_strings()) mixed += s + "\n";
  EXPECT_EQ(tg::data::train_byte_bpe(mixed, 400).merges(), reference_train(mixed, 400));
}

TEST(TrainByteBpe, FortunesMatchesThePlainReferenceTrainer) {
  NEED_FORTUNES();  // 2.5 MB: pre-tokenized in chunks (Note [pre-tokenization in chunks])
  EXPECT_EQ(tg::data::train_byte_bpe(fortunes(), 280).merges(), reference_train(fortunes(), 280));
}

TEST(TrainByteBpe, StopsAtTheAskedVocabularySize) {
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe(synthetic_text(), 300);
  EXPECT_EQ(tok.vocab_size(), 300);
  EXPECT_EQ(tok.num_merges(), 44);
  // Each merge pairs earlier ids and no pair repeats (the constructor's rules).
  for (std::size_t k = 0; k < tok.merges().size(); ++k) {
    EXPECT_LT(tok.merges()[k].first, 256 + static_cast<std::int32_t>(k));
    EXPECT_LT(tok.merges()[k].second, 256 + static_cast<std::int32_t>(k));
  }
}

TEST(TrainByteBpe, StopsEarlyWhenNoPairOccursTwice) {
  // The synthetic text has 22 distinct words: once each word piece is one token no pair is left, so a vocabulary
  // of 5000 is not reached, and every piece of the text encodes to a single token.
  const std::string text = synthetic_text();
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe(text, 5000);
  EXPECT_LT(tok.vocab_size(), 5000);
  EXPECT_GT(tok.vocab_size(), 256 + 22);
  std::set<std::string_view> distinct;
  for (std::string_view piece : tg::data::gpt2_pre_tokenize(text)) distinct.insert(piece);
  EXPECT_GT(distinct.size(), 40u);
  for (std::string_view piece : distinct) EXPECT_EQ(tok.encode(piece).size(), 1u) << "'" << piece << "'";
  // A text without a repeated pair learns nothing.
  EXPECT_EQ(tg::data::train_byte_bpe("abcdefg", 300).num_merges(), 0);
}

TEST(TrainByteBpe, IsDeterministicAcrossRunsAndCallPaths) {
  const std::string text = synthetic_text();
  const ByteBpeTokenizer a = tg::data::train_byte_bpe(text, 300), b = tg::data::train_byte_bpe(text, 300);
  EXPECT_EQ(a.merges(), b.merges());
  // Through load_or_train_bpe (no cache) and make_tokenizer("bpe:300").
  const auto r = tg::data::load_or_train_bpe(text, 300, {});
  EXPECT_FALSE(r.from_cache);
  EXPECT_TRUE(r.cache_file.empty());
  EXPECT_EQ(std::get<ByteBpeTokenizer>(r.tok.variant()).merges(), a.merges());
  const AnyTokenizer m = tg::data::make_tokenizer("bpe:300", {.text = text});
  EXPECT_EQ(std::get<ByteBpeTokenizer>(m.variant()).merges(), a.merges());
  // A larger vocabulary starts with the same merges (greedy training).
  const ByteBpeTokenizer c = tg::data::train_byte_bpe(text, 310);
  ASSERT_EQ(c.merges().size(), a.merges().size() + 10);
  EXPECT_TRUE(std::equal(a.merges().begin(), a.merges().end(), c.merges().begin()));
}

TEST(TrainByteBpe, FortunesIsDeterministicAndCompressesHeldOutText) {
  NEED_FORTUNES();
  const std::string& text = fortunes();
  const std::size_t cut = text.size() * 9 / 10;
  const ByteBpeTokenizer again = tg::data::train_byte_bpe(text.substr(0, cut), 2048);
  EXPECT_EQ(again.merges(), fortunes_bpe().merges());
  EXPECT_EQ(fortunes_bpe().vocab_size(), 2048);
  const std::string held_out = text.substr(cut);
  const auto ids = fortunes_bpe().encode(held_out);
  const double bytes_per_token = static_cast<double>(held_out.size()) / static_cast<double>(ids.size());
  EXPECT_GT(bytes_per_token, 2.3) << "2048 tokens should compress English well beyond 1 byte per token";
  EXPECT_EQ(fortunes_bpe().decode(ids), held_out);
}

TEST(TrainByteBpe, RejectsBadVocabularySizesAndEmptyText) {
  std::string msg = error_of([] { tg::data::train_byte_bpe("some text", 256); });
  EXPECT_HAS(msg, "vocab_size 256");
  EXPECT_HAS(msg, "[257, 65536]");
  msg = error_of([] { tg::data::train_byte_bpe("some text", 65537); });
  EXPECT_HAS(msg, "vocab_size 65537");
  msg = error_of([] { tg::data::train_byte_bpe("", 1000); });
  EXPECT_HAS(msg, "training text is empty");
}

// ---- ByteBpeTokenizer ------------------------------------------------------------------------------------

TEST(ByteBpeTokenizer, EncodeMatchesThePlainReferenceBpe) {
  const std::string text = synthetic_text();
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe(text, 600);
  for (const auto& s : round_trip_strings()) EXPECT_EQ(tok.encode(s), reference_encode(tok.merges(), s));
  EXPECT_EQ(tok.encode(text.substr(0, 20000)), reference_encode(tok.merges(), text.substr(0, 20000)));
  // Long pieces and repeats of merged pairs (the heap path; "aaaa..." with overlapping (a, a)).
  const ByteBpeTokenizer aa = tg::data::train_byte_bpe(std::string(64, 'a') + " " + std::string(65, 'a'), 270);
  for (int n : {1, 2, 3, 5, 7, 64, 100, 1001}) {
    const std::string s(static_cast<std::size_t>(n), 'a');
    EXPECT_EQ(aa.encode(s), reference_encode(aa.merges(), s)) << n;
  }
}

TEST(ByteBpeTokenizer, FortunesEncodeMatchesTheReference) {
  NEED_FORTUNES();
  // The whole corpus (2.5 MB, pre-tokenized in chunks by encode, whole by the reference).
  EXPECT_EQ(fortunes_bpe().encode(fortunes()), reference_encode(fortunes_bpe().merges(), fortunes()));
}

TEST(ByteBpeTokenizer, ConstructorRejectsForwardReferencesAndRepeats) {
  std::string msg = error_of([] { ByteBpeTokenizer(Merges{{'a', 'b'}, {256, 258}}); });
  EXPECT_HAS(msg, "merge 1 (256, 258)");
  EXPECT_HAS(msg, "id 258");
  msg = error_of([] { ByteBpeTokenizer(Merges{{'a', 'b'}, {'c', 'd'}, {'a', 'b'}}); });
  EXPECT_HAS(msg, "merge 2 (97, 98) repeats merge 0");
  msg = error_of([] { ByteBpeTokenizer(Merges{{-1, 'b'}}); });
  EXPECT_HAS(msg, "id -1");
  const ByteBpeTokenizer none;
  EXPECT_EQ(none.vocab_size(), 256);
  EXPECT_EQ(none.encode("hi"), (std::vector<std::int32_t>{'h', 'i'}));
}

TEST(ByteBpeTokenizer, DecodeIsExactAndRejectsUnknownIds) {
  const ByteBpeTokenizer tok(Merges{{'h', 'i'}, {256, '!'}});
  EXPECT_EQ(tok.decode(std::vector<std::int32_t>{257, 0, 0xFF, 256}), std::string("hi!\0\xFFhi", 7));
  std::string msg = error_of([&] { tok.decode(std::vector<std::int32_t>{257, 104, 258}); });
  EXPECT_HAS(msg, "ByteBpeTokenizer::decode");
  EXPECT_HAS(msg, "id 258 at position 2");
  EXPECT_HAS(msg, "[0, 258)");
  msg = error_of([&] { tok.decode(std::vector<std::int32_t>{-5}); });
  EXPECT_HAS(msg, "id -5 at position 0");
  EXPECT_HAS(error_of([&] { tok.token_bytes(258); }), "id 258");
  EXPECT_FALSE(tok.eot_id().has_value());
}

TEST(ByteBpeTokenizer, ConcurrentEncodesAgree) {
  const ByteBpeTokenizer tok = tg::data::train_byte_bpe(synthetic_text(), 500);
  const std::string text = synthetic_text().substr(0, 40000);
  const auto expected = reference_encode(tok.merges(), text);
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      const ByteBpeTokenizer copy = tok;  // copies share the piece cache
      for (int r = 0; r < 3; ++r)
        if (copy.encode(text) != expected) ++wrong;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
}

// ---- round trips of every kind ------------------------------------------------------------------------------

std::vector<AnyTokenizer> all_kinds(const TinyGpt2& gpt2) {
  return {AnyTokenizer(ByteTokenizer{}), AnyTokenizer(tg::data::train_byte_bpe(synthetic_text(), 300)),
          AnyTokenizer(gpt2.load())};
}

TEST(AnyTokenizer, RoundTripsUnicodeInvalidUtf8NulsAndEmptyForEveryKind) {
  TinyGpt2 gpt2;
  for (const AnyTokenizer& tok : all_kinds(gpt2)) {
    for (const auto& s : round_trip_strings()) {
      const auto ids = tok.encode(s);
      EXPECT_EQ(tok.decode(ids), s) << tok.kind();
      for (auto id : ids) ASSERT_TRUE(id >= 0 && id < tok.vocab_size()) << tok.kind() << " id " << id;
    }
    EXPECT_TRUE(tok.encode("").empty()) << tok.kind();
    EXPECT_EQ(tok.decode(std::vector<std::int32_t>{}), "") << tok.kind();
  }
}

TEST(AnyTokenizer, RoundTripsTheFortunesCorpusForEveryKind) {
  NEED_FORTUNES();
  TinyGpt2 gpt2;
  std::vector<AnyTokenizer> toks = all_kinds(gpt2);
  toks.emplace_back(fortunes_bpe());
  for (const AnyTokenizer& tok : toks) EXPECT_EQ(tok.decode(tok.encode(fortunes())), fortunes()) << tok.describe();
}

TEST(AnyTokenizer, KindsDescriptionsAndByteLengths) {
  TinyGpt2 gpt2;
  const auto toks = all_kinds(gpt2);
  EXPECT_EQ(toks[0].kind(), "byte");
  EXPECT_EQ(toks[1].kind(), "bpe");
  EXPECT_EQ(toks[2].kind(), "gpt2");
  EXPECT_EQ(toks[0].describe(), "bytes, 256 tokens");
  EXPECT_EQ(toks[1].describe(), "byte-level BPE, 300 tokens (44 merges)");
  EXPECT_HAS(toks[2].describe(), "GPT-2 BPE, 263 tokens (6 merges, end-of-text id 262)");
  EXPECT_HAS(toks[2].describe(), gpt2.vocab.string());
  EXPECT_FALSE(toks[0].eot_id());
  EXPECT_FALSE(toks[1].eot_id());
  EXPECT_EQ(toks[2].eot_id(), 262);
  EXPECT_EQ(toks[2].token_bytes(258), " the");
  EXPECT_EQ(toks[2].token_bytes(262), "<|endoftext|>");
  EXPECT_EQ(toks[0].token_bytes(0x41), "A");
  EXPECT_HAS(error_of([&] { toks[0].token_bytes(256); }), "id 256");
  // The byte lengths of a text's tokens add up to its bytes (what bits per byte divides by).
  const std::string text = "the singing thing, in a house\n\xF0\x9F\x8E\x89<|endoftext|>";
  for (const AnyTokenizer& tok : toks) {
    const auto len = tok.token_byte_lengths();
    ASSERT_EQ(static_cast<std::int64_t>(len.size()), tok.vocab_size());
    std::int64_t sum = 0;
    for (auto id : tok.encode(text)) sum += len[static_cast<std::size_t>(id)];
    EXPECT_EQ(sum, static_cast<std::int64_t>(text.size())) << tok.kind();
    for (std::int32_t id = 0; id < tok.vocab_size(); id += 37)
      EXPECT_EQ(len[static_cast<std::size_t>(id)], static_cast<std::int32_t>(tok.token_bytes(id).size()));
  }
}

// ---- JSON ---------------------------------------------------------------------------------------------------

TEST(AnyTokenizer, JsonRoundTripEncodesIdenticallyForEveryKind) {
  TinyGpt2 gpt2;
  std::vector<std::string> texts = round_trip_strings();
  if (!fortunes().empty()) texts.push_back(fortunes().substr(0, 300000));
  for (const AnyTokenizer& tok : all_kinds(gpt2)) {
    const std::string json = tok.to_json();
    const AnyTokenizer back = AnyTokenizer::from_json(json);
    EXPECT_EQ(back.kind(), tok.kind());
    EXPECT_EQ(back.vocab_size(), tok.vocab_size());
    EXPECT_EQ(back.eot_id(), tok.eot_id());
    EXPECT_EQ(back.describe(), tok.describe());
    EXPECT_EQ(back.to_json(), json) << tok.kind();
    for (const auto& s : texts) EXPECT_EQ(back.encode(s), tok.encode(s)) << tok.kind();
  }
}

TEST(Gpt2BpeTokenizer, FromStringsMatchesTheFilesAndRegeneratesThem) {
  TinyGpt2 gpt2;
  const Gpt2BpeTokenizer files = gpt2.load();
  const Gpt2BpeTokenizer strings = Gpt2BpeTokenizer::from_strings(read_file(gpt2.vocab), read_file(gpt2.merges));
  const Gpt2BpeTokenizer regenerated = Gpt2BpeTokenizer::from_strings(files.vocab_json(), files.merges_text());
  EXPECT_EQ(strings.vocab_size(), 263);
  EXPECT_EQ(regenerated.num_merges(), 6);
  EXPECT_EQ(regenerated.eot_id(), 262);
  EXPECT_EQ(files.merges_text(), "#version: 0.2\nt h\nth e\n" + sym(" ") + " the\ni n\nin g\n" + sym(" ") + " a\n");
  for (const auto& s : round_trip_strings()) {
    EXPECT_EQ(strings.encode(s), files.encode(s));
    EXPECT_EQ(regenerated.encode(s), files.encode(s));
  }
  EXPECT_EQ(files.encode(" the thing"), (std::vector<std::int32_t>{258, ' ', 256, 260}));  // Ġthe Ġ th ing
  EXPECT_EQ(strings.source(), "");
  EXPECT_EQ(files.source(), gpt2.vocab.string());
  // The same validation as the file constructor, naming the texts.
  std::string msg = error_of([&] { Gpt2BpeTokenizer::from_strings("{not json", read_file(gpt2.merges)); });
  EXPECT_HAS(msg, "vocab.json text:1: malformed JSON");
  msg = error_of([&] { Gpt2BpeTokenizer::from_strings(read_file(gpt2.vocab), "#version: 0.2\nq z\n"); });
  EXPECT_HAS(msg, "merges.txt text:2");
  EXPECT_HAS(msg, "'qz'");
  msg = error_of([&] { Gpt2BpeTokenizer::from_strings("{\"a\": 0}", ""); });
  EXPECT_HAS(msg, "lacks the byte symbol");
}

TEST(AnyTokenizer, FromJsonRejectsMalformedInput) {
  const std::string head = R"({"format": "typegrad-tokenizer", "version": 1, )";
  std::string msg = error_of([] { AnyTokenizer::from_json("not json at all"); });
  EXPECT_HAS(msg, "malformed JSON");
  msg = error_of([] { AnyTokenizer::from_json("[1, 2]"); });
  EXPECT_HAS(msg, "expected a JSON object, got a JSON array");
  msg = error_of([] { AnyTokenizer::from_json(R"({"kind": "byte"})"); });
  EXPECT_HAS(msg, "\"format\" is missing");
  msg = error_of([] { AnyTokenizer::from_json(R"({"format": "typegrad-tokenizer", "version": 7, "kind": "byte"})"); });
  EXPECT_HAS(msg, "version 7");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "wordpiece"})"); });
  EXPECT_HAS(msg, "unknown kind \"wordpiece\"");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": 3})"); });
  EXPECT_HAS(msg, "\"kind\" is a JSON number");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "bpe"})"); });
  EXPECT_HAS(msg, "\"merges\" is missing");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "bpe", "merges": [[97, 98], [97]]})"); });
  EXPECT_HAS(msg, "merge 1 is [97]");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "bpe", "merges": [[97, 98], [300, 1]]})"); });
  EXPECT_HAS(msg, "id 300");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "bpe", "merges": [[97, 9999999999]]})"); });
  EXPECT_HAS(msg, "id 9999999999");
  msg = error_of([&] { AnyTokenizer::from_json(head + R"("kind": "gpt2", "vocab_json": "{}"})"); });
  EXPECT_HAS(msg, "\"merges_txt\" is missing");
  const AnyTokenizer ok = AnyTokenizer::from_json(head + R"("kind": "bpe", "merges": [[97, 98]], "extra": true})");
  EXPECT_EQ(ok.encode("abab"), (std::vector<std::int32_t>{256, 256}));
}

// ---- specs ----------------------------------------------------------------------------------------------------

TEST(TokenizerSpec, ParsesTheThreeForms) {
  EXPECT_EQ(tg::data::parse_tokenizer_spec("byte").kind, "byte");
  const auto b = tg::data::parse_tokenizer_spec("bpe:2048");
  EXPECT_EQ(b.kind, "bpe");
  EXPECT_EQ(b.vocab_size, 2048);
  const auto g = tg::data::parse_tokenizer_spec("gpt2:/models/gpt2");
  EXPECT_EQ(g.kind, "gpt2");
  EXPECT_EQ(g.dir, fs::path("/models/gpt2"));
  EXPECT_EQ(tg::data::make_tokenizer("byte").kind(), "byte");
  TinyGpt2 gpt2;
  const AnyTokenizer t = tg::data::make_tokenizer("gpt2:" + gpt2.dir.path().string());
  EXPECT_EQ(t.kind(), "gpt2");
  EXPECT_EQ(t.vocab_size(), 263);
}

TEST(TokenizerSpec, RejectsMalformedSpecsNamingThem) {
  auto err = [](const std::string& spec) {
    return error_of([&] { tg::data::make_tokenizer(spec, {.text = "some text"}); });
  };
  std::string msg = err("bpe:abc");
  EXPECT_HAS(msg, "'bpe:abc'");
  EXPECT_HAS(msg, "not an integer");
  EXPECT_HAS(msg, "gpt2:DIR");
  msg = err("bpe:100");
  EXPECT_HAS(msg, "'bpe:100'");
  EXPECT_HAS(msg, "vocabulary size 100 is outside [257, 65536]");
  msg = err("bpe:70000");
  EXPECT_HAS(msg, "vocabulary size 70000");
  EXPECT_HAS(err("bpe:"), "not an integer");
  EXPECT_HAS(err("bpe:2048x"), "not an integer");
  EXPECT_HAS(err("bpe: 512"), "not an integer");
  msg = err("foo");
  EXPECT_HAS(msg, "'foo' is not recognized");
  EXPECT_HAS(msg, "byte, bpe:N (N an integer in [257, 65536]), gpt2:DIR");
  EXPECT_HAS(err(""), "'' is not recognized");
  EXPECT_HAS(err("Byte"), "'Byte' is not recognized");
  EXPECT_HAS(err("gpt2:"), "DIR is empty");
  msg = err("gpt2:/nonexistent");
  EXPECT_HAS(msg, "'/nonexistent'");
  EXPECT_HAS(msg, "does not exist");
  // A directory without merges.txt: the error names the missing file.
  TempDir dir;
  dir.write("vocab.json", "{}");
  msg = err("gpt2:" + dir.path().string());
  EXPECT_HAS(msg, (dir.path() / "merges.txt").string());
  // bpe:N without a training text.
  msg = error_of([] { tg::data::make_tokenizer("bpe:512"); });
  EXPECT_HAS(msg, "'bpe:512'");
  EXPECT_HAS(msg, "training text");
}

// ---- the cache ------------------------------------------------------------------------------------------------

std::string hex16(std::uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

TEST(BpeCache, SecondCallReadsTheCacheAndCorruptFilesAreRetrained) {
  TempDir dir;
  const std::string text = synthetic_text();
  const auto first = tg::data::load_or_train_bpe(text, 420, dir.path(), "words");
  EXPECT_FALSE(first.from_cache);
  EXPECT_EQ(first.cache_file, dir.path() / ("words.bpe-420-" + hex16(tg::data::corpus_hash(text)) + ".json"));
  ASSERT_TRUE(fs::exists(first.cache_file));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1) << "no temp file left";
  const auto merges = std::get<ByteBpeTokenizer>(first.tok.variant()).merges();
  EXPECT_EQ(merges, tg::data::train_byte_bpe(text, 420).merges());

  const auto second = tg::data::load_or_train_bpe(text, 420, dir.path(), "words");
  EXPECT_TRUE(second.from_cache);
  EXPECT_EQ(second.tok.to_json(), first.tok.to_json());
  // The cache file is itself a tokenizer JSON.
  EXPECT_EQ(AnyTokenizer::from_json(read_file(first.cache_file)).to_json(), first.tok.to_json());

  // Another N or another text is another file.
  EXPECT_FALSE(tg::data::load_or_train_bpe(text, 430, dir.path(), "words").from_cache);
  EXPECT_FALSE(tg::data::load_or_train_bpe(text + "!", 420, dir.path(), "words").from_cache);

  // Damage: truncated, then a merge changed (still valid JSON), then another corpus' hash. Each is retrained
  // with a warning, and the rewritten file is sound again.
  const std::string good = read_file(first.cache_file);
  const std::string changed = [&] {
    std::string s = good;
    const auto at = s.find("[[") + 2;
    s.insert(at, "1");  // [[116, ... -> [[1116, ...: a forward reference; or the checksum fails
    return s;
  }();
  std::string foreign = good;
  foreign.replace(foreign.find(hex16(tg::data::corpus_hash(text))), 16, "0123456789abcdef");
  for (const std::string& bad : {good.substr(0, good.size() / 2), changed, foreign, std::string()}) {
    dir.write(first.cache_file.filename().string(), bad);
    testing::internal::CaptureStderr();
    const auto again = tg::data::load_or_train_bpe(text, 420, dir.path(), "words");
    const std::string err = testing::internal::GetCapturedStderr();
    EXPECT_FALSE(again.from_cache);
    EXPECT_HAS(err, "warning: ignoring the BPE cache file");
    EXPECT_HAS(err, first.cache_file.string());
    EXPECT_EQ(std::get<ByteBpeTokenizer>(again.tok.variant()).merges(), merges);
    EXPECT_EQ(read_file(first.cache_file), good);
    EXPECT_TRUE(tg::data::load_or_train_bpe(text, 420, dir.path(), "words").from_cache);
  }
}

TEST(BpeCache, ChecksumCatchesAValidButAlteredMergeList) {
  TempDir dir;
  const std::string text = synthetic_text();
  const auto first = tg::data::load_or_train_bpe(text, 300, dir.path(), "c");
  std::string s = read_file(first.cache_file);
  // Swap the first merge's ids: still valid (both are bytes), only the checksum can tell.
  const auto& m0 = std::get<ByteBpeTokenizer>(first.tok.variant()).merges()[0];
  const std::string from = "[[" + std::to_string(m0.first) + "," + std::to_string(m0.second) + "]";
  const std::string to = "[[" + std::to_string(m0.second) + "," + std::to_string(m0.first) + "]";
  ASSERT_NE(from, to);
  ASSERT_NE(s.find(from), std::string::npos) << s.substr(0, 200);
  s.replace(s.find(from), from.size(), to);
  dir.write(first.cache_file.filename().string(), s);
  testing::internal::CaptureStderr();
  const auto again = tg::data::load_or_train_bpe(text, 300, dir.path(), "c");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_FALSE(again.from_cache);
  EXPECT_HAS(err, "checksum");
}

TEST(BpeCache, MakeTokenizerUsesTheCacheAndReportsIt) {
  TempDir dir;
  const std::string text = synthetic_text();
  tg::data::BpeCacheResult info;
  const AnyTokenizer a =
      tg::data::make_tokenizer("bpe:350", {.text = text, .cache_dir = dir.path(), .cache_stem = "s"}, &info);
  EXPECT_FALSE(info.from_cache);
  EXPECT_HAS(info.cache_file.filename().string(), "s.bpe-350-");
  const AnyTokenizer b =
      tg::data::make_tokenizer("bpe:350", {.text = text, .cache_dir = dir.path(), .cache_stem = "s"}, &info);
  EXPECT_TRUE(info.from_cache);
  EXPECT_EQ(a.to_json(), b.to_json());
  EXPECT_HAS(error_of([&] { tg::data::load_or_train_bpe(text, 300, dir.path(), "a/b"); }), "cache stem 'a/b'");
  EXPECT_HAS(error_of([&] { tg::data::load_or_train_bpe("", 300, dir.path(), "s"); }), "training text is empty");
}

TEST(BpeCache, DefaultDirectoryIsTheDataDirectoryOrTheUserCache) {
  TempDir dir;
  const fs::path data = dir.write("data.txt", "x");
  EXPECT_EQ(tg::data::default_bpe_cache_dir(data), dir.path());
  // A directory of texts: beside it, not in it (with or without a trailing '/').
  const fs::path texts = dir.path() / "texts";
  fs::create_directories(texts);
  EXPECT_EQ(tg::data::default_bpe_cache_dir(texts), dir.path());
  EXPECT_EQ(tg::data::default_bpe_cache_dir(texts.string() + "/"), dir.path());
  EXPECT_HAS(error_of([] { tg::data::default_bpe_cache_dir(""); }), "data path is empty");
  // A data path whose directory does not exist falls back to $XDG_CACHE_HOME/typegrad (created).
  const char* old = std::getenv("XDG_CACHE_HOME");
  const std::string saved = old ? old : "";
  ::setenv("XDG_CACHE_HOME", (dir.path() / "xdg").c_str(), 1);
  const fs::path got = tg::data::default_bpe_cache_dir("/nonexistent_tg_dir/corpus.txt");
  const fs::path user = tg::data::user_cache_dir();
  if (old) ::setenv("XDG_CACHE_HOME", saved.c_str(), 1);
  else ::unsetenv("XDG_CACHE_HOME");
  EXPECT_EQ(got, dir.path() / "xdg" / "typegrad");
  EXPECT_EQ(user, got);
  EXPECT_TRUE(fs::is_directory(got));
}

// ---- corpus_hash ------------------------------------------------------------------------------------------------

TEST(CorpusHash, IsPinnedAndSensitiveToEveryByteAndTheLength) {
  // Pinned (checked against a separate Python implementation of the documented mix): cache file names depend on
  // these values staying the same across versions.
  EXPECT_EQ(hex16(tg::data::corpus_hash("")), "7acdbb98b1344213");
  EXPECT_EQ(hex16(tg::data::corpus_hash("hello, world\n")), "4153d25348a86291");
  EXPECT_NE(tg::data::corpus_hash("a"), tg::data::corpus_hash(std::string("a\0", 2)));
  EXPECT_NE(tg::data::corpus_hash(""), tg::data::corpus_hash(std::string(1, '\0')));
  std::string s = synthetic_text().substr(0, 1000);
  const std::uint64_t h = tg::data::corpus_hash(s);
  std::set<std::uint64_t> seen = {h};
  for (std::size_t i = 0; i < s.size(); i += 97) {
    std::string t = s;
    t[i] = static_cast<char>(t[i] ^ 1);
    EXPECT_TRUE(seen.insert(tg::data::corpus_hash(t)).second) << "flipping a bit of byte " << i;
  }
}

}  // namespace

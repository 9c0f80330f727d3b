// Tests of include/typegrad/data: ByteTokenizer, Gpt2BpeTokenizer (a tiny consistent BPE written to a temp
// dir), GPT-2 pre-tokenization, TextDataset splits and errors, BatchSampler, the fortunes corpus, token files
// (export, mmap, validation errors, sidecar) and the PrefetchingSampler.
//   ./build/cpu/tests/test_data --gtest_filter='Gpt2Bpe*'
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

#include "typegrad/core/random.hpp"
#include "typegrad/data/dataset.hpp"
#include "typegrad/data/prefetch.hpp"
#include "typegrad/data/sampler.hpp"
#include "typegrad/data/token_file.hpp"
#include "typegrad/data/tokenizer.hpp"

#include "data/fixtures.hpp"

namespace {

namespace fs = std::filesystem;
using tg::data::BatchSampler;
using tg::data::ByteTokenizer;
using tg::data::Gpt2BpeTokenizer;
using tg::data::TextDataset;

static_assert(tg::data::Tokenizer<ByteTokenizer>);
static_assert(tg::data::Tokenizer<Gpt2BpeTokenizer>);

// ---- helpers ---------------------------------------------------------------------------------------

using data_fixtures::TempDir;

using data_fixtures::json_string;
using data_fixtures::sym;
using data_fixtures::utf8;

// The tiny BPE: ids 0..255 are the byte symbols in byte order (id = byte value), then the merges, in rank
// order, each adding its concatenation, then <|endoftext|>.
//   rank 0: h e -> he (256)      rank 3: hell o -> hello (259)     rank 5: e r -> er (261)
//   rank 1: l l -> ll (257)      rank 4: Ġ hello -> Ġhello (260)   rank 6: Ġ w -> Ġw (262)
//   rank 2: he ll -> hell (258)                                    <|endoftext|> (263)
struct TinyBpe {
  static constexpr std::int32_t kHe = 256, kLl = 257, kHell = 258, kHello = 259, kSpaceHello = 260, kEr = 261,
                                kSpaceW = 262, kEot = 263;
  TempDir dir;
  fs::path vocab, merges;
  explicit TinyBpe(bool version_header = true) {
    const std::vector<std::pair<std::string, std::string>> ms = {
        {"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {sym(" "), "hello"}, {"e", "r"}, {sym(" "), "w"}};
    std::string v = "{\n";
    for (int b = 0; b < 256; ++b) v += "  " + json_string(sym(std::string(1, static_cast<char>(b)))) + ": " + std::to_string(b) + ",\n";
    int id = 256;
    for (const auto& [a, c] : ms) v += "  " + json_string(a + c) + ": " + std::to_string(id++) + ",\n";
    v += "  \"<|endoftext|>\": " + std::to_string(id) + "\n}\n";
    std::string m = version_header ? "#version: 0.2\n" : "";
    for (const auto& [a, c] : ms) m += a + " " + c + "\n";
    vocab = dir.write("vocab.json", v);
    merges = dir.write("merges.txt", m);
  }
  Gpt2BpeTokenizer load() const { return Gpt2BpeTokenizer(vocab, merges); }
};

using data_fixtures::error_of;

std::vector<std::string> round_trip_strings() {
  std::vector<std::string> s = {
      "", "hello", "hello hello", "Hello, World!", "  leading and trailing  ", "a   b", "x\n\ny", "tabs\t\tand\r\nCRLF",
      "don't you'll we've I'm they'd it's we're", "'''", "1234 5678 3.14159", "mixed123abc!!?? ...",
      "caf\xC3\xA9 na\xC3\xAFve \xE2\x80\x94 r\xC3\xA9sum\xC3\xA9",                                // café naïve — résumé
      "\xE6\x97\xA5\xE6\x9C\xAC\xE8\xAA\x9E \xF0\x9F\x8E\x89 \xD0\xBF\xD1\x80\xD0\xB8\xD0\xB2\xD0\xB5\xD1\x82",  // 日本語 🎉 привет
      std::string("nul\0byte\0", 9), "\xFF\xFE invalid \xC3 utf8 \xE2\x82 \xED\xA0\x80 \xF4\x90\x80\x80",
      "<|endoftext|>", "before<|endoftext|>after<|endoftext|>", "<|endoftext", "   \n\t \x0B\x0C  \n", "\xC2\xA0nbsp\xE3\x80\x80ideographic",
      "\xC2\xB2\xC2\xBD \xEF\xBC\x91\xEF\xBC\x92 \xCC\x81" "accent",
  };
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  s.push_back(all);
  // random bytes, biased toward ASCII text and whitespace
  for (auto& r : data_fixtures::random_texts(7, 50, 64, " \n\thelo\'srtd1,.")) s.push_back(r);
  return s;
}

std::vector<std::string> pieces(std::string_view s) {
  std::vector<std::string> out;
  for (auto p : tg::data::gpt2_pre_tokenize(s)) out.emplace_back(p);
  return out;
}

// ---- ByteTokenizer ---------------------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsAll256Bytes) {
  ByteTokenizer tok;
  std::string all;
  for (int b = 0; b < 256; ++b) all += static_cast<char>(b);
  const auto ids = tok.encode(all);
  ASSERT_EQ(ids.size(), 256u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(ids[static_cast<std::size_t>(b)], b);
  EXPECT_EQ(tok.decode(ids), all);
  EXPECT_EQ(tok.vocab_size(), 256);
  EXPECT_FALSE(tok.eot_id().has_value());
}

TEST(ByteTokenizer, RoundTripsInvalidUtf8AndNuls) {
  ByteTokenizer tok;
  for (const auto& s : round_trip_strings()) EXPECT_EQ(tok.decode(tok.encode(s)), s);
}

TEST(ByteTokenizer, DecodeRejectsOutOfRangeIds) {
  ByteTokenizer tok;
  const std::vector<std::int32_t> ids = {104, 256};
  const std::string msg = error_of([&] { tok.decode(ids); });
  EXPECT_NE(msg.find("ByteTokenizer::decode"), std::string::npos) << msg;
  EXPECT_NE(msg.find("256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  EXPECT_THROW(tok.decode(std::vector<std::int32_t>{-1}), tg::Error);
}

// ---- byte-to-unicode and pre-tokenization -----------------------------------------------------------

TEST(Gpt2ByteToUnicode, MatchesGpt2TableAndInverts) {
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode('A'), U'A');
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode('!'), U'!');
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode(0xE9), char32_t{0xE9});
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode(' '), char32_t{0x120});   // Ġ
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode('\n'), char32_t{0x10A});  // Ċ
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode(0), char32_t{0x100});
  EXPECT_EQ(tg::data::gpt2_byte_to_unicode(0xAD), char32_t{0x143});  // the last of the 68 remapped bytes
  std::set<char32_t> image;
  for (int b = 0; b < 256; ++b) {
    const char32_t cp = tg::data::gpt2_byte_to_unicode(static_cast<std::uint8_t>(b));
    image.insert(cp);
    EXPECT_EQ(tg::data::gpt2_unicode_to_byte(cp), b);
  }
  EXPECT_EQ(image.size(), 256u);
  EXPECT_EQ(tg::data::gpt2_unicode_to_byte(U' '), -1);
  EXPECT_EQ(tg::data::gpt2_unicode_to_byte(0x144), -1);
}

TEST(Gpt2PreTokenize, SplitsLikeGpt2Regex) {
  using V = std::vector<std::string>;
  EXPECT_EQ(pieces("Hello world"), (V{"Hello", " world"}));
  EXPECT_EQ(pieces("hello hello"), (V{"hello", " hello"}));
  EXPECT_EQ(pieces("a   b"), (V{"a", "  ", " b"}));  // \s+(?!\S) leaves the last space to " b"
  EXPECT_EQ(pieces("x\n\ny"), (V{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pieces("end  "), (V{"end", "  "}));
  EXPECT_EQ(pieces("don't we'll they're I've he'd she's I'm"),
            (V{"don", "'t", " we", "'ll", " they", "'re", " I", "'ve", " he", "'d", " she", "'s", " I", "'m"}));
  EXPECT_EQ(pieces("'hello'"), (V{"'", "hello", "'"}));
  EXPECT_EQ(pieces("abc123 456!?"), (V{"abc", "123", " 456", "!?"}));
  EXPECT_EQ(pieces(" !! ?"), (V{" !!", " ?"}));
  EXPECT_EQ(pieces("a\tb"), (V{"a", "\t", "b"}));
  EXPECT_EQ(pieces(""), V{});
  // Non-ASCII: letters stay in words, the em dash is punctuation, NBSP is whitespace.
  EXPECT_EQ(pieces("caf\xC3\xA9 na\xC3\xAFve\xE2\x80\x94yes"), (V{"caf\xC3\xA9", " na\xC3\xAFve", "\xE2\x80\x94", "yes"}));
  EXPECT_EQ(pieces("\xD0\xBF\xD1\x80\xD0\xB8 \xE6\x97\xA5\xE6\x9C\xAC"), (V{"\xD0\xBF\xD1\x80\xD0\xB8", " \xE6\x97\xA5\xE6\x9C\xAC"}));
  EXPECT_EQ(pieces("a\xC2\xA0" "b"), (V{"a", "\xC2\xA0", "b"}));
  // An invalid byte is a letter of its own unit; the pieces still cover the input.
  EXPECT_EQ(pieces("ab\xFF" "c d"), (V{"ab\xFF" "c", " d"}));
}

TEST(Gpt2PreTokenize, PiecesPartitionAnyInput) {
  for (const auto& s : round_trip_strings()) {
    std::string joined;
    for (auto p : tg::data::gpt2_pre_tokenize(s)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, s);
  }
}

// ---- Gpt2BpeTokenizer --------------------------------------------------------------------------------

TEST(Gpt2BpeTokenizer, LoadsTinyVocabAndMerges) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  EXPECT_EQ(tok.vocab_size(), 264);
  EXPECT_EQ(tok.num_merges(), 7);
  ASSERT_TRUE(tok.eot_id().has_value());
  EXPECT_EQ(*tok.eot_id(), TinyBpe::kEot);
  EXPECT_EQ(tok.token_id(sym(" ") + "hello"), TinyBpe::kSpaceHello);
  EXPECT_FALSE(tok.token_id("nope").has_value());
  EXPECT_EQ(tok.token_string(TinyBpe::kHell), "hell");
  EXPECT_THROW(tok.token_string(9999), tg::Error);
  // Without the "#version" header the merges are the same.
  TinyBpe plain(false);
  EXPECT_EQ(plain.load().encode("hello hello"), tok.encode("hello hello"));
}

TEST(Gpt2BpeTokenizer, EncodesWithExpectedIds) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  using V = std::vector<std::int32_t>;
  EXPECT_EQ(tok.encode("hello hello"), (V{TinyBpe::kHello, TinyBpe::kSpaceHello}));
  EXPECT_EQ(tok.encode("hello"), (V{TinyBpe::kHello}));
  EXPECT_EQ(tok.encode("hell"), (V{TinyBpe::kHell}));
  // Lowest rank first: (h,e) rank 0 beats (e,r) rank 5, and "he"+"r" is no merge.
  EXPECT_EQ(tok.encode("her"), (V{TinyBpe::kHe, 'r'}));
  EXPECT_EQ(tok.encode("ber"), (V{'b', TinyBpe::kEr}));
  EXPECT_EQ(tok.encode("hello world"), (V{TinyBpe::kHello, TinyBpe::kSpaceW, 'o', 'r', 'l', 'd'}));
  EXPECT_EQ(tok.encode("ll"), (V{TinyBpe::kLl}));
  // Merges never cross pre-tokenization pieces: "o w" stays o, Ġw.
  EXPECT_EQ(tok.encode("lo w"), (V{'l', 'o', TinyBpe::kSpaceW}));
  // Bytes outside ASCII are their byte ids (id = byte here).
  EXPECT_EQ(tok.encode("\xC3\xA9"), (V{0xC3, 0xA9}));
  EXPECT_EQ(tok.encode(std::string("\0", 1)), (V{0}));
}

TEST(Gpt2BpeTokenizer, EndOfTextIsSpecialUnlessOrdinary) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  using V = std::vector<std::int32_t>;
  EXPECT_EQ(tok.encode("hello<|endoftext|>hello"), (V{TinyBpe::kHello, TinyBpe::kEot, TinyBpe::kHello}));
  EXPECT_EQ(tok.encode("<|endoftext|><|endoftext|>"), (V{TinyBpe::kEot, TinyBpe::kEot}));
  const auto ordinary = tok.encode_ordinary("<|endoftext|>");
  EXPECT_EQ(ordinary.size(), 13u);  // no merges apply to its characters
  EXPECT_EQ(tok.decode(ordinary), "<|endoftext|>");
  EXPECT_EQ(tok.decode(V{TinyBpe::kEot}), "<|endoftext|>");
}

TEST(Gpt2BpeTokenizer, DecodeEncodeRoundTripsManyStrings) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  for (const auto& s : round_trip_strings()) {
    EXPECT_EQ(tok.decode(tok.encode(s)), s) << "input of " << s.size() << " bytes";
    EXPECT_EQ(tok.decode(tok.encode_ordinary(s)), s);
  }
  // A second pass hits the cache and must give the same ids.
  const auto first = tok.encode("hello hello her hell");
  EXPECT_EQ(tok.encode("hello hello her hell"), first);
}

TEST(Gpt2BpeTokenizer, CopiesShareCacheAcrossThreads) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  const std::string text = "hello hello her world hell ber hello";
  const auto expected = tok.encode(text);
  std::vector<std::thread> threads;
  std::atomic<int> mismatches{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, copy = tok] {
      for (int i = 0; i < 200; ++i)
        if (copy.encode(text) != expected) ++mismatches;
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

TEST(Gpt2BpeTokenizer, MissingFilesNameThePath) {
  TinyBpe bpe;
  const fs::path missing = bpe.dir.path() / "no_such_vocab.json";
  std::string msg = error_of([&] { Gpt2BpeTokenizer(missing, bpe.merges); });
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  const fs::path missing_merges = bpe.dir.path() / "no_such_merges.txt";
  msg = error_of([&] { Gpt2BpeTokenizer(bpe.vocab, missing_merges); });
  EXPECT_NE(msg.find(missing_merges.string()), std::string::npos) << msg;
}

TEST(Gpt2BpeTokenizer, MalformedJsonNamesFileAndLine) {
  TinyBpe bpe;
  const fs::path bad = bpe.dir.write("bad.json", "{\n  \"a\": 1,\n  \"b\" 2\n}\n");
  std::string msg = error_of([&] { Gpt2BpeTokenizer(bad, bpe.merges); });
  EXPECT_NE(msg.find(bad.string() + ":3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("malformed JSON"), std::string::npos) << msg;

  const fs::path array = bpe.dir.write("array.json", "[1, 2]");
  msg = error_of([&] { Gpt2BpeTokenizer(array, bpe.merges); });
  EXPECT_NE(msg.find("expected a JSON object"), std::string::npos) << msg;

  const fs::path str_id = bpe.dir.write("str_id.json", "{\"a\": \"1\"}");
  msg = error_of([&] { Gpt2BpeTokenizer(str_id, bpe.merges); });
  EXPECT_NE(msg.find("'a'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("non-negative integer"), std::string::npos) << msg;

  const fs::path no_bytes = bpe.dir.write("no_bytes.json", "{\"a\": 0, \"b\": 1}");
  msg = error_of([&] { Gpt2BpeTokenizer(no_bytes, bpe.merges); });
  EXPECT_NE(msg.find("lacks the byte symbol"), std::string::npos) << msg;
}

TEST(Gpt2BpeTokenizer, BadMergesNameFileAndLine) {
  TinyBpe bpe;
  // Line 3 refers to a symbol the vocabulary lacks.
  const fs::path unknown = bpe.dir.write("unknown.txt", "#version: 0.2\nh e\nhe zz\n");
  std::string msg = error_of([&] { Gpt2BpeTokenizer(bpe.vocab, unknown); });
  EXPECT_NE(msg.find(unknown.string() + ":3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'zz'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not in the vocabulary"), std::string::npos) << msg;
  // Both symbols known but their concatenation is not.
  const fs::path product = bpe.dir.write("product.txt", "x y\n");
  msg = error_of([&] { Gpt2BpeTokenizer(bpe.vocab, product); });
  EXPECT_NE(msg.find(product.string() + ":1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'xy'"), std::string::npos) << msg;
  // Not two symbols.
  const fs::path three = bpe.dir.write("three.txt", "h e\nh e l\n");
  msg = error_of([&] { Gpt2BpeTokenizer(bpe.vocab, three); });
  EXPECT_NE(msg.find(three.string() + ":2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("two symbols"), std::string::npos) << msg;
}

TEST(Gpt2BpeTokenizer, DecodeRejectsUnknownIds) {
  TinyBpe bpe;
  const auto tok = bpe.load();
  std::string msg = error_of([&] { tok.decode(std::vector<std::int32_t>{TinyBpe::kHello, 264}); });
  EXPECT_NE(msg.find("id 264"), std::string::npos) << msg;
  EXPECT_NE(msg.find("position 1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("out of range [0, 264)"), std::string::npos) << msg;
  EXPECT_THROW(tok.decode(std::vector<std::int32_t>{-3}), tg::Error);
  // A gap in the ids of vocab.json.
  std::string v = "{";
  for (int b = 0; b < 256; ++b) v += json_string(sym(std::string(1, static_cast<char>(b)))) + ": " + std::to_string(b) + ", ";
  v += "\"<|endoftext|>\": 300}";
  const fs::path gappy = bpe.dir.write("gappy.json", v);
  const fs::path none = bpe.dir.write("none.txt", "#version: 0.2\n");
  const Gpt2BpeTokenizer g(gappy, none);
  EXPECT_EQ(g.vocab_size(), 301);
  msg = error_of([&] { g.decode(std::vector<std::int32_t>{280}); });
  EXPECT_NE(msg.find("not in the vocabulary"), std::string::npos) << msg;
  EXPECT_EQ(g.decode(g.encode("hi<|endoftext|>")), "hi<|endoftext|>");
}

// ---- TextDataset -------------------------------------------------------------------------------------

std::vector<std::int32_t> iota_tokens(std::int32_t n) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), 0);
  return t;
}

TEST(TextDataset, SplitsLastFractionIntoValidation) {
  const TextDataset ds(iota_tokens(1000), 0.1);
  EXPECT_EQ(ds.size(), 1000);
  EXPECT_EQ(ds.train_size(), 900);
  EXPECT_EQ(ds.val_size(), 100);
  EXPECT_EQ(ds.train().tokens().front(), 0);
  EXPECT_EQ(ds.train().tokens().back(), 899);
  EXPECT_EQ(ds.validation().tokens().front(), 900);
  EXPECT_EQ(ds.validation().tokens().back(), 999);
  const TextDataset odd(iota_tokens(1001), 0.25);  // floor(250.25) = 250
  EXPECT_EQ(odd.val_size(), 250);
  EXPECT_EQ(odd.train_size(), 751);
  const TextDataset all_train(iota_tokens(10), 0.0);
  EXPECT_EQ(all_train.val_size(), 0);
}

TEST(TextDataset, FromFileTokenizesBytes) {
  TempDir dir;
  const fs::path p = dir.write("corpus.txt", "hello world, hello typegrad\n");
  const auto ds = TextDataset::from_file(p, ByteTokenizer{}, 0.25);
  EXPECT_EQ(ds.size(), 28);
  EXPECT_EQ(ds.val_size(), 7);
  EXPECT_EQ(ds.tokens()[0], 'h');
  EXPECT_EQ(ds.tokens().back(), '\n');
  TinyBpe bpe;
  const auto bds = TextDataset::from_file(p, bpe.load(), 0.0);
  EXPECT_EQ(bds.tokens()[0], TinyBpe::kHello);
}

TEST(TextDataset, DirectoryAndListsConcatenate) {
  TempDir dir;
  dir.write("b.txt", "BBB");
  dir.write("a.txt", "AA");
  dir.write(".hidden", "zz");
  fs::create_directories(dir.path() / "sub");
  dir.write("sub/c.txt", "CCCC");
  const auto files = tg::data::list_text_files(dir.path());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(tg::data::read_text_directory(dir.path()), "AABBB");  // sorted, no hidden files, no subdirectories
  EXPECT_EQ(tg::data::read_text_files({dir.path() / "b.txt", dir.path() / "a.txt"}), "BBBAA");  // the given order
  const auto ds = TextDataset::from_directory(dir.path(), ByteTokenizer{}, 0.2);
  EXPECT_EQ(ds.size(), 5);
  EXPECT_EQ(ds.val_size(), 1);
  const auto ds2 = TextDataset::from_files({dir.path() / "a.txt"}, ByteTokenizer{}, 0.0);
  EXPECT_EQ(ds2.size(), 2);
}

TEST(TextDataset, MissingOrEmptyFilesNameThePath) {
  TempDir dir;
  const fs::path missing = dir.path() / "nope.txt";
  std::string msg = error_of([&] { TextDataset::from_file(missing, ByteTokenizer{}); });
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  const fs::path empty = dir.write("empty.txt", "");
  msg = error_of([&] { TextDataset::from_file(empty, ByteTokenizer{}); });
  EXPECT_NE(msg.find(empty.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("is empty"), std::string::npos) << msg;
  msg = error_of([&] { TextDataset::from_file(dir.path(), ByteTokenizer{}); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
  const fs::path missing_dir = dir.path() / "nodir";
  msg = error_of([&] { TextDataset::from_directory(missing_dir, ByteTokenizer{}); });
  EXPECT_NE(msg.find(missing_dir.string()), std::string::npos) << msg;
  fs::create_directories(dir.path() / "emptydir");
  msg = error_of([&] { TextDataset::from_directory(dir.path() / "emptydir", ByteTokenizer{}); });
  EXPECT_NE(msg.find("holds no files"), std::string::npos) << msg;
}

TEST(TextDataset, RejectsSplitsShorterThanContextPlusOne) {
  // 100 tokens, val 0.1 -> 90 / 10; context 9 fits (10 tokens), context 10 does not.
  EXPECT_NO_THROW(TextDataset(iota_tokens(100), 0.1, 9));
  std::string msg = error_of([&] { TextDataset(iota_tokens(100), 0.1, 10); });
  EXPECT_NE(msg.find("validation split has 10 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("context + 1 = 11"), std::string::npos) << msg;
  msg = error_of([&] { TextDataset(iota_tokens(100), 0.0, 100); });
  EXPECT_NE(msg.find("train split has 100 tokens"), std::string::npos) << msg;
  const TextDataset ds(iota_tokens(100), 0.5);
  EXPECT_THROW(ds.require_context(50), tg::Error);
  EXPECT_NO_THROW(ds.require_context(49));
  EXPECT_THROW(TextDataset(iota_tokens(10), 1.0), tg::Error);
  EXPECT_THROW(TextDataset(iota_tokens(10), -0.1), tg::Error);
  EXPECT_THROW(TextDataset(std::vector<std::int32_t>{}, 0.1), tg::Error);
}

// ---- BatchSampler -------------------------------------------------------------------------------------

std::vector<std::int64_t> values(const tg::Tensor<std::int64_t>& t) { return t.to_vector(); }

TEST(BatchSampler, SameSeedSameBatchesDifferentSeedDifferent) {
  const TextDataset ds(iota_tokens(5000), 0.1);
  BatchSampler a(ds.train(), 4, 16, 123), b(ds.train(), 4, 16, 123), c(ds.train(), 4, 16, 124);
  bool any_differs = false;
  for (int i = 0; i < 10; ++i) {
    const auto ba = a.next(), bb = b.next(), bc = c.next();
    EXPECT_EQ(values(ba.inputs), values(bb.inputs));
    EXPECT_EQ(values(ba.targets), values(bb.targets));
    any_differs |= values(ba.inputs) != values(bc.inputs);
  }
  EXPECT_TRUE(any_differs);
}

TEST(BatchSampler, TargetsAreInputsShiftedByOne) {
  const TextDataset ds(iota_tokens(3000), 0.1);  // token value = its position, so windows are easy to read
  BatchSampler s(ds.train(), 8, 32, 5);
  for (int i = 0; i < 20; ++i) {
    const auto batch = s.next();
    ASSERT_EQ(batch.inputs.shape(), tg::Shape({8, 32}));
    ASSERT_EQ(batch.targets.shape(), tg::Shape({8, 32}));
    for (std::int64_t r = 0; r < 8; ++r) {
      const std::int64_t start = batch.inputs.at({r, 0});
      EXPECT_GE(start, 0);
      EXPECT_LE(start + 32, ds.train_size() - 1);  // the last target is inside the train split
      for (std::int64_t t = 0; t < 32; ++t) {
        EXPECT_EQ(batch.inputs.at({r, t}), start + t);
        EXPECT_EQ(batch.targets.at({r, t}), start + t + 1);
      }
    }
  }
}

TEST(BatchSampler, RestoredPositionContinuesIdentically) {
  const TextDataset ds(iota_tokens(4000), 0.1);
  BatchSampler s(ds.train(), 4, 8, 99);
  for (int i = 0; i < 7; ++i) s.next();
  const tg::data::SamplerPosition pos = s.position();
  EXPECT_EQ(pos.seed, 99u);
  EXPECT_EQ(pos.counter, 7u);
  std::vector<std::vector<std::int64_t>> expected;
  for (int i = 0; i < 5; ++i) expected.push_back(values(s.next().inputs));
  BatchSampler fresh(ds.train(), 4, 8, 0);  // another seed: the position carries the seed
  fresh.set_position(pos);
  EXPECT_EQ(fresh.position(), pos);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(values(fresh.next().inputs), expected[static_cast<std::size_t>(i)]);
  s.set_position(pos);
  EXPECT_EQ(values(s.next().inputs), expected[0]);
}

TEST(BatchSampler, StartsArePureFunctionOfSeedAndCounter) {
  const TextDataset ds(iota_tokens(10000), 0.0);
  const BatchSampler b4(ds.train(), 4, 16, 42), b8(ds.train(), 8, 16, 42);
  for (std::uint64_t c = 0; c < 20; ++c) {
    const auto s4 = b4.window_starts(c), s8 = b8.window_starts(c);
    for (std::size_t r = 0; r < 4; ++r) EXPECT_EQ(s4[r], s8[r]);  // rows shared by both batch sizes agree
  }
  // Starts spread over the whole range [0, n - T - 1].
  std::int64_t lo = 1 << 30, hi = -1;
  for (std::uint64_t c = 0; c < 500; ++c)
    for (auto st : b8.window_starts(c)) lo = std::min(lo, st), hi = std::max(hi, st);
  EXPECT_GE(lo, 0);
  EXPECT_LE(hi, 10000 - 16 - 1);
  EXPECT_LT(lo, 200);
  EXPECT_GT(hi, 10000 - 16 - 200);
  // The smallest split: exactly one window.
  const TextDataset tiny(iota_tokens(17), 0.0);
  BatchSampler one(tiny.train(), 3, 16, 1);
  EXPECT_EQ(values(one.next().targets).back(), 16);
}

TEST(BatchSampler, SequentialCoversSplitInOrder) {
  const TextDataset ds(iota_tokens(1103), 0.0934);  // floor(1103 * 0.0934) = 103 val tokens
  ASSERT_EQ(ds.val_size(), 103);
  auto s = BatchSampler::sequential(ds.validation(), 4, 10);  // (103 - 1) / 10 = 10 windows -> 4 + 4 + 2
  EXPECT_EQ(s.num_windows(), 10);
  EXPECT_EQ(s.num_batches(), 3);
  std::int64_t window = 0;
  for (int i = 0; i < 3; ++i) {
    const auto b = s.next();
    const std::int64_t rows = b.inputs.size(0);
    EXPECT_EQ(rows, i < 2 ? 4 : 2);
    for (std::int64_t r = 0; r < rows; ++r, ++window)
      for (std::int64_t t = 0; t < 10; ++t) {
        EXPECT_EQ(b.inputs.at({r, t}), 1000 + window * 10 + t);
        EXPECT_EQ(b.targets.at({r, t}), 1000 + window * 10 + t + 1);
      }
  }
  EXPECT_EQ(window, 10);
  EXPECT_EQ(s.next().inputs.at({0, 0}), 1000);  // wraps to the start
  s.reset();
  EXPECT_EQ(s.position().counter, 0u);
}

TEST(BatchSampler, RejectsSplitsShorterThanContextPlusOne) {
  const TextDataset ds(iota_tokens(100), 0.1);
  const std::string msg = error_of([&] { BatchSampler(ds.validation(), 2, 10, 0); });
  EXPECT_NE(msg.find("10 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("context + 1 = 11"), std::string::npos) << msg;
  EXPECT_THROW(BatchSampler(ds.train(), 0, 8, 0), tg::Error);
  EXPECT_THROW(BatchSampler(ds.train(), 2, 0, 0), tg::Error);
  const BatchSampler r(ds.train(), 2, 8, 0);
  EXPECT_THROW(r.num_batches(), tg::Error);
}

// ---- token files -------------------------------------------------------------------------------------

using tg::data::PrefetchingSampler;
using tg::data::SamplerPosition;
using tg::data::TokenStream;

/// n pseudo-random ids in [0, vocab).
std::vector<std::int32_t> random_tokens(std::int64_t n, std::int64_t vocab, std::uint64_t seed) {
  tg::Generator gen(seed);
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  for (auto& v : t) v = static_cast<std::int32_t>(gen.next_u64() % static_cast<std::uint64_t>(vocab));
  return t;
}

/// A raw token file: the 256-int32 header given by its first slots, then `payload` bytes.
fs::path write_raw_token_file(const TempDir& dir, const std::string& name, std::vector<std::int32_t> header_slots,
                              const std::string& payload) {
  std::vector<std::int32_t> header(256, 0);
  std::copy(header_slots.begin(), header_slots.end(), header.begin());
  std::string bytes(reinterpret_cast<const char*>(header.data()), 1024);
  return dir.write(name, bytes + payload);
}
std::string u16_bytes(const std::vector<std::uint16_t>& ids) {
  return std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 2);
}

void expect_same_batches(BatchSampler& a, BatchSampler& b, int n) {
  for (int i = 0; i < n; ++i) {
    const auto ba = a.next(), bb = b.next();
    ASSERT_EQ(values(ba.inputs), values(bb.inputs)) << "batch " << i;
    ASSERT_EQ(values(ba.targets), values(bb.targets)) << "batch " << i;
  }
}

TEST(TokenFile, ExportThenMmapEqualsInMemoryDataset) {
  TempDir dir;
  const std::vector<std::int32_t> tokens = random_tokens(20011, 300, 3);
  const fs::path p = dir.path() / "corpus.bin";
  tg::data::write_token_file(p, tokens, 300, "{\"tokenizer\": 1}");
  EXPECT_EQ(fs::file_size(p), 1024u + 2u * tokens.size());
  EXPECT_TRUE(tg::data::is_token_file(p));

  const auto tf = tg::data::open_token_file(p, 300);
  EXPECT_EQ(tf.size(), 20011);
  EXPECT_EQ(tf.width(), 2);
  EXPECT_EQ(tf.vocab_size(), 300);
  EXPECT_EQ(tf.max_id(), *std::max_element(tokens.begin(), tokens.end()));
  EXPECT_EQ(tf.header().version, 1);
  EXPECT_EQ(tf.header().count, 20011);
  EXPECT_EQ(tf.header().vocab_size, 300);
  EXPECT_EQ(tf.header().max_id, tf.max_id());
  EXPECT_TRUE(tf.header().has_tokenizer);
  const TokenStream& st = *tf.stream();
  EXPECT_FALSE(st.in_memory());
  EXPECT_EQ(st.kind(), TokenStream::Kind::uint16);
  for (std::int64_t i = 0; i < st.size(); ++i) ASSERT_EQ(st.at(i), tokens[static_cast<std::size_t>(i)]) << i;
  std::vector<std::int64_t> window(100);
  st.copy_window(20011 - 100, 100, window.data());
  for (std::size_t k = 0; k < 100; ++k) EXPECT_EQ(window[k], tokens[20011 - 100 + k]);
  EXPECT_THROW(st.copy_window(20011 - 99, 100, window.data()), tg::Error);
  EXPECT_THROW(st.at(20011), tg::Error);
  EXPECT_THROW(st.at(-1), tg::Error);

  const TextDataset mem(tokens, 0.1, 64);
  const TextDataset file = tf.dataset(0.1, 64);
  EXPECT_EQ(file.size(), mem.size());
  EXPECT_EQ(file.train_size(), mem.train_size());
  EXPECT_EQ(file.val_size(), mem.val_size());
  EXPECT_NE(file.source().find(p.string()), std::string::npos) << file.source();
  EXPECT_EQ(file.validation().at(0), tokens[static_cast<std::size_t>(mem.train_size())]);
  // The in-memory accessors say what to use instead for a mapped stream.
  const std::string msg = error_of([&] { (void)file.tokens(); });
  EXPECT_NE(msg.find("copy_window"), std::string::npos) << msg;
  EXPECT_THROW((void)file.train().tokens(), tg::Error);

  for (std::int64_t B : {1, 4}) {
    BatchSampler a(mem.train(), B, 64, 11), b(file.train(), B, 64, 11);
    expect_same_batches(a, b, 25);
  }
  auto va = BatchSampler::sequential(mem.validation(), 3, 64), vb = BatchSampler::sequential(file.validation(), 3, 64);
  expect_same_batches(va, vb, static_cast<int>(va.num_batches()) + 2);  // a full pass and the wrap

  // vocab 0 takes the header's; the static factory reads the same dataset.
  EXPECT_EQ(tg::data::open_token_file(p).vocab_size(), 300);
  const auto ds = TextDataset::from_token_file(p, 300, 0.1, 64);
  EXPECT_EQ(ds.train_size(), mem.train_size());
  BatchSampler c(mem.train(), 2, 64, 5), d(ds.train(), 2, 64, 5);
  expect_same_batches(c, d, 5);
  // The split checks apply to files too.
  EXPECT_THROW(tf.dataset(0.001, 64), tg::Error);  // 20 validation tokens < 65
}

TEST(TokenFile, DatasetOutlivesTheTokenFileObject) {
  TempDir dir;
  const auto tokens = random_tokens(5000, 50, 9);
  const fs::path p = dir.path() / "t.bin";
  tg::data::write_token_file(p, tokens, 50);
  std::optional<BatchSampler> s;
  {
    const TextDataset ds = tg::data::open_token_file(p, 50).dataset(0.0);
    s.emplace(ds.train(), 2, 16, 1);
  }  // the file object and the dataset are gone; the split keeps the mapping alive
  const TextDataset mem(tokens, 0.0);
  BatchSampler m(mem.train(), 2, 16, 1);
  expect_same_batches(*s, m, 5);
}

TEST(TokenFile, TokenizerSidecarRoundTrip) {
  TempDir dir;
  const fs::path p = dir.path() / "c.bin";
  const std::string json = "{\"model\": {\"type\": \"BPE\"},\n \"x\": \"caf\xC3\xA9 \\u0000\"}\n";
  tg::data::write_token_file(p, random_tokens(100, 256, 1), 256, json);
  EXPECT_TRUE(fs::exists(tg::data::token_file_tokenizer_path(p)));
  EXPECT_EQ(tg::data::token_file_tokenizer_path(p).string(), p.string() + ".tokenizer.json");
  auto tf = tg::data::open_token_file(p, 256);
  ASSERT_TRUE(tf.tokenizer_json().has_value());
  EXPECT_EQ(*tf.tokenizer_json(), json);
  // Re-exported without a tokenizer: no sidecar, and the stale one is gone.
  tg::data::write_token_file(p, random_tokens(100, 256, 2), 256, "");
  EXPECT_FALSE(fs::exists(tg::data::token_file_tokenizer_path(p)));
  tf = tg::data::open_token_file(p, 256);
  EXPECT_FALSE(tf.header().has_tokenizer);
  EXPECT_FALSE(tf.tokenizer_json().has_value());
  // A header that claims a sidecar which is missing.
  tg::data::write_token_file(p, random_tokens(100, 256, 2), 256, "{}");
  fs::remove(tg::data::token_file_tokenizer_path(p));
  const std::string msg = error_of([&] { tg::data::open_token_file(p, 256); });
  EXPECT_NE(msg.find(p.string() + ".tokenizer.json"), std::string::npos) << msg;
  // Only the data file and nothing temporary in the directory.
  int entries = 0;
  for (const auto& e : fs::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "c.bin");
  }
  EXPECT_EQ(entries, 1);
}

TEST(TokenFile, IsTokenFileLooksAtTheMagic) {
  TempDir dir;
  const fs::path bin = dir.path() / "a.bin";
  tg::data::write_token_file(bin, std::vector<std::int32_t>{1, 2, 3}, 4);
  EXPECT_TRUE(tg::data::is_token_file(bin));
  EXPECT_FALSE(tg::data::is_token_file(dir.write("text.txt", "hello world, this is text\n")));
  EXPECT_FALSE(tg::data::is_token_file(dir.write("short", "\x58")));
  EXPECT_FALSE(tg::data::is_token_file(dir.path() / "missing.bin"));
  EXPECT_FALSE(tg::data::is_token_file(dir.path()));
}

TEST(TokenFile, RejectsWrongMagicNamingWhatWasExpected) {
  TempDir dir;
  const fs::path txt = dir.write("corpus.txt", "hello world, not a token file at all, but long enough to have a header");
  const std::string msg = error_of([&] { tg::data::open_token_file(txt, 256); });
  EXPECT_NE(msg.find(txt.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("20240520"), std::string::npos) << msg;
  EXPECT_NE(msg.find("llm.c"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"hell\""), std::string::npos) << msg;  // what was found
  const fs::path empty = dir.write("empty.bin", "");
  EXPECT_NE(error_of([&] { tg::data::open_token_file(empty, 256); }).find("only 0 bytes"), std::string::npos);
}

TEST(TokenFile, RejectsTruncatedAndPaddedFilesNamingSizes) {
  TempDir dir;
  const fs::path p = dir.path() / "t.bin";
  tg::data::write_token_file(p, random_tokens(1000, 256, 4), 256);  // 1024 + 2000 = 3024 bytes
  fs::resize_file(p, 3022);
  std::string msg = error_of([&] { tg::data::open_token_file(p, 256); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3024"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3022"), std::string::npos) << msg;
  fs::resize_file(p, 3030);
  msg = error_of([&] { tg::data::open_token_file(p, 256); });
  EXPECT_NE(msg.find("padded"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3024"), std::string::npos) << msg;
  EXPECT_NE(msg.find("3030"), std::string::npos) << msg;
  fs::resize_file(p, 500);  // shorter than the header
  msg = error_of([&] { tg::data::open_token_file(p, 256); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1024-byte header"), std::string::npos) << msg;
}

TEST(TokenFile, RejectsCountZeroAndUnknownVersions) {
  TempDir dir;
  const fs::path zero = write_raw_token_file(dir, "zero.bin", {20240520, 1, 0}, "");
  std::string msg = error_of([&] { tg::data::open_token_file(zero, 256); });
  EXPECT_NE(msg.find(zero.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("count is 0"), std::string::npos) << msg;
  const fs::path v3 = write_raw_token_file(dir, "v3.bin", {20240520, 3, 2}, u16_bytes({1, 2}));
  msg = error_of([&] { tg::data::open_token_file(v3, 256); });
  EXPECT_NE(msg.find("version 3"), std::string::npos) << msg;
}

TEST(TokenFile, RejectsIdsOutsideTheCallersVocabulary) {
  TempDir dir;
  // Written for a vocabulary of 1000; one id past 256 at position 1234.
  std::vector<std::int32_t> tokens = random_tokens(3000, 256, 5);
  tokens[1234] = 700;
  tokens[2000] = 900;
  const fs::path p = dir.path() / "gpt.bin";
  tg::data::write_token_file(p, tokens, 1000);
  std::string msg = error_of([&] { tg::data::open_token_file(p, 256); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 1234 has id 700"), std::string::npos) << msg;
  EXPECT_NE(msg.find("vocabulary of 256"), std::string::npos) << msg;
  EXPECT_NE(msg.find("written for a vocabulary of 1000"), std::string::npos) << msg;
  EXPECT_NO_THROW(tg::data::open_token_file(p, 1000));
  EXPECT_NO_THROW(tg::data::open_token_file(p, 1001));  // a larger vocabulary than the writer's is accepted
  EXPECT_THROW(tg::data::open_token_file(p, 901), tg::Error);  // a smaller one is not, though every id fits
  // Every id fits, but the header says the ids are another (larger) vocabulary's.
  const fs::path q = dir.path() / "small_ids.bin";
  tg::data::write_token_file(q, random_tokens(3000, 256, 6), 1000);
  msg = error_of([&] { tg::data::open_token_file(q, 256); });
  EXPECT_NE(msg.find("written for a vocabulary of 1000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("pass the tokenizer it was written with"), std::string::npos) << msg;
  // An llm.c file (no vocabulary recorded): checked against the caller's; without one it cannot be.
  const fs::path l = write_raw_token_file(dir, "llmc.bin", {20240520, 1, 4}, u16_bytes({5, 50256, 7, 300}));
  msg = error_of([&] { tg::data::open_token_file(l, 256); });
  EXPECT_NE(msg.find("token 1 has id 50256"), std::string::npos) << msg;
  EXPECT_EQ(tg::data::open_token_file(l, 50257).max_id(), 50256);
  msg = error_of([&] { tg::data::open_token_file(l, 0); });
  EXPECT_NE(msg.find("records no vocabulary"), std::string::npos) << msg;
  // A header whose recorded largest id disagrees with the tokens: corrupt.
  const fs::path c = write_raw_token_file(dir, "corrupt.bin", {20240520, 1, 3, 100, 50}, u16_bytes({1, 60, 2}));
  msg = error_of([&] { tg::data::open_token_file(c, 100); });
  EXPECT_NE(msg.find("corrupt"), std::string::npos) << msg;
}

TEST(TokenFile, Version2FilesHoldUint32Ids) {
  TempDir dir;
  const std::vector<std::int32_t> tokens = random_tokens(4000, 128256, 8);  // llm.c's LLaMA-3 layout
  std::vector<std::uint32_t> ids(tokens.begin(), tokens.end());
  const fs::path p = write_raw_token_file(dir, "llama.bin", {20240520, 2, 4000},
                                          std::string(reinterpret_cast<const char*>(ids.data()), ids.size() * 4));
  const auto tf = tg::data::open_token_file(p, 128256);
  EXPECT_EQ(tf.width(), 4);
  EXPECT_EQ(tf.stream()->kind(), TokenStream::Kind::uint32);
  const TextDataset mem(tokens, 0.1), file = tf.dataset(0.1);
  BatchSampler a(mem.train(), 3, 50, 2), b(file.train(), 3, 50, 2);
  expect_same_batches(a, b, 10);
  EXPECT_THROW(tg::data::open_token_file(p, 65536), tg::Error);
}

TEST(TokenFile, WriteRejectsBadIdsAndVocabulariesLeavingNothing) {
  TempDir dir;
  const fs::path p = dir.path() / "out.bin";
  std::vector<std::int32_t> tokens = random_tokens(1000, 256, 7);
  tokens[517] = 256;
  std::string msg = error_of([&] { tg::data::write_token_file(p, tokens, 256, "{}"); });
  EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 517 has id 256"), std::string::npos) << msg;
  tokens[517] = -1;
  msg = error_of([&] { tg::data::write_token_file(p, tokens, 256); });
  EXPECT_NE(msg.find("token 517 has id -1"), std::string::npos) << msg;
  tokens[517] = 0;
  msg = error_of([&] { tg::data::write_token_file(p, tokens, 65537); });
  EXPECT_NE(msg.find("65537"), std::string::npos) << msg;
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;
  EXPECT_THROW(tg::data::write_token_file(p, tokens, 0), tg::Error);
  EXPECT_THROW(tg::data::write_token_file(p, std::vector<std::int32_t>{}, 256), tg::Error);
  EXPECT_TRUE(fs::is_empty(dir.path()));  // neither a file, a sidecar nor a temporary
  EXPECT_NO_THROW(tg::data::write_token_file(p, tokens, 65536));  // the largest uint16 vocabulary
  EXPECT_EQ(tg::data::open_token_file(p).vocab_size(), 65536);
  // A write into a missing directory names the path and the system's reason.
  const fs::path nodir = dir.path() / "no_such_dir" / "x.bin";
  msg = error_of([&] { tg::data::write_token_file(nodir, tokens, 256); });
  EXPECT_NE(msg.find(nodir.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
}

TEST(TokenFile, MissingFileNamesThePath) {
  TempDir dir;
  const fs::path missing = dir.path() / "nope.bin";
  std::string msg = error_of([&] { tg::data::open_token_file(missing, 256); });
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  msg = error_of([&] { tg::data::open_token_file(dir.path(), 256); });
  EXPECT_NE(msg.find("is a directory"), std::string::npos) << msg;
  msg = error_of([&] { TextDataset::from_token_file(missing, 256); });
  EXPECT_NE(msg.find(missing.string()), std::string::npos) << msg;
}

// ---- PrefetchingSampler --------------------------------------------------------------------------------

void expect_same_batches(PrefetchingSampler& a, BatchSampler& b, int n) {
  for (int i = 0; i < n; ++i) {
    const auto ba = a.next(), bb = b.next();
    ASSERT_EQ(values(ba.inputs), values(bb.inputs)) << "batch " << i;
    ASSERT_EQ(values(ba.targets), values(bb.targets)) << "batch " << i;
    ASSERT_EQ(a.position(), b.position()) << "batch " << i;
  }
}

/// Waits (up to 10 s) until pred() holds.
template <class F>
bool eventually(F&& pred) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(PrefetchingSampler, YieldsThePlainSamplersBatches) {
  TempDir dir;
  const auto tokens = random_tokens(30000, 500, 12);
  const fs::path p = dir.path() / "c.bin";
  tg::data::write_token_file(p, tokens, 500);
  const TextDataset mem(tokens, 0.1), file = TextDataset::from_token_file(p, 500, 0.1);
  for (int depth : {0, 1, 2, 5}) {
    SCOPED_TRACE("depth " + std::to_string(depth));
    PrefetchingSampler pf(BatchSampler(file.train(), 4, 32, 21), depth);
    EXPECT_EQ(pf.depth(), depth);
    ASSERT_NE(pf.sampler(), nullptr);
    EXPECT_EQ(pf.sampler()->batch_size(), 4);
    BatchSampler plain(mem.train(), 4, 32, 21);
    expect_same_batches(pf, plain, 50);
  }
  // Sequential (validation) across the wrap, and from a sampler already advanced.
  PrefetchingSampler pv(BatchSampler::sequential(file.validation(), 8, 32));
  auto plain_v = BatchSampler::sequential(mem.validation(), 8, 32);
  expect_same_batches(pv, plain_v, static_cast<int>(plain_v.num_batches()) * 2 + 1);
  BatchSampler advanced(mem.train(), 2, 16, 4);
  for (int i = 0; i < 7; ++i) advanced.next();
  PrefetchingSampler pa(advanced);
  EXPECT_EQ(pa.position().counter, 7u);
  expect_same_batches(pa, advanced, 10);
}

TEST(PrefetchingSampler, ResumeContinuesIdentically) {
  const TextDataset ds(random_tokens(20000, 100, 13), 0.1);
  PrefetchingSampler pf(BatchSampler(ds.train(), 4, 16, 77));
  for (int i = 0; i < 10; ++i) pf.next();
  const SamplerPosition pos = pf.position();
  EXPECT_EQ(pos, (SamplerPosition{77, 10}));
  std::vector<std::vector<std::int64_t>> expected;
  for (int i = 0; i < 6; ++i) expected.push_back(values(pf.next().inputs));
  pf.set_position(pos);  // discards what the worker prepared (batches 16, 17)
  EXPECT_EQ(pf.position(), pos);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(values(pf.next().inputs), expected[static_cast<std::size_t>(i)]) << i;
  // A fresh prefetcher (another seed) resumed at pos, and the plain sampler resumed there, agree.
  PrefetchingSampler fresh(BatchSampler(ds.train(), 4, 16, 1));
  fresh.next();
  fresh.set_position(pos);
  BatchSampler plain(ds.train(), 4, 16, 0);
  plain.set_position(pos);
  expect_same_batches(fresh, plain, 20);
  // Another seed via set_position, then reset() back to counter 0 of that seed.
  fresh.set_position({5, 3});
  BatchSampler seed5(ds.train(), 4, 16, 5);
  for (int i = 0; i < 3; ++i) seed5.next();
  expect_same_batches(fresh, seed5, 5);
  fresh.reset();
  seed5.reset();
  EXPECT_EQ(fresh.position(), (SamplerPosition{5, 0}));
  expect_same_batches(fresh, seed5, 5);
  // Moved: the worker keeps going for the new owner.
  PrefetchingSampler moved(std::move(fresh));
  expect_same_batches(moved, seed5, 5);
  PrefetchingSampler assigned(BatchSampler(ds.train(), 4, 16, 9));
  assigned = std::move(moved);
  expect_same_batches(assigned, seed5, 5);
}

TEST(PrefetchingSampler, WorksAheadAtMostDepthBatches) {
  std::atomic<int> calls{0};
  std::atomic<std::uint64_t> last{0};
  PrefetchingSampler pf(
      [&](const SamplerPosition& p) {
        last = p.counter;
        ++calls;
        return tg::data::Batch{tg::Tensor<std::int64_t>::full({1, 1}, static_cast<double>(p.counter)),
                               tg::Tensor<std::int64_t>::full({1, 1}, static_cast<double>(p.seed))};
      },
      SamplerPosition{3, 100}, 2);
  ASSERT_TRUE(eventually([&] { return calls.load() >= 2; }));  // prepared before anyone asked
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(calls.load(), 2);  // and no further than depth
  EXPECT_EQ(last.load(), 101u);
  const auto b = pf.next();
  EXPECT_EQ(b.inputs.at({0, 0}), 100);
  EXPECT_EQ(b.targets.at({0, 0}), 3);
  ASSERT_TRUE(eventually([&] { return calls.load() >= 3; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(calls.load(), 3);
  EXPECT_EQ(pf.next().inputs.at({0, 0}), 101);
  EXPECT_EQ(pf.position(), (SamplerPosition{3, 102}));
}

TEST(PrefetchingSampler, RethrowsWorkerExceptionsFromNext) {
  PrefetchingSampler pf(
      [](const SamplerPosition& p) {
        if (p.counter == 3) throw tg::Error("producer: batch ", p.counter, " is bad");
        return tg::data::Batch{tg::Tensor<std::int64_t>::full({1}, static_cast<double>(p.counter)),
                               tg::Tensor<std::int64_t>::full({1}, 0.0)};
      },
      SamplerPosition{0, 0}, 2);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(pf.next().inputs.at({0}), i);
  const std::string msg = error_of([&] { pf.next(); });
  EXPECT_NE(msg.find("batch 3 is bad"), std::string::npos) << msg;
  EXPECT_EQ(pf.position().counter, 4u);  // the failed batch counts, as in the plain sampler
  EXPECT_EQ(pf.next().inputs.at({0}), 4);
  pf.set_position({0, 3});
  EXPECT_THROW(pf.next(), tg::Error);
  EXPECT_EQ(pf.next().inputs.at({0}), 4);
  // Any exception type gets through; a depth of 0 throws directly.
  PrefetchingSampler other([](const SamplerPosition&) -> tg::data::Batch { throw std::runtime_error("not tg"); },
                           SamplerPosition{}, 1);
  EXPECT_THROW(other.next(), std::runtime_error);
  PrefetchingSampler sync([](const SamplerPosition&) -> tg::data::Batch { throw tg::Error("sync", "!"); },
                          SamplerPosition{}, 0);
  EXPECT_THROW(sync.next(), tg::Error);
  EXPECT_THROW(PrefetchingSampler(BatchSampler(TextDataset(iota_tokens(100), 0.0).train(), 1, 8), -1), tg::Error);
}

TEST(PrefetchingSampler, DestructionMidStreamReturnsPromptly) {
  using clock = std::chrono::steady_clock;
  auto slow = [](const SamplerPosition& p) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return tg::data::Batch{tg::Tensor<std::int64_t>::full({1}, static_cast<double>(p.counter)),
                           tg::Tensor<std::int64_t>::full({1}, 0.0)};
  };
  for (int taken : {0, 1, 3}) {
    auto pf = std::make_unique<PrefetchingSampler>(slow, SamplerPosition{}, 4);
    for (int i = 0; i < taken; ++i) EXPECT_EQ(pf->next().inputs.at({0}), i);
    const auto t0 = clock::now();
    pf.reset();  // the worker is mid-batch or waiting
    const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
    EXPECT_LT(ms, 2000.0) << "after " << taken << " batches";  // at most one batch (20 ms) plus the join
  }
  // A worker blocked on a full queue.
  const TextDataset ds(iota_tokens(1000), 0.0);
  auto pf = std::make_unique<PrefetchingSampler>(BatchSampler(ds.train(), 2, 8, 1), 2);
  pf->next();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  const auto t0 = clock::now();
  pf.reset();
  const double ms = std::chrono::duration<double, std::milli>(clock::now() - t0).count();
  EXPECT_LT(ms, 2000.0);
}

// ---- fortunes -----------------------------------------------------------------------------------------

TEST(Fortunes, StripSeparatorsLeavesEmptyLines) {
  EXPECT_EQ(tg::data::strip_fortune_separators("one\n%\ntwo\nlines\n%\nthree\n%\n"), "one\n\ntwo\nlines\n\nthree\n");
  EXPECT_EQ(tg::data::strip_fortune_separators("%\nfirst\n%\n50% off\n"), "first\n\n50% off\n");
  EXPECT_EQ(tg::data::strip_fortune_separators("no newline"), "no newline\n");
}

TEST(Fortunes, MissingDirectoryNamesThePackage) {
  const std::string msg = error_of([] { tg::data::load_fortunes_corpus("/nonexistent/fortunes"); });
  EXPECT_NE(msg.find("/nonexistent/fortunes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("fortunes` package"), std::string::npos) << msg;
}

TEST(Fortunes, FileSelectionSkipsDatU8AndSubdirectories) {
  TempDir dir;
  dir.write("zen", "a\n%\nb\n");
  dir.write("art", "c\n");
  dir.write("art.dat", "binary");
  dir.write("art.u8", "c\n");
  fs::create_directories(dir.path() / "off");
  dir.write("off/rude", "x\n");
  const auto files = tg::data::fortune_files(dir.path());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].filename(), "art");
  EXPECT_EQ(files[1].filename(), "zen");
  EXPECT_EQ(tg::data::load_fortunes_corpus(dir.path()), "c\n\na\n\nb\n");
}

TEST(Fortunes, DefaultCorpusIsLargeAndHasNoSeparators) {
  if (!fs::is_directory(tg::data::kFortunesDir))
    GTEST_SKIP() << tg::data::kFortunesDir << " is absent (install Debian's `fortunes` package)";
  const std::string corpus = tg::data::load_fortunes_corpus();
  std::cout << "[          ] fortunes corpus: " << corpus.size() << " bytes from "
            << tg::data::fortune_files().size() << " files\n";
  EXPECT_GT(corpus.size(), 1'000'000u);
  std::size_t pos = 0;
  std::int64_t separator_lines = 0;
  while (pos < corpus.size()) {
    std::size_t eol = corpus.find('\n', pos);
    if (eol == std::string::npos) eol = corpus.size();
    if (corpus.compare(pos, eol - pos, "%") == 0) ++separator_lines;
    pos = eol + 1;
  }
  EXPECT_EQ(separator_lines, 0);
  const auto ds = TextDataset::fortunes(ByteTokenizer{}, 0.1, 256);
  EXPECT_EQ(ds.size(), static_cast<std::int64_t>(corpus.size()));
  EXPECT_GT(ds.val_size(), 100'000);
}

}  // namespace

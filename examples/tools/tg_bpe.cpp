// tg_bpe: the byte-level BPE trainer and encoder from the command line (include/typegrad/data/tokenizer.hpp).
//   tg_bpe corpus OUT.txt               write the fortunes corpus (tg::data::load_fortunes_corpus) to a file
//   tg_bpe train FILE N OUT.json        train a BPE of N tokens on FILE; prints the seconds and merges learned
//   tg_bpe encode TOK.json FILE         encode FILE; prints tokens, bytes, bytes/token, MB/s, round trip
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>

#include <typegrad/data/dataset.hpp>
#include <typegrad/data/tokenizer.hpp>

namespace {

std::string read_file(const char* path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw tg::Error("tg_bpe: cannot open '", path, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const char* path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.flush()) throw tg::Error("tg_bpe: cannot write '", path, "'");
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int usage() {
  std::cerr << "usage: tg_bpe corpus OUT.txt | tg_bpe train FILE N OUT.json | tg_bpe encode TOK.json FILE\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) try {
  if (argc < 2) return usage();
  const std::string cmd = argv[1];
  if (cmd == "corpus" && argc == 3) {
    const std::string text = tg::data::load_fortunes_corpus();
    write_file(argv[2], text);
    std::printf("wrote %zu bytes to %s\n", text.size(), argv[2]);
  } else if (cmd == "train" && argc == 5) {
    const std::string text = read_file(argv[2]);
    char* end = nullptr;
    const long long n = std::strtoll(argv[3], &end, 10);
    if (end == argv[3] || *end != '\0') throw tg::Error("tg_bpe train: N = '", argv[3], "' is not an integer");
    const auto t0 = std::chrono::steady_clock::now();
    const tg::data::AnyTokenizer tok(tg::data::train_byte_bpe(text, n));
    const double secs = since(t0);
    write_file(argv[4], tok.to_json());
    std::printf("trained %s on %zu bytes in %.3f s\nseconds %.3f\n", tok.describe().c_str(), text.size(), secs, secs);
  } else if (cmd == "encode" && argc == 4) {
    const tg::data::AnyTokenizer tok = tg::data::AnyTokenizer::from_json(read_file(argv[2]));
    const std::string text = read_file(argv[3]);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<std::int32_t> ids = tok.encode(text);
    const double secs = since(t0);
    const bool exact = tok.decode(ids) == text;
    std::printf("tokenizer %s\ntokens %zu\nbytes %zu\nbytes_per_token %.4f\nencode_mb_per_s %.2f\nround_trip %s\n",
                tok.describe().c_str(), ids.size(), text.size(),
                ids.empty() ? 0.0 : static_cast<double>(text.size()) / static_cast<double>(ids.size()),
                static_cast<double>(text.size()) / 1e6 / secs, exact ? "exact" : "DIFFERS");
    return exact ? 0 : 1;
  } else {
    return usage();
  }
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}

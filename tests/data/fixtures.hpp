// Test helpers shared by test_data.cpp and test_tokenizers.cpp: a temporary directory, and what writing GPT-2
// style vocab.json / merges.txt fixtures needs (UTF-8 of a code point, the byte-to-unicode symbol of a byte
// string, a JSON string literal).
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <typegrad/core/error.hpp>
#include <typegrad/core/random.hpp>
#include <typegrad/data/tokenizer.hpp>

namespace data_fixtures {

/// A fresh directory under the system temp dir (named after `tag` and the process), removed with the object.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "tg_test_data") {
    static std::atomic<int> n{0};
    path_ = std::filesystem::temp_directory_path() / (tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(n++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path write(const std::string& name, const std::string& bytes) const {
    const std::filesystem::path p = path_ / name;
    std::ofstream out(p, std::ios::binary);
    out << bytes;
    return p;
  }

 private:
  std::filesystem::path path_;
};


inline std::string utf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) s += static_cast<char>(cp);
  else if (cp < 0x800) s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
  else
    s += static_cast<char>(0xE0 | (cp >> 12)), s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F)),
        s += static_cast<char>(0x80 | (cp & 0x3F));
  return s;
}
/// GPT-2's byte-to-unicode form of a byte string ("Ġhello" for " hello").
inline std::string sym(std::string_view bytes) {
  std::string s;
  for (char c : bytes) s += utf8(tg::data::gpt2_byte_to_unicode(static_cast<std::uint8_t>(c)));
  return s;
}
/// `s` as a JSON string literal (quotes and backslashes escaped).
inline std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

/// The message of the tg::Error that `f` throws, or "<no tg::Error thrown>".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tg::Error& e) {
    return e.what();
  }
  return "<no tg::Error thrown>";
}

/// `count` random byte strings of fewer than `max_len` bytes, half their bytes drawn from `pool` (text-like:
/// spaces, newlines, letters) and half uniform, from a seeded Philox generator.
inline std::vector<std::string> random_texts(std::uint64_t seed, int count, int max_len, std::string_view pool) {
  tg::Generator gen(seed);
  std::vector<std::string> out;
  for (int k = 0; k < count; ++k) {
    std::string r;
    const int len = static_cast<int>(gen.next_u64() % static_cast<std::uint64_t>(max_len));
    for (int i = 0; i < len; ++i) {
      const std::uint64_t u = gen.next_u64();
      r += (u & 1) ? pool[(u >> 8) % pool.size()] : static_cast<char>(u >> 16);
    }
    out.push_back(r);
  }
  return out;
}

}  // namespace data_fixtures

// libFuzzer target for the safetensors parser: any byte string either parses into a consistent file or
// throws tg::Error; never a crash, leak or out-of-bounds read (built with -fsanitize=fuzzer,address,undefined).
//   fuzz_safetensors -runs=200000 corpus/ seeds/          # see tests/io/fuzz/CMakeLists.txt
#include <cstddef>
#include <cstdint>
#include <vector>

#include "typegrad/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  try {
    const auto r = tg::io::SafetensorsReader::parse(std::vector<std::uint8_t>(data, data + size), "<fuzz input>");
    // Invariants of an accepted file: the tensors tile the data section, every byte span is in bounds.
    std::uint64_t at = 0, sum = 0;
    for (const auto& t : r.tensors()) {
      if (t.begin != at || t.end < t.begin) __builtin_trap();
      at = t.end;
      const auto b = r.bytes(t.name);
      if (b.size() != t.nbytes()) __builtin_trap();
      for (std::size_t i = 0; i < b.size(); i += 61) sum += b[i];  // touch the bytes (ASan checks bounds)
      if (!b.empty()) sum += b[b.size() - 1];
    }
    if (at > size) __builtin_trap();
    try {
      r.verify_checksums(false);
    } catch (const tg::Error&) {
    }
    return static_cast<int>(sum & 0);
  } catch (const tg::Error&) {
    return 0;
  }
}

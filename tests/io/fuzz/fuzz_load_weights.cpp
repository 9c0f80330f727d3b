// libFuzzer target for tg::io::load_weights: the input is a safetensors file, loaded into three fixed
// parameters ("w" [2,3], "b" [3], "s" []). Invariants: it either succeeds, and then every parameter holds
// the file's tensor (converted to fp32), or it throws tg::Error and no parameter changed; never a crash,
// leak or undefined behaviour (built with -fsanitize=fuzzer,address,undefined).
//   fuzz_load_weights -runs=100000 corpus/ seeds/          # see tests/io/fuzz/CMakeLists.txt
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fuzz_common.hpp"
#include "typegrad/io/train_state.hpp"

namespace {
std::vector<tg::optim::Param>& params() {
  static std::vector<tg::optim::Param> ps{{"w", tg::Tensor<float>::empty({2, 3})},
                                          {"b", tg::Tensor<float>::empty({3})},
                                          {"s", tg::Tensor<float>::empty({})}};
  return ps;
}

/// Fixed values before every input (distinct, so a partial copy shows).
void reset(const std::vector<tg::optim::Param>& ps) {
  float v = 0.25f;
  for (const auto& p : ps)
    for (std::int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.data()[i] = (v += 1.f);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto& ps = params();
  reset(ps);
  const std::vector<float> before = tg_fuzz::snapshot(ps);
  const std::string& path = tg_fuzz::scratch_path("load_weights");
  tg_fuzz::write_bytes(path, data, size);
  try {
    tg::io::load_weights(path, ps);
  } catch (const tg::Error&) {
    if (!tg_fuzz::same_bytes(before, tg_fuzz::snapshot(ps))) __builtin_trap();  // an error must change nothing
    return 0;
  }
  // Accepted: the file parses, and each parameter holds exactly the file's values.
  const auto r = tg::io::SafetensorsReader::parse(std::vector<std::uint8_t>(data, data + size), "<fuzz input>");
  for (const auto& p : ps) {
    const tg::Tensor<float> want = r.get_converted<float>(p.name);
    if (want.numel() != p.tensor.numel()) __builtin_trap();
    if (want.numel() > 0 && std::memcmp(want.data(), p.tensor.data(), static_cast<std::size_t>(want.nbytes())) != 0)
      __builtin_trap();
  }
  return 0;
}

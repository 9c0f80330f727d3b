// The cuBLASLt heuristic's answers cached per GEMM configuration (Note [cached GEMM algorithms] in gemm.cu),
// shared by the float GEMMs (gemm.cu) and the int8 GEMM (gemm_int8.cu).
//   static detail::LtAlgoCache<9> cache;  cache.get(key, result, found, [&](auto& r, int& f) { ...heuristic... });
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>

namespace tg::backend::cuda::detail {

/// Keys of N integers holding every input of the descriptors and preferences the heuristic reads, so a cached
/// answer is exactly the heuristic's answer for that call. Thread-safe.
template <std::size_t N>
class LtAlgoCache {
 public:
  using Key = std::array<std::int64_t, N>;
  /// The answer for `key`: `ask(result, found)` runs the heuristic the first time (found = 0, "no algorithm",
  /// is kept as an answer too), later calls copy what it gave.
  template <class Ask>
  void get(const Key& key, cublasLtMatmulHeuristicResult_t& result, int& found, Ask&& ask) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = answers_.find(key);
    if (it == answers_.end()) {
      ask(result, found);
      it = answers_.emplace(key, Answer{result, found}).first;
    }
    result = it->second.result;
    found = it->second.found;
  }

 private:
  struct Answer {
    cublasLtMatmulHeuristicResult_t result;
    int found;
  };
  std::mutex mu_;
  std::map<Key, Answer> answers_;
};

}  // namespace tg::backend::cuda::detail

// What the float GEMMs (gemm.cu) and the int8 GEMM (gemm_int8.cu) share of cuBLAS / cuBLASLt: the checked
// call, and the heuristic's answers cached per GEMM configuration (Note [cached GEMM algorithms] in gemm.cu).
//   TG_CUBLAS_CHECK(cublasLtCreate(&handle));     // throws tg::Error with file:line and cuBLAS's status name
//   static detail::LtAlgoCache<9> cache;  cache.get(key, result, found, [&](auto& r, int& f) { ...heuristic... });
#pragma once

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <map>
#include <mutex>

#include "typegrad/core/error.hpp"

/// Checks a cuBLAS / cuBLASLt call: anything but CUBLAS_STATUS_SUCCESS throws tg::Error naming the call.
#define TG_CUBLAS_CHECK(call)                                                                              \
  do {                                                                                                     \
    const cublasStatus_t tg_status_ = (call);                                                              \
    if (tg_status_ != CUBLAS_STATUS_SUCCESS)                                                               \
      throw ::tg::Error("cuBLAS error at ", __FILE__, ":", __LINE__, ": ", #call, " failed: ",              \
                        cublasGetStatusName(tg_status_), " (", cublasGetStatusString(tg_status_), ")");    \
  } while (0)

namespace tg::backend::cuda::detail {

/// Keys of N integers holding every input of the descriptors and preferences the heuristic reads, so a cached
/// answer is exactly the heuristic's answer for that call. Thread-safe.
template <std::size_t N>
class LtAlgoCache {
 public:
  using Key = std::array<std::int64_t, N>;
  /// The answer for `key`: `ask(result, found)` runs the heuristic until it gives a definitive answer (it
  /// returns ask_status's verdict: an algorithm, or "not supported", is kept; a transient failure such as
  /// an allocation error answers this call with found = 0 and is asked again next time), later calls copy it.
  template <class Ask>
  void get(const Key& key, cublasLtMatmulHeuristicResult_t& result, int& found, Ask&& ask) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = answers_.find(key);
    if (it == answers_.end()) {
      if (!ask(result, found)) return;
      it = answers_.emplace(key, Answer{result, found}).first;
    }
    result = it->second.result;
    found = it->second.found;
  }
  /// After the algorithm kept for `key` declined at cublasLtMatmul (lt_run_declined): the answer becomes "no
  /// algorithm", so later calls of the configuration take the fallback at once instead of failing again.
  void decline(const Key& key) {
    std::lock_guard<std::mutex> lock(mu_);
    answers_[key] = Answer{cublasLtMatmulHeuristicResult_t{}, 0};
  }

 private:
  struct Answer {
    cublasLtMatmulHeuristicResult_t result;
    int found;
  };
  std::mutex mu_;
  std::map<Key, Answer> answers_;
};

/// The heuristic's status as an answer for LtAlgoCache: found = 0 unless it succeeded; true (keep it) for success
/// and for CUBLAS_STATUS_NOT_SUPPORTED ("no algorithm for this configuration"), false for anything else.
inline bool ask_status(cublasStatus_t st, int& found) {
  if (st != CUBLAS_STATUS_SUCCESS) found = 0;
  return st == CUBLAS_STATUS_SUCCESS || st == CUBLAS_STATUS_NOT_SUPPORTED;
}

/// Whether cublasLtMatmul's status says the heuristic's algorithm declined the call before running it (nothing
/// written): cublasLt.h's "doesn't fully guarantee algo will run (will fail if e.g. buffers are not correctly
/// aligned)". The caller then takes its fallback (cuBLAS, the composite, the plain int8 kernel) and tells the
/// cache (LtAlgoCache::decline). Any other failure is an error.
inline bool lt_run_declined(cublasStatus_t st) {
  return st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE || st == CUBLAS_STATUS_ARCH_MISMATCH;
}

}  // namespace tg::backend::cuda::detail

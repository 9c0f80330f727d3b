// CPU GEMM entry points (compiled in backends/cpu/, explicitly instantiated there).
//   tg::backend::cpu::gemm<float>(Trans::N, Trans::T, M, N, K, 1.f, a, K, w, K, 0.f, c, N);   // C = A·Wᵀ
//   tg::backend::cpu::gemm_kernel_name();   // which kernel runs on this CPU, e.g. "avx2-fma packed 6x16"
#pragma once

#include <cstdint>
#include <string>

#include "typegrad/core/dtype.hpp"

namespace tg::backend::cpu {

enum class Trans : bool { N = false, T = true };

/// Optional fused work done while C is written, to save a pass over the output.
struct GemmEpilogue {
  const float* bias = nullptr;  // length N, added to every row of C after alpha/beta
  bf16* out_bf16 = nullptr;     // if set, also writes a bf16 copy of C here (leading dimension ldo)
  std::int64_t ldo = 0;
};

// Note [GEMM conventions]
// Row-major: C[M,N] = alpha · op(A)[M,K] · op(B)[K,N] + beta · C. op(A) = A (stored [M,K], lda >= K) or
// Aᵀ (stored [K,M], lda >= M); likewise B ([K,N] or [N,K]). Inputs of type T; C of type T too, except
// that the accumulation is always fp32 (fp64 for T = fp64): 16-bit outputs are rounded once at the
// end. beta == 0 never reads C (so C may hold NaN garbage). Instantiated for fp64, fp32, bf16, fp16.
template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C, std::int64_t ldc,
          const GemmEpilogue& epilogue = {});

/// `batch` independent GEMMs; operand i starts at A + i·stride_a (etc.). A stride of 0 broadcasts.
template <class T>
void gemm_batched(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  const T* A, std::int64_t lda, std::int64_t stride_a, const T* B, std::int64_t ldb,
                  std::int64_t stride_b, float beta, T* C, std::int64_t ldc, std::int64_t stride_c,
                  std::int64_t batch);

/// The plain Eigen path: the reference every optimized kernel is tested against.
template <class T>
void gemm_reference(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                    const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
                    std::int64_t ldc);

/// Name of the kernel gemm<T> dispatches to on this CPU.
std::string gemm_kernel_name(DType t);

/// vdpbf16ps flop rate / fp32 FMA flop rate on this core (zmm, independent chains), measured once per process
/// (about a millisecond); 0 without avx512_bf16. bf16 GEMMs use the vdpbf16ps kernel only when it is at
/// least kBf16DotMinSpeedup (Note [bf16 kernel choice]).
double gemm_bf16_dot_speedup();
/// 1.0: the known cores sit a factor of 2 either side (Zen 4: 2.0x, the Xeon of docs/performance.md: 0.5x), so
/// a noisy measurement (a loaded machine) still picks the same kernel in every process, which keeps bf16
/// results, and so exact resume across processes, reproducible. TG_GEMM_KERNEL pins the choice outright.
inline constexpr double kBf16DotMinSpeedup = 1.0;

}  // namespace tg::backend::cpu

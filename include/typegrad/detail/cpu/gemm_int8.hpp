// CPU int8 GEMMs: int8 x int8 products with exact int32 accumulation (compiled in backends/cpu/gemm_int8*.cpp),
// for the quantized inference models of tg::quant (Note [int8 GEMM]).
//   tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, M, N, K, a, K, w, K, c, N);          // C = A·Wᵀ in int32
//   tg::backend::cpu::PackedInt8Weights pw(w, N, K, K);                                      // pack W [N,K] once
//   tg::backend::cpu::gemm_s8_packed_dequant(M, a, K, a_scale, pw, w_scale, bias, y, N);     // y = dequantized A·Wᵀ + b
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu {

// Note [int8 GEMM]
// Row-major, as Note [GEMM conventions]: C[M,N] = op(A)[M,K] · op(B)[K,N] (+ C when `accumulate`), A and B
// signed int8, C int32. Every product and sum is exact: the result equals the integer reference bit for bit,
// for K <= kInt8MaxK (so that no int32 partial sum can overflow, whatever the order of the additions).
// The kernels: AVX-512 VNNI (vpdpbusd multiplies unsigned by signed bytes, so A is packed as A + 128 and
// 128 · Σ_k B(k, n) is subtracted per column), AMX int8 tiles (tdpbssd, signed x signed) where the CPU has
// them, an AVX2 kernel (bytes widened to int16, vpmaddwd), and the plain reference loops. The choice is made
// at run time, the best the CPU has; TG_INT8_KERNEL=reference|avx2|vnni|amx forces one (forcing one the CPU
// lacks throws tg::Error naming it and the detected features).

/// The largest K an int8 GEMM accepts: 2^16, under 2^31 / (255 · 128) = 65793 (no int32 partial sum overflows).
inline constexpr std::int64_t kInt8MaxK = 65536;

/// The kernels of Note [int8 GEMM], by the names TG_INT8_KERNEL takes.
enum class Int8Kernel { reference, avx2, vnni, amx };

/// C = op(A)·op(B) (or C += with `accumulate`), exact in int32. M, N, K >= 0; K <= kInt8MaxK.
void gemm_s8s8s32(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, const std::int8_t* A,
                  std::int64_t lda, const std::int8_t* B, std::int64_t ldb, std::int32_t* C, std::int64_t ldc,
                  bool accumulate = false);

/// The plain loops every optimized int8 kernel is tested against.
void gemm_s8s8s32_reference(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K,
                            const std::int8_t* A, std::int64_t lda, const std::int8_t* B, std::int64_t ldb,
                            std::int32_t* C, std::int64_t ldc, bool accumulate = false);

/// Weights W [N,K] (PyTorch Linear layout, row stride ldw) packed once into the layout the kernel chosen on
/// this CPU reads, with what it needs besides (the per-column sums for the VNNI offset). Immutable after
/// construction; shared by the threads of a product.
class PackedInt8Weights {
 public:
  PackedInt8Weights(const std::int8_t* W, std::int64_t N, std::int64_t K, std::int64_t ldw);
  /// Packed for kernel `kernel` (tests, benchmarks); throws tg::Error when this CPU cannot run it.
  PackedInt8Weights(const std::int8_t* W, std::int64_t N, std::int64_t K, std::int64_t ldw, Int8Kernel kernel);
  ~PackedInt8Weights();
  PackedInt8Weights(PackedInt8Weights&&) noexcept;
  PackedInt8Weights& operator=(PackedInt8Weights&&) noexcept;
  PackedInt8Weights(const PackedInt8Weights&) = delete;
  PackedInt8Weights& operator=(const PackedInt8Weights&) = delete;

  std::int64_t n() const;
  std::int64_t k() const;
  /// Bytes held (the packed panels and the column sums).
  std::int64_t bytes() const;
  /// The kernel the weights were packed for (the one gemm_s8_packed_dequant runs on them).
  Int8Kernel kernel() const;
  struct Impl;
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

/// y[m, n] = (Σ_k A[m,k] · W[n,k]) · a_scale[m] · w_scale[n] + bias[n], in fp32 (bias may be null), with A
/// int8 [M,K] row-major (row stride lda) and W packed. The int32 sums are exact (Note [int8 GEMM]); the
/// scaling is one fp32 multiply per factor, in that order, then the bias add.
void gemm_s8_packed_dequant(std::int64_t M, const std::int8_t* A, std::int64_t lda, const float* a_scale,
                            const PackedInt8Weights& W, const float* w_scale, const float* bias, float* y,
                            std::int64_t ldy);

/// Name of the int8 kernel chosen on this CPU, e.g. "avx512-vnni vpdpbusd packed 12x32".
std::string gemm_int8_kernel_name();

// ---- kernel choice: the entries tests and benchmarks use to run each kernel -----------------------------
/// "reference" | "avx2" | "vnni" | "amx".
std::string int8_kernel_name(Int8Kernel k);
/// Whether this CPU (and OS) can run kernel k (amx: the CPU reports amx_int8 and Linux grants the tile state).
bool int8_kernel_supported(Int8Kernel k);
/// The kernel used now: TG_INT8_KERNEL's (read at every call; an unknown name, or a kernel this CPU lacks,
/// throws tg::Error), else the best supported one (amx, vnni, avx2, reference).
Int8Kernel int8_kernel();
/// gemm_s8s8s32 on kernel k (tg::Error when unsupported) with `threads` OpenMP threads (0: the default, as
/// gemm_s8s8s32 chooses: 1 inside a parallel region or for small products, else the team).
/// TG_INT8_BLOCKING="kc,mc,nc" (k, rows, columns; 0 keeps the derived value) forces the cache blocking
/// (Note [int8 GEMM blocking]), so that small products can cross every block boundary.
void gemm_s8s8s32_with(Int8Kernel k, int threads, Trans ta, Trans tb, std::int64_t M, std::int64_t N,
                       std::int64_t K, const std::int8_t* A, std::int64_t lda, const std::int8_t* B, std::int64_t ldb,
                       std::int32_t* C, std::int64_t ldc, bool accumulate = false);
/// gemm_s8_packed_dequant with `threads` threads (0: the default), on the kernel W was packed for.
void gemm_s8_packed_dequant_with(int threads, std::int64_t M, const std::int8_t* A, std::int64_t lda,
                                 const float* a_scale, const PackedInt8Weights& W, const float* w_scale,
                                 const float* bias, float* y, std::int64_t ldy);

}  // namespace tg::backend::cpu

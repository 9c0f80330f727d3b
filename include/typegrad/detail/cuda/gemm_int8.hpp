// int8 quantizers and int8 x int8 GEMMs on the GPU (cuBLASLt's IMMA path), the device side of tg::quant's
// quantized linear layer (Note [int8 GEMM on the GPU]). Device pointers; work goes on the current stream.
//   tg::backend::cuda::quantize_rows_int8(x, M, K, K, qx, sx);                                  // qx [M,K], sx [M]
//   tg::backend::cuda::gemm_s8_dequant(M, N, K, qx, K, sx, qw, K, sw, bias, y, N);             // y = x·Wᵀ + b
// Declared always; defined by backends/cuda/gemm_int8.cu when TG_HAVE_CUDA, otherwise each call throws a
// tg::Error saying the build has no CUDA backend (backends/cpu/no_cuda.cpp).
#pragma once

#include <cstdint>

namespace tg::backend::cuda {

// Note [int8 GEMM on the GPU]
// The same math as the CPU (Note [int8 quantization] in quant/int8.hpp, Note [int8 GEMM]), bit for bit:
// * Quantizers. s = max_k |x[m,k]| / 127 (1 for a zero row); q = rn(clamp(x / s, -127, 127)), with x / s
//   the IEEE fp32 quotient (__fdiv_rn, whatever the compiler's -prec-div), the clamp fmaxf then fminf and
//   rn = __float2int_rn, round to nearest, ties to even (the CPU's nearbyint in the default rounding mode).
//   The row maximum is reduced with fmaxf, which ignores NaN like the CPU's std::max(m, |x|) loop, and max
//   is exact in any order, so s is the CPU's s. (A NaN input quantizes to -127 here; on the CPU its int8 is
//   unspecified.)
// * GEMM. Row-major C[M,N] = A[M,K]·W[N,K]ᵀ is, read column-major, Cᵀ[N,M] = W'ᵀ·A' with W' the
//   column-major [K,N] matrix (ld ldw) and A' the column-major [K,M] matrix (ld lda): cuBLASLt's "TN" form
//   with its A = W (op T), its B = A (op N), m = N, n = M, k = K, CUBLAS_COMPUTE_32I, scale type CUDA_R_32I
//   (alpha = 1, beta = 0 as int32), A/B CUDA_R_8I, C/D CUDA_R_32I. cuBLASLt's IMMA kernels with the regular
//   (column-major) order require (cuBLAS 13 documentation, cublasLtMatmul(), "To use IMMA kernels", set 1):
//   every matrix pointer 4-byte aligned (16 for better performance), the leading dimensions of A, B, C
//   multiples of 4, the TN form, and m and k multiples of 4. This code asks for more, so that the Hopper
//   kernels' 16-byte loads apply: every pointer 16-byte aligned and every leading dimension a multiple of
//   16 bytes (16 int8 elements, 4 int32 elements), N and K multiples of 4. An operand that misses one of
//   these is copied (cudaMemcpy2DAsync) into a zero-padded workspace from the caching allocator: K rounded
//   up to 16 when it is not a multiple of 4 (the extra k terms add 0·0), W given round_up(N, 4) rows (the
//   extra rows of C are 0 and never copied out), row strides of 16 bytes; C is then computed in a padded
//   block and its [M,N] part copied back. int8_padded_gemm_calls() counts those calls.
// * Exactness. Every product is an integer of magnitude <= 2^14 and, for K <= kInt8MaxK = 65536, every
//   partial sum is at most 2^30 in magnitude, so int32 accumulation is exact in any order or split: the
//   result equals the CPU's gemm_s8s8s32_reference bit for bit. K > 65536 is a tg::Error.
// * Fallback. Should cuBLASLt's heuristic find no algorithm for a (padded) problem, a plain kernel (one
//   thread per output, the same exact sums: gemm_s8s8s32_nt_reference) computes C instead, and
//   int8_gemm_fallback_calls() counts it, so a test can tell that cuBLASLt ran.
// * Dequantization. cuBLASLt's int32-output int8 GEMM takes no epilogue, so gemm_s8_dequant writes the
//   int32 product to a workspace and one kernel computes y = ((float(c) · a_scale[m]) · w_scale[n]) + bias[n]
//   with __int2float_rn, __fmul_rn and __fadd_rn: one IEEE rounding per operation in that order, never a
//   fused multiply-add (nvcc contracts a·b + c by default; the intrinsics are never contracted), as the
//   CPU's epilogue compiled with -ffp-contract=off.

/// Quantizes x [M,K] (row stride ldx) per row: scale[m] = max_k |x[m,k]| / 127 (1 for a zero row) and
/// q[m,k] = round-half-even(x[m,k] / scale[m]) clamped to [-127, 127]; q [M,K] has row stride K. The CPU's
/// quant::quantize_rows, bit for bit.
void quantize_rows_int8(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, std::int8_t* q, float* scale);
/// q = round-half-even(x / scale) clamped to [-127, 127] with one host-given scale (> 0 and finite, else a
/// tg::Error); q [M,K] has row stride K. The CPU's quant::quantize_with_scale, bit for bit.
void quantize_int8_with_scale(const float* x, std::int64_t M, std::int64_t K, std::int64_t ldx, float scale,
                              std::int8_t* q);

/// C[M,N] = A[M,K] · W[N,K]ᵀ exactly in int32, row-major (row strides lda, ldw, ldc), through cuBLASLt's
/// int8 GEMM (Note [int8 GEMM on the GPU]). M, N, K >= 0, K <= 65536; lda, ldw >= K and ldc >= N.
void gemm_s8s8s32_nt(std::int64_t M, std::int64_t N, std::int64_t K, const std::int8_t* A, std::int64_t lda,
                     const std::int8_t* W, std::int64_t ldw, std::int32_t* C, std::int64_t ldc);
/// The same product from a plain kernel (one thread per output): what the cuBLASLt path is tested against
/// on the device, and its fallback.
void gemm_s8s8s32_nt_reference(std::int64_t M, std::int64_t N, std::int64_t K, const std::int8_t* A,
                               std::int64_t lda, const std::int8_t* W, std::int64_t ldw, std::int32_t* C,
                               std::int64_t ldc);
/// y[m,n] = float(Σ_k A[m,k]·W[n,k]) · a_scale[m] · w_scale[n] + bias[n] (bias may be null; y row stride
/// ldy >= N): the exact int32 product, then one fp32 rounding per operation in that order, so the result
/// equals the CPU's backend::cpu::gemm_s8_packed_dequant bit for bit.
void gemm_s8_dequant(std::int64_t M, std::int64_t N, std::int64_t K, const std::int8_t* A, std::int64_t lda,
                     const float* a_scale, const std::int8_t* W, std::int64_t ldw, const float* w_scale,
                     const float* bias, float* y, std::int64_t ldy);

/// How many int8 GEMMs in this process ran on zero-padded, realigned copies of an operand or of C (Note
/// [int8 GEMM on the GPU]). 0 without the CUDA backend.
std::int64_t int8_padded_gemm_calls();
/// How many int8 GEMMs fell back to the plain kernel because cuBLASLt had no algorithm. 0 without CUDA.
std::int64_t int8_gemm_fallback_calls();

}  // namespace tg::backend::cuda

// int8 quantizers, the exact int8 x int8 -> int32 GEMM through cuBLASLt's IMMA kernels (zero-padded,
// realigned copies where an operand misses their requirements), its plain fallback kernel, and the fp32
// dequantization: Note [int8 GEMM on the GPU] in detail/cuda/gemm_int8.hpp.
#include <cublasLt.h>

#include <array>
#include <atomic>
#include <cmath>
#include <map>
#include <mutex>
#include <optional>

#include "common.cuh"
#include "cublaslt.cuh"
#include "typegrad/detail/cpu/gemm_int8.hpp"  // kInt8MaxK, shared with the CPU
#include "typegrad/detail/cuda/gemm_int8.hpp"

namespace tg::backend::cuda {

namespace {

using i64 = std::int64_t;
constexpr i64 kMaxK = ::tg::backend::cpu::kInt8MaxK;
constexpr float kQMax = 127.f;

std::atomic<i64> g_padded_calls{0};
std::atomic<i64> g_fallback_calls{0};

// ---- quantizers -------------------------------------------------------------------------------------------

/// q = rn(clamp(x / s, -127, 127)): the IEEE quotient, fmaxf then fminf (the CPU's std::max then std::min for
/// every non-NaN quotient), round to nearest even. |v| <= 127 after the clamp, so the int fits an int8.
__device__ __forceinline__ std::int8_t quantize_one(float x, float s) {
  float v = __fdiv_rn(x, s);
  v = fminf(fmaxf(v, -kQMax), kQMax);
  return static_cast<std::int8_t>(__float2int_rn(v));
}

/// max over the block of v (each >= 0), with fmaxf (a NaN operand is ignored); every thread gets it.
/// blockDim.x is a multiple of 32, at most 1024; `shm` holds 32 floats. max is exact, so the order is free.
__device__ float block_absmax(float v, float* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  __syncthreads();  // shm may still be read for the previous row
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : 0.f;
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

/// One block per row (rows strided over the grid): s = max_k |x[r,k]| / 127 (1 when the max is 0), then q.
__global__ void quantize_rows_kernel(const float* x, i64 M, i64 K, i64 ldx, std::int8_t* q, float* scale) {
  __shared__ float shm[32];
  for (i64 r = blockIdx.x; r < M; r += gridDim.x) {
    const float* xr = x + r * ldx;
    float m = 0.f;  // the CPU's absmax starts at 0 too
    for (i64 k = threadIdx.x; k < K; k += blockDim.x) m = fmaxf(m, fabsf(xr[k]));
    m = block_absmax(m, shm);
    const float s = m > 0.f ? __fdiv_rn(m, kQMax) : 1.f;
    if (threadIdx.x == 0) scale[r] = s;
    std::int8_t* qr = q + r * K;
    for (i64 k = threadIdx.x; k < K; k += blockDim.x) qr[k] = quantize_one(xr[k], s);
  }
}

__global__ void quantize_with_scale_kernel(const float* x, i64 M, i64 K, i64 ldx, float s, std::int8_t* q) {
  TG_GRID_STRIDE(i, M * K) {
    const i64 r = i / K, k = i - r * K;
    q[i] = quantize_one(x[r * ldx + k], s);
  }
}

// ---- the plain GEMM and the dequantization ----------------------------------------------------------------

/// C[m,n] = Σ_k A[m,k]·W[n,k], one thread per output: exact (|partial sums| <= 2^30 for K <= 65536).
__global__ void gemm_s8_nt_reference_kernel(i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* W,
                                            i64 ldw, std::int32_t* C, i64 ldc) {
  TG_GRID_STRIDE(t, M * N) {
    const i64 m = t / N, n = t - m * N;
    const std::int8_t* a = A + m * lda;
    const std::int8_t* w = W + n * ldw;
    std::int32_t s = 0;
    for (i64 k = 0; k < K; ++k) s += static_cast<std::int32_t>(a[k]) * static_cast<std::int32_t>(w[k]);
    C[m * ldc + n] = s;
  }
}

/// y[m,n] = ((float(c[m,n]) · a_scale[m]) · w_scale[n]) + bias[n]: one IEEE rounding per operation, in this
/// order; the _rn intrinsics are never fused into an FMA (Note [int8 GEMM on the GPU]).
__global__ void dequant_kernel(const std::int32_t* c, i64 ldc, const float* a_scale, const float* w_scale,
                               const float* bias, float* y, i64 ldy, i64 M, i64 N) {
  TG_GRID_STRIDE(t, M * N) {
    const i64 m = t / N, n = t - m * N;
    float v = __int2float_rn(c[m * ldc + n]);
    v = __fmul_rn(v, a_scale[m]);
    v = __fmul_rn(v, w_scale[n]);
    if (bias) v = __fadd_rn(v, bias[n]);
    y[m * ldy + n] = v;
  }
}

// ---- cuBLASLt ---------------------------------------------------------------------------------------------

cublasLtHandle_t lt_handle() {
  static std::once_flag once;
  static cublasLtHandle_t h = nullptr;
  std::call_once(once, [] { TG_CUBLAS_CHECK(cublasLtCreate(&h)); });  // a throw leaves the flag unset
  return h;
}

/// The most workspace cuBLASLt may ask for; the call gets exactly what the chosen algorithm needs, from the
/// caching allocator (so after the first call of a shape no cudaMalloc happens).
constexpr std::size_t kLtMaxWorkspace = std::size_t{32} << 20;

/// Largest power of two (up to 256) dividing the address: the alignment the heuristic is told.
std::uint32_t alignment(const void* p) {
  const std::uint64_t a = reinterpret_cast<std::uintptr_t>(p) | 256u;
  return static_cast<std::uint32_t>(a & (~a + 1));
}

// The heuristic's answer per configuration (as Note [cached GEMM algorithms] in gemm.cu): sizes, leading
// dimensions and the operands' alignments are every input of the descriptors and preferences below.
using AlgoCache = detail::LtAlgoCache<9>;
AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}

/// Descriptors destroyed on every path out.
struct LtDescriptors {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t lw = nullptr, la = nullptr, lc = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtDescriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (lw) cublasLtMatrixLayoutDestroy(lw);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

/// Column-major Cᵀ[Np,M] (ld ldc) = op_T(W')[Np,Kp] · A'[Kp,M] in cuBLASLt's TN form (Note [int8 GEMM on the
/// GPU]); every requirement is already met by the caller. Returns false, having enqueued nothing, when the
/// heuristic finds no algorithm.
bool lt_gemm_tn(i64 Np, i64 M, i64 Kp, const std::int8_t* W, i64 ldw, const std::int8_t* A, i64 lda, std::int32_t* C,
                i64 ldc, cudaStream_t stream) {
  const cublasLtHandle_t h = lt_handle();
  LtDescriptors d;
  const cublasOperation_t op_w = CUBLAS_OP_T, op_a = CUBLAS_OP_N;
  TG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&d.desc, CUBLAS_COMPUTE_32I, CUDA_R_32I));
  TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_w, sizeof op_w));
  TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a));
  // W stored row-major [Np, Kp] = column-major [Kp, Np]; A stored row-major [M, Kp] = column-major [Kp, M].
  TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.lw, CUDA_R_8I, static_cast<std::uint64_t>(Kp), static_cast<std::uint64_t>(Np), ldw));
  TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.la, CUDA_R_8I, static_cast<std::uint64_t>(Kp), static_cast<std::uint64_t>(M), lda));
  TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&d.lc, CUDA_R_32I, static_cast<std::uint64_t>(Np), static_cast<std::uint64_t>(M), ldc));
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&d.pref));
  const std::uint64_t max_ws = kLtMaxWorkspace;
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &max_ws, sizeof max_ws));
  const std::uint32_t al_w = alignment(W), al_a = alignment(A), al_c = alignment(C);
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_w, sizeof al_w));
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_a, sizeof al_a));
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c));
  TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c));

  const AlgoCache::Key key = {Np, M, Kp, ldw, lda, ldc, al_w, al_a, al_c};
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  // "No algorithm" (a status or an empty answer) is an answer here: the caller runs the plain kernel.
  algo_cache().get(key, result, found, [&](cublasLtMatmulHeuristicResult_t& r, int& f) {
    return detail::ask_status(cublasLtMatmulAlgoGetHeuristic(h, d.desc, d.lw, d.la, d.lc, d.lc, d.pref, 1, &r, &f), f);
  });
  if (found <= 0) return false;
  std::optional<detail::Workspace> ws;
  if (result.workspaceSize > 0) ws.emplace(result.workspaceSize);  // cudaMalloc'd blocks: 256-byte aligned
  const std::int32_t alpha = 1, beta = 0;  // scale type CUDA_R_32I, host pointer mode
  const cublasStatus_t st = cublasLtMatmul(h, d.desc, &alpha, W, d.lw, A, d.la, &beta, C, d.lc, C, d.lc, &result.algo,
                                           ws ? ws->as<void>() : nullptr, result.workspaceSize, stream);
  if (st == CUBLAS_STATUS_SUCCESS) return true;
  if (!detail::lt_run_declined(st)) TG_CUBLAS_CHECK(st);
  algo_cache().decline(key);  // the algorithm declined (nothing written): the plain kernel, now and next time
  return false;
}

i64 round_up(i64 v, i64 q) { return (v + q - 1) / q * q; }
bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

/// Copies the row-major int8 [rows, width] matrix (row stride from_ld) into the block `to` of
/// [padded_rows, to_ld] bytes and zeroes the rest of the block: columns [width, to_ld) and rows [rows, padded_rows).
void copy_zero_padded(std::int8_t* to, i64 to_ld, i64 padded_rows, const std::int8_t* from, i64 from_ld, i64 rows,
                      i64 width, cudaStream_t stream) {
  if (rows == 1) from_ld = std::max(from_ld, width);  // one row: its stride is never used
  TG_CUDA_CHECK(cudaMemcpy2DAsync(to, static_cast<std::size_t>(to_ld), from, static_cast<std::size_t>(from_ld),
                                  static_cast<std::size_t>(width), static_cast<std::size_t>(rows), cudaMemcpyDeviceToDevice,
                                  stream));
  if (to_ld > width)
    TG_CUDA_CHECK(cudaMemset2DAsync(to + width, static_cast<std::size_t>(to_ld), 0, static_cast<std::size_t>(to_ld - width),
                                    static_cast<std::size_t>(rows), stream));
  if (padded_rows > rows)
    TG_CUDA_CHECK(cudaMemsetAsync(to + rows * to_ld, 0, static_cast<std::size_t>((padded_rows - rows) * to_ld), stream));
}

void check_gemm_args(const char* who, i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* W, i64 ldw,
                     const void* C, i64 ldc) {
  TG_CHECK(M >= 0 && N >= 0 && K >= 0, who, ": sizes must be non-negative, got M = ", M, ", N = ", N, ", K = ", K);
  TG_CHECK(K <= kMaxK, who, ": K = ", K, " exceeds kInt8MaxK = ", kMaxK,
           " (larger K could overflow the int32 sums; split K and add the partial products)");
  if (M > 0 && K > 0) TG_CHECK(A != nullptr && lda >= K, who, ": A is null or lda = ", lda, " < K = ", K);
  if (N > 0 && K > 0) TG_CHECK(W != nullptr && ldw >= K, who, ": W is null or ldw = ", ldw, " < K = ", K);
  if (M > 0 && N > 0) TG_CHECK(C != nullptr && ldc >= N, who, ": the output is null or its row stride ", ldc, " < N = ", N);
}

/// C = A·Wᵀ (arguments checked, M, N > 0). `c_padding_writable`: C's row stride is at least round_up(N, 4) and
/// its columns [N, round_up(N, 4)) may be written (a caller's own workspace), so N % 4 != 0 alone needs no copy of C.
void int8_gemm(i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* W, i64 ldw, std::int32_t* C,
               i64 ldc, bool c_padding_writable) {
  const cudaStream_t stream = detail::stream();
  if (K == 0) {  // the empty sum
    TG_CUDA_CHECK(cudaMemset2DAsync(C, static_cast<std::size_t>(ldc) * sizeof(std::int32_t), 0,
                                    static_cast<std::size_t>(N) * sizeof(std::int32_t), static_cast<std::size_t>(M), stream));
    return;
  }
  // Note [int8 GEMM on the GPU]: cuBLASLt's m = N and k = K multiples of 4; int8 row strides multiples of 16
  // bytes, int32 ones of 4 elements; every pointer 16-byte aligned. What misses goes through a padded copy.
  const bool k_ok = K % 4 == 0;
  const i64 Kp = k_ok ? K : round_up(K, 16);
  const i64 Np = round_up(N, 4);
  const bool fix_a = !k_ok || !aligned16(A) || lda % 16 != 0;
  const bool fix_w = !k_ok || Np != N || !aligned16(W) || ldw % 16 != 0;
  const bool fix_c = !aligned16(C) || ldc % 4 != 0 || (Np != N && !(c_padding_writable && ldc >= Np));
  const i64 lda2 = fix_a ? round_up(Kp, 16) : lda, ldw2 = fix_w ? round_up(Kp, 16) : ldw, ldc2 = fix_c ? Np : ldc;
  std::optional<detail::Workspace> wa, ww, wc;
  const std::int8_t* a2 = A;
  const std::int8_t* w2 = W;
  std::int32_t* c2 = C;
  if (fix_a) {
    wa.emplace(static_cast<std::size_t>(M * lda2));
    copy_zero_padded(wa->as<std::int8_t>(), lda2, M, A, lda, M, K, stream);
    a2 = wa->as<std::int8_t>();
  }
  if (fix_w) {
    ww.emplace(static_cast<std::size_t>(Np * ldw2));
    copy_zero_padded(ww->as<std::int8_t>(), ldw2, Np, W, ldw, N, K, stream);
    w2 = ww->as<std::int8_t>();
  }
  if (fix_c) {
    wc.emplace(static_cast<std::size_t>(M * ldc2) * sizeof(std::int32_t));
    c2 = wc->as<std::int32_t>();
  }
  if (!lt_gemm_tn(Np, M, Kp, w2, ldw2, a2, lda2, c2, ldc2, stream)) {
    // No cuBLASLt algorithm: the plain kernel on the caller's operands (any strides and alignment).
    g_fallback_calls.fetch_add(1);
    gemm_s8_nt_reference_kernel<<<detail::grid_for(M * N), detail::kThreads, 0, stream>>>(M, N, K, A, lda, W, ldw, C, ldc);
    TG_CUDA_LAUNCHED();
    return;
  }
  if (fix_c)
    TG_CUDA_CHECK(cudaMemcpy2DAsync(C, static_cast<std::size_t>(ldc) * sizeof(std::int32_t), c2,
                                    static_cast<std::size_t>(ldc2) * sizeof(std::int32_t),
                                    static_cast<std::size_t>(N) * sizeof(std::int32_t), static_cast<std::size_t>(M),
                                    cudaMemcpyDeviceToDevice, stream));
  if (fix_a || fix_w || fix_c) g_padded_calls.fetch_add(1);
  // The workspaces go back to the current stream's free list here: reuse is ordered after this work.
}

}  // namespace

void quantize_rows_int8(const float* x, i64 M, i64 K, i64 ldx, std::int8_t* q, float* scale) {
  TG_CHECK(M >= 0 && K >= 0, "quantize_rows_int8: sizes must be non-negative, got M = ", M, ", K = ", K);
  if (M == 0) return;
  TG_CHECK(scale != nullptr, "quantize_rows_int8: scale is null");
  if (K > 0) TG_CHECK(x != nullptr && q != nullptr && ldx >= K, "quantize_rows_int8: x or q is null or ldx = ", ldx, " < K = ", K);
  const unsigned blocks = static_cast<unsigned>(std::min<i64>(M, 65535LL * 16));
  quantize_rows_kernel<<<blocks, detail::row_threads(K), 0, detail::stream()>>>(x, M, K, ldx, q, scale);
  TG_CUDA_LAUNCHED();
}

void quantize_int8_with_scale(const float* x, i64 M, i64 K, i64 ldx, float scale, std::int8_t* q) {
  TG_CHECK(std::isfinite(scale) && scale > 0.f, "quantize_int8_with_scale: the scale must be positive and finite, got ", scale);
  TG_CHECK(M >= 0 && K >= 0, "quantize_int8_with_scale: sizes must be non-negative, got M = ", M, ", K = ", K);
  if (M == 0 || K == 0) return;
  TG_CHECK(x != nullptr && q != nullptr && ldx >= K, "quantize_int8_with_scale: x or q is null or ldx = ", ldx, " < K = ", K);
  quantize_with_scale_kernel<<<detail::grid_for(M * K), detail::kThreads, 0, detail::stream()>>>(x, M, K, ldx, scale, q);
  TG_CUDA_LAUNCHED();
}

void gemm_s8s8s32_nt(i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* W, i64 ldw, std::int32_t* C,
                     i64 ldc) {
  check_gemm_args("gemm_s8s8s32_nt", M, N, K, A, lda, W, ldw, C, ldc);
  if (M == 0 || N == 0) return;
  int8_gemm(M, N, K, A, lda, W, ldw, C, ldc, /*c_padding_writable=*/false);
}

void gemm_s8s8s32_nt_reference(i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* W, i64 ldw,
                               std::int32_t* C, i64 ldc) {
  check_gemm_args("gemm_s8s8s32_nt_reference", M, N, K, A, lda, W, ldw, C, ldc);
  if (M == 0 || N == 0) return;
  gemm_s8_nt_reference_kernel<<<detail::grid_for(M * N), detail::kThreads, 0, detail::stream()>>>(M, N, K, A, lda, W, ldw,
                                                                                                  C, ldc);
  TG_CUDA_LAUNCHED();
}

void gemm_s8_dequant(i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const float* a_scale, const std::int8_t* W,
                     i64 ldw, const float* w_scale, const float* bias, float* y, i64 ldy) {
  check_gemm_args("gemm_s8_dequant", M, N, K, A, lda, W, ldw, y, ldy);
  if (M == 0 || N == 0) return;
  TG_CHECK(a_scale != nullptr && w_scale != nullptr, "gemm_s8_dequant: a_scale and w_scale must not be null");
  // The int32 product in a workspace whose rows have room for the padded N (16-byte row strides).
  const i64 ldc = round_up(N, 4);
  const detail::Workspace wc(static_cast<std::size_t>(M * ldc) * sizeof(std::int32_t));
  int8_gemm(M, N, K, A, lda, W, ldw, wc.as<std::int32_t>(), ldc, /*c_padding_writable=*/true);
  dequant_kernel<<<detail::grid_for(M * N), detail::kThreads, 0, detail::stream()>>>(wc.as<std::int32_t>(), ldc, a_scale,
                                                                                    w_scale, bias, y, ldy, M, N);
  TG_CUDA_LAUNCHED();
}

std::int64_t int8_padded_gemm_calls() { return g_padded_calls.load(); }
std::int64_t int8_gemm_fallback_calls() { return g_fallback_calls.load(); }

}  // namespace tg::backend::cuda

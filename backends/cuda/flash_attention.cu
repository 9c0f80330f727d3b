// Fused causal attention on tensor cores for 16-bit storage (Note [flash attention on the GPU]): the T×T
// scores and probabilities live in shared memory one tile at a time, never in global memory. gemm.cu's
// attention_forward / attention_backward call these first and keep the composite (batched GEMMs and a
// softmax kernel) for fp32 and fp64, for head sizes other than 64 and 128, and when TG_CUDA_ATTENTION is
// "composite".
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "flash_attention.cuh"

namespace tg::backend::cuda {

// Note [flash attention on the GPU]
// Inputs: heads of [Tn, hs] rows, T = bf16 or fp16, hs 64 or 128, placed by a Heads layout (row t of head
// (b, h) at b·batch + h·head + t·row): BH contiguous heads for causal_attention, or the heads packed in a fused
// QKV projection's [B, Tn, 3, H, hs] output (and out, dout in [B, Tn, H, hs]) for causal_attention_qkv, read and
// written in place with no layout copy. The lse and the row sums D are fp32, [B·H, Tn]. Scores are computed with WMMA 16x16x16 tiles (fp32 accumulators)
// from tiles staged in shared memory; each of a block's 4 warps owns 16 rows of the tile, so the softmax of a
// row and its output accumulator belong to one warp (no block barrier between the two GEMMs of a step).
//
// Forward (one block per (head, 64 query rows)): for each key tile of 64 up to the diagonal,
//   S = scale·Q·Kᵀ, masked (j > i under the causal mask, j >= Tn) to −inf; m' = max(m, rowmax S);
//   P = exp(S − m') rounded to T (the composite also multiplies P in T); l = l·exp(m − m') + rowsum(P);
//   O = O·exp(m − m') + P·V.
// Then out = O / l and lse = m + log l (the composite's lse: the log-sum-exp of the scaled, masked scores).
// Backward, deterministic (no atomics; FlashAttention-2's schedule split in two kernels so that each output
// tile has one writer): D_i = Σ_c dO[i,c]·O[i,c] per row; then
//   dK/dV kernel, one block per (head, 64 keys): over the query tiles at or after the keys, recompute
//     Sᵀ = scale·K·Qᵀ and Pᵀ = exp(Sᵀ − lse), dPᵀ = V·dOᵀ, dSᵀ = scale·Pᵀ∘(dPᵀ − D);
//     dV += Pᵀ·dO, dK += dSᵀ·Q;
//   dQ kernel, one block per (head, 64 queries): over the key tiles up to the diagonal, recompute P and dP
//     the same way and dQ += dS·K.
// Each kernel sums its tiles in a fixed order, so results are reproducible run to run. They equal the
// composite's up to rounding (the composite rounds P and dS to T for its GEMMs too; here the fp32 partial
// sums are grouped by tile). The op database's CUDA-vs-CPU entries for causal_attention check both paths.

namespace {

using namespace nvcuda;

template <class T>
struct WmmaType;
template <>
struct WmmaType<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct WmmaType<fp16> {
  using type = __half;
};

constexpr int kWarps = 4;               // warps per block; each owns 16 rows of the block's tile
constexpr int kRows = 16 * kWarps;      // rows per block (queries in forward and dQ, keys in dK/dV)
constexpr int kBlockThreads = 32 * kWarps;

/// Byte offsets into dynamic shared memory, each buffer 128-byte aligned (WMMA needs 32).
constexpr std::size_t align128(std::size_t b) { return (b + 127) / 128 * 128; }

/// Where the heads' rows are: row t of head (b, h) starts at b·batch + h·head + t·row elements from the base
/// pointer (contiguous [B·H, Tn, hs] heads: {Tn·hs, 0, hs} with H = 1; a fused QKV projection's q part:
/// {Tn·3C, hs, 3C}).
struct Heads {
  std::int64_t batch, head, row;
};

__device__ __forceinline__ std::int64_t head_offset(const Heads& l, std::int64_t bh, std::int64_t H) {
  return (bh / H) * l.batch + (bh % H) * l.head;
}

/// Copies rows [r0, r0 + rows) of a head (rows `ld` elements apart) into a [rows, HS] tile (16-byte vectors),
/// zeros past Tn.
template <class T, int HS>
__device__ void load_tile(T* dst, const T* src, std::int64_t ld, std::int64_t r0, int rows, std::int64_t Tn) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kPerRow = HS / kVec;
  const int n = rows * kPerRow;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int r = idx / kPerRow, c = idx % kPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < Tn) v = reinterpret_cast<const uint4*>(src + (r0 + r) * ld)[c];
    reinterpret_cast<uint4*>(dst + r * HS)[c] = v;
  }
}

template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, typename WmmaType<T>::type, wmma::row_major>;
template <class T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, typename WmmaType<T>::type, wmma::row_major>;
template <class T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, typename WmmaType<T>::type, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <class T>
__device__ const typename WmmaType<T>::type* wp(const T* p) {
  return reinterpret_cast<const typename WmmaType<T>::type*>(p);
}

/// C[16, N] (fp32, row-major, ld ldc) = A[16, HS] · Bᵀ with B [N, HS] row-major: A's 16 rows against N rows
/// of B (N a multiple of 16), both tiles in shared memory with leading dimension HS.
template <class T, int HS, int N>
__device__ void rows_times_rows_t(const T* a, const T* b, float* c, int ldc) {
  FragA<T> fa;
  FragBCol<T> fb;
  FragC fc;
#pragma unroll
  for (int n = 0; n < N / 16; ++n) {
    wmma::fill_fragment(fc, 0.f);
#pragma unroll
    for (int k = 0; k < HS / 16; ++k) {
      wmma::load_matrix_sync(fa, wp(a + k * 16), HS);
      wmma::load_matrix_sync(fb, wp(b + n * 16 * HS + k * 16), HS);  // Bᵀ(k, n) = B[n][k]: column-major
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(c + n * 16, fc, ldc, wmma::mem_row_major);
  }
}

/// C[16, HS] (fp32, row-major, ld HS, in shared memory) += A[16, K] (T, row-major, ld K) · B[K, HS] (T,
/// row-major, ld HS).
template <class T, int HS, int K>
__device__ void accumulate_rows(const T* a, const T* b, float* c) {
  FragA<T> fa;
  FragBRow<T> fb;
  FragC fc;
#pragma unroll
  for (int n = 0; n < HS / 16; ++n) {
    wmma::load_matrix_sync(fc, c + n * 16, HS, wmma::mem_row_major);
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
      wmma::load_matrix_sync(fa, wp(a + k * 16), K);
      wmma::load_matrix_sync(fb, wp(b + k * 16 * HS + n * 16), HS);
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(c + n * 16, fc, HS, wmma::mem_row_major);
  }
}

// ---- forward ------------------------------------------------------------------------------------------------
template <int HS>
struct FwdSmem {
  static constexpr int kCols = 64;  // keys per step
  static constexpr std::size_t q = 0;
  static constexpr std::size_t k = q + align128(kRows * HS * 2);
  static constexpr std::size_t v = k + align128(kCols * HS * 2);
  static constexpr std::size_t s = v + align128(kCols * HS * 2);
  static constexpr std::size_t p = s + align128(kRows * kCols * 4);
  static constexpr std::size_t o = p + align128(kRows * kCols * 2);
  static constexpr std::size_t stats = o + align128(kRows * HS * 4);  // m, l per row
  static constexpr std::size_t bytes = stats + align128(2 * kRows * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_forward_kernel(const T* q, const T* k, const T* v, Heads in,
                                                                      T* out, Heads io, float* lse, std::int64_t H,
                                                                      std::int64_t Tn, float scale, bool causal) {
  using L = FwdSmem<HS>;
  constexpr int C = L::kCols;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  float* ss = reinterpret_cast<float*>(smem + L::s);
  T* ps = reinterpret_cast<T*>(smem + L::p);
  float* os = reinterpret_cast<float*>(smem + L::o);
  float* ms = reinterpret_cast<float*>(smem + L::stats);
  float* ls = ms + kRows;

  const std::int64_t head = blockIdx.y, q0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(qs, q + base, in.row, q0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) os[i] = 0.f;
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
    ms[i] = -INFINITY;
    ls[i] = 0.f;
  }
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  for (std::int64_t k0 = 0; k0 < kend; k0 += C) {
    __syncthreads();  // the previous step's K, V are no longer read
    load_tile<T, HS>(ks, k + base, in.row, k0, C, Tn);
    load_tile<T, HS>(vs, v + base, in.row, k0, C, Tn);
    __syncthreads();
    rows_times_rows_t<T, HS, C>(qs + r0 * HS, ks, ss + r0 * C, C);
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
      const int row = r0 + rr;
      const std::int64_t i = q0 + row;
      float sv[C / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < C / 32; ++t) {
        const int c = lane + 32 * t;
        const std::int64_t j = k0 + c;
        const bool ok = j < Tn && (!causal || j <= i);
        sv[t] = ok ? ss[row * C + c] * scale : -INFINITY;
        mx = (sv[t] > mx || sv[t] != sv[t]) ? sv[t] : mx;  // NaN wins and stays (fmaxf would drop it)
      }
      mx = detail::warp_max(mx);
      // A NaN score makes the row NaN, as in the composite and on the CPU: with fmaxf a NaN in a row whose
      // other keys are masked gave m_new = -inf, and the row was treated as having no valid key (output 0).
      const float m_old = ms[row], m_new = (mx != mx || m_old != m_old) ? NAN : fmaxf(m_old, mx);
      // a row with no valid key so far (only rows past Tn): keep everything at zero
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m_old - m_new);
      float sum = 0.f;  // of the unrounded values: lse is the exact log-sum-exp, as the composite's
#pragma unroll
      for (int t = 0; t < C / 32; ++t) {
        const float pv = m_new == -INFINITY ? 0.f : __expf(sv[t] - m_new);
        ps[row * C + lane + 32 * t] = scalar_cast<T>(pv);
        sum += pv;
      }
      sum = detail::warp_sum(sum);
#pragma unroll
      for (int c = lane; c < HS; c += 32) os[row * HS + c] *= alpha;
      __syncwarp();
      if (lane == 0) {
        ms[row] = m_new;
        ls[row] = ls[row] * alpha + sum;
      }
    }
    __syncwarp();
    accumulate_rows<T, HS, C>(ps + r0 * C, vs, os + r0 * HS);
    __syncwarp();
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int row = r0 + rr;
    const std::int64_t i = q0 + row;
    if (i >= Tn) break;
    const float l = ls[row], inv = l > 0.f ? 1.f / l : 0.f;
    for (int c = lane; c < HS; c += 32) out[obase + i * io.row + c] = scalar_cast<T>(os[row * HS + c] * inv);
    if (lane == 0) lse[head * Tn + i] = ms[row] + logf(l);
  }
}

// ---- backward -----------------------------------------------------------------------------------------------
/// D[bh·Tn + t] = Σ_c dout[t, c]·out[t, c] over the rows of every head (layout io), one warp per row.
template <class T>
__global__ void row_dot_kernel(const T* dout, const T* out, Heads io, float* d, std::int64_t H, std::int64_t Tn,
                               std::int64_t rows, int hs) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const std::int64_t off = head_offset(io, r / Tn, H) + (r % Tn) * io.row;
    float s = 0.f;
    for (int c = threadIdx.x & 31; c < hs; c += 32) s += scalar_cast<float>(dout[off + c]) * scalar_cast<float>(out[off + c]);
    s = detail::warp_sum(s);
    if ((threadIdx.x & 31) == 0) d[r] = s;
  }
}

/// dK/dV: one block per (head, 64 keys); query tiles of BQ rows.
template <int HS>
struct DkvSmem {
  static constexpr int kQ = HS == 64 ? 64 : 32;  // queries per step
  static constexpr std::size_t k = 0;
  static constexpr std::size_t v = k + align128(kRows * HS * 2);
  static constexpr std::size_t q = v + align128(kRows * HS * 2);
  static constexpr std::size_t dout = q + align128(kQ * HS * 2);
  static constexpr std::size_t st = dout + align128(kQ * HS * 2);   // Sᵀ [64 keys, kQ] fp32
  static constexpr std::size_t dpt = st + align128(kRows * kQ * 4);  // dPᵀ
  static constexpr std::size_t pt = dpt + align128(kRows * kQ * 4);  // Pᵀ in T
  static constexpr std::size_t dst = pt + align128(kRows * kQ * 2);  // dSᵀ in T
  static constexpr std::size_t dk = dst + align128(kRows * kQ * 2);  // fp32 accumulators
  static constexpr std::size_t dv = dk + align128(kRows * HS * 4);
  static constexpr std::size_t rows = dv + align128(kRows * HS * 4);  // lse, D of the query tile
  static constexpr std::size_t bytes = rows + align128(2 * kQ * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_backward_dkdv_kernel(
    const T* q, const T* k, const T* v, Heads in, const T* dout, Heads io, const float* lse, const float* dvec, T* dk,
    T* dv, std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  using L = DkvSmem<HS>;
  constexpr int Q = L::kQ;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  float* st = reinterpret_cast<float*>(smem + L::st);
  float* dpt = reinterpret_cast<float*>(smem + L::dpt);
  T* pt = reinterpret_cast<T*>(smem + L::pt);
  T* dst = reinterpret_cast<T*>(smem + L::dst);
  float* dks = reinterpret_cast<float*>(smem + L::dk);
  float* dvs = reinterpret_cast<float*>(smem + L::dv);
  float* lses = reinterpret_cast<float*>(smem + L::rows);
  float* ds = lses + Q;

  const std::int64_t head = blockIdx.y, k0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(ks, k + base, in.row, k0, kRows, Tn);
  load_tile<T, HS>(vs, v + base, in.row, k0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) dks[i] = dvs[i] = 0.f;
  const std::int64_t qstart = causal ? k0 / Q * Q : 0;
  for (std::int64_t q0 = qstart; q0 < Tn; q0 += Q) {
    __syncthreads();  // the previous step's Q, dO tiles are no longer read
    load_tile<T, HS>(qs, q + base, in.row, q0, Q, Tn);
    load_tile<T, HS>(dos, dout + obase, io.row, q0, Q, Tn);
    for (int i = threadIdx.x; i < Q; i += blockDim.x) {
      const bool inside = q0 + i < Tn;
      lses[i] = inside ? lse[head * Tn + q0 + i] : 0.f;
      ds[i] = inside ? dvec[head * Tn + q0 + i] : 0.f;
    }
    __syncthreads();
    rows_times_rows_t<T, HS, Q>(ks + r0 * HS, qs, st + r0 * Q, Q);     // Sᵀ = K·Qᵀ (unscaled)
    rows_times_rows_t<T, HS, Q>(vs + r0 * HS, dos, dpt + r0 * Q, Q);   // dPᵀ = V·dOᵀ
    __syncwarp();
    for (int e = lane; e < 16 * Q; e += 32) {
      const int rr = e / Q, c = e % Q, row = r0 + rr;
      const std::int64_t j = k0 + row, i = q0 + c;
      const bool ok = i < Tn && j < Tn && (!causal || j <= i);
      const float p = ok ? __expf(st[row * Q + c] * scale - lses[c]) : 0.f;
      const T pr = scalar_cast<T>(p);
      pt[row * Q + c] = pr;
      dst[row * Q + c] = scalar_cast<T>(ok ? scale * scalar_cast<float>(pr) * (dpt[row * Q + c] - ds[c]) : 0.f);
    }
    __syncwarp();
    accumulate_rows<T, HS, Q>(pt + r0 * Q, dos, dvs + r0 * HS);   // dV += Pᵀ·dO
    accumulate_rows<T, HS, Q>(dst + r0 * Q, qs, dks + r0 * HS);   // dK += dSᵀ·Q
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * HS; idx += blockDim.x) {
    const int row = idx / HS;
    if (k0 + row >= Tn) continue;
    dk[base + (k0 + row) * in.row + idx % HS] = scalar_cast<T>(dks[idx]);
    dv[base + (k0 + row) * in.row + idx % HS] = scalar_cast<T>(dvs[idx]);
  }
}

/// dQ: one block per (head, 64 queries); key tiles of 64.
template <int HS>
struct DqSmem {
  static constexpr int kCols = 64;
  static constexpr std::size_t q = 0;
  static constexpr std::size_t dout = q + align128(kRows * HS * 2);
  static constexpr std::size_t k = dout + align128(kRows * HS * 2);
  static constexpr std::size_t v = k + align128(kCols * HS * 2);
  static constexpr std::size_t s = v + align128(kCols * HS * 2);    // S [64 queries, 64 keys] fp32
  static constexpr std::size_t dp = s + align128(kRows * kCols * 4);
  static constexpr std::size_t ds = dp + align128(kRows * kCols * 4);  // dS in T
  static constexpr std::size_t dq = ds + align128(kRows * kCols * 2);
  static constexpr std::size_t rows = dq + align128(kRows * HS * 4);
  static constexpr std::size_t bytes = rows + align128(2 * kRows * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_backward_dq_kernel(
    const T* q, const T* k, const T* v, Heads in, const T* dout, Heads io, const float* lse, const float* dvec, T* dq,
    std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  using L = DqSmem<HS>;
  constexpr int C = L::kCols;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  float* ss = reinterpret_cast<float*>(smem + L::s);
  float* dps = reinterpret_cast<float*>(smem + L::dp);
  T* dss = reinterpret_cast<T*>(smem + L::ds);
  float* dqs = reinterpret_cast<float*>(smem + L::dq);
  float* lses = reinterpret_cast<float*>(smem + L::rows);
  float* dsum = lses + kRows;

  const std::int64_t head = blockIdx.y, q0 = static_cast<std::int64_t>(blockIdx.x) * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(qs, q + base, in.row, q0, kRows, Tn);
  load_tile<T, HS>(dos, dout + obase, io.row, q0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) dqs[i] = 0.f;
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
    const bool inside = q0 + i < Tn;
    lses[i] = inside ? lse[head * Tn + q0 + i] : 0.f;
    dsum[i] = inside ? dvec[head * Tn + q0 + i] : 0.f;
  }
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  for (std::int64_t k0 = 0; k0 < kend; k0 += C) {
    __syncthreads();
    load_tile<T, HS>(ks, k + base, in.row, k0, C, Tn);
    load_tile<T, HS>(vs, v + base, in.row, k0, C, Tn);
    __syncthreads();
    rows_times_rows_t<T, HS, C>(qs + r0 * HS, ks, ss + r0 * C, C);    // S = Q·Kᵀ (unscaled)
    rows_times_rows_t<T, HS, C>(dos + r0 * HS, vs, dps + r0 * C, C);  // dP = dO·Vᵀ
    __syncwarp();
    for (int e = lane; e < 16 * C; e += 32) {
      const int rr = e / C, c = e % C, row = r0 + rr;
      const std::int64_t i = q0 + row, j = k0 + c;
      const bool ok = i < Tn && j < Tn && (!causal || j <= i);
      const float p = ok ? scalar_cast<float>(scalar_cast<T>(__expf(ss[row * C + c] * scale - lses[row]))) : 0.f;
      dss[row * C + c] = scalar_cast<T>(ok ? scale * p * (dps[row * C + c] - dsum[row]) : 0.f);
    }
    __syncwarp();
    accumulate_rows<T, HS, C>(dss + r0 * C, ks, dqs + r0 * HS);  // dQ += dS·K
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const std::int64_t i = q0 + r0 + rr;
    if (i >= Tn) break;
    for (int c = lane; c < HS; c += 32) dq[base + i * in.row + c] = scalar_cast<T>(dqs[(r0 + rr) * HS + c]);
  }
}

/// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per device (`done`
/// holds a bit per device ordinal below 64; higher ordinals set it on every call).
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes, std::atomic<std::uint64_t>& done) {
  int dev = 0;
  TG_CUDA_CHECK(cudaGetDevice(&dev));
  const std::uint64_t bit = dev >= 0 && dev < 64 ? std::uint64_t{1} << dev : 0;
  if (bit && (done.load() & bit)) return;
  TG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.fetch_or(bit);
}

/// Whether the fused kernels may run: TG_CUDA_ATTENTION=composite turns them off at start, set_flash_attention
/// at any time.
std::atomic<bool>& flash_enabled() {
  static std::atomic<bool> on{[] {
    const char* e = std::getenv("TG_CUDA_ATTENTION");
    return !(e && std::strcmp(e, "composite") == 0);
  }()};
  return on;
}

std::atomic<std::int64_t> g_flash_calls{0};

template <class T, int HS>
void forward_hs(const T* q, const T* k, const T* v, Heads in, T* out, Heads io, float* lse, std::int64_t B,
                std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  static std::atomic<std::uint64_t> ready{0};
  allow_smem(flash_forward_kernel<T, HS>, FwdSmem<HS>::bytes, ready);
  const dim3 grid(static_cast<unsigned>((Tn + kRows - 1) / kRows), static_cast<unsigned>(B * H));
  flash_forward_kernel<T, HS><<<grid, kBlockThreads, FwdSmem<HS>::bytes, detail::stream()>>>(q, k, v, in, out, io, lse,
                                                                                            H, Tn, scale, causal);
  TG_CUDA_LAUNCHED();
}

template <class T, int HS>
void backward_hs(const T* q, const T* k, const T* v, Heads in, const T* out, const T* dout, Heads io, const float* lse,
                 T* dq, T* dk, T* dv, std::int64_t B, std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  static std::atomic<std::uint64_t> ready_dkdv{0}, ready_dq{0};
  allow_smem(flash_backward_dkdv_kernel<T, HS>, DkvSmem<HS>::bytes, ready_dkdv);
  allow_smem(flash_backward_dq_kernel<T, HS>, DqSmem<HS>::bytes, ready_dq);
  const std::int64_t rows = B * H * Tn;
  detail::Workspace wd(static_cast<std::size_t>(rows) * sizeof(float));
  float* d = wd.as<float>();
  row_dot_kernel<T><<<static_cast<unsigned>(std::min<std::int64_t>((rows + 7) / 8, 65535LL * 8)), 256, 0, detail::stream()>>>(
      dout, out, io, d, H, Tn, rows, static_cast<int>(HS));
  TG_CUDA_LAUNCHED();
  const dim3 grid(static_cast<unsigned>((Tn + kRows - 1) / kRows), static_cast<unsigned>(B * H));
  flash_backward_dkdv_kernel<T, HS><<<grid, kBlockThreads, DkvSmem<HS>::bytes, detail::stream()>>>(
      q, k, v, in, dout, io, lse, d, dk, dv, H, Tn, scale, causal);
  TG_CUDA_LAUNCHED();
  flash_backward_dq_kernel<T, HS><<<grid, kBlockThreads, DqSmem<HS>::bytes, detail::stream()>>>(
      q, k, v, in, dout, io, lse, d, dq, H, Tn, scale, causal);
  TG_CUDA_LAUNCHED();
}

template <class T>
constexpr bool kSixteenBit = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

/// Whether every pointer allows the 16-byte vector loads (fresh allocations do; a view at an odd offset may not).
template <class... P>
bool aligned16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

/// The dynamic shared memory a block may opt in to on the current device (cached per device ordinal below 64).
std::size_t smem_optin_limit() {
  static std::atomic<int> limits[64] = {};
  int dev = 0;
  TG_CUDA_CHECK(cudaGetDevice(&dev));
  const bool cached = dev >= 0 && dev < 64;
  if (cached)
    if (const int v = limits[dev].load(); v > 0) return static_cast<std::size_t>(v);
  int v = 0;
  TG_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (cached) limits[dev].store(v);
  return static_cast<std::size_t>(v);
}

/// Whether the fused kernels may run. Their tiles need up to 137 KiB of shared memory per block (hs 128's
/// backward; Note [flash attention on the GPU]): GPUs that allow less (99 KiB on sm_86 / sm_89 / sm_120) run
/// the composite for the kernels that do not fit, forward and backward deciding separately (their lse
/// agree).
bool usable(std::int64_t BH, std::int64_t Tn, std::int64_t hs, bool backward) {
  if (!(BH > 0 && Tn > 0 && (hs == 64 || hs == 128) && BH <= 65535 && flash_enabled().load())) return false;
  const std::size_t need =
      backward ? (hs == 64 ? std::max(DkvSmem<64>::bytes, DqSmem<64>::bytes) : std::max(DkvSmem<128>::bytes, DqSmem<128>::bytes))
               : (hs == 64 ? FwdSmem<64>::bytes : FwdSmem<128>::bytes);
  return need <= smem_optin_limit();
}

}  // namespace

std::int64_t flash_attention_calls() { return g_flash_calls.load(); }
void set_flash_attention(bool enabled) { flash_enabled().store(enabled); }
bool flash_attention_enabled() { return flash_enabled().load(); }

namespace {
/// The fused kernels over heads at layouts `in` (q, k, v and their gradients) and `io` (out and dout).
template <class T>
bool forward_any(const T* q, const T* k, const T* v, Heads in, T* out, Heads io, float* lse, std::int64_t B,
                 std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  const auto s = static_cast<float>(scale);
  if (hs == 64) forward_hs<T, 64>(q, k, v, in, out, io, lse, B, H, Tn, s, causal);
  else forward_hs<T, 128>(q, k, v, in, out, io, lse, B, H, Tn, s, causal);
  g_flash_calls.fetch_add(1);
  return true;
}
template <class T>
bool backward_any(const T* q, const T* k, const T* v, Heads in, const T* out, const T* dout, Heads io,
                  const float* lse, T* dq, T* dk, T* dv, std::int64_t B, std::int64_t H, std::int64_t Tn,
                  std::int64_t hs, double scale, bool causal) {
  const auto s = static_cast<float>(scale);
  if (hs == 64) backward_hs<T, 64>(q, k, v, in, out, dout, io, lse, dq, dk, dv, B, H, Tn, s, causal);
  else backward_hs<T, 128>(q, k, v, in, out, dout, io, lse, dq, dk, dv, B, H, Tn, s, causal);
  g_flash_calls.fetch_add(1);
  return true;
}
/// Row and head strides whose 16-bit elements keep 16-byte vectors aligned.
bool strides16(const Heads& l) { return l.batch % 8 == 0 && l.head % 8 == 0 && l.row % 8 == 0; }
}  // namespace

template <class T>
bool flash_attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH,
                             std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    if (!usable(BH, Tn, hs, false) || !aligned16(q, k, v, out)) return false;
    const Heads l{Tn * hs, 0, hs};  // BH heads of [Tn, hs], one after another
    return forward_any<T>(q, k, v, l, out, l, lse, BH, 1, Tn, hs, scale, causal);
  }
}

template <class T>
bool flash_attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse,
                              T* dq, T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale,
                              bool causal) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    if (!usable(BH, Tn, hs, true) || !aligned16(q, k, v, out, dout, dq, dk, dv)) return false;
    const Heads l{Tn * hs, 0, hs};
    return backward_any<T>(q, k, v, l, out, dout, l, lse, dq, dk, dv, BH, 1, Tn, hs, scale, causal);
  }
}

template <class T>
bool flash_attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H,
                                 std::int64_t Tn, std::int64_t hs, double scale) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const std::int64_t C = H * hs;
    const Heads in{Tn * 3 * C, hs, 3 * C}, io{Tn * C, hs, C};
    if (!usable(B * H, Tn, hs, false) || !aligned16(qkv, out) || !strides16(in) || !strides16(io)) return false;
    return forward_any<T>(qkv, qkv + C, qkv + 2 * C, in, out, io, lse, B, H, Tn, hs, scale, true);
  }
}

template <class T>
bool flash_attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv,
                                  std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const std::int64_t C = H * hs;
    const Heads in{Tn * 3 * C, hs, 3 * C}, io{Tn * C, hs, C};
    if (!usable(B * H, Tn, hs, true) || !aligned16(qkv, out, dout, dqkv) || !strides16(in) || !strides16(io)) return false;
    return backward_any<T>(qkv, qkv + C, qkv + 2 * C, in, out, dout, io, lse, dqkv, dqkv + C, dqkv + 2 * C, B, H, Tn, hs,
                           scale, true);
  }
}

#define TG_FLASH_INSTANTIATE(T)                                                                                   \
  template bool flash_attention_forward<T>(const T*, const T*, const T*, T*, accum_t<T>*, std::int64_t,          \
                                           std::int64_t, std::int64_t, double, bool);                            \
  template bool flash_attention_backward<T>(const T*, const T*, const T*, const T*, const T*, const accum_t<T>*, \
                                            T*, T*, T*, std::int64_t, std::int64_t, std::int64_t, double, bool); \
  template bool flash_attention_qkv_forward<T>(const T*, T*, accum_t<T>*, std::int64_t, std::int64_t,           \
                                               std::int64_t, std::int64_t, double);                              \
  template bool flash_attention_qkv_backward<T>(const T*, const T*, const T*, const accum_t<T>*, T*,            \
                                                std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);
TG_FLASH_INSTANTIATE(double)
TG_FLASH_INSTANTIATE(float)
TG_FLASH_INSTANTIATE(::tg::bf16)
TG_FLASH_INSTANTIATE(::tg::fp16)
#undef TG_FLASH_INSTANTIATE

}  // namespace tg::backend::cuda

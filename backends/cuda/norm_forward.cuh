// The LayerNorm / RMSNorm forward over rows of whole 16-byte packs (Note [norm forward in packs]), shared by
// layernorm_forward / rmsnorm_forward (nn.cu) and add_layernorm_forward (add_layernorm.cu): one kernel body, so the
// fused residual add + LayerNorm computes what `add` then `layernorm` compute, bit for bit. A private header of
// the CUDA backend. With TG_ROWS_EMULATED defined it leaves out common.cuh and the launcher (the host side of CUDA):
// the includer supplies detail::acc_t, detail::warp_sum, scalar_cast and the CUDA built-ins, as
// tests/cuda/test_rows_emulated.cpp does to run the kernel's body, unchanged, on the CPU.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#ifndef TG_ROWS_EMULATED
#include "common.cuh"
#endif

namespace tg::backend::cuda::detail {

// Note [norm forward in packs]
// When a row is at least one 16-byte pack per lane of a warp (n a multiple of V = 16 / sizeof(T) and n >= 32 V) and
// the normalized input, the output, the weight and the bias are 16-byte aligned, a warp takes a row: lane l owns
// packs l, l + 32, l + 64, ... and sums its elements in that order, the warp adds the 32 lane sums with a butterfly
// of shuffles (every lane gets the same total: warp_sum), and three passes (the mean, the centred variance, the
// output) read the row in 16-byte loads, the later two from cache. There is no shared memory and no block barrier;
// the block-per-row kernels (nn.cu's norm_forward_kernel, add_layernorm.cu's) read one element per thread and load
// instruction, and reduce through shared memory with four barriers per row.
// add_layernorm's first pass writes the sum h = x + r (rounded to T) in packs and sums the values it stored; each
// lane reads its own writes back in the later passes. It reads x and r in packs when both are aligned and element by
// element otherwise (the same elements, in the same order), so the path depends only on what the fused op and the
// unfused pair share: n and the alignment of h (the add's output, which the layernorm reads), y, w and b. `add` then
// `layernorm` over the same rows therefore take the same path, and the two passes after the sum are this one body.
// Other rows take the block-per-row kernels. Not yet run on a GPU (docs/cuda.md).
constexpr int kNormRowWarps = 4;
constexpr unsigned kMaxNormRowBlocks = 65535u * 8u;

template <class T>
struct alignas(16) NormPack {
  T v[16 / sizeof(T)];
};

/// Whether rows of n elements take the packed kernel, given every pointer the choice depends on (null: no bias).
template <class T>
inline bool norm_rows_in_packs(std::int64_t n, std::initializer_list<const void*> pointers) {
  constexpr std::int64_t V = 16 / sizeof(T);
  if (n % V != 0 || n < 32 * V) return false;
  for (const void* p : pointers)
    if (p != nullptr && reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <class T>
__device__ __forceinline__ NormPack<T> load_norm_pack(const T* p, bool in_packs) {
  if (in_packs) return *reinterpret_cast<const NormPack<T>*>(p);
  NormPack<T> k;
#pragma unroll
  for (int i = 0; i < static_cast<int>(16 / sizeof(T)); ++i) k.v[i] = p[i];
  return k;
}

/// kAdd: h = x + r first (add_layernorm; mean must not be null), then the LayerNorm of h; else the LayerNorm
/// (RMSNorm when mean is null) of x. rows x n contiguous, a warp per row (Note [norm forward in packs]).
template <class T, bool kAdd>
__global__ void norm_forward_packed_kernel(const T* x, const T* r, bool xr_in_packs, const T* w, const T* b, T* h, T* y,
                                           acc_t<T>* mean, acc_t<T>* rstd, std::int64_t rows, std::int64_t n,
                                           acc_t<T> eps) {
  using A = acc_t<T>;
  using E = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the elementwise add's register type
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const std::int64_t packs = n / V, warps_per_block = blockDim.x >> 5;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * warps_per_block;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * warps_per_block + (threadIdx.x >> 5); row < rows;
       row += stride) {
    const T* src = kAdd ? h + row * n : x + row * n;  // the values normalized
    T* yr = y + row * n;
    A mu = 0;
    if constexpr (kAdd) {
      const T* xr = x + row * n;
      const T* rr = r + row * n;
      T* hr = h + row * n;
      A s = 0;
      for (std::int64_t p = lane; p < packs; p += 32) {
        const NormPack<T> a = load_norm_pack(xr + p * V, xr_in_packs), c = load_norm_pack(rr + p * V, xr_in_packs);
        NormPack<T> o;
#pragma unroll
        for (int k = 0; k < V; ++k) o.v[k] = scalar_cast<T>(scalar_cast<E>(a.v[k]) + scalar_cast<E>(c.v[k]));
        *reinterpret_cast<NormPack<T>*>(hr + p * V) = o;
#pragma unroll
        for (int k = 0; k < V; ++k) s += scalar_cast<A>(o.v[k]);
      }
      mu = warp_sum(s) / static_cast<A>(n);
    } else {
      if (mean) {
        A s = 0;
        for (std::int64_t p = lane; p < packs; p += 32) {
          const NormPack<T> a = load_norm_pack(src + p * V, true);
#pragma unroll
          for (int k = 0; k < V; ++k) s += scalar_cast<A>(a.v[k]);
        }
        mu = warp_sum(s) / static_cast<A>(n);
      }
    }
    A v = 0;  // two passes: the variance of centred values does not cancel
    for (std::int64_t p = lane; p < packs; p += 32) {
      const NormPack<T> a = load_norm_pack(src + p * V, true);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A d = scalar_cast<A>(a.v[k]) - mu;
        v += d * d;
      }
    }
    const A rs = A(1) / sqrt(warp_sum(v) / static_cast<A>(n) + eps);
    if (lane == 0) {
      if (mean) mean[row] = mu;
      rstd[row] = rs;
    }
    for (std::int64_t p = lane; p < packs; p += 32) {
      const NormPack<T> a = load_norm_pack(src + p * V, true), wp = load_norm_pack(w + p * V, true);
      NormPack<T> bp{};
      if (b) bp = load_norm_pack(b + p * V, true);
      NormPack<T> o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A t = (scalar_cast<A>(a.v[k]) - mu) * rs * scalar_cast<A>(wp.v[k]);
        o.v[k] = scalar_cast<T>(b ? t + scalar_cast<A>(bp.v[k]) : t);
      }
      *reinterpret_cast<NormPack<T>*>(yr + p * V) = o;
    }
  }
}

#ifndef TG_ROWS_EMULATED
/// Launches the packed kernel on the current stream (the caller checked norm_rows_in_packs).
template <class T, bool kAdd>
void launch_norm_forward_packed(const T* x, const T* r, bool xr_in_packs, const T* w, const T* b, T* h, T* y,
                                acc_t<T>* mean, acc_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps) {
  const std::int64_t blocks = std::clamp<std::int64_t>((rows + kNormRowWarps - 1) / kNormRowWarps, 1, kMaxNormRowBlocks);
  norm_forward_packed_kernel<T, kAdd><<<static_cast<unsigned>(blocks), 32 * kNormRowWarps, 0, stream()>>>(
      x, r, xr_in_packs, w, b, h, y, mean, rstd, rows, n, static_cast<acc_t<T>>(eps));
  TG_CUDA_LAUNCHED();
}
#endif  // TG_ROWS_EMULATED

}  // namespace tg::backend::cuda::detail

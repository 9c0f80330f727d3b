// Elementwise maps over contiguous operands with vector memory accesses (Note [vector elementwise maps]).
//   if (vector_map_fits(out, in)) vector_map(CastTo<float>{}, out, n, in);  // out[i] = f(in[i])
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

// With TG_ELEM_EMULATED defined the CUDA side (common.cuh and the launcher) is left out: the includer supplies
// TG_GRID_STRIDE and the CUDA built-ins, as tests/cuda/test_elementwise_emulated.cpp does to run the kernels'
// bodies, unchanged, on the CPU.
#ifndef TG_ELEM_EMULATED
#include "common.cuh"
#endif

namespace tg::backend::cuda::detail {

// Note [vector elementwise maps]
// A grid-stride loop with one element per thread issues one 2-byte access per bf16 element, and the memory
// system moves whole sectors: such kernels stay well under the bandwidth a 16-byte access per thread reaches.
// When every operand is contiguous (no broadcast, no stride) and aligned to its vector's size, the map takes N
// elements per thread per access, N = 16 bytes over the widest operand's element (8 for bf16 / fp16, 4 for fp32,
// 2 for fp64; a narrower operand then moves N·sizeof bytes, still one access), and a thread per element for the
// n mod N tail. The element function is the scalar kernel's, so results are the scalar loop's bit for bit.

template <class... T>
constexpr int vector_width() {
  constexpr std::size_t widest = std::max({sizeof(T)...});
  return static_cast<int>(16 / widest);
}

template <int N, class T>
struct alignas(N * sizeof(T)) VecN {
  T v[N];
};

template <int N, class T>
inline bool vector_aligned(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % (N * sizeof(T)) == 0;
}

/// Whether vector_map may run: every pointer aligned to its vector (the element counts are any).
template <class TO, class... TI>
inline bool vector_map_fits(const TO* out, const TI*... in) {
  constexpr int N = vector_width<TO, TI...>();
  return N > 1 && vector_aligned<N>(out) && (... && vector_aligned<N>(in));
}

template <int N, class F, class TO, class TA>
__global__ void vector_map_kernel(F f, TO* out, std::int64_t n, const TA* a) {
  const std::int64_t packs = n / N;
  TG_GRID_STRIDE(p, packs) {
    const VecN<N, TA> x = reinterpret_cast<const VecN<N, TA>*>(a)[p];
    VecN<N, TO> o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = f(x.v[k]);
    reinterpret_cast<VecN<N, TO>*>(out)[p] = o;
  }
  const std::int64_t t = packs * N + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (t < n) out[t] = f(a[t]);
}
template <int N, class F, class TO, class TA, class TB>
__global__ void vector_map_kernel(F f, TO* out, std::int64_t n, const TA* a, const TB* b) {
  const std::int64_t packs = n / N;
  TG_GRID_STRIDE(p, packs) {
    const VecN<N, TA> x = reinterpret_cast<const VecN<N, TA>*>(a)[p];
    const VecN<N, TB> y = reinterpret_cast<const VecN<N, TB>*>(b)[p];
    VecN<N, TO> o;
#pragma unroll
    for (int k = 0; k < N; ++k) o.v[k] = f(x.v[k], y.v[k]);
    reinterpret_cast<VecN<N, TO>*>(out)[p] = o;
  }
  const std::int64_t t = packs * N + blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  if (t < n) out[t] = f(a[t], b[t]);
}

#ifndef TG_ELEM_EMULATED
/// out[i] = f(in[i]...) for i < n (one or two inputs), every operand contiguous; call when
/// vector_map_fits(out, in...). `out` may be one of the inputs (each element is read before it is written).
template <class F, class TO, class... TI>
void vector_map(F f, TO* out, std::int64_t n, const TI*... in) {
  static_assert(sizeof...(TI) == 1 || sizeof...(TI) == 2);
  constexpr int N = vector_width<TO, TI...>();
  if (n == 0) return;
  const std::int64_t packs = n / N;
  vector_map_kernel<N><<<grid_for(packs > 0 ? packs : 1), kThreads, 0, stream()>>>(f, out, n, in...);
  TG_CUDA_LAUNCHED();
}
#endif  // TG_ELEM_EMULATED

}  // namespace tg::backend::cuda::detail

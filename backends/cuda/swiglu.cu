// swiglu's CUDA kernels (Note [swiglu halves] in ops/swiglu.hpp): one thread per output element of the
// contiguous [rows, n] result (grid-stride), the shared scalar formulas math::swiglu / math::swiglu_grad in
// kernel_math_t (fp32 for 16-bit storage): the CPU kernels' math, rounded once on store.
#define TG_KERNELS_ONLY
#include "common.cuh"
#include "typegrad/ops/swiglu.hpp"

namespace tg::backend::cuda {

using detail::kThreads;

namespace {

template <class T>
__global__ void swiglu_forward_kernel(const T* x, T* out, std::int64_t rows, std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::swiglu, T>;
  TG_GRID_STRIDE(k, rows * n) {
    const std::int64_t r = k / n, j = k % n;
    const T* a = x + r * 2 * n;
    out[k] = scalar_cast<T>(math::swiglu(scalar_cast<A>(a[j]), scalar_cast<A>(a[n + j])));
  }
}

template <class T>
__global__ void swiglu_backward_kernel(const T* x, const T* dout, T* dx, std::int64_t rows, std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::swiglu, T>;
  TG_GRID_STRIDE(k, rows * n) {
    const std::int64_t r = k / n, j = k % n;
    const T* a = x + r * 2 * n;
    A ga, gb;
    math::swiglu_grad(scalar_cast<A>(a[j]), scalar_cast<A>(a[n + j]), scalar_cast<A>(dout[k]), ga, gb);
    dx[r * 2 * n + j] = scalar_cast<T>(ga);
    dx[r * 2 * n + n + j] = scalar_cast<T>(gb);
  }
}

}  // namespace

template <class T>
void swiglu_forward(const T* x, T* out, std::int64_t rows, std::int64_t n) {
  if (rows * n == 0) return;
  swiglu_forward_kernel<T><<<detail::grid_for(rows * n), kThreads, 0, detail::stream()>>>(x, out, rows, n);
  TG_CUDA_LAUNCHED();
}

template <class T>
void swiglu_backward(const T* x, const T* dout, T* dx, std::int64_t rows, std::int64_t n) {
  if (rows * n == 0) return;
  swiglu_backward_kernel<T><<<detail::grid_for(rows * n), kThreads, 0, detail::stream()>>>(x, dout, dx, rows, n);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_SWIGLU, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

// rope's CUDA kernel (Note [rope: rotate half] in ops/rope.hpp), the CPU kernel's math: a cos / sin table
// per (position, pair) computed in fp64 by one small kernel and rounded to the math type, then one thread
// per output element (coalesced along Dh), math in kernel_math_t (fp32 for 16-bit storage).
#define TG_KERNELS_ONLY
#include "common.cuh"
#include "typegrad/ops/rope.hpp"

namespace tg::backend::cuda {

using detail::kThreads;

namespace {

template <class A>
__global__ void rope_table_kernel(A* cs, A* sn, std::int64_t t, std::int64_t half, std::int64_t r,
                                  std::int64_t offset, double theta, int sign) {
  TG_GRID_STRIDE(k, t * half) {
    const std::int64_t p = k / half, i = k % half;
    double s, c;
    sincos(::tg::detail::rope_angle(offset + p, i, r, theta), &s, &c);
    cs[k] = static_cast<A>(c);
    sn[k] = static_cast<A>(sign * s);
  }
}

template <class T, class A>
__global__ void rope_apply_kernel(const T* x, T* y, const A* cs, const A* sn, std::int64_t total, std::int64_t t,
                                  std::int64_t dh, std::int64_t r) {
  const std::int64_t half = r / 2;
  TG_GRID_STRIDE(k, total) {
    const std::int64_t rt = k / dh, j = k % dh;
    const T* xr = x + rt * dh;
    if (j >= r) {
      y[k] = xr[j];
      continue;
    }
    const std::int64_t i = j < half ? j : j - half;
    const std::int64_t ti = (rt % t) * half + i;
    const A c = cs[ti], s = sn[ti];
    const A x1 = scalar_cast<A>(xr[i]), x2 = scalar_cast<A>(xr[i + half]);
    y[k] = scalar_cast<T>(j < half ? x1 * c - x2 * s : x2 * c + x1 * s);
  }
}

}  // namespace

template <class T>
void rope_rotate(const T* x, T* y, std::int64_t rows, std::int64_t t, std::int64_t dh, std::int64_t r,
                 std::int64_t offset, double theta, int sign) {
  using A = amp::kernel_math_t<amp::op::rope, T>;
  const std::int64_t half = r / 2, total = rows * t * dh;
  if (total == 0) return;
  detail::Workspace ws(2 * static_cast<std::size_t>(t * half) * sizeof(A));
  A* cs = ws.as<A>();
  A* sn = cs + t * half;
  rope_table_kernel<A><<<detail::grid_for(t * half), kThreads, 0, detail::stream()>>>(cs, sn, t, half, r, offset, theta, sign);
  TG_CUDA_LAUNCHED();
  rope_apply_kernel<T, A><<<detail::grid_for(total), kThreads, 0, detail::stream()>>>(x, y, cs, sn, total, t, dh, r);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ROPE, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

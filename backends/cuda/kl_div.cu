// kl_div's CUDA kernels (Note [kl_div: batchmean over rows] in ops/kl_div.hpp), the CPU kernels' math
// (math::kl_div_term / math::kl_div_grad in kernel_math_t, fp32 for 16-bit storage). Forward: one block per
// row, a fixed-order block reduction (no atomics) into one sum per row, then one thread adds the row sums in row
// order in fp64, as the CPU does, and stores the mean: nothing is read back. Backward: one thread per element
// (grid-stride), its scale from the upstream gradient in device memory, rounded once on store.
#define TG_KERNELS_ONLY
#include "common.cuh"
#include "typegrad/ops/kl_div.hpp"

namespace tg::backend::cuda {

using detail::kThreads;

namespace {

constexpr unsigned kMaxRowBlocks = 65535u * 8u;
unsigned row_blocks(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, kMaxRowBlocks)); }

template <class T, class A>
__global__ void kl_div_forward_kernel(const T* x, const T* t, A* row_sum, std::int64_t rows, std::int64_t v) {
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * v;
    const T* tr = t + r * v;
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x)
      s += math::kl_div_term(scalar_cast<A>(xr[j]), scalar_cast<A>(tr[j]));
    s = detail::block_sum(s, shm);
    if (threadIdx.x == 0) row_sum[r] = s;
  }
}

// The row sums added in row order in fp64 and divided by rows (NaN for rows = 0), as the CPU kernel does: a short
// serial loop (one fp64 add per row of V elements) that keeps the two devices' order.
template <class A>
__global__ void kl_div_mean_kernel(const A* row_sum, std::int64_t rows, double* loss) {
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) total += static_cast<double>(row_sum[r]);
  loss[0] = rows ? total / static_cast<double>(rows) : nan("");
}

template <class T>
__global__ void kl_div_backward_kernel(const T* x, const T* t, const double* dloss, T* dx, T* dt, std::int64_t rows,
                                       std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::kl_div, T>;
  const double scale = rows ? dloss[0] / static_cast<double>(rows) : 0.0;
  const A sc = static_cast<A>(scale);
  TG_GRID_STRIDE(k, n) {
    A gx, gt;
    math::kl_div_grad(scalar_cast<A>(x[k]), scalar_cast<A>(t[k]), sc, gx, gt);
    if (dx) dx[k] = scalar_cast<T>(gx);
    if (dt) dt[k] = scalar_cast<T>(gt);
  }
}

}  // namespace

template <class T>
void kl_div_forward(const T* x, const T* t, std::int64_t rows, std::int64_t v, double* loss) {
  using A = amp::kernel_math_t<amp::op::kl_div, T>;
  detail::Workspace ws(static_cast<std::size_t>(std::max<std::int64_t>(rows, 1)) * sizeof(A));
  if (rows * v > 0) {
    kl_div_forward_kernel<T, A>
        <<<row_blocks(rows), detail::row_threads(v), 0, detail::stream()>>>(x, t, ws.as<A>(), rows, v);
    TG_CUDA_LAUNCHED();
  }
  kl_div_mean_kernel<A><<<1, 1, 0, detail::stream()>>>(ws.as<A>(), rows, loss);
  TG_CUDA_LAUNCHED();
}

template <class T>
void kl_div_backward(const T* x, const T* t, const double* dloss, T* dx, T* dt, std::int64_t rows, std::int64_t v) {
  if (rows * v == 0 || (!dx && !dt)) return;
  kl_div_backward_kernel<T>
      <<<detail::grid_for(rows * v), kThreads, 0, detail::stream()>>>(x, t, dloss, dx, dt, rows, rows * v);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_KL_DIV, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

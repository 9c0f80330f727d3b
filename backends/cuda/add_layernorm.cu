// add_layernorm's CUDA kernel (Note [fused residual add and LayerNorm] in ops/add_layernorm.hpp): one block
// per row with the LayerNorm kernel's block size and block reductions (backends/cuda/nn.cu), so h and y are
// the unfused `add` + `layernorm` kernels' bit for bit. Each thread writes its elements of h (rounded to T)
// and reads its own writes back for the variance and output passes: one launch instead of two, and the
// residual stream is read once. Rows of whole 16-byte packs take the warp-per-row kernel that layernorm_forward
// takes for them (norm_forward.cuh, Note [norm forward in packs]).
#define TG_KERNELS_ONLY
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "norm_forward.cuh"
#include "typegrad/ops/add_layernorm.hpp"

namespace tg::backend::cuda {

using detail::acc_t;

namespace {

constexpr unsigned kMaxRowBlocks = 65535u * 8u;

template <class T>
__global__ void add_layernorm_kernel(const T* x, const T* r, const T* w, const T* b, T* h, T* y, acc_t<T>* mean,
                                     acc_t<T>* rstd, std::int64_t rows, std::int64_t n, acc_t<T> eps) {
  using E = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the elementwise add's register type
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* xr = x + i * n;
    const T* rr = r + i * n;
    T* hr = h + i * n;
    T* yr = y + i * n;
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const T v = scalar_cast<T>(scalar_cast<E>(xr[j]) + scalar_cast<E>(rr[j]));
      hr[j] = v;
      s += scalar_cast<A>(v);
    }
    const A mu = detail::block_sum(s, shm) / static_cast<A>(n);
    A v = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A d = scalar_cast<A>(hr[j]) - mu;
      v += d * d;
    }
    const A rs = A(1) / sqrt(detail::block_sum(v, shm) / static_cast<A>(n) + eps);
    if (threadIdx.x == 0) {
      mean[i] = mu;
      rstd[i] = rs;
    }
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A o = (scalar_cast<A>(hr[j]) - mu) * rs * scalar_cast<A>(w[j]);
      yr[j] = scalar_cast<T>(o + scalar_cast<A>(b[j]));
    }
  }
}

}  // namespace

template <class T>
void add_layernorm_forward(const T* x, const T* r, const T* w, const T* b, T* h, T* y, accum_t<T>* mean,
                           accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps) {
  if (rows * n == 0) return;
  // Note [norm forward in packs]: the path depends on what `add` then `layernorm` share (h, y, w, b), not on x, r
  if (detail::norm_rows_in_packs<T>(n, {h, w, b, y})) {
    const bool xr_in_packs = detail::norm_rows_in_packs<T>(n, {x, r});
    detail::launch_norm_forward_packed<T, true>(x, r, xr_in_packs, w, b, h, y, mean, rstd, rows, n, eps);
    return;
  }
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>(rows, kMaxRowBlocks));
  add_layernorm_kernel<T><<<blocks, detail::row_threads(n), 0, detail::stream()>>>(x, r, w, b, h, y, mean, rstd, rows, n,
                                                                                  static_cast<acc_t<T>>(eps));
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ADD_LAYERNORM, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

// add_layernorm's CUDA kernel (Note [fused residual add and LayerNorm] in ops/add_layernorm.hpp): one block
// per row with the LayerNorm kernel's block size and block reductions (add_layernorm_rows.cuh), so h and y are
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

// The kernel, next to nn.cu's LayerNorm forward that it must equal bit for bit.
#include "add_layernorm_rows.cuh"

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

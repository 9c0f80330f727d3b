// add_layernorm: the residual add of a pre-LN transformer block fused with the LayerNorm that reads its result.
//   auto [h, y] = tg::add_layernorm(x, branch, ln.weight, ln.bias);   // h = x + branch, y = layernorm(h)
//   auto out = tg::add(h, mlp(y));                                     // h goes on down the residual stream
#pragma once

#include <cstdint>

#include "typegrad/amp/rule.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// Note [fused residual add and LayerNorm]
// A pre-LN block writes h = x + branch and then reads h back for LayerNorm; the fused kernel makes one pass
// that writes h (rounded to T, as `add` stores it) and sums the stored values for the mean, then the
// variance and y exactly as layernorm_forward does from h. The results are the unfused pair's bit for bit on
// each device (the same roundings, the same summation order per row; on the GPU the same block size and block
// reduction as the LayerNorm kernel), so a model may switch to it without changing a loss.
// The tape keeps the unfused structure: an "add" node for h (dx = dr = dh) and an "add_layernorm" node for y
// whose input is h and whose backward is LayerNorm's. h's gradient therefore sums the LayerNorm's dh and the
// residual stream's in the order the unfused pair sums them, and checkpoint regions, guards and hooks see
// ordinary nodes. Memory: the same tensors are kept as unfused (h is saved for the LayerNorm's backward).

// add_layernorm_forward: h = x + r elementwise (rounded to T), y = (h − mean)·rstd·w + b per row of the
//                        contiguous [rows, n] blocks x, r, h, y; writes mean, rstd (accum_t<T>) as
//                        layernorm_forward does.
#define TG_KERNELS_ADD_LAYERNORM(K, ...)                                                                       \
  K(void, add_layernorm_forward, (const T* x, const T* r, const T* w, const T* b, T* h, T* y,                    \
                                  accum_t<T>* mean, accum_t<T>* rstd, std::int64_t rows, std::int64_t n,       \
                                  double eps), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_ADD_LAYERNORM)

#ifndef TG_KERNELS_ONLY  // Note [kernels declared once]: kernel files see only the list above
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/layernorm.hpp"

namespace tg {

/// What add_layernorm returns: the residual stream's next value and the LayerNorm of it.
template <FloatingElement T, Device D>
struct AddLayerNorm {
  Tensor<T, D> sum;  // x + branch
  Tensor<T, D> out;  // layernorm(x + branch)
};

namespace detail {
/// add_layernorm writing h into `h` (allocated by the caller: contiguous, x's shape). With record_add false the
/// "add" node for h is the caller's (tg::compile's pair rewrite: the add recorded it, Note [pair rewrites]).
template <FloatingElement T, Device D>
Tensor<T, D> add_layernorm_into(const Tensor<T, D>& x, const Tensor<T, D>& branch, const Tensor<T, D>& weight,
                                const Tensor<T, D>& bias, double eps, Tensor<T, D>& h, bool record_add) {
  const std::int64_t n = x.shape()[x.dim() - 1], rows = n ? x.numel() / n : 0;
  const Tensor<T, D> xc = x.contiguous_raw(), rc = branch.contiguous_raw(), wc = weight.contiguous_raw(),
                     bc = bias.contiguous_raw();
  Tensor<T, D> y = Tensor<T, D>::empty(x.shape());
  Tensor<accum_t<T>, D> mean = Tensor<accum_t<T>, D>::empty({rows}), rstd = Tensor<accum_t<T>, D>::empty({rows});
  TG_BACKEND(D, add_layernorm_forward<T>(xc.data(), rc.data(), wc.data(), bc.data(), h.data(), y.data(), mean.data(),
                                         rstd.data(), rows, n, eps));
  if (record_add)
    autodiff::record("add", h, detail::BinarySaved{},
                     [](detail::BinarySaved&, const Tensor<T, D>& g, auto need) {
                       return std::tuple{need[0] ? g : Tensor<T, D>(), need[1] ? g : Tensor<T, D>()};
                     }, x, branch);
  autodiff::record("add_layernorm", y, detail::NormSaved<T, D>{h.detach(), wc.detach(), mean, rstd},
                   [bwd = detail::norm_backward_fn<T, D>(rows, n, true)](detail::NormSaved<T, D>& s,
                                                                         const Tensor<T, D>& dout, auto need) {
                     auto [dxw, db] = bwd(s, dout, need);
                     return std::tuple{std::get<0>(dxw), std::get<1>(dxw), db};
                   }, h, weight, bias);
  return y;
}
}  // namespace detail

/// h = x + branch and y = layernorm(h, weight, bias, eps) in one pass (Note [fused residual add and LayerNorm]).
/// x and branch have the same shape (no broadcasting); weight and bias are [C], C the last dim.
template <FloatingElement T, Device D>
AddLayerNorm<T, D> add_layernorm(const Tensor<T, D>& x, const Tensor<T, D>& branch, const Tensor<T, D>& weight,
                                 const Tensor<T, D>& bias, double eps = 1e-5) {
  TG_CHECK(x.shape() == branch.shape(), "add_layernorm: x ", x.shape(), " and branch ", branch.shape(),
           " must have the same shape");
  detail::check_norm_param(x, weight, "add_layernorm", "weight");
  detail::check_norm_param(x, bias, "add_layernorm", "bias");
  Tensor<T, D> h = Tensor<T, D>::empty(x.shape());
  Tensor<T, D> y = detail::add_layernorm_into(x, branch, weight, bias, eps, h, true);
  return {h, y};
}

}  // namespace tg
#endif  // TG_KERNELS_ONLY

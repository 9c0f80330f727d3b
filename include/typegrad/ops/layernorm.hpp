// layernorm and rmsnorm over the last dim with affine parameters (Ba et al. 2016; Zhang & Sennrich 2019).
//   auto h = tg::layernorm(x, weight, bias, 1e-5);   // x (B,T,C), weight/bias (C)
//   auto r = tg::rmsnorm(x, weight);                  // x · rsqrt(mean(x²) + eps) · weight
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/ops/fusion_hook.hpp"

namespace tg {

namespace detail {
template <Element T, Device D>
struct NormSaved {
  Tensor<T, D> x, weight;            // the input (contiguous) and the scale
  Tensor<accum_t<T>, D> mean, rstd;  // per row, in the accumulation type (mean undefined for rmsnorm)
};

template <Element T, Device D>
void check_norm_param(const Tensor<T, D>& x, const Tensor<T, D>& p, const char* op, const char* what) {
  TG_CHECK(x.dim() >= 1, op, ": x needs at least one dim, got ", x.shape());
  const std::int64_t C = x.shape()[x.dim() - 1];
  TG_CHECK(p.dim() == 1 && p.shape()[0] == C, op, ": ", what, " must be [", C, "] (the last dim of x ", x.shape(),
           "), got ", p.shape());
}

template <Element T, Device D>
auto norm_backward_fn(std::int64_t rows, std::int64_t n, bool with_bias) {
  return [rows, n, with_bias](NormSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
    const Tensor<T, D> g = dout.contiguous_raw();
    Tensor<T, D> dx, dw, db;
    if (need[0]) dx = Tensor<T, D>::empty(s.x.shape());
    if (need[1]) dw = Tensor<T, D>::empty(s.weight.shape());
    if (with_bias && need[with_bias ? 2 : 0]) db = Tensor<T, D>::empty(s.weight.shape());
    TG_BACKEND(D, layernorm_backward<T>(s.x.data(), s.weight.data(), s.mean.defined() ? s.mean.data() : nullptr,
                                        s.rstd.data(), g.data(), dx.data(), dw.data(), db.data(), rows, n));
    return std::pair{std::tuple{dx, dw}, db};
  };
}
}  // namespace detail

/// y = (x − mean) / sqrt(var + eps) · weight + bias over the last dim (biased variance).
template <FloatingElement T, Device D>
Tensor<T, D> layernorm(const Tensor<T, D>& x, const Tensor<T, D>& weight, const Tensor<T, D>& bias, double eps = 1e-5) {
  detail::check_norm_param(x, weight, "layernorm", "weight");
  detail::check_norm_param(x, bias, "layernorm", "bias");
  if (fusion::rewriter()) [[unlikely]]  // the layernorm of a deferred residual add (Note [pair rewrites])
    if (auto f = detail::try_consume_layernorm(x, weight, bias, eps)) return *f;
  const std::int64_t n = x.shape()[x.dim() - 1], rows = n ? x.numel() / n : 0;
  const Tensor<T, D> xc = x.contiguous_raw(), wc = weight.contiguous_raw(), bc = bias.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  Tensor<accum_t<T>, D> mean = Tensor<accum_t<T>, D>::empty({rows}), rstd = Tensor<accum_t<T>, D>::empty({rows});
  TG_BACKEND(D, layernorm_forward<T>(xc.data(), wc.data(), bc.data(), out.data(), mean.data(), rstd.data(), rows, n, eps));
  autodiff::record("layernorm", out, detail::NormSaved<T, D>{xc.detach(), wc.detach(), mean, rstd},
                   [bwd = detail::norm_backward_fn<T, D>(rows, n, true)](detail::NormSaved<T, D>& s,
                                                                         const Tensor<T, D>& dout, auto need) {
                     auto [dxw, db] = bwd(s, dout, need);
                     return std::tuple{std::get<0>(dxw), std::get<1>(dxw), db};
                   }, x, weight, bias);
  return out;
}

/// y = x / sqrt(mean(x²) + eps) · weight over the last dim.
template <FloatingElement T, Device D>
Tensor<T, D> rmsnorm(const Tensor<T, D>& x, const Tensor<T, D>& weight, double eps = 1e-6) {
  detail::check_norm_param(x, weight, "rmsnorm", "weight");
  const std::int64_t n = x.shape()[x.dim() - 1], rows = n ? x.numel() / n : 0;
  const Tensor<T, D> xc = x.contiguous_raw(), wc = weight.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  Tensor<accum_t<T>, D> rstd = Tensor<accum_t<T>, D>::empty({rows});
  TG_BACKEND(D, rmsnorm_forward<T>(xc.data(), wc.data(), out.data(), rstd.data(), rows, n, eps));
  autodiff::record("rmsnorm", out, detail::NormSaved<T, D>{xc.detach(), wc.detach(), Tensor<accum_t<T>, D>(), rstd},
                   [bwd = detail::norm_backward_fn<T, D>(rows, n, false)](detail::NormSaved<T, D>& s,
                                                                          const Tensor<T, D>& dout, auto need) {
                     return std::get<0>(bwd(s, dout, need));
                   }, x, weight);
  return out;
}

}  // namespace tg

// detail::run_fused_add_layernorm, which layernorm calls (it needs this header whole)
#include "typegrad/ops/fused_pairs.hpp"

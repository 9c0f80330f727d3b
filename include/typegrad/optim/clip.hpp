// Gradient clipping by global L2 norm (torch.nn.utils.clip_grad_norm_ semantics).
//   double norm = tg::optim::clip_grad_norm(opt, /*max_norm=*/1.0);    // every parameter of an optimizer
//   double norm = tg::optim::clip_grad_norm(params, 1.0);              // or a list of parameters
#pragma once

#include <cmath>
#include <limits>
#include <span>

#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

// Note [global norm clipping]
// total = sqrt(Σ_params Σ_i g_i²), accumulated in fp64 over the parameters that have a gradient.
// When total is finite and c = max_norm / (total + 1e-6) < 1, every gradient is scaled by c (in fp32);
// otherwise nothing changes. A NaN or infinite total is returned as it is and the gradients are left
// untouched, so a caller (or a loss scaler) can skip the step. Returns total, before scaling.

namespace detail {
template <class ForEach>
double clip_by_global_norm(ForEach&& for_each, double max_norm) {
  TG_CHECK(max_norm >= 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  double sq = 0;
  for_each([&](const Param& p) {
    if (Tensor<fp32> g = p.tensor.grad(); g.defined()) sq += backend::cpu::sum_squares<fp32>(g.data(), g.numel());
  });
  const double total = std::sqrt(sq);
  if (!std::isfinite(total)) return total;
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for_each([&](const Param& p) {
      if (Tensor<fp32> g = p.tensor.grad(); g.defined()) backend::cpu::scale_inplace<fp32>(g.data(), g.numel(), coef);
    });
  return total;
}
}  // namespace detail

inline double clip_grad_norm(std::span<const Param> params, double max_norm) {
  return detail::clip_by_global_norm([&](auto&& f) { for (const Param& p : params) f(p); }, max_norm);
}
inline double clip_grad_norm(const Optimizer& opt, double max_norm) {
  return detail::clip_by_global_norm([&](auto&& f) { opt.for_each_param(f); }, max_norm);
}
/// The global gradient norm without clipping.
inline double grad_norm(std::span<const Param> params) {
  return clip_grad_norm(params, std::numeric_limits<double>::infinity());
}

}  // namespace tg::optim

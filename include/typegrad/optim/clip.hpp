// Gradient clipping by global L2 norm (torch.nn.utils.clip_grad_norm_ semantics), on any device.
//   double norm = tg::optim::clip_grad_norm(opt, /*max_norm=*/1.0);    // every parameter of an optimizer
//   double norm = tg::optim::clip_grad_norm(params, 1.0);              // or a list of parameters
#pragma once

#include <cmath>
#include <limits>
#include <span>
#include <type_traits>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/reduce.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/cross_rank.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

// Note [global norm clipping]
// total = sqrt(Σ_params Σ_i g_i²) over the parameters that have a gradient, computed with ops on the
// parameters' device: each gradient's Σ g² in fp64, the per-tensor sums added there, one scalar read back.
// On the CPU the sum and the scaling are one pass each over the gradient (backend::cpu::sum_squares,
// scale_inplace): clipping is memory-bound, and the op form would write an fp64 copy of every gradient
// (1.5 GB for GPT-2) each step.
// When total is finite and c = max_norm / (total + 1e-6) < 1, every gradient is scaled by c in place (fp32);
// otherwise nothing changes. A NaN or infinite total is returned as it is and the gradients are left
// untouched, so a caller (or a loss scaler) can skip the step. Returns total, before scaling. One function
// for every device and every optimizer (BasicOptimizer<D>) or list of parameters. With a CrossRank whose
// ranks hold shards of the gradients (ZeRO), Σ g² is summed over the ranks before the square root, so every
// rank clips by the same global norm (Note [cross-rank step decisions]).

namespace detail {
inline double across_ranks(double sq, const CrossRank* cross) {
  if (cross && cross->sharded_grads()) cross->sum_norms(std::span<double>(&sq, 1));
  return sq;
}

template <Device D, class ForEach>
double clip_by_global_norm(ForEach&& for_each, double max_norm, const CrossRank* cross = nullptr) {
  TG_CHECK(max_norm >= 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  if constexpr (std::is_same_v<D, cpu>) {
    double sq = 0;
    for_each([&](const Param& p) {
      if (cross && cross->sharded_grads() && !cross->counts_in_norm(p.name)) return;
      if (const Tensor<fp32> g = p.tensor.grad(); g.defined()) {
        backend::report_launch("sum_squares", true, g.data(), g.numel());  // Note [launch watch]: a read
        sq += backend::cpu::sum_squares<fp32>(g.data(), g.numel());
      }
    });
    const double total = std::sqrt(across_ranks(sq, cross));
    if (!std::isfinite(total)) return total;
    const double coef = max_norm / (total + 1e-6);
    if (coef < 1.0)
      for_each([&](const Param& p) {
        if (const Tensor<fp32> g = p.tensor.grad(); g.defined()) {
          backend::report_launch("scale_inplace", false, g.data(), g.numel(), coef);
          backend::cpu::scale_inplace<fp32>(g.data(), g.numel(), coef);
        }
      });
    return total;
  }
  if constexpr (std::is_same_v<D, cuda>) {
    // One multi-tensor launch for Σ g² and one for the rescale instead of a chain of launches per parameter,
    // when every gradient is contiguous (as backward makes them); otherwise the per-tensor ops below.
    std::vector<float*> all, counted;
    std::vector<std::int64_t> all_sizes, counted_sizes;
    bool contiguous = true;
    for_each([&](const BasicParam<D>& p) {
      const Tensor<fp32, D> g = p.tensor.grad();
      if (!g.defined() || g.numel() == 0) return;
      contiguous = contiguous && g.is_contiguous();
      all.push_back(g.data());
      all_sizes.push_back(g.numel());
      if (cross && cross->sharded_grads() && !cross->counts_in_norm(p.name)) return;
      counted.push_back(g.data());
      counted_sizes.push_back(g.numel());
    });
    if (contiguous) {
      backend::report_launch("sum_squares_multi", true, counted, counted_sizes);  // Note [launch watch]: a read
      const double sq = backend::cuda::sum_squares_multi(counted.data(), counted_sizes.data(), static_cast<int>(counted.size()));
      const double total = std::sqrt(across_ranks(sq, cross));
      if (!std::isfinite(total)) return total;
      const double coef = max_norm / (total + 1e-6);
      if (coef < 1.0) {
        backend::report_launch("scale_multi", false, all, all_sizes, static_cast<float>(coef));
        backend::cuda::scale_multi(all.data(), all_sizes.data(), static_cast<int>(all.size()), static_cast<float>(coef));
      }
      return total;
    }
  }
  NoGrad no_grad;
  Tensor<fp64, D> sq;
  for_each([&](const BasicParam<D>& p) {
    const Tensor<fp32, D> g = p.tensor.grad();
    if (!g.defined() || g.numel() == 0) return;
    if (cross && cross->sharded_grads() && !cross->counts_in_norm(p.name)) return;
    const Tensor<fp64, D> g64 = g.detach().template to<fp64>();
    const Tensor<fp64, D> s = sum(mul(g64, g64));
    sq = sq.defined() ? add(sq, s) : s;
  });
  const double total = std::sqrt(across_ranks(sq.defined() ? static_cast<double>(sq.item()) : 0.0, cross));
  if (!std::isfinite(total)) return total;
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    for_each([&](const BasicParam<D>& p) {
      const Tensor<fp32, D> g = p.tensor.grad();
      if (g.defined() && g.numel() > 0) tg::detail::copy_tensor(mul(g.detach(), coef), g);
    });
  return total;
}
}  // namespace detail

template <Device D>
double clip_grad_norm(std::span<const BasicParam<D>> params, double max_norm) {
  return detail::clip_by_global_norm<D>([&](auto&& f) { for (const BasicParam<D>& p : params) f(p); }, max_norm);
}
template <Device D>
double clip_grad_norm(const std::vector<BasicParam<D>>& params, double max_norm) {
  return clip_grad_norm(std::span<const BasicParam<D>>(params), max_norm);
}
template <Device D>
double clip_grad_norm(const BasicOptimizer<D>& opt, double max_norm, const CrossRank* cross = nullptr) {
  return detail::clip_by_global_norm<D>([&](auto&& f) { opt.for_each_param(f); }, max_norm, cross);
}
/// The global gradient norm without clipping.
template <Device D>
double grad_norm(std::span<const BasicParam<D>> params) {
  return clip_grad_norm(params, std::numeric_limits<double>::infinity());
}
template <Device D>
double grad_norm(const std::vector<BasicParam<D>>& params) {
  return grad_norm(std::span<const BasicParam<D>>(params));
}

}  // namespace tg::optim

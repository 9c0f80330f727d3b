// kl_div: the Kullback–Leibler divergence KL(p ‖ q) between rows of log-probabilities, "batchmean" over rows
// (the distillation loss of quant/distill.hpp is built on it): input = log q (the student), target = log p.
//   auto loss = tg::kl_div(tg::log_softmax(student), tg::log_softmax(teacher));  // (..., V) each -> scalar
//   loss.backward();       // torch: F.kl_div(x.reshape(-1, V), t.reshape(-1, V), 'batchmean', log_target=True)
#pragma once

#include <cmath>
#include <cstdint>

#include "typegrad/amp/rule.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"
#include "typegrad/detail/macros.hpp"

// Note [kl_div: batchmean over rows]
// input x and target t have one shape (..., V): R = numel / V rows of V log-probabilities each (x = log q,
// t = log p; neither is required to be normalized, the formula is applied as is). With p = exp(t),
//   loss = (1/R) Σ_rows Σ_j p_j · (t_j − x_j),
//   d loss/d x_j = −p_j / R,   d loss/d t_j = p_j · (t_j − x_j + 1) / R.
// This is torch's F.kl_div(x.reshape(-1, V), t.reshape(-1, V), reduction='batchmean', log_target=True):
// "batchmean" divides by the number of rows, which for a (B,T,V) input is B·T (torch itself would divide
// by B for the unflattened (B,T,V) tensor and by V for a 1-D one; here a 1-D input is one distribution,
// R = 1). A term with p = 0 (t = −inf: a token the teacher masked out) is 0 (the limit p log p → 0), and so
// are its gradients, where torch's log_target form gives 0 · (−inf − x) = NaN. R = 0 (no rows) gives NaN,
// as a mean over nothing does in torch.
// Math in accum_t<T> (fp32 for 16-bit storage, fp64 for fp64): each row is summed in that type in a fixed
// order (index order on the CPU; on the GPU a block's tree, whose shape follows V), then the rows' sums are
// added in row order in fp64, so the value depends neither on the number of OpenMP threads nor on the CUDA
// grid (the two devices agree within the rows' summation rounding). The loss is stored as Out (kl_div_as<fp32>
// for 16-bit inputs, as cross_entropy_as; kl_div: the inputs' type); the gradients have the inputs' type, rounded
// once.
// Nothing is read back to the host. The forward kernel writes the mean into one fp64 on the inputs' device,
// converted to Out there (a copy kernel); the backward kernel reads its upstream gradient, converted to fp64, from
// the device and divides it by R itself. So a distilled step (quant/distill.hpp) under a device boundary keeps its
// one read per step, and its launches are the same every step: the loss no longer reaches the device as a fill's
// argument (Note [graph blockers]). The values are those of the host computation bit for bit: the same fp64
// division, the same scalar_cast to Out.

// kl_div_forward:  loss[0] = Σ_r Σ_j p·(t − x) / rows (math::kl_div_term; NaN for rows = 0) over contiguous
//                  x, t [rows, v]: each row summed in kernel_math_t, the row sums added in row order in fp64, the
//                  total divided by rows; loss is one fp64 on the device.
// kl_div_backward: dx[r, j] = −p·scale, dt[r, j] = p·(t − x + 1)·scale (math::kl_div_grad) over contiguous
//                  x, t, dx, dt [rows, v], scale = dloss[0] / rows (0 for rows = 0) read on the device from one
//                  fp64; dx or dt is null when that gradient is not wanted.
#define TG_KERNELS_KL_DIV(K, ...)                                                                                \
  K(void, kl_div_forward, (const T* x, const T* t, std::int64_t rows, std::int64_t v, double* loss), __VA_ARGS__) \
  K(void, kl_div_backward,                                                                                       \
    (const T* x, const T* t, const double* dloss, T* dx, T* dt, std::int64_t rows, std::int64_t v), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_KL_DIV)
// A loss: exp/log and a reduction, never in 16-bit arithmetic (fp32 math; the loss itself fp32 under
// mixed precision through kl_div_as, as cross_entropy).
TG_AUTOCAST_RULE(kl_div, fp32_math)

namespace tg::math {
/// One term p·(t − x) of Note [kl_div: batchmean over rows], p = exp(t); 0 where p is 0.
template <class A>
TG_HOST_DEVICE TG_INLINE A kl_div_term(A x, A t) {
  const A p = std::exp(t);
  return p == A(0) ? A(0) : p * (t - x);
}
/// The term's gradients times `scale` (the upstream gradient over R): dx = −p·scale, dt = p·(t − x + 1)·scale.
template <class A>
TG_HOST_DEVICE TG_INLINE void kl_div_grad(A x, A t, A scale, A& dx, A& dt) {
  const A p = std::exp(t);
  const A ps = p * scale;
  dx = -ps;
  dt = p == A(0) ? A(0) : ps * (t - x + A(1));
}
}  // namespace tg::math

#ifndef TG_KERNELS_ONLY  // Note [kernels declared once]: kernel files see only the list above
#include <type_traits>

#include "typegrad/autodiff/node.hpp"

namespace tg {
namespace detail {
/// A one-element tensor as U on its device, by a copy kernel (scalar_cast per element); itself when already U.
template <Element U, Element S, Device D>
Tensor<U, D> kl_div_convert(const Tensor<S, D>& x) {
  if constexpr (std::is_same_v<U, S>) {
    return x.contiguous_raw();
  } else {
    Tensor<U, D> y = Tensor<U, D>::empty(x.shape());
    copy_tensor(x, y);
    return y;
  }
}
template <Element T, Device D>
struct KlDivSaved {
  Tensor<T, D> input;   // log q, contiguous, detached
  Tensor<T, D> target;  // log p, contiguous, detached: both gradients need both
};
}  // namespace detail

/// KL(p ‖ q) with x = log q (input) and t = log p (target), both (..., V), summed over V and averaged over
/// the rows (Note [kl_div: batchmean over rows]); a 0-dim tensor stored as Out (fp32 for 16-bit inputs
/// under mixed precision). Both inputs get gradients when they require them (a teacher usually does not).
template <FloatingElement Out, FloatingElement T, Device D>
Tensor<Out, D> kl_div_as(const Tensor<T, D>& input, const Tensor<T, D>& target) {
  TG_CHECK(input.dim() >= 1, "kl_div: input must have at least one dim (..., V) of log-probabilities, got ",
           input.shape());
  TG_CHECK(target.shape() == input.shape(), "kl_div: input and target must have the same shape (..., V): input is ",
           input.shape(), ", target is ", target.shape());
  const std::int64_t v = input.shape()[input.dim() - 1];
  TG_CHECK(v > 0, "kl_div: the last dim V (the classes of each distribution) must not be empty, got V = 0 (input is ",
           input.shape(), ")");
  const std::int64_t rows = input.numel() / v;
  const Tensor<T, D> xc = input.contiguous_raw(), tc = target.contiguous_raw();
  const Tensor<fp64, D> loss = Tensor<fp64, D>::empty(Shape());  // Note [kl_div: batchmean over rows]: on the device
  TG_BACKEND(D, kl_div_forward<T>(xc.data(), tc.data(), rows, v, loss.data()));
  Tensor<Out, D> out = detail::kl_div_convert<Out>(loss);
  autodiff::record("kl_div", out, detail::KlDivSaved<T, D>{xc.detach(), tc.detach()},
                   [rows, v](detail::KlDivSaved<T, D>& s, const Tensor<Out, D>& dout, auto need) {
                     const Tensor<fp64, D> dloss = detail::kl_div_convert<fp64>(dout);
                     Tensor<T, D> dx, dt;
                     if (need[0]) dx = Tensor<T, D>::empty(s.input.shape());
                     if (need[1]) dt = Tensor<T, D>::empty(s.target.shape());
                     TG_BACKEND(D, kl_div_backward<T>(s.input.data(), s.target.data(), dloss.data(),
                                                      need[0] ? dx.data() : nullptr, need[1] ? dt.data() : nullptr,
                                                      rows, v));
                     return std::tuple{dx, dt};
                   }, input, target);
  return out;
}

/// kl_div_as<T>: the loss in the inputs' own type.
template <FloatingElement T, Device D>
Tensor<T, D> kl_div(const Tensor<T, D>& input, const Tensor<T, D>& target) {
  return kl_div_as<T>(input, target);
}

// Note [mixing precisions or devices] (ops/binary.hpp): input and target of different types or devices
// pick this overload, whose static_assert names the fix.
template <class T, class D, class U, class E>
  requires(!std::is_same_v<T, U> || !std::is_same_v<D, E>)
void kl_div(const Tensor<T, D>&, const Tensor<U, E>&) {
  static_assert(std::is_same_v<T, U>, "tg::kl_div: input and target have different precisions; convert one "
                                      "explicitly, e.g. target.to<T>()");
  static_assert(std::is_same_v<D, E>, "tg::kl_div: input and target live on different devices; move one explicitly "
                                      "with .to<tg::cpu>() or .to<tg::cuda>()");
}

}  // namespace tg
#endif  // TG_KERNELS_ONLY

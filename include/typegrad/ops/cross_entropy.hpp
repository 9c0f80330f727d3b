// cross_entropy: fused log_softmax + negative log-likelihood, the mean over targets ≠ ignore_index.
//   auto loss = tg::cross_entropy(logits, targets);        // logits (B,T,V), targets (B,T) int64 -> scalar
//   loss.backward();                                        // dlogits = (softmax − onehot) / count
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/ops/embedding.hpp"

namespace tg {

// Note [the loss stays on the device]
// The cross-entropy's forward writes its mean into a scalar on the logits' device, and its backward reads the
// upstream gradient there (the kernels take device pointers; the count of counted targets comes from the
// targets, which stay on the host). So on a GPU neither direction reads anything back, and a training step's
// only read-backs are the ones it chooses: TrainStep keeps each micro-batch's loss on the device and reads
// them all once, after the last micro-batch's backward and before the step's boundary decides on them (the
// non-finite-loss check, the logged loss). On the CPU the values are unchanged: the kernel still sums the
// rows' losses in row order in fp64 and divides by the count in fp64; the GPU sums them in fp64 in a fixed
// order (one block), within rounding of the CPU.

// Note [cross-entropy on strided rows]
// The logits' rows are read where they are when each row's V elements are contiguous and the rows are a fixed
// stride ld ≥ V apart: the padded LM head's (B, T, V) view of its (B, T, P) logits (Note [padded
// vocabulary]) is read in place, with no copy of the narrowed logits and none kept for the backward (the saved
// tensor is that view). Other layouts are copied once, as before. The gradient is contiguous (B, T, V).

// Note [cross-entropy on padded logits]
// The padded LM head's logits (B, T, P) reach the loss as narrow_classes' (B, T, V) view. A gradient of that
// view's shape would be widened back to (B, T, P) by the narrow's backward (a zero fill of P columns and a copy
// of V), and both buffers would be alive at once: for GPT-2 at B=16, T=1024 in bf16, 1.6 GB of traffic each and
// 1.6 GB more at the peak. So when the view remembers its padded base (narrow_classes, recorded), the loss is
// recorded against the base itself: its backward writes (B, T, P) rows whose columns past V are zero, which
// are the base's gradient as the narrow would have built it, bit for bit. The narrow's own node then receives
// no gradient from the loss (another reader of the view still sends its gradient through the narrow, and the
// two add at the base).

namespace detail {
/// The rows of x (its last dim being the classes) when they are `V` contiguous elements each, a fixed stride
/// apart: that stride (≥ V), else 0.
template <Element T, Device D>
std::int64_t uniform_row_stride(const Tensor<T, D>& x) {
  const std::int64_t d = x.dim(), V = x.shape()[d - 1];
  if (V == 0 || x.strides()[d - 1] != 1) return 0;
  std::int64_t ld = -1, rows_after = 1;  // the stride of the innermost row dim of extent > 1
  for (std::int64_t k = d - 2; k >= 0; --k) {
    const std::int64_t n = x.shape()[k], s = x.strides()[k];
    if (n == 1) continue;
    if (ld < 0) ld = s;
    else if (s != ld * rows_after) return 0;  // the rows are not one fixed stride apart
    rows_after *= n;
  }
  if (ld < 0) ld = V;  // a single row
  return ld >= V ? ld : 0;
}

template <Element T, Device D>
struct CrossEntropySaved {
  Tensor<T, D> logits;              // rows of V elements ld apart; softmax is recomputed from it in backward
  Tensor<std::int64_t> targets;     // contiguous
  Tensor<accum_t<T>, D> lse;        // per-row logsumexp of the logits
  std::int64_t count = 0;           // targets that count (not ignore_index)
};
}  // namespace detail

/// loss = mean over rows r with t_r ≠ ignore_index of (logsumexp(logits[r]) − logits[r, t_r]); NaN when
/// every target is ignored (as in PyTorch). logits [N, V] with targets [N], or [B, T, V] with [B, T].
/// The loss is stored as Out (fp32 for 16-bit logits under mixed precision: amp/autocast.hpp); the math is
/// in accum_t<T> and fp64 sums either way, and dlogits has the logits' type T.
template <FloatingElement Out, FloatingElement T, Device D>
Tensor<Out, D> cross_entropy_as(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets,
                                std::int64_t ignore_index = -100) {
  TG_CHECK(logits.dim() == 2 || logits.dim() == 3, "cross_entropy: logits must be [N, V] or [B, T, V], got ",
           logits.shape());
  Shape want = logits.shape();
  want.erase(want.size() - 1);
  TG_CHECK(targets.shape() == want, "cross_entropy: targets must be ", want, " for logits ", logits.shape(), ", got ",
           targets.shape());
  const std::int64_t V = logits.shape()[logits.dim() - 1], rows = want.numel();
  const Tensor<std::int64_t> tc = targets.contiguous_raw();
  // the targets that count, from the host's targets (no read-back), in the range check's pass
  const std::int64_t count =
      detail::check_index_range(tc, V, "cross_entropy", "target", "the number of classes V =", &ignore_index);
  // Note [cross-entropy on strided rows]: rows a fixed stride apart are read in place
  std::int64_t ld = detail::uniform_row_stride(logits);
  const Tensor<T, D> lc = ld ? logits : logits.contiguous_raw();
  if (!ld) ld = V;
  // Note [cross-entropy on padded logits]: the gradient goes to the padded base, whole rows of ld
  Tensor<T, D> base;
  if (const auto& m = logits.autograd_meta(); m && m->padded_base.defined()) {
    const Tensor<T, D>& b = m->padded_base;
    if (b.requires_grad() && b.is_contiguous() && b.dim() == logits.dim() && b.shape()[b.dim() - 1] == ld &&
        b.data() == logits.data())
      base = b;
  }
  Tensor<accum_t<T>, D> lse = Tensor<accum_t<T>, D>::empty({rows});
  // Note [the loss stays on the device]: the kernel writes the mean into a scalar on D
  Tensor<accum_t<T>, D> mean = Tensor<accum_t<T>, D>::empty(Shape());
  TG_BACKEND(D, cross_entropy_forward<T>(lc.data(), tc.data(), lse.data(), mean.data(), rows, V, ld, ignore_index, count));
  Tensor<Out, D> out;
  if constexpr (std::is_same_v<Out, accum_t<T>>) out = mean;
  else out = mean.template to<Out>();
  // the gradient has the recorded input's shape: the logits' (rows of V), or the padded base's (rows of ld)
  auto backward = [rows, V, ld, ignore_index, ld_out = base.defined() ? ld : V](
                      detail::CrossEntropySaved<T, D>& s, const Tensor<Out, D>& dout, const Shape& shape) {
    Tensor<accum_t<T>, D> g;  // the upstream gradient as a scalar on D, read by the kernel
    if constexpr (std::is_same_v<Out, accum_t<T>>) g = dout.contiguous_raw();
    else g = dout.template to<accum_t<T>>();
    Tensor<T, D> dl = Tensor<T, D>::empty(shape);
    TG_BACKEND(D, cross_entropy_backward<T>(s.logits.data(), s.targets.data(), s.lse.data(), g.data(), s.count,
                                            dl.data(), rows, V, ld, ld_out, ignore_index));
    return std::tuple{dl};
  };
  detail::CrossEntropySaved<T, D> saved{lc.detach(), tc, lse, count};
  if (base.defined())
    autodiff::record("cross_entropy", out, std::move(saved),
                     [backward, shape = base.shape()](detail::CrossEntropySaved<T, D>& s, const Tensor<Out, D>& dout,
                                                      auto) { return backward(s, dout, shape); }, base);
  else
    autodiff::record("cross_entropy", out, std::move(saved),
                     [backward, shape = logits.shape()](detail::CrossEntropySaved<T, D>& s, const Tensor<Out, D>& dout,
                                                        auto) { return backward(s, dout, shape); }, logits);
  return out;
}

/// cross_entropy_as<T>: the loss in the logits' own type.
template <FloatingElement T, Device D>
Tensor<T, D> cross_entropy(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets,
                           std::int64_t ignore_index = -100) {
  return cross_entropy_as<T>(logits, targets, ignore_index);
}

}  // namespace tg

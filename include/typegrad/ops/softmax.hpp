// softmax and log_softmax over the last dim, max-subtracted (fp32 math for 16-bit storage).
//   auto p = tg::softmax(scores);          // (B,H,T,T), rows sum to 1
//   auto lp = tg::log_softmax(logits);     // backward from the saved output only
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/ops/fusion_hook.hpp"

namespace tg {

namespace detail {
template <Element T, Device D>
struct SoftmaxSaved {
  Tensor<T, D> out;  // y = softmax(x) (or log_softmax(x)), contiguous: backward needs only y
};

/// The forward of softmax / log_softmax (not recorded); rows and n describe the [rows, n] block.
template <FloatingElement T, Device D>
Tensor<T, D> softmax_forward_raw(const Tensor<T, D>& x, std::int64_t dim, bool log, const char* name, std::int64_t& rows,
                                 std::int64_t& n) {
  const int d = wrap_dim(dim, x.dim(), name);
  TG_CHECK(x.dim() == 0 || d == x.dim() - 1, name, ": only the last dim is supported, got dim ", dim,
           " for a tensor of shape ", x.shape());
  const Tensor<T, D> xc = x.contiguous_raw();
  n = x.dim() ? x.shape()[x.dim() - 1] : 1;
  rows = n ? x.numel() / n : 0;
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, softmax_forward<T>(xc.data(), out.data(), rows, n, log));
  return out;
}

/// Backward of both, from the saved output.
template <FloatingElement T, Device D>
auto softmax_backward_fn(std::int64_t rows, std::int64_t n, bool log) {
  return [rows, n, log](SoftmaxSaved<T, D>& s, const Tensor<T, D>& dout, auto) {
    const Tensor<T, D> g = dout.contiguous_raw();
    Tensor<T, D> dx = Tensor<T, D>::empty(s.out.shape());
    TG_BACKEND(D, softmax_backward<T>(s.out.data(), g.data(), dx.data(), rows, n, log));
    return std::tuple{dx};
  };
}
}  // namespace detail

/// y_i = exp(x_i − max x) / Σ_j exp(x_j − max x) over the last dim.
template <FloatingElement T, Device D>
Tensor<T, D> softmax(const Tensor<T, D>& x, std::int64_t dim = -1) {
  if (fusion::rewriter()) [[unlikely]]  // the end of a hand-written scale, mask and softmax (Note [pair rewrites])
    if (x.dim() == 0 || dim == -1 || dim == x.dim() - 1)
      if (auto f = detail::try_consume_softmax(x)) return *f;
  std::int64_t rows, n;
  Tensor<T, D> out = detail::softmax_forward_raw(x, dim, false, "softmax", rows, n);
  autodiff::record("softmax", out, detail::SoftmaxSaved<T, D>{out.detach()}, detail::softmax_backward_fn<T, D>(rows, n, false), x);
  return out;
}

/// y_i = x_i − max x − log Σ_j exp(x_j − max x) over the last dim.
template <FloatingElement T, Device D>
Tensor<T, D> log_softmax(const Tensor<T, D>& x, std::int64_t dim = -1) {
  std::int64_t rows, n;
  Tensor<T, D> out = detail::softmax_forward_raw(x, dim, true, "log_softmax", rows, n);
  autodiff::record("log_softmax", out, detail::SoftmaxSaved<T, D>{out.detach()},
                   detail::softmax_backward_fn<T, D>(rows, n, true), x);
  return out;
}

}  // namespace tg

#include "typegrad/ops/fused_pairs.hpp"  // run_fused_scale_masked_softmax (after softmax: it may reach this header)

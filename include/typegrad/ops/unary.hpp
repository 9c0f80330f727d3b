// Unary elementwise ops: exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu (exact or tanh form), silu.
//   auto h = tg::gelu_tanh(x);     // GPT-2's MLP activation (recorded "gelu_tanh"); tg::gelu(x) is the exact form
//   auto p = tg::sigmoid(logits);  auto l = tg::log(p);
// Formulas: math::apply / math::grad (detail/math.hpp), shared with the CUDA backend. Each backward keeps
// one tensor: the output where f' is a function of f (exp, sqrt, rsqrt, tanh, sigmoid, relu), else the
// input (log, gelu, silu); math::uses_output says which.
#pragma once

#include <type_traits>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/detail/math.hpp"
#include "typegrad/ops/fusion_hook.hpp"

namespace tg {

namespace detail {
/// Saved by ops whose derivative is a function of their output.
template <Element T, Device D>
struct UnaryOutputSaved {
  Tensor<T, D> out;
};
/// Saved by ops whose derivative needs their input.
template <Element T, Device D>
struct UnaryInputSaved {
  Tensor<T, D> x;
};

/// y = f(x), contiguous, no autodiff.
template <FloatingElement T, Device D>
Tensor<T, D> unary_raw(math::Unary op, const Tensor<T, D>& x) {
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, unary_forward<T>(op, x.data(), x.strides(), out.data(), x.shape()));
  return out;
}

/// dx = dout · f'(saved), contiguous, no autodiff.
template <FloatingElement T, Device D>
Tensor<T, D> unary_grad_raw(math::Unary op, const Tensor<T, D>& saved, const Tensor<T, D>& dout) {
  TG_CHECK(saved.shape() == dout.shape(), "unary backward: gradient shape ", dout.shape(), " does not match ",
           saved.shape());
  Tensor<T, D> din = Tensor<T, D>::empty(dout.shape());
  TG_BACKEND(D, unary_backward<T>(op, saved.data(), saved.strides(), dout.data(), dout.strides(), din.data(), dout.shape()));
  return din;
}

/// The backward shared by every unary op: f' from whichever tensor the op saved.
template <math::Unary U>
struct UnaryBackward {
  template <Element T, Device D, class Need>
  std::tuple<Tensor<T, D>> operator()(UnaryOutputSaved<T, D>& s, const Tensor<T, D>& dout, Need) const {
    static_assert(math::uses_output(U));
    return std::tuple{unary_grad_raw(U, s.out, dout)};
  }
  template <Element T, Device D, class Need>
  std::tuple<Tensor<T, D>> operator()(UnaryInputSaved<T, D>& s, const Tensor<T, D>& dout, Need) const {
    static_assert(!math::uses_output(U));
    return std::tuple{unary_grad_raw(U, s.x, dout)};
  }
};
}  // namespace detail

/// e^x
template <FloatingElement T, Device D>
Tensor<T, D> exp(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::exp, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::exp, x);
  autodiff::record("exp", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::exp>{}, x);
  return out;
}

/// Natural log (NaN below 0, -inf at 0).
template <FloatingElement T, Device D>
Tensor<T, D> log(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::log, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::log, x);
  autodiff::record("log", out, detail::UnaryInputSaved<T, D>{x.detach()}, detail::UnaryBackward<math::Unary::log>{}, x);
  return out;
}

/// sqrt(x)
template <FloatingElement T, Device D>
Tensor<T, D> sqrt(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::sqrt, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::sqrt, x);
  autodiff::record("sqrt", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::sqrt>{}, x);
  return out;
}

/// 1 / sqrt(x)
template <FloatingElement T, Device D>
Tensor<T, D> rsqrt(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::rsqrt, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::rsqrt, x);
  autodiff::record("rsqrt", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::rsqrt>{}, x);
  return out;
}

/// tanh(x)
template <FloatingElement T, Device D>
Tensor<T, D> tanh(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::tanh, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::tanh, x);
  autodiff::record("tanh", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::tanh>{}, x);
  return out;
}

/// 1 / (1 + e^-x)
template <FloatingElement T, Device D>
Tensor<T, D> sigmoid(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::sigmoid, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::sigmoid, x);
  autodiff::record("sigmoid", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::sigmoid>{}, x);
  return out;
}

/// max(x, 0); the gradient at 0 is 0; NaN propagates.
template <FloatingElement T, Device D>
Tensor<T, D> relu(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::relu, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::relu, x);
  autodiff::record("relu", out, detail::UnaryOutputSaved<T, D>{out.detach()}, detail::UnaryBackward<math::Unary::relu>{}, x);
  return out;
}

/// GELU, exact: x·Φ(x) = 0.5 x erfc(-x/√2) (PyTorch's approximate='none').
template <FloatingElement T, Device D>
Tensor<T, D> gelu(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::gelu_erf, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::gelu_erf, x);
  autodiff::record("gelu", out, detail::UnaryInputSaved<T, D>{x.detach()}, detail::UnaryBackward<math::Unary::gelu_erf>{}, x);
  return out;
}

/// GELU, tanh approximation: 0.5 x (1 + tanh(√(2/π)(x + 0.044715 x³))) (GPT-2; approximate='tanh').
template <FloatingElement T, Device D>
Tensor<T, D> gelu_tanh(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::gelu_tanh, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::gelu_tanh, x);
  autodiff::record("gelu_tanh", out, detail::UnaryInputSaved<T, D>{x.detach()}, detail::UnaryBackward<math::Unary::gelu_tanh>{}, x);
  return out;
}

/// GELU with the form chosen at run time (a config flag): none -> gelu ("gelu"), tanh -> gelu_tanh ("gelu_tanh").
enum class GeluApprox : unsigned char { none, tanh };
template <FloatingElement T, Device D>
Tensor<T, D> gelu(const Tensor<T, D>& x, GeluApprox approx) {
  return approx == GeluApprox::tanh ? gelu_tanh(x) : gelu(x);
}

/// x · sigmoid(x) (a.k.a. swish)
template <FloatingElement T, Device D>
Tensor<T, D> silu(const Tensor<T, D>& x) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Unary::silu, 0), x.shape(), x)) return *f;
  Tensor<T, D> out = detail::unary_raw(math::Unary::silu, x);
  autodiff::record("silu", out, detail::UnaryInputSaved<T, D>{x.detach()}, detail::UnaryBackward<math::Unary::silu>{}, x);
  return out;
}

}  // namespace tg

// detail::run_fused_chain, which the ops above call (pointwise.hpp includes it last itself: it needs this header whole)
#ifndef TG_POINTWISE_HPP_IN_PROGRESS
#include "typegrad/ops/pointwise_chain.hpp"
#endif

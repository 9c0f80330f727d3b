// add, sub, mul, div with numpy broadcasting, and with a scalar on either side.
//   auto y = tg::add(x, bias);      // (B,T,C) + (C)
//   auto z = x * 0.5;  auto w = 1.0 - x;
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/ops/fusion_hook.hpp"
#include "typegrad/ops/reduce.hpp"

namespace tg {

namespace detail {
/// a's strides in the index space of `out` (0 on broadcast dims).
template <Element T, Device D>
Shape broadcast_strides(const Tensor<T, D>& a, const Shape& out) {
  Shape st = Shape::filled(out.size(), 0);
  const int lead = out.size() - a.dim();
  for (int i = 0; i < a.dim(); ++i) st[lead + i] = a.shape()[i] == 1 ? 0 : a.strides()[i];
  return st;
}

template <Element T, Device D>
Tensor<T, D> binary_raw(math::Binary op, const Tensor<T, D>& a, const Tensor<T, D>& b, const char* name) {
  const Shape out_shape = broadcast_shapes(a.shape(), b.shape(), name);
  Tensor<T, D> out = Tensor<T, D>::empty(out_shape);
  TG_BACKEND(D, binary<T>(op, a.data(), broadcast_strides(a, out_shape), b.data(), broadcast_strides(b, out_shape), out.data(), out_shape));
  return out;
}

struct BinarySaved {};
template <Element T, Device D>
struct MulDivSaved {
  Tensor<T, D> a, b;  // mul: both inputs; div: a and b
};
}  // namespace detail

template <FloatingElement T, Device D>
Tensor<T, D> add(const Tensor<T, D>& a, const Tensor<T, D>& b) {
  Tensor<T, D> out;
  if (fusion::rewriter()) [[unlikely]] {
    bool deferred = false;  // the sum a later layernorm writes (Note [pair rewrites]): only the node is recorded here
    if (auto f = detail::try_fuse(pw::ChainStep(math::Binary::add, 0, 1), broadcast_shapes(a.shape(), b.shape(), "add"), a, &b,
                                  &deferred)) {
      if (!deferred) return *f;
      out = std::move(*f);
    }
  }
  if (!out.defined()) out = detail::binary_raw(math::Binary::add, a, b, "add");
  autodiff::record("add", out, detail::BinarySaved{},
                   [sa = a.shape(), sb = b.shape()](detail::BinarySaved&, const Tensor<T, D>& g, auto need) {
                     return std::tuple{need[0] ? sum_to_shape(g, sa) : Tensor<T, D>(), need[1] ? sum_to_shape(g, sb) : Tensor<T, D>()};
                   }, a, b);
  return out;
}

template <FloatingElement T, Device D>
Tensor<T, D> sub(const Tensor<T, D>& a, const Tensor<T, D>& b) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Binary::sub, 0, 1), broadcast_shapes(a.shape(), b.shape(), "sub"), a, &b))
      return *f;
  Tensor<T, D> out = detail::binary_raw(math::Binary::sub, a, b, "sub");
  autodiff::record("sub", out, detail::BinarySaved{},
                   [sa = a.shape(), sb = b.shape()](detail::BinarySaved&, const Tensor<T, D>& g, auto need) {
                     Tensor<T, D> db;
                     if (need[1]) {
                       const Tensor<T, D> s = sum_to_shape(g, sb);
                       db = detail::binary_raw(math::Binary::sub, Tensor<T, D>::zeros({1}), s, "sub");
                     }
                     return std::tuple{need[0] ? sum_to_shape(g, sa) : Tensor<T, D>(), db};
                   }, a, b);
  return out;
}

template <FloatingElement T, Device D>
Tensor<T, D> mul(const Tensor<T, D>& a, const Tensor<T, D>& b) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Binary::mul, 0, 1), broadcast_shapes(a.shape(), b.shape(), "mul"), a, &b))
      return *f;
  Tensor<T, D> out = detail::binary_raw(math::Binary::mul, a, b, "mul");
  autodiff::record("mul", out, detail::MulDivSaved<T, D>{a.detach(), b.detach()},
                   [](detail::MulDivSaved<T, D>& s, const Tensor<T, D>& g, auto need) {
                     Tensor<T, D> da, db;
                     if (need[0]) da = sum_to_shape(detail::binary_raw(math::Binary::mul, g, s.b, "mul"), s.a.shape());
                     if (need[1]) db = sum_to_shape(detail::binary_raw(math::Binary::mul, g, s.a, "mul"), s.b.shape());
                     return std::tuple{da, db};
                   }, a, b);
  return out;
}

template <FloatingElement T, Device D>
Tensor<T, D> div(const Tensor<T, D>& a, const Tensor<T, D>& b) {
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_fuse(pw::ChainStep(math::Binary::div, 0, 1), broadcast_shapes(a.shape(), b.shape(), "div"), a, &b))
      return *f;
  Tensor<T, D> out = detail::binary_raw(math::Binary::div, a, b, "div");
  autodiff::record("div", out, detail::MulDivSaved<T, D>{a.detach(), b.detach()},
                   [](detail::MulDivSaved<T, D>& s, const Tensor<T, D>& g, auto need) {
                     Tensor<T, D> da, db;
                     const Tensor<T, D> g_over_b = detail::binary_raw(math::Binary::div, g, s.b, "div");
                     if (need[0]) da = sum_to_shape(g_over_b, s.a.shape());
                     if (need[1]) {
                       // d(a/b)/db = -a/b^2 = -(g/b)·(a/b)
                       const Tensor<T, D> q = detail::binary_raw(math::Binary::div, s.a, s.b, "div");
                       const Tensor<T, D> t = detail::binary_raw(math::Binary::mul, g_over_b, q, "div");
                       db = sum_to_shape(detail::binary_raw(math::Binary::sub, Tensor<T, D>::zeros({1}), t, "div"), s.b.shape());
                     }
                     return std::tuple{da, db};
                   }, a, b);
  return out;
}

// Scalars on either side: a 1-element tensor broadcast (its gradient is not kept).
#define TG_SCALAR_OVERLOADS(fn, sym)                                                                   \
  template <FloatingElement T, Device D>                                                              \
  Tensor<T, D> fn(const Tensor<T, D>& a, double s) { return fn(a, Tensor<T, D>::full(Shape(), s)); }      \
  template <FloatingElement T, Device D>                                                              \
  Tensor<T, D> fn(double s, const Tensor<T, D>& b) { return fn(Tensor<T, D>::full(Shape(), s), b); }      \
  template <FloatingElement T, Device D>                                                              \
  Tensor<T, D> operator sym(const Tensor<T, D>& a, const Tensor<T, D>& b) { return fn(a, b); }        \
  template <FloatingElement T, Device D>                                                              \
  Tensor<T, D> operator sym(const Tensor<T, D>& a, double s) { return fn(a, s); }                     \
  template <FloatingElement T, Device D>                                                              \
  Tensor<T, D> operator sym(double s, const Tensor<T, D>& b) { return fn(s, b); }
TG_SCALAR_OVERLOADS(add, +)
TG_SCALAR_OVERLOADS(sub, -)
TG_SCALAR_OVERLOADS(mul, *)
TG_SCALAR_OVERLOADS(div, /)
#undef TG_SCALAR_OVERLOADS

// Note [mixing precisions or devices]
// Binary ops take two tensors of one element type and one device. A call with two different types
// picks this overload, whose static_assert names the fix, instead of a wall of deduction failures.
#define TG_MIXED_OPERANDS_GUARD(fn)                                                                         \
  template <class T, class D, class U, class E>                                                             \
    requires(!std::is_same_v<T, U> || !std::is_same_v<D, E>)                                                \
  void fn(const Tensor<T, D>&, const Tensor<U, E>&) {                                                       \
    static_assert(std::is_same_v<T, U>,                                                                     \
                  "tg::" #fn ": the operands have different precisions; convert one explicitly, e.g. b.to<T>()"); \
    static_assert(std::is_same_v<D, E>, "tg::" #fn ": the operands live on different devices; move one "    \
                                        "explicitly with .to<tg::cpu>() or .to<tg::cuda>()");                \
  }
TG_MIXED_OPERANDS_GUARD(add)
TG_MIXED_OPERANDS_GUARD(sub)
TG_MIXED_OPERANDS_GUARD(mul)
TG_MIXED_OPERANDS_GUARD(div)
#undef TG_MIXED_OPERANDS_GUARD

/// neg(x) = -x, as x·(−1): exact, and −0 for +0 (0 − x would give +0), forward and backward.
template <FloatingElement T, Device D>
Tensor<T, D> neg(const Tensor<T, D>& x) {
  return mul(x, -1.0);
}
template <FloatingElement T, Device D>
Tensor<T, D> operator-(const Tensor<T, D>& x) {
  return neg(x);
}

template <Element T, Device D>
Tensor<T, D> mean(const Tensor<T, D>& x, std::initializer_list<std::int64_t> dims, bool keepdim)
  requires FloatingElement<T>
{
  const std::vector<int> rd = detail::reduction_dims(dims, x.dim(), "mean");
  std::int64_t count = 1;
  for (int d : rd) count *= x.shape()[d];
  return mul(sum(x, dims, keepdim), 1.0 / static_cast<double>(std::max<std::int64_t>(count, 1)));
}

}  // namespace tg

// detail::run_fused_chain, which the ops above call (pointwise.hpp includes it last itself: it needs this header whole)
#ifndef TG_POINTWISE_HPP_IN_PROGRESS
#include "typegrad/ops/pointwise_chain.hpp"
#endif

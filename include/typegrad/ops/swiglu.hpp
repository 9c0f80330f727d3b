// swiglu: the fused SwiGLU activation of LLaMA-style MLPs (Shazeer 2020, "GLU Variants Improve Transformer"):
// x (..., 2N) is split into a = x[..., :N] and b = x[..., N:], out = silu(a) · b, shape (..., N).
//   auto h = tg::swiglu(tg::linear(x, w_gate_up));   // w_gate_up [2N, C]: the gate rows first, then the up rows
//   auto y = tg::linear(h, w_down);                  // as torch's `a, b = h.chunk(2, -1); F.silu(a) * b`
#pragma once

#include <cstdint>

#include "typegrad/amp/rule.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"
#include "typegrad/detail/math.hpp"

// Note [swiglu halves]
// The FIRST half a is gated (goes through silu), the second half b is the linear "up" value, as in
// `a, b = x.chunk(2, dim=-1); F.silu(a) * b` (the common torch form; LLaMA's w1 / w3 stacked in that order).
// With s = sigmoid(a):
//   out = a·s·b,   d out/d a = b · s · (1 + a·(1 − s)),   d out/d b = a·s = silu(a).
// Math in accum_t<T> (fp32 for 16-bit storage), each result rounded once on store. The scalar formulas
// below are the one definition both backends' kernels run.

// swiglu_forward:  out[r, j] = silu(x[r, j]) · x[r, n + j] over contiguous x [rows, 2n], out [rows, n].
// swiglu_backward: dx[r, j] = dout[r, j] · x[r, n+j] · silu'(x[r, j]), dx[r, n+j] = dout[r, j] · silu(x[r, j]);
//                  x, dx [rows, 2n], dout [rows, n], all contiguous.
#define TG_KERNELS_SWIGLU(K, ...)                                                                       \
  K(void, swiglu_forward, (const T* x, T* out, std::int64_t rows, std::int64_t n), __VA_ARGS__)          \
  K(void, swiglu_backward, (const T* x, const T* dout, T* dx, std::int64_t rows, std::int64_t n), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_SWIGLU)
// Elementwise: storage in the compute type, fp32 registers for 16-bit storage.
TG_AUTOCAST_RULE(swiglu, elementwise)

namespace tg::math {
/// silu(a) · b (Note [swiglu halves]).
template <class A>
TG_HOST_DEVICE TG_INLINE A swiglu(A a, A b) {
  return a * sigmoid(a) * b;
}
/// The two input gradients of swiglu for upstream g: da = g · b · s(1 + a(1 − s)), db = g · a · s.
template <class A>
TG_HOST_DEVICE TG_INLINE void swiglu_grad(A a, A b, A g, A& da, A& db) {
  const A s = sigmoid(a);
  da = g * b * s * (A(1) + a * (A(1) - s));
  db = g * a * s;
}
}  // namespace tg::math

#ifndef TG_KERNELS_ONLY  // Note [kernels declared once]: kernel files see only the list above
#include "typegrad/autodiff/node.hpp"

namespace tg {
namespace detail {
template <Element T, Device D>
struct SwigluSaved {
  Tensor<T, D> x;  // the input (contiguous, detached): backward needs both halves
};
}  // namespace detail

/// silu(a) · b with a, b the first and second halves of x's last dim (Note [swiglu halves]): (..., 2N) -> (..., N).
template <FloatingElement T, Device D>
Tensor<T, D> swiglu(const Tensor<T, D>& x) {
  TG_CHECK(x.dim() >= 1, "swiglu: x must have at least one dim (..., 2N), got ", x.shape());
  const std::int64_t two_n = x.shape()[x.dim() - 1];
  TG_CHECK(two_n % 2 == 0, "swiglu: the last dim of x must be even (the gate half, then the up half), got ", two_n,
           " (x is ", x.shape(), ")");
  const std::int64_t n = two_n / 2, rows = two_n ? x.numel() / two_n : 0;
  Shape out_shape = x.shape();
  out_shape[out_shape.size() - 1] = n;
  const Tensor<T, D> xc = x.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(out_shape);
  TG_BACKEND(D, swiglu_forward<T>(xc.data(), out.data(), rows, n));
  autodiff::record("swiglu", out, detail::SwigluSaved<T, D>{xc.detach()},
                   [rows, n](detail::SwigluSaved<T, D>& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dx = Tensor<T, D>::empty(s.x.shape());
                     TG_BACKEND(D, swiglu_backward<T>(s.x.data(), g.data(), dx.data(), rows, n));
                     return std::tuple{dx};
                   }, x);
  return out;
}

}  // namespace tg
#endif  // TG_KERNELS_ONLY

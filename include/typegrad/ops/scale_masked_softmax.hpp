// scale_masked_softmax: a hand-written attention's scale, mask and softmax in one pass with one node.
//   auto p = tg::scale_masked_softmax(scores, 1.0 / std::sqrt(hs), tg::causal_mask(T));  // fill -inf
//   auto p = tg::scale_masked_softmax(scores, 0.125);                                     // no mask
#pragma once

#include <cmath>
#include <cstdint>

#include "typegrad/amp/rule.hpp"
#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/ops/binary.hpp"

// Note [fused scale, mask and softmax]
// scale_masked_softmax(x, s, mask, fill) is softmax(masked_fill(mul(x, s), mask, fill)) over the last dim, bit for
// bit on each device, forward and backward: v_j = T(x_j · s) (s rounded to T, as mul's scalar is), v_j = T(fill)
// where the mask (uint8, broadcast to x's shape) is nonzero, and the softmax of v's row; the backward runs
// softmax's formula, zeroes the masked positions and multiplies by s, rounding to T after each as the three
// separate backward ops store their results. The CPU writes each row's v into a row buffer and runs softmax's
// own row code over it; the GPU recomputes v_j in each of softmax's passes, its product through __fmul_rn so that
// no multiply-add joins it to the max subtraction. It keeps only y (and the mask and the one-element scale),
// where the three ops keep mul's input x, the mask and y: the composite's (B,H,T,T) scores are not kept.
// detail::scale_masked_softmax_at also takes a division (softmax(x / s)), no scale or no mask: the forms
// tg::compile's rewrite of a hand-written chain (mul or div by a one-element tensor, masked_fill, softmax; Note
// [pair rewrites]) runs as this op.

// softmax's rule (its kernels, declared with softmax's in detail/kernels/nn.hpp, run softmax's row code and math).
TG_AUTOCAST_RULE(scale_masked_softmax, fp32_math)

namespace tg {

namespace detail {
template <Element T, Device D>
struct ScaleMaskedSoftmaxSaved {
  Tensor<T, D> out, scale;         // y; the one-element scale (undefined: none)
  Tensor<std::uint8_t, D> mask;    // undefined: none
  Shape mask_strides;              // the mask's strides in y's index space (0 on broadcast dims)
};

/// softmax(masked_fill(x ∘ s, mask, fill)) with ∘ = · (÷ when `divide`); scale and mask may be null.
template <FloatingElement T, Device D>
Tensor<T, D> scale_masked_softmax_at(const Tensor<T, D>& x, const Tensor<T, D>* scale, bool divide,
                                     const Tensor<std::uint8_t, D>* mask, double fill) {
  constexpr const char* name = "scale_masked_softmax";
  TG_CHECK(!scale || (scale->defined() && scale->numel() == 1), name, ": the scale must be one element, got ",
           scale && scale->defined() ? to_string(scale->shape()) : std::string("an undefined tensor"));
  TG_CHECK(!scale || !scale->requires_grad(), name, ": the scale must not require a gradient (use the separate ops)");
  Shape sm;
  if (mask) {
    TG_CHECK(mask->defined(), name, ": the mask is an undefined tensor");
    bool fits = mask->dim() <= x.dim();
    for (int i = 0; fits && i < mask->dim(); ++i) {
      const std::int64_t m = mask->shape()[i], have = x.shape()[x.dim() - mask->dim() + i];
      fits = m == have || m == 1;
    }
    TG_CHECK(fits, name, ": the mask of shape ", mask->shape(), " cannot be broadcast to the input's shape ", x.shape());
    sm = broadcast_strides(*mask, x.shape());
  }
  const Tensor<T, D> xc = x.contiguous_raw();
  const Tensor<T, D> sc = scale ? scale->contiguous_raw() : Tensor<T, D>();
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, scale_masked_softmax_forward<T>(xc.data(), scale ? sc.data() : nullptr, divide, mask ? mask->data() : nullptr,
                                                sm, scalar_cast<T>(fill), out.data(), x.shape()));
  autodiff::record(name, out,
                   ScaleMaskedSoftmaxSaved<T, D>{out.detach(), sc.defined() ? sc.detach() : Tensor<T, D>(),
                                                 mask ? mask->detach() : Tensor<std::uint8_t, D>(), sm},
                   [divide](ScaleMaskedSoftmaxSaved<T, D>& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dx = Tensor<T, D>::empty(s.out.shape());  // the kernel writes every element
                     TG_BACKEND(D, scale_masked_softmax_backward<T>(
                                       s.out.data(), g.data(), s.scale.defined() ? s.scale.data() : nullptr, divide,
                                       s.mask.defined() ? s.mask.data() : nullptr, s.mask_strides, dx.data(), s.out.shape()));
                     return std::tuple{dx};
                   }, x);
  return out;
}
}  // namespace detail

/// softmax(masked_fill(x · scale, mask, fill)) over the last dim in one pass (Note [fused scale, mask and softmax]):
/// the mask (uint8, nonzero where masked) broadcast to x's shape.
template <FloatingElement T, Device D>
Tensor<T, D> scale_masked_softmax(const Tensor<T, D>& x, double scale, const Tensor<std::uint8_t, D>& mask,
                                  double fill = -INFINITY) {
  const Tensor<T, D> s = Tensor<T, D>::full(Shape(), scale);  // rounded to T, as mul's scalar
  return detail::scale_masked_softmax_at(x, &s, false, &mask, fill);
}

/// softmax(x · scale) over the last dim in one pass.
template <FloatingElement T, Device D>
Tensor<T, D> scale_masked_softmax(const Tensor<T, D>& x, double scale) {
  const Tensor<T, D> s = Tensor<T, D>::full(Shape(), scale);
  return detail::scale_masked_softmax_at<T, D>(x, &s, false, nullptr, 0.0);
}

}  // namespace tg

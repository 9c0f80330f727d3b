// masked_fill (value where a broadcastable uint8 mask is nonzero) and causal_mask (attention's mask).
//   auto m = tg::causal_mask(T);                                      // (T,T), 1 above the diagonal
//   auto att = tg::masked_fill(scores, m, -INFINITY);                 // scores (B,H,T,T)
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/ops/binary.hpp"

namespace tg {

/// What masked_fill keeps for backward: the mask and its strides broadcast to the input's shape.
template <Device D>
struct MaskedFillSaved {
  Tensor<std::uint8_t, D> mask;
  Shape mask_strides;  // in the input's index space, 0 on broadcast dims
};

/// out = mask ? value : x, the mask broadcast to x's shape (numpy rules; the output has x's shape).
/// d out / d x = !mask.
template <FloatingElement T, Device D>
Tensor<T, D> masked_fill(const Tensor<T, D>& x, const Tensor<std::uint8_t, D>& mask, double value) {
  TG_CHECK(mask.defined(), "masked_fill: the mask is an undefined tensor");
  bool fits = mask.dim() <= x.dim();
  for (int i = 0; fits && i < mask.dim(); ++i) {
    const std::int64_t m = mask.shape()[i], have = x.shape()[x.dim() - mask.dim() + i];
    fits = m == have || m == 1;
  }
  TG_CHECK(fits, "masked_fill: the mask of shape ", mask.shape(), " cannot be broadcast to the input's shape ", x.shape());
  if (fusion::rewriter()) [[unlikely]]  // an op of a hand-written scale, mask and softmax (Note [pair rewrites])
    if (auto f = detail::try_defer_masked_fill(x, mask, value)) return *f;
  const Shape sm = detail::broadcast_strides(mask, x.shape());
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, masked_fill<T>(x.data(), x.strides(), mask.data(), sm, scalar_cast<T>(value), out.data(), x.shape()));
  autodiff::record("masked_fill", out, MaskedFillSaved<D>{mask.detach(), sm},
                   [](MaskedFillSaved<D>& s, const Tensor<T, D>& dout, auto) {
                     Tensor<T, D> din = Tensor<T, D>::empty(dout.shape());
                     TG_BACKEND(D, masked_fill<T>(dout.data(), dout.strides(), s.mask.data(), s.mask_strides,
                                                  scalar_cast<T>(0.0), din.data(), dout.shape()));
                     return std::tuple{din};
                   }, x);
  return out;
}

/// (T,T) uint8 mask for causal attention: m[i, j] = 1 (masked) iff j > i, i.e. strictly above the diagonal.
template <Device D = cpu>
Tensor<std::uint8_t, D> causal_mask(std::int64_t t) {
  TG_CHECK(t >= 0, "causal_mask: the size must be non-negative, got ", t);
  Tensor<std::uint8_t, cpu> m = Tensor<std::uint8_t, cpu>::empty({t, t});
  std::uint8_t* p = m.data();
  for (std::int64_t i = 0; i < t; ++i)
    for (std::int64_t j = 0; j < t; ++j) p[i * t + j] = j > i ? 1 : 0;
  if constexpr (std::is_same_v<D, cpu>) return m;
  else return m.template to<D>();
}

}  // namespace tg

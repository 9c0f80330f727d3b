// rope: rotary position embeddings (Su et al. 2021, RoFormer eq. 34), the "rotate half" form of GPT-NeoX
// and HF LLaMA, over x (B,H,T,Dh) with positions offset, offset+1, ... along T; optional partial rotary.
//   auto q2 = tg::rope(q);                        // q (B,H,T,Dh), theta 10000, positions 0..T-1
//   auto k2 = tg::rope(k, 10000.0, cache_len);    // decoding with a KV cache: positions start at cache_len
#pragma once

#include <cmath>
#include <cstdint>

#include "typegrad/amp/rule.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// Note [rope: rotate half]
// x's last dim holds Dh features; the first R (rotary_dim, default Dh, even) are rotated, the rest pass
// through unchanged (partial rotary, GPT-NeoX / Phi). Feature i < R/2 is paired with i + R/2 (the "rotate
// half" convention of GPT-NeoX and HF LLaMA, `x * cos + rotate_half(x) * sin` with rotate_half(x) =
// cat(-x2, x1); not GPT-J's interleaved pairs (2i, 2i+1)). At position p = offset + t (t the index along
// dim -2) pair i turns by the angle
//   a(p, i) = p · theta^(-2i/R),  i = 0 .. R/2 − 1,
//   y[i]       = x[i] cos a − x[i+R/2] sin a,
//   y[i+R/2]   = x[i+R/2] cos a + x[i] sin a.
// The map is a rotation, so its backward is the rotation by −a: dx[i] = dy[i] cos a + dy[i+R/2] sin a,
// dx[i+R/2] = dy[i+R/2] cos a − dy[i] sin a (the same kernel with sign −1). The frequency and the angle are
// computed in fp64 and their cosine and sine rounded once to the math type, so positions far into a long
// context (p·freq of 10^5 radians) lose no accuracy; math in accum_t<T> (fp32 for 16-bit storage).

// rope_rotate: y = x rotated by sign·a(p, i) (sign +1 forward, −1 backward) over contiguous rows of
// (T, Dh): x, y [rows, T, Dh], position of row element t is offset + t, features [R, Dh) copied.
#define TG_KERNELS_ROPE(K, ...)                                                                              \
  K(void, rope_rotate, (const T* x, T* y, std::int64_t rows, std::int64_t t, std::int64_t dh, std::int64_t r, \
                        std::int64_t offset, double theta, int sign), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_ROPE)
// Elementwise-like, with fp32 math for 16-bit storage (its cos/sin and the rotation are never in 16 bits).
TG_AUTOCAST_RULE(rope, fp32_math)

namespace tg::detail {
/// The angle a(p, i) of Note [rope: rotate half], in fp64 (both backends call this).
TG_HOST_DEVICE TG_INLINE double rope_angle(std::int64_t pos, std::int64_t i, std::int64_t r, double theta) {
  return static_cast<double>(pos) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(r));
}
}  // namespace tg::detail

#ifndef TG_KERNELS_ONLY  // Note [kernels declared once]: kernel files see only the list above
#include "typegrad/autodiff/node.hpp"
#include "typegrad/ops/reduce.hpp"

namespace tg {

/// Rotary position embeddings over x (…, T, Dh) (typically (B,H,T,Dh), the layout of causal_attention's
/// q and k): positions offset .. offset+T−1 along dim −2, frequencies theta^(−2i/R) for the first R =
/// rotary_dim features (−1: all Dh), rotate-half pairs (i, i+R/2) (Note [rope: rotate half]).
template <FloatingElement T, Device D>
Tensor<T, D> rope(const Tensor<T, D>& x, double theta = 10000.0, std::int64_t offset = 0,
                  std::int64_t rotary_dim = -1) {
  TG_CHECK(x.dim() >= 2, "rope: x must be (..., T, Dh), e.g. (B,H,T,Dh), got ", x.shape());
  const std::int64_t dh = x.shape()[x.dim() - 1], t = x.shape()[x.dim() - 2];
  const std::int64_t r = rotary_dim < 0 ? dh : rotary_dim;
  if (rotary_dim < 0)
    TG_CHECK(dh >= 2 && dh % 2 == 0, "rope: the last dim Dh of x must be even and at least 2, got Dh = ", dh,
             " (x is ", x.shape(), ")");
  else
    TG_CHECK(r >= 2 && r % 2 == 0 && r <= dh, "rope: rotary_dim must be even and in [2, Dh = ", dh, "], got ", r,
             " (x is ", x.shape(), ")");
  TG_CHECK(std::isfinite(theta) && theta > 0, "rope: theta must be positive and finite, got ", theta);
  TG_CHECK(offset >= 0, "rope: offset must be >= 0, got ", offset);
  const std::int64_t rows = t * dh ? x.numel() / (t * dh) : 0;
  const Tensor<T, D> xc = x.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, rope_rotate<T>(xc.data(), out.data(), rows, t, dh, r, offset, theta, 1));
  autodiff::record("rope", out, detail::NoSaved{},
                   [=](detail::NoSaved&, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dx = Tensor<T, D>::empty(g.shape());
                     TG_BACKEND(D, rope_rotate<T>(g.data(), dx.data(), rows, t, dh, r, offset, theta, -1));
                     return std::tuple{dx};
                   }, x);
  return out;
}

}  // namespace tg
#endif  // TG_KERNELS_ONLY

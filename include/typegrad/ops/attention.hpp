// Causal scaled-dot-product attention: a fused kernel (flash-attention style: the T×T probabilities are
// never stored, backward recomputes them from the per-row logsumexp) and the same op built from primitives.
//   auto y = tg::causal_attention(q, k, v);       // q, k, v (B,H,T,hs) -> (B,H,T,hs), scale 1/sqrt(hs)
//   auto r = tg::attention_composite(q, k, v);    // matmul, masked_fill, softmax, matmul: the reference
#pragma once

#include <cmath>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/attention.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/masked_fill.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/softmax.hpp"

namespace tg {

namespace detail {
template <Element T, Device D>
struct AttentionSaved {
  Tensor<T, D> q, k, v, out;    // contiguous (B,H,T,hs); out gives D_i = Σ dO_i·O_i in backward
  Tensor<accum_t<T>, D> lse;    // (B,H,T) logsumexp of each row of the scaled, masked scores
};

template <Element T, Device D>
void check_attention(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v, const char* op) {
  TG_CHECK(q.dim() == 4, op, ": q must be (B,H,T,hs), got ", q.shape());
  TG_CHECK(k.shape() == q.shape(), op, ": k must have q's shape ", q.shape(), ", got ", k.shape());
  TG_CHECK(v.shape() == q.shape(), op, ": v must have q's shape ", q.shape(), ", got ", v.shape());
}
}  // namespace detail

/// softmax(q·kᵀ / sqrt(hs) + causal mask) · v, fused; parallel over (B·H, query blocks).
template <FloatingElement T, Device D>
Tensor<T, D> causal_attention(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v) {
  detail::check_attention(q, k, v, "causal_attention");
  const std::int64_t B = q.shape()[0], H = q.shape()[1], Tn = q.shape()[2], hs = q.shape()[3];
  const double scale = hs ? 1.0 / std::sqrt(static_cast<double>(hs)) : 1.0;
  const Tensor<T, D> qc = q.contiguous_raw(), kc = k.contiguous_raw(), vc = v.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(q.shape());
  Tensor<accum_t<T>, D> lse = Tensor<accum_t<T>, D>::empty({B, H, Tn});
  TG_BACKEND(D, attention_forward<T>(qc.data(), kc.data(), vc.data(), out.data(), lse.data(), B * H, Tn, hs, scale, true));
  autodiff::record("causal_attention", out,
                   detail::AttentionSaved<T, D>{qc.detach(), kc.detach(), vc.detach(), out.detach(), lse},
                   [B, H, Tn, hs, scale](detail::AttentionSaved<T, D>& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dq = Tensor<T, D>::empty(s.q.shape()), dk = Tensor<T, D>::empty(s.q.shape()),
                                  dv = Tensor<T, D>::empty(s.q.shape());  // the kernel writes every element
                     TG_BACKEND(D, attention_backward<T>(s.q.data(), s.k.data(), s.v.data(), s.out.data(), g.data(),
                                                         s.lse.data(), dq.data(), dk.data(), dv.data(), B * H, Tn, hs,
                                                         scale, true));
                     return std::tuple{dq, dk, dv};
                   }, q, k, v);
  return out;
}

/// The same attention from primitives (records matmul, mul, masked_fill, softmax, matmul): the reference
/// the fused op is tested against, and a path that keeps the (B,H,T,T) probabilities.
template <FloatingElement T, Device D>
Tensor<T, D> attention_composite(const Tensor<T, D>& q, const Tensor<T, D>& k, const Tensor<T, D>& v) {
  detail::check_attention(q, k, v, "attention_composite");
  const std::int64_t Tn = q.shape()[2], hs = q.shape()[3];
  const double scale = hs ? 1.0 / std::sqrt(static_cast<double>(hs)) : 1.0;
  const Tensor<T, D> att = mul(matmul(q, k.transpose(-2, -1)), scale);  // (B,H,T,T)
  return matmul(softmax(masked_fill(att, causal_mask<D>(Tn), -INFINITY)), v);
}

}  // namespace tg

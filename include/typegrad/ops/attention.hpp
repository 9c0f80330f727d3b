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

namespace detail {
template <Element T, Device D>
struct AttentionQkvSaved {
  Tensor<T, D> qkv, out;      // contiguous (B,T,3C) and (B,T,C)
  Tensor<accum_t<T>, D> lse;  // (B,H,T)
};
}  // namespace detail

/// causal_attention of the n_head heads packed in a fused QKV projection's output: qkv (B,T,3C), its last dim
/// q, k, v (C each, head h at columns h·hs .. h·hs + hs of each) -> (B,T,C) with head h at the same columns.
/// The values of splitting qkv into heads, causal_attention and merging the heads back; but the kernels read
/// and write the packed layouts in place (16-bit heads are widened to fp32 on the CPU, as causal_attention's
/// are), so no head-layout copy is made or recorded and the backward writes dqkv in one tensor.
template <FloatingElement T, Device D>
Tensor<T, D> causal_attention_qkv(const Tensor<T, D>& qkv, std::int64_t n_head) {
  TG_CHECK(qkv.dim() == 3, "causal_attention_qkv: qkv must be (B,T,3C), got ", qkv.shape());
  TG_CHECK(n_head >= 1, "causal_attention_qkv: n_head must be >= 1, got ", n_head);
  const std::int64_t B = qkv.shape()[0], Tn = qkv.shape()[1], C3 = qkv.shape()[2];
  TG_CHECK(C3 % (3 * n_head) == 0, "causal_attention_qkv: the last dim of qkv ", qkv.shape(),
           " must be 3·n_head·head_size with n_head = ", n_head);
  const std::int64_t C = C3 / 3, hs = C / n_head;
  const double scale = hs ? 1.0 / std::sqrt(static_cast<double>(hs)) : 1.0;
  const Tensor<T, D> qc = qkv.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty({B, Tn, C});
  Tensor<accum_t<T>, D> lse = Tensor<accum_t<T>, D>::empty({B, n_head, Tn});
  TG_BACKEND(D, attention_qkv_forward<T>(qc.data(), out.data(), lse.data(), B, n_head, Tn, hs, scale));
  autodiff::record("causal_attention_qkv", out, detail::AttentionQkvSaved<T, D>{qc.detach(), out.detach(), lse},
                   [B, n_head, Tn, hs, scale](detail::AttentionQkvSaved<T, D>& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dqkv = Tensor<T, D>::empty(s.qkv.shape());  // the kernel writes every element
                     TG_BACKEND(D, attention_qkv_backward<T>(s.qkv.data(), s.out.data(), g.data(), s.lse.data(),
                                                             dqkv.data(), B, n_head, Tn, hs, scale));
                     return std::tuple{dqkv};
                   }, qkv);
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

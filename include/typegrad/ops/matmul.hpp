// matmul (batched, broadcasting batch dims, 1-D operands as in torch.matmul) and linear (x·Wᵀ + b).
//   auto y = tg::matmul(a, b);          // (B,M,K) @ (K,N) -> (B,M,N); transposed views run without copies
//   auto h = tg::linear(x, W, bias);    // x (B,T,C), W (N,C), bias (N) -> (B,T,N)
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/cpu/gemm.hpp"
#include "typegrad/detail/cpu/kernels.hpp"  // gemm_operand_ok: the GEMM operand geometry
#include "typegrad/detail/kernels/matmul.hpp"
#include "typegrad/detail/kernels/reduce.hpp"
#include "typegrad/ops/fusion_hook.hpp"
#include "typegrad/ops/reduce.hpp"

namespace tg {

namespace detail {

/// `t` itself when its last two dims can feed a GEMM through a Trans flag, else a contiguous copy.
template <Element T, Device D>
Tensor<T, D> gemm_ready(const Tensor<T, D>& t) {
  const int r = t.dim();
  if (backend::cpu::gemm_operand_ok(t.shape()[r - 2], t.shape()[r - 1], t.strides()[r - 2], t.strides()[r - 1]))
    return t.detach();
  return t.contiguous_raw();
}

/// Strides of `t` (rank nb_t + 2) laid out over a batch of rank nb (0 on broadcast batch dims).
template <Element T, Device D>
Shape matmul_strides(const Tensor<T, D>& t, const Shape& batch) {
  const int nb = batch.size(), nt = t.dim() - 2, lead = nb - nt;
  Shape st = Shape::filled(nb + 2, 0);
  for (int d = 0; d < nt; ++d) st[lead + d] = t.shape()[d] == 1 ? 0 : t.strides()[d];
  st[nb] = t.strides()[nt];
  st[nb + 1] = t.strides()[nt + 1];
  return st;
}

/// Contiguous strides of a [own batch..., rows, cols] buffer over `batch` (0 where its batch dim is 1 or
/// missing: matmul_strided then reduces over that dim).
inline Shape reduce_strides(const Shape& own, const Shape& batch) {
  const Shape cs = contiguous_strides(own);
  const int nb = batch.size(), no = own.size() - 2, lead = nb - no;
  Shape st = Shape::filled(nb + 2, 0);
  for (int d = 0; d < no; ++d) st[lead + d] = own[d] == 1 ? 0 : cs[d];
  st[nb] = cs[no];
  st[nb + 1] = cs[no + 1];
  return st;
}

template <Element T, Device D>
Tensor<T, D> swap_last_two(const Tensor<T, D>& t) {
  Shape sz = t.shape(), st = t.strides();
  const int r = t.dim();
  std::swap(sz[r - 1], sz[r - 2]);
  std::swap(st[r - 1], st[r - 2]);
  return t.as_strided_raw(sz, st, t.storage_offset());
}

/// C (shape c_shape = c's batch + [M, N], contiguous) = A·B over `batch`, reducing over the batch dims
/// that c_shape lacks or has as 1.
template <Element T, Device D>
Tensor<T, D> matmul_into(const Tensor<T, D>& a, const Tensor<T, D>& b, const Shape& batch, const Shape& c_shape) {
  const Tensor<T, D> ga = gemm_ready(a), gb = gemm_ready(b);
  const std::int64_t M = ga.shape()[ga.dim() - 2], K = ga.shape()[ga.dim() - 1], N = gb.shape()[gb.dim() - 1];
  Tensor<T, D> c = Tensor<T, D>::empty(c_shape);
  TG_BACKEND(D, matmul_strided<T>(ga.data(), matmul_strides(ga, batch), gb.data(), matmul_strides(gb, batch), c.data(),
                                  reduce_strides(c_shape, batch), batch, M, N, K));
  return c;
}

template <Element T, Device D>
struct MatmulSaved {
  Tensor<T, D> a, b;  // the operands as [batch..., M, K] and [batch..., K, N] views (1-D ones unsqueezed)
};
template <Element T, Device D>
struct LinearSaved {
  Tensor<T, D> x, weight;  // x as a [rows, K] matrix view (or copy), weight [N, K]
};

inline Shape batch_of(const Shape& s) {
  Shape b;
  for (int i = 0; i + 2 < s.size(); ++i) b.push_back(s[i]);
  return b;
}
inline Shape with_matrix(Shape batch, std::int64_t r, std::int64_t c) {
  batch.push_back(r);
  batch.push_back(c);
  return batch;
}
}  // namespace detail

/// torch.matmul semantics: a [..., M, K] · b [..., K, N] with broadcast batch dims; a 1-D a is a row
/// vector [1, K] and a 1-D b a column [K, 1], whose unit dims are dropped from the result.
template <FloatingElement T, Device D>
Tensor<T, D> matmul(const Tensor<T, D>& a, const Tensor<T, D>& b) {
  TG_CHECK(a.dim() >= 1 && b.dim() >= 1, "matmul: both operands need at least one dim: a is ", a.shape(), ", b is ",
           b.shape());
  const Tensor<T, D> a2 = a.dim() == 1 ? a.as_strided_raw({1, a.shape()[0]}, {a.shape()[0] * a.strides()[0], a.strides()[0]},
                                                          a.storage_offset())
                                       : a.detach();
  const Tensor<T, D> b2 = b.dim() == 1 ? b.as_strided_raw({b.shape()[0], 1}, {b.strides()[0], 1}, b.storage_offset())
                                       : b.detach();
  const std::int64_t M = a2.shape()[a2.dim() - 2], K = a2.shape()[a2.dim() - 1];
  const std::int64_t Kb = b2.shape()[b2.dim() - 2], N = b2.shape()[b2.dim() - 1];
  TG_CHECK(K == Kb, "matmul: inner dimensions differ: a is ", a.shape(), ", b is ", b.shape());
  const Shape ba = detail::batch_of(a2.shape()), bb = detail::batch_of(b2.shape());
  const int nb = std::max(ba.size(), bb.size());
  Shape batch = Shape::filled(nb, 1);
  for (int i = 0; i < nb; ++i) {
    const int ia = ba.size() - nb + i, ib = bb.size() - nb + i;
    const std::int64_t da = ia >= 0 ? ba[ia] : 1, db = ib >= 0 ? bb[ib] : 1;
    TG_CHECK(da == db || da == 1 || db == 1, "matmul: batch dimensions cannot be broadcast: a is ", a.shape(), ", b is ",
             b.shape());
    batch[i] = da == 1 ? db : da;
  }
  const Shape full_shape = detail::with_matrix(batch, M, N);
  const Tensor<T, D> full = autodiff::region_kept_output<Tensor<T, D>>(  // Note [checkpoint regions]
      "matmul", full_shape, [&] { return detail::matmul_into(a2, b2, batch, full_shape); });
  Shape out_shape = batch;
  if (a.dim() > 1) out_shape.push_back(M);
  if (b.dim() > 1) out_shape.push_back(N);
  Tensor<T, D> out = full.as_strided_raw(out_shape, contiguous_strides(out_shape), 0);
  autodiff::record("matmul", out, detail::MatmulSaved<T, D>{a2, b2},
                   [batch, M, N, sa = a.shape(), sb = b.shape()](detail::MatmulSaved<T, D>& s, const Tensor<T, D>& dout,
                                                                 auto need) {
                     const Tensor<T, D> g0 = dout.contiguous_raw();
                     const Shape gs = detail::with_matrix(batch, M, N);
                     const Tensor<T, D> g = g0.as_strided_raw(gs, contiguous_strides(gs), g0.storage_offset());
                     Tensor<T, D> da, db;
                     if (need[0]) {  // dA = dC·Bᵀ, summed over the batch dims A was broadcast on
                       const Tensor<T, D> r = detail::matmul_into(g, detail::swap_last_two(s.b), batch, s.a.shape());
                       da = r.as_strided_raw(sa, contiguous_strides(sa), 0);
                     }
                     if (need[1]) {  // dB = Aᵀ·dC
                       const Tensor<T, D> r = detail::matmul_into(detail::swap_last_two(s.a), g, batch, s.b.shape());
                       db = r.as_strided_raw(sb, contiguous_strides(sb), 0);
                     }
                     return std::tuple{da, db};
                   }, a, b);
  return out;
}

namespace detail {
/// x [..., K] as a [rows, K] matrix: a view when x is 2-D GEMM-able or contiguous, else a copy.
template <Element T, Device D>
Tensor<T, D> linear_rows(const Tensor<T, D>& x) {
  const std::int64_t K = x.shape()[x.dim() - 1];
  std::int64_t rows = 1;
  for (int d = 0; d + 1 < x.dim(); ++d) rows *= x.shape()[d];
  if (x.dim() == 2) return gemm_ready(x);
  const Tensor<T, D> c = x.contiguous_raw();
  return c.as_strided_raw({rows, K}, {K, 1}, c.storage_offset());
}

/// The argument checks of linear and of the ops built on it (linear_gelu_tanh), whose name `op` starts each message.
template <Element T, Device D>
void check_linear(const Tensor<T, D>& x, const Tensor<T, D>& w, const Tensor<T, D>* b, const char* op = "linear") {
  TG_CHECK(x.dim() >= 1, op, ": x needs at least one dim, got ", x.shape());
  TG_CHECK(w.dim() == 2, op, ": weight must be [out_features, in_features], got ", w.shape());
  TG_CHECK(x.shape()[x.dim() - 1] == w.shape()[1], op, ": inner dimensions differ: x is ", x.shape(), ", weight is ",
           w.shape(), " (weight is [out_features, in_features])");
  if (b) TG_CHECK(b->dim() == 1 && b->shape()[0] == w.shape()[0], op, ": bias must be [", w.shape()[0], "], got ",
                  b->shape());
}

/// linear's output shape: x's with the last dim W's out_features.
template <Element T, Device D>
Shape linear_out_shape(const Tensor<T, D>& x, const Tensor<T, D>& w) {
  Shape s = x.shape();
  s[s.size() - 1] = w.shape()[0];
  return s;
}

template <Element T, Device D>
Tensor<T, D> linear_impl(const Tensor<T, D>& x, const Tensor<T, D>& w, const Tensor<T, D>* bias, Tensor<T, D>& xr,
                         Tensor<T, D>& wr) {
  xr = linear_rows(x);
  wr = gemm_ready(w);
  const std::int64_t M = xr.shape()[0], K = xr.shape()[1], N = wr.shape()[0];
  Shape out_shape = x.shape();
  out_shape[out_shape.size() - 1] = N;
  // A checkpoint region's policy may keep this output or hand back the kept one (Note [checkpoint regions]).
  return autodiff::region_kept_output<Tensor<T, D>>("linear", out_shape, [&] {
    Tensor<T, D> out = Tensor<T, D>::empty(out_shape);
    const Tensor<T, D> bc = bias ? bias->contiguous_raw() : Tensor<T, D>();
    TG_BACKEND(D, linear_forward<T>(xr.data(), xr.strides()[0], xr.strides()[1], wr.data(), wr.strides()[0],
                                    wr.strides()[1], bias ? bc.data() : nullptr, out.data(), M, N, K));
    return out;
  });
}

/// dX = dY·W, dW = dYᵀ·X over the flattened rows; dY is [M, N] contiguous.
template <Element T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> linear_backward(const LinearSaved<T, D>& s, const Tensor<T, D>& dy, bool need_x,
                                                      bool need_w, const Shape& x_shape) {
  const std::int64_t M = s.x.shape()[0], K = s.x.shape()[1], N = s.weight.shape()[0];
  Tensor<T, D> dx, dw;
  if (need_x) {
    dx = Tensor<T, D>::empty(x_shape);
    TG_BACKEND(D, matmul_strided<T>(dy.data(), {N, 1}, s.weight.data(), {s.weight.strides()[0], s.weight.strides()[1]},
                                    dx.data(), {K, 1}, Shape(), M, K, N));
  }
  if (need_w) {
    dw = Tensor<T, D>::empty({N, K});
    TG_BACKEND(D, linear_weight_grad<T>(dy.data(), s.x.data(), s.x.strides()[0], s.x.strides()[1], dw.data(), nullptr,
                                        M, N, K));
  }
  return {dx, dw};
}

/// linear_backward with the bias gradient db = Σ_rows dY when need_b: computed with dW in one kernel call
/// (linear_weight_grad; on the GPU the weight GEMM's BGRADB epilogue, Note [bias gradients in the weight GEMM]).
template <Element T, Device D>
std::tuple<Tensor<T, D>, Tensor<T, D>, Tensor<T, D>> linear_backward_bias(const LinearSaved<T, D>& s, const Tensor<T, D>& dy,
                                                                          bool need_x, bool need_w, bool need_b,
                                                                          const Shape& x_shape) {
  Tensor<T, D> dx = linear_backward(s, dy, need_x, false, x_shape).first, dw;
  const std::int64_t M = s.x.shape()[0], K = s.x.shape()[1], N = s.weight.shape()[0];
  Tensor<T, D> db;
  if (need_w) dw = Tensor<T, D>::empty({N, K});
  if (need_b) db = Tensor<T, D>::empty({N});
  if (need_w || need_b)
    TG_BACKEND(D, linear_weight_grad<T>(dy.data(), s.x.data(), s.x.strides()[0], s.x.strides()[1],
                                        need_w ? dw.data() : nullptr, need_b ? db.data() : nullptr, M, N, K));
  return {dx, dw, db};
}
}  // namespace detail

/// y = x·Wᵀ + bias over the last dim: x [..., K], W [N, K], bias [N] -> [..., N].
template <FloatingElement T, Device D>
Tensor<T, D> linear(const Tensor<T, D>& x, const Tensor<T, D>& weight, const Tensor<T, D>& bias) {
  detail::check_linear(x, weight, &bias);
  if (fusion::rewriter()) [[unlikely]]  // a linear whose gelu_tanh runs it (Note [pair rewrites])
    if (auto f = detail::try_defer(fusion::Special::linear, detail::linear_out_shape(x, weight), {&x, &weight, &bias})) return *f;
  Tensor<T, D> xr, wr;
  Tensor<T, D> out = detail::linear_impl(x, weight, &bias, xr, wr);
  autodiff::record("linear", out, detail::LinearSaved<T, D>{xr, wr},
                   [xs = x.shape()](detail::LinearSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     return detail::linear_backward_bias(s, dout.contiguous_raw(), need[0], need[1], need[2], xs);
                   }, x, weight, bias);
  return out;
}

/// y = x·Wᵀ without a bias.
template <FloatingElement T, Device D>
Tensor<T, D> linear(const Tensor<T, D>& x, const Tensor<T, D>& weight) {
  detail::check_linear<T, D>(x, weight, nullptr);
  if (fusion::rewriter()) [[unlikely]]
    if (auto f = detail::try_defer(fusion::Special::linear, detail::linear_out_shape(x, weight), {&x, &weight})) return *f;
  Tensor<T, D> xr, wr;
  Tensor<T, D> out = detail::linear_impl<T, D>(x, weight, nullptr, xr, wr);
  autodiff::record("linear", out, detail::LinearSaved<T, D>{xr, wr},
                   [xs = x.shape()](detail::LinearSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     const Tensor<T, D> dy = dout.contiguous_raw();
                     auto [dx, dw] = detail::linear_backward(s, dy, need[0], need[1], xs);
                     return std::tuple{dx, dw};
                   }, x, weight);
  return out;
}

}  // namespace tg

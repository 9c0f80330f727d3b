// linear_gelu_tanh: y = gelu_tanh(x·Wᵀ + b) as one op, GPT-2's MLP up-projection and activation; and
// mlp_gelu_tanh: the whole MLP, linear(gelu_tanh(linear(x, W_fc, b_fc)), W_proj, b_proj), as one op.
//   auto h = tg::linear_gelu_tanh(x, W_fc, b_fc);  // x (B,T,C), W (4C,C), b (4C) -> (B,T,4C)
//   auto g = tg::linear_gelu_tanh(x, W_fc);        // without a bias
//   auto y = tg::mlp_gelu_tanh(x, W_fc, b_fc, W_proj, b_proj);   // W_proj (C,4C), b_proj (C) -> (B,T,C)
#pragma once

#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/kernels/matmul.hpp"
#include "typegrad/detail/kernels/reduce.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/unary.hpp"

namespace tg {

// Note [fused linear + GELU]
// linear_gelu_tanh(x, W, b) is gelu_tanh(linear(x, W, b)) with one tape node ("linear_gelu_tanh"). It
// saves what the composite's two nodes save together: x (as linear's [rows, K] matrix), W, and the
// pre-activation pre = x·Wᵀ + b (the input gelu_tanh would save), so it costs no extra memory.
//
// Forward, through backend kernel linear_gelu_tanh_forward (writes pre and y):
// * CPU: linear_forward into pre, then unary_forward(gelu_tanh) over pre - the composite's kernels in its
//   order, so values and gradients equal the composite's bit for bit (tested in fp32 and bf16).
// * CUDA: one cuBLASLt matmul with CUBLASLT_EPILOGUE_GELU_AUX_BIAS (GELU_AUX without a bias): it adds the
//   bias to the fp32 accumulator, writes that sum to the aux buffer (pre, rounded to T) and GELU of it to
//   y (rounded to T). cuBLASLt documents the aux ld as a multiple of 8, at least the rows of the
//   column-major output, i.e. N here (pre is contiguous): N % 8 != 0 goes to the fallback, and so does every
//   call for which the heuristic returns no algorithm (and fp64). The fallback is the composite's kernels
//   (GEMM with the bias epilogue, then the gelu_tanh kernel), never another formula.
//   backend::cuda::gelu_epilogue_calls() counts the calls that took the epilogue.
// * cuBLASLt's GELU is the tanh approximation 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))), GPT-2's: cublasLt.h
//   names it only "GELU", but PyTorch's reference decomposition of its cuBLASLt-backed
//   _addmm_activation(use_gelu=True) is gelu(approximate="tanh") on CUDA (torch/_decomp/decompositions.py),
//   and the GPU test CudaLinearGelu.EpilogueIsTanhGelu tells the two forms apart in fp32 (they differ by
//   up to ~5e-4). It passed on an H200 (2026-12-04), with the other CudaLinearGelu tests; GPT-2's MLP
//   ran the nvjet "geluauxbias" kernels there (docs/performance.md).
//   The fused GPU result differs from the composite by rounding only: the GELU reads the fp32 sum rather
//   than the pre-activation rounded to T, and cuBLASLt evaluates tanh its own way.
//
// Backward (both devices): dpre = dy · gelu_tanh'(pre) by unary_backward with math::Unary::gelu_tanh, the
// kernel gelu_tanh's own backward runs (math::gelu_tanh_grad, TG_HOST_DEVICE, shared by the CPU and CUDA
// kernels); then linear's backward: dX = dpre·W, dW = dpreᵀ·X and db = Σ_rows dpre (detail::linear_backward_bias:
// on the GPU db comes from the dW GEMM's BGRADB epilogue, Note [bias gradients in the weight GEMM]).
//
// Checkpoint regions (Note [checkpoint regions]): the pre-activation is the op's GEMM output, so a policy
// that keeps GEMM outputs keeps pre (as it kept linear's output in the composite) and a recompute that
// reuses it runs only the gelu_tanh kernel on it. On the GPU that recomputed y is gelu_tanh of the rounded
// pre, i.e. the fallback's value, which differs from the fused forward's y by rounding only.

namespace detail {
template <Element T, Device D>
struct LinearGeluSaved {
  Tensor<T, D> x, weight;  // as LinearSaved: x as a [rows, K] matrix view (or copy), weight [N, K]
  Tensor<T, D> pre;        // x·Wᵀ + b, [..., N] contiguous: gelu_tanh's input
};

/// (y, pre) of linear_gelu_tanh; xr / wr receive linear's GEMM operands (saved for backward).
template <Element T, Device D>
std::pair<Tensor<T, D>, Tensor<T, D>> linear_gelu_impl(const Tensor<T, D>& x, const Tensor<T, D>& w,
                                                       const Tensor<T, D>* bias, Tensor<T, D>& xr, Tensor<T, D>& wr) {
  xr = linear_rows(x);
  wr = gemm_ready(w);
  const std::int64_t M = xr.shape()[0], K = xr.shape()[1], N = wr.shape()[0];
  Shape out_shape = x.shape();
  out_shape[out_shape.size() - 1] = N;
  Tensor<T, D> y;
  // A checkpoint region's policy may keep pre or hand back the kept one (then only the GELU runs).
  Tensor<T, D> pre = autodiff::region_kept_output<Tensor<T, D>>("linear_gelu_tanh", out_shape, [&] {
    Tensor<T, D> p = Tensor<T, D>::empty(out_shape);
    y = Tensor<T, D>::empty(out_shape);
    const Tensor<T, D> bc = bias ? bias->contiguous_raw() : Tensor<T, D>();
    TG_BACKEND(D, linear_gelu_tanh_forward<T>(xr.data(), xr.strides()[0], xr.strides()[1], wr.data(), wr.strides()[0],
                                              wr.strides()[1], bias ? bc.data() : nullptr, y.data(), p.data(), M, N, K));
    return p;
  });
  if (!y.defined()) y = unary_raw(math::Unary::gelu_tanh, pre);
  return {y, pre};
}

/// dpre = dy · gelu_tanh'(pre), contiguous [M, N] (gelu_tanh's backward kernel).
template <Element T, Device D>
Tensor<T, D> linear_gelu_dpre(const LinearGeluSaved<T, D>& s, const Tensor<T, D>& dout) {
  return unary_grad_raw(math::Unary::gelu_tanh, s.pre, dout);
}
}  // namespace detail

/// y = gelu_tanh(x·Wᵀ + bias) over the last dim: x [..., K], W [N, K], bias [N] -> [..., N].
template <FloatingElement T, Device D>
Tensor<T, D> linear_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& weight, const Tensor<T, D>& bias) {
  detail::check_linear(x, weight, &bias, "linear_gelu_tanh");
  Tensor<T, D> xr, wr;
  auto [out, pre] = detail::linear_gelu_impl(x, weight, &bias, xr, wr);
  autodiff::record("linear_gelu_tanh", out, detail::LinearGeluSaved<T, D>{xr, wr, pre},
                   [xs = x.shape()](detail::LinearGeluSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     return detail::linear_backward_bias(detail::LinearSaved<T, D>{s.x, s.weight},
                                                         detail::linear_gelu_dpre(s, dout), need[0], need[1], need[2], xs);
                   }, x, weight, bias);
  return out;
}

/// y = gelu_tanh(x·Wᵀ) without a bias.
template <FloatingElement T, Device D>
Tensor<T, D> linear_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& weight) {
  detail::check_linear<T, D>(x, weight, nullptr, "linear_gelu_tanh");
  Tensor<T, D> xr, wr;
  auto [out, pre] = detail::linear_gelu_impl<T, D>(x, weight, nullptr, xr, wr);
  autodiff::record("linear_gelu_tanh", out, detail::LinearGeluSaved<T, D>{xr, wr, pre},
                   [xs = x.shape()](detail::LinearGeluSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     const Tensor<T, D> dpre = detail::linear_gelu_dpre(s, dout);
                     auto [dx, dw] = detail::linear_backward(detail::LinearSaved<T, D>{s.x, s.weight}, dpre, need[0],
                                                             need[1], xs);
                     return std::tuple{dx, dw};
                   }, x, weight);
  return out;
}

// Note [the fused GELU MLP]
// mlp_gelu_tanh(x, W_fc, b_fc, W_proj, b_proj) is linear(linear_gelu_tanh(x, W_fc, b_fc), W_proj, b_proj) with
// one tape node ("mlp_gelu_tanh"). Its forward is the two ops' forwards (the GELU_AUX epilogue GEMM, then the
// projection with its bias epilogue; the same checkpoint-region outputs, so a policy keeps what it kept), and
// it saves what the two nodes saved: x, W_fc, the pre-activation pre, h = gelu_tanh(pre) and W_proj. What one
// node gains is its backward, which sees both GEMMs:
//   dW_proj, db_proj  = dYᵀ·h and Σ_rows dY      (linear_weight_grad: one GEMM with BGRADB on the GPU)
//   dpre, db_fc       = (dY·W_proj) ∘ gelu_tanh'(pre) and Σ_rows dpre
//   dX, dW_fc         = dpre·W_fc and dpreᵀ·x
// On the GPU the second line is one GEMM whose cuBLASLt DGELU_BGRAD epilogue reads pre as its aux input
// (backend::cuda::linear_gelu_input_grad; dgelu_epilogue_calls() counts it): the (rows, 4C) gradient of h is
// never written, and neither the gelu_tanh backward kernel nor the c_fc bias reduction reads anything. Where
// the epilogue cannot run (fp64, 4C not a multiple of 8, no algorithm, operands that need realigning copies)
// and always on the CPU, the backward is the two nodes' backwards in their kernels: on the CPU the op equals
// the unfused pair bit for bit (tested); on the GPU the fused path differs by rounding only (the epilogue's
// own GELU derivative, in fp32, of the stored pre).
// Memory: the backward drops h once dW_proj is computed (unless the graph is retained), as the pair's c_proj
// node freed it, but the node's incoming gradient dY (rows, C) stays alive until the whole node returns, where
// the pair freed it before the GELU's backward. On the GPU the (rows, 4C) dh it never writes outweighs that;
// on the CPU, which has no fused form, the GPT keeps the pair (nn::BasicMLP).
namespace detail {
template <Element T, Device D>
struct MlpSaved {
  LinearGeluSaved<T, D> fc;  // x rows, W_fc, pre
  LinearSaved<T, D> proj;    // h rows, W_proj
};

template <Element T, Device D>
void check_mlp(const Tensor<T, D>& x, const Tensor<T, D>& w_fc, const Tensor<T, D>* b_fc, const Tensor<T, D>& w_proj,
               const Tensor<T, D>* b_proj) {
  check_linear(x, w_fc, b_fc, "mlp_gelu_tanh");
  TG_CHECK(w_proj.dim() == 2 && w_proj.shape()[1] == w_fc.shape()[0], "mlp_gelu_tanh: W_proj must be [out_features, ",
           w_fc.shape()[0], "] (its inputs are W_fc's outputs), got ", w_proj.shape());
  if (b_proj)
    TG_CHECK(b_proj->dim() == 1 && b_proj->shape()[0] == w_proj.shape()[0], "mlp_gelu_tanh: b_proj must be [",
             w_proj.shape()[0], "], got ", b_proj->shape());
}

/// The MLP's output; `saved` receives what the backward reads.
template <Element T, Device D>
Tensor<T, D> mlp_impl(const Tensor<T, D>& x, const Tensor<T, D>& w_fc, const Tensor<T, D>* b_fc, const Tensor<T, D>& w_proj,
                      const Tensor<T, D>* b_proj, MlpSaved<T, D>& saved) {
  auto [h, pre] = linear_gelu_impl(x, w_fc, b_fc, saved.fc.x, saved.fc.weight);
  saved.fc.pre = pre;
  return linear_impl(h, w_proj, b_proj, saved.proj.x, saved.proj.weight);
}

/// The gradients (dx, dW_fc, db_fc, dW_proj, db_proj) for need = those five (biases false when absent).
template <Element T, Device D>
std::array<Tensor<T, D>, 5> mlp_backward(MlpSaved<T, D>& s, const Tensor<T, D>& dout, const std::array<bool, 5>& need,
                                         const Shape& x_shape) {
  const Tensor<T, D> dy = dout.contiguous_raw();
  std::array<Tensor<T, D>, 5> g;
  Shape h_shape = x_shape;
  const std::int64_t N = s.fc.weight.shape()[0], M = s.fc.x.shape()[0], K = s.proj.weight.shape()[0];
  h_shape[h_shape.size() - 1] = N;
  const bool need_fc = need[0] || need[1] || need[2];
  const Tensor<T, D>& wp = s.proj.weight;
  // dh = dY·W_proj by linear's dX GEMM (the same call), for the path without the fused epilogue
  auto dh_of = [&] {
    const Tensor<T, D> dh = Tensor<T, D>::empty(h_shape);
    TG_BACKEND(D, matmul_strided<T>(dy.data(), {K, 1}, wp.data(), {wp.strides()[0], wp.strides()[1]}, dh.data(), {N, 1},
                                    Shape(), M, N, K));
    return dh;
  };
  // On the CPU (no fused form: its kernel returns false) the buffers come and go in the unfused pair's order:
  // c_proj's node makes dh, dW_proj, db_proj; then gelu's makes dpre, dx, dW_fc, db_fc while dh lives.
  Tensor<T, D> dh;
  if constexpr (std::is_same_v<D, cpu>)
    if (need_fc) dh = dh_of();
  if (need[3] || need[4]) {
    auto [unused, dwp, dbp] = linear_backward_bias(s.proj, dy, false, need[3], need[4], h_shape);
    g[3] = dwp;
    g[4] = dbp;
  }
  // h (the (rows, 4C) GELU output) is read by nothing after dW_proj: dropped now, as the unfused pair's c_proj
  // node would have freed it before the GELU's backward ran (unless the graph is kept for another backward).
  if (!autodiff::retaining_graph()) s.proj.x = Tensor<T, D>();
  if (!need_fc) return g;
  Tensor<T, D> dpre = Tensor<T, D>::empty(h_shape), db_fc;
  bool fused = false;
  if constexpr (!std::is_same_v<D, cpu>) {
    if (need[2]) db_fc = Tensor<T, D>::empty({N});
    fused = TG_BACKEND(D, linear_gelu_input_grad<T>(dy.data(), wp.data(), wp.strides()[0], wp.strides()[1],
                                                    s.fc.pre.data(), dpre.data(), need[2] ? db_fc.data() : nullptr, M,
                                                    N, K));
    if (!fused) dh = dh_of();
  }
  if (!fused)  // gelu_tanh's backward kernel, into dpre
    TG_BACKEND(D, unary_backward<T>(math::Unary::gelu_tanh, s.fc.pre.data(), s.fc.pre.strides(), dh.data(), dh.strides(),
                                    dpre.data(), dh.shape()));
  auto [dx, dw, db] = linear_backward_bias(LinearSaved<T, D>{s.fc.x, s.fc.weight}, dpre, need[0], need[1],
                                           need[2] && !fused, x_shape);
  g[0] = dx;
  g[1] = dw;
  g[2] = fused ? db_fc : db;
  return g;
}
}  // namespace detail

/// linear(gelu_tanh(x·W_fcᵀ + b_fc), W_proj, b_proj) as one op (Note [the fused GELU MLP]): x [..., C],
/// W_fc [H, C], b_fc [H], W_proj [O, H], b_proj [O] -> [..., O].
template <FloatingElement T, Device D>
Tensor<T, D> mlp_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& w_fc, const Tensor<T, D>& b_fc,
                           const Tensor<T, D>& w_proj, const Tensor<T, D>& b_proj) {
  detail::check_mlp(x, w_fc, &b_fc, w_proj, &b_proj);
  detail::MlpSaved<T, D> saved;
  Tensor<T, D> out = detail::mlp_impl(x, w_fc, &b_fc, w_proj, &b_proj, saved);
  autodiff::record("mlp_gelu_tanh", out, std::move(saved),
                   [xs = x.shape()](detail::MlpSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     auto g = detail::mlp_backward(s, dout, {need[0], need[1], need[2], need[3], need[4]}, xs);
                     return std::tuple{g[0], g[1], g[2], g[3], g[4]};
                   }, x, w_fc, b_fc, w_proj, b_proj);
  return out;
}

/// mlp_gelu_tanh without biases: linear(gelu_tanh(x·W_fcᵀ), W_proj).
template <FloatingElement T, Device D>
Tensor<T, D> mlp_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& w_fc, const Tensor<T, D>& w_proj) {
  detail::check_mlp<T, D>(x, w_fc, nullptr, w_proj, nullptr);
  detail::MlpSaved<T, D> saved;
  Tensor<T, D> out = detail::mlp_impl<T, D>(x, w_fc, nullptr, w_proj, nullptr, saved);
  autodiff::record("mlp_gelu_tanh", out, std::move(saved),
                   [xs = x.shape()](detail::MlpSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
                     auto g = detail::mlp_backward(s, dout, {need[0], need[1], false, need[2], false}, xs);
                     return std::tuple{g[0], g[1], g[3]};
                   }, x, w_fc, w_proj);
  return out;
}

}  // namespace tg

// linear_gelu_tanh: y = gelu_tanh(x·Wᵀ + b) as one op, GPT-2's MLP up-projection and activation.
//   auto h = tg::linear_gelu_tanh(x, W_fc, b_fc);  // x (B,T,C), W (4C,C), b (4C) -> (B,T,4C)
//   auto g = tg::linear_gelu_tanh(x, W_fc);        // without a bias
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
// kernels); then linear's backward: dX = dpre·W, dW = dpreᵀ·X (detail::linear_backward), db = Σ_rows dpre.
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
                     const Tensor<T, D> dpre = detail::linear_gelu_dpre(s, dout);
                     auto [dx, dw] = detail::linear_backward(detail::LinearSaved<T, D>{s.x, s.weight}, dpre, need[0],
                                                             need[1], xs);
                     Tensor<T, D> db;
                     if (need[2]) {  // db = Σ_rows dpre
                       const std::int64_t N = s.weight.shape()[0];
                       db = Tensor<T, D>::empty({N});
                       TG_BACKEND(D, reduce_sum<T>(dpre.data(), db.data(), 1, s.x.shape()[0], N));
                     }
                     return std::tuple{dx, dw, db};
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

}  // namespace tg

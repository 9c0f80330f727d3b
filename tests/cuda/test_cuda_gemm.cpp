// Large 16-bit GEMMs with an odd row width run on zero-padded, 16-byte aligned copies (Note [16-byte
// aligned GEMM operands] in backends/cuda/gemm.cu), as GPT-2's LM head (vocabulary 50257) does. Here an
// LM-head-shaped linear (odd out_features, with and without a bias) and a batched matmul whose weight
// gradient accumulates over the batch (beta = 1 into a padded C) take that path on the GPU, which
// padded_gemm_calls() counts, and match the CPU's fp32 results on the same rounded inputs. A padding that is
// not zero, a bias read past its end or a C block copied back with the wrong stride all break the match.
// Every test skips with the reason when no CUDA device is present (the build machines have none).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <typegrad/typegrad.hpp>

#include "../../backends/cuda/cublaslt.cuh"
#include "cuda/gpu_skip.hpp"

namespace test_cuda_gemm_cpp {  // the file's own names (Note [unity test sources])

namespace {

class CudaPaddedGemm : public tg::testing::GpuTest {};

template <class T, class D>
std::vector<double> values(const tg::Tensor<T, D>& t) {
  const auto v = t.detach().template to<tg::fp32>().template to<tg::cpu>().to_vector();
  return {v.begin(), v.end()};
}
double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}
/// Largest |a_i − b_i| relative to b's largest entry.
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) w = std::max(w, std::abs(a[i] - b[i]));
  return w / std::max(max_abs(b), 1e-30);
}
/// The tensor rounded to T and back to fp32: the inputs both sides see.
template <class T>
tg::Tensor<float> rounded(const tg::Tensor<float>& t) {
  return t.to<T>().template to<tg::fp32>();
}

// 1104 tokens, 1024 features, 1251 outputs: 1.41e9 multiply-adds per GEMM (over the 2^30 gate). The
// forward's N, dX's K and dW's transposed M are 1251, each a row width, so all three GEMMs are padded.
// The GPU sums rounded products in fp32 and rounds the output to 16 bits (2^-8 relative for bf16, 2^-11
// for fp16); the CPU reference sums the same rounded inputs in fp32: 1e-2 (bf16) / 2e-3 (fp16) of each
// tensor's largest entry bounds that, and a wrong padding moves entries by a sizeable fraction of it.
template <class T>
void check_lm_head_linear(bool with_bias, double tolerance) {
  tg::Generator gen(20261204);
  const auto x = rounded<T>(tg::Tensor<float>::normal({1104, 1024}, 0.f, 1.f, gen));
  const auto w = rounded<T>(tg::Tensor<float>::normal({1251, 1024}, 0.f, 0.03f, gen));
  const auto b = rounded<T>(tg::Tensor<float>::normal({1251}, 0.f, 1.f, gen));
  const auto u = rounded<T>(tg::Tensor<float>::normal({1104, 1251}, 0.f, 1.f, gen));

  auto xg = x.template to<T>().template to<tg::cuda>().requires_grad_();
  auto wg = w.template to<T>().template to<tg::cuda>().requires_grad_();
  auto bg = b.template to<T>().template to<tg::cuda>().requires_grad_();
  const std::int64_t before = tg::backend::cuda::padded_gemm_calls();
  const auto y = with_bias ? tg::linear(xg, wg, bg) : tg::linear(xg, wg);
  EXPECT_EQ(tg::backend::cuda::padded_gemm_calls(), before + 1) << "the forward GEMM (N = 1251) was not padded";
  y.backward(u.template to<T>().template to<tg::cuda>());
  EXPECT_EQ(tg::backend::cuda::padded_gemm_calls(), before + 3) << "dX (K = 1251) and dW (M = 1251) were not padded";

  auto xc = x.clone().requires_grad_();
  auto wc = w.clone().requires_grad_();
  auto bc = b.clone().requires_grad_();
  const auto yc = with_bias ? tg::linear(xc, wc, bc) : tg::linear(xc, wc);
  yc.backward(u);
  EXPECT_LE(relative_error(values(y), values(yc)), tolerance) << "forward";
  EXPECT_LE(relative_error(values(xg.grad()), values(xc.grad())), tolerance) << "dX";
  EXPECT_LE(relative_error(values(wg.grad()), values(wc.grad())), tolerance) << "dW";
  if (with_bias) EXPECT_LE(relative_error(values(bg.grad()), values(bc.grad())), tolerance) << "db";
}

TEST_F(CudaPaddedGemm, LmHeadShapedLinearInBf16MatchesTheCpu) { check_lm_head_linear<tg::bf16>(false, 1e-2); }
TEST_F(CudaPaddedGemm, LmHeadShapedLinearWithBiasInBf16MatchesTheCpu) { check_lm_head_linear<tg::bf16>(true, 1e-2); }
TEST_F(CudaPaddedGemm, LmHeadShapedLinearWithBiasInFp16MatchesTheCpu) { check_lm_head_linear<tg::fp16>(true, 2e-3); }

// x [2, 1104, 1024] · w [1024, 1251]: w's gradient sums x_bᵀ·dY_b over the batch, the second GEMM with
// beta = 1 into the same odd-width C (1024 x 1251), so the padded block must start from C's values.
TEST_F(CudaPaddedGemm, BatchReducedWeightGradientAccumulatesIntoAPaddedBlock) {
  tg::Generator gen(7);
  const auto x = rounded<tg::bf16>(tg::Tensor<float>::normal({2, 1104, 1024}, 0.f, 1.f, gen));
  const auto w = rounded<tg::bf16>(tg::Tensor<float>::normal({1024, 1251}, 0.f, 0.03f, gen));
  const auto u = rounded<tg::bf16>(tg::Tensor<float>::normal({2, 1104, 1251}, 0.f, 1.f, gen));
  auto xg = x.to<tg::bf16>().to<tg::cuda>().requires_grad_();
  auto wg = w.to<tg::bf16>().to<tg::cuda>().requires_grad_();
  const std::int64_t before = tg::backend::cuda::padded_gemm_calls();
  const auto y = tg::matmul(xg, wg);
  y.backward(u.to<tg::bf16>().to<tg::cuda>());
  EXPECT_GT(tg::backend::cuda::padded_gemm_calls(), before) << "no GEMM of the odd-width matmul was padded";

  auto xc = x.clone().requires_grad_();
  auto wc = w.clone().requires_grad_();
  const auto yc = tg::matmul(xc, wc);
  yc.backward(u);
  EXPECT_LE(relative_error(values(y), values(yc)), 1e-2) << "forward";
  EXPECT_LE(relative_error(values(xg.grad()), values(xc.grad())), 1e-2) << "dX";
  EXPECT_LE(relative_error(values(wg.grad()), values(wc.grad())), 1e-2) << "dW (two GEMMs summed)";
}

}  // namespace

// The cuBLASLt algorithm cache (backends/cuda/cublaslt.cuh) keeps definitive answers only: an algorithm, or
// "not supported"; a transient failure (an allocation error) answers the call with no algorithm and asks again
// the next time; an algorithm that declines when run is replaced by "no algorithm". Host code only: runs without a GPU.
TEST(LtAlgoCache, KeepsDefinitiveAnswersAndAsksAgainAfterTransientFailures) {
  tg::backend::cuda::detail::LtAlgoCache<2> cache;
  cublasLtMatmulHeuristicResult_t r{};
  int found = -1, asked = 0;
  cublasStatus_t next = CUBLAS_STATUS_ALLOC_FAILED;
  auto ask = [&](cublasLtMatmulHeuristicResult_t& res, int& f) {
    ++asked;
    f = 1;
    res.workspaceSize = 64;
    return tg::backend::cuda::detail::ask_status(next, f);
  };
  cache.get({1, 2}, r, found, ask);
  EXPECT_EQ(found, 0) << "a failed heuristic call means no algorithm for this call";
  next = CUBLAS_STATUS_SUCCESS;
  cache.get({1, 2}, r, found, ask);
  EXPECT_EQ(asked, 2) << "the transient failure was not kept";
  EXPECT_EQ(found, 1);
  cache.get({1, 2}, r, found, ask);
  EXPECT_EQ(asked, 2) << "the algorithm was kept";
  EXPECT_EQ(r.workspaceSize, 64u);
  next = CUBLAS_STATUS_NOT_SUPPORTED;
  cache.get({3, 4}, r, found, ask);
  cache.get({3, 4}, r, found, ask);
  EXPECT_EQ(asked, 3) << "not supported is an answer, kept";
  EXPECT_EQ(found, 0);
  // an algorithm that declines at cublasLtMatmul (lt_run_declined) becomes "no algorithm" for its configuration
  next = CUBLAS_STATUS_SUCCESS;
  cache.get({5, 6}, r, found, ask);
  EXPECT_EQ(found, 1);
  cache.decline({5, 6});
  cache.get({5, 6}, r, found, ask);
  EXPECT_EQ(found, 0);
  EXPECT_EQ(asked, 4) << "declined is an answer, kept";
  cache.get({1, 2}, r, found, ask);
  EXPECT_EQ(found, 1) << "other configurations keep theirs";
  using tg::backend::cuda::detail::lt_run_declined;
  EXPECT_TRUE(lt_run_declined(CUBLAS_STATUS_NOT_SUPPORTED) && lt_run_declined(CUBLAS_STATUS_INVALID_VALUE) &&
              lt_run_declined(CUBLAS_STATUS_ARCH_MISMATCH));
  EXPECT_FALSE(lt_run_declined(CUBLAS_STATUS_EXECUTION_FAILED) || lt_run_declined(CUBLAS_STATUS_ALLOC_FAILED) ||
               lt_run_declined(CUBLAS_STATUS_INTERNAL_ERROR));
}

}  // namespace test_cuda_gemm_cpp

// linear_gelu_tanh on the GPU (Note [fused linear + GELU]): a GPT-shaped bf16 call takes cuBLASLt's
// GELU_AUX_BIAS epilogue (gelu_epilogue_calls() counts it) and matches the composite gelu_tanh(linear(...))
// forward and backward; the epilogue's GELU is the tanh form; widths cuBLASLt cannot take (N % 8 != 0)
// run the composite's kernels bit for bit; nn::BasicGPT<cuda>'s MLP takes the epilogue once per block.
// Every test skips with the reason when no CUDA device is present (the build machines have none).
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <typegrad/nn/gpt.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_linear_gelu_cpp {  // the file's own names (Note [unity test sources])

// Outside the anonymous namespace: the tests below that namespace derive from it too.
class CudaLinearGelu : public tg::testing::GpuTest {};

namespace {

template <class T, class D>
std::vector<double> values(const tg::Tensor<T, D>& t) {
  const auto v = t.detach().template to<tg::fp32>().template to<tg::cpu>().to_vector();
  return {v.begin(), v.end()};
}
/// max_i |a_i − b_i| / (atol + rtol·|b_i|): <= 1 means within tolerance.
double worst(const std::vector<double>& a, const std::vector<double>& b, double atol, double rtol) {
  EXPECT_EQ(a.size(), b.size());
  double w = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) w = std::max(w, std::abs(a[i] - b[i]) / (atol + rtol * std::abs(b[i])));
  return w;
}
double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::abs(x));
  return m;
}

struct Results {
  std::vector<double> y, dx, dw, db;
};
/// Forward and backward (upstream u) of the fused op or of the composite, on the GPU.
template <class T>
Results run_op(bool fused, const tg::Tensor<float>& xh, const tg::Tensor<float>& wh, const tg::Tensor<float>& bh,
        const tg::Tensor<float>& uh) {
  auto x = xh.to<T>().template to<tg::cuda>().requires_grad_();
  auto w = wh.to<T>().template to<tg::cuda>().requires_grad_();
  auto b = bh.to<T>().template to<tg::cuda>().requires_grad_();
  const auto y = fused ? tg::linear_gelu_tanh(x, w, b) : tg::gelu_tanh(tg::linear(x, w, b));
  y.backward(uh.to<T>().template to<tg::cuda>());
  return {values(y), values(x.grad()), values(w.grad()), values(b.grad())};
}

// GPT-2 small's c_fc at B=4, T=64 in bf16: one call through the epilogue, within bf16 rounding of the
// composite. The fused GELU reads the fp32 sum, the composite the bf16-rounded pre-activation: one bf16
// step (2^-8 relative) of pre times gelu' <= 1.13, plus one of the output. Gradients: the backward is the
// composite's kernels on pre (fused: cuBLASLt's aux; composite: the bias GEMM's output, equal up to the
// GEMM's summation order), 2e-2 of each tensor's largest entry.
TEST_F(CudaLinearGelu, Bf16GptShapeTakesTheEpilogueAndMatchesTheComposite) {
  tg::Generator gen(20261203);
  const auto x = tg::Tensor<float>::normal({4, 64, 768}, 0.f, 1.f, gen);
  const auto w = tg::Tensor<float>::normal({3072, 768}, 0.f, 0.02f, gen);
  const auto b = tg::Tensor<float>::normal({3072}, 0.f, 0.1f, gen);
  const auto u = tg::Tensor<float>::normal({4, 64, 3072}, 0.f, 1.f, gen);
  const std::int64_t before = tg::backend::cuda::gelu_epilogue_calls();
  const Results f = run_op<tg::bf16>(true, x, w, b, u);
  EXPECT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before + 1) << "the bf16 GPT-shaped call did not take the epilogue";
  const Results c = run_op<tg::bf16>(false, x, w, b, u);
  EXPECT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before + 1) << "the composite must not count";
  EXPECT_LE(worst(f.y, c.y, 1e-2, 2e-2), 1.0) << "forward";
  EXPECT_LE(worst(f.dx, c.dx, 2e-2 * max_abs(c.dx), 0), 1.0) << "dx";
  EXPECT_LE(worst(f.dw, c.dw, 2e-2 * max_abs(c.dw), 0), 1.0) << "dw";
  EXPECT_LE(worst(f.db, c.db, 2e-2 * max_abs(c.db), 0), 1.0) << "db";
}

// fp32 (no TF32), pre-activations spread over about [-5, 5]: the fused output is gelu_tanh's to fp32
// round-off, and much farther from the exact (erf) GELU, which differs from the tanh form by up to ~5e-4
// there. So the epilogue's GELU is the tanh approximation the op promises.
TEST_F(CudaLinearGelu, EpilogueIsTanhGelu) {
  tg::backend::cuda::set_allow_tf32(false);
  tg::Generator gen(11);
  const auto x = tg::Tensor<float>::uniform({96, 256}, -1.f, 1.f, gen).to<tg::cuda>();
  const auto w = tg::Tensor<float>::normal({128, 256}, 0.f, 0.15f, gen).to<tg::cuda>();
  const auto b = tg::Tensor<float>::normal({128}, 0.f, 0.5f, gen).to<tg::cuda>();
  const std::int64_t before = tg::backend::cuda::gelu_epilogue_calls();
  const auto fused = values(tg::linear_gelu_tanh(x, w, b));
  ASSERT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before + 1) << "fp32 did not take the epilogue";
  const auto pre = tg::linear(x, w, b);
  const auto tanh_form = values(tg::gelu_tanh(pre)), erf_form = values(tg::gelu(pre));
  EXPECT_GT(max_abs(values(pre)), 3.0) << "the sample should reach where the two GELUs differ";
  double d_tanh = 0, d_erf = 0;
  for (std::size_t i = 0; i < fused.size(); ++i) {
    d_tanh = std::max(d_tanh, std::abs(fused[i] - tanh_form[i]));
    d_erf = std::max(d_erf, std::abs(fused[i] - erf_form[i]));
  }
  EXPECT_LT(d_tanh, 2e-5) << "fused vs gelu_tanh(linear)";
  EXPECT_GT(d_erf, 1e-4) << "fused vs the exact GELU";
  EXPECT_LT(d_tanh * 5, d_erf);
}

// N = 20 (not a multiple of 8) breaks cuBLASLt's aux ld rule: the op runs linear_forward then the gelu_tanh
// kernel, the composite's own kernels, so the result equals the composite bit for bit and nothing is counted.
TEST_F(CudaLinearGelu, OddWidthRunsTheCompositeKernels) {
  tg::Generator gen(5);
  const auto x = tg::Tensor<tg::bf16>::normal({3, 7, 24}, 0.f, 1.f, gen).to<tg::cuda>();
  const auto w = tg::Tensor<tg::bf16>::normal({20, 24}, 0.f, 0.3f, gen).to<tg::cuda>();
  const auto b = tg::Tensor<tg::bf16>::normal({20}, 0.f, 0.3f, gen).to<tg::cuda>();
  const std::int64_t before = tg::backend::cuda::gelu_epilogue_calls();
  const auto f = tg::linear_gelu_tanh(x, w, b).to<tg::cpu>().to_vector();
  EXPECT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before);
  const auto c = tg::gelu_tanh(tg::linear(x, w, b)).to<tg::cpu>().to_vector();
  ASSERT_EQ(f.size(), c.size());
  for (std::size_t i = 0; i < f.size(); ++i) ASSERT_EQ(f[i].bits, c[i].bits) << "element " << i;
}

// The fused GEMM runs on the current stream: a side stream gives the default stream's bits.
TEST_F(CudaLinearGelu, SideStreamGivesTheDefaultStreamsResult) {
  tg::Generator gen(9);
  const auto x = tg::Tensor<tg::bf16>::normal({64, 128}, 0.f, 1.f, gen).to<tg::cuda>();
  const auto w = tg::Tensor<tg::bf16>::normal({256, 128}, 0.f, 0.1f, gen).to<tg::cuda>();
  const auto b = tg::Tensor<tg::bf16>::normal({256}, 0.f, 0.1f, gen).to<tg::cuda>();
  const auto on_default = tg::linear_gelu_tanh(x, w, b).to<tg::cpu>().to_vector();
  tg::backend::cuda::Stream side;
  std::vector<tg::bf16> on_side;
  {
    tg::backend::cuda::StreamGuard guard(side);
    on_side = tg::linear_gelu_tanh(x, w, b).to<tg::cpu>().to_vector();
  }
  ASSERT_EQ(on_side.size(), on_default.size());
  for (std::size_t i = 0; i < on_side.size(); ++i) ASSERT_EQ(on_side[i].bits, on_default[i].bits) << "element " << i;
}

// The GEMM's cuBLASLt descriptors are kept per configuration (Note [cached GEMM descriptors] in
// backends/cuda/gemm.cu) and given each call's bias and aux pointers: three fused calls of one shape on other
// tensors, all alive at once (other addresses), in fp32 without TF32, their three backwards after the three
// forwards; each matches the composite forward and backward. A kept descriptor that read an earlier call's bias
// would be off by that bias (the biases are far apart); one that wrote the GELU input into an earlier call's aux
// would give both calls' backwards the wrong pre-activation.
TEST_F(CudaLinearGelu, KeptDescriptorsTakeEachCallsBiasAndAux) {
  tg::backend::cuda::set_allow_tf32(false);
  tg::Generator gen(20261207);
  struct Call {
    tg::Tensor<float> x, w, b, u;            // on the host
    tg::Tensor<float, tg::cuda> xd, wd, bd, y;  // the fused call's, kept alive
  };
  std::vector<Call> calls;
  for (int k = 0; k < 3; ++k) {
    Call c;
    c.x = tg::Tensor<float>::normal({32, 64}, 0.f, 1.f, gen);
    c.w = tg::Tensor<float>::normal({96, 64}, 0.f, 0.2f, gen);
    c.b = tg::Tensor<float>::normal({96}, 2.f * static_cast<float>(k), 0.5f, gen);
    c.u = tg::Tensor<float>::normal({32, 96}, 0.f, 1.f, gen);
    c.xd = c.x.to<tg::cuda>().requires_grad_();
    c.wd = c.w.to<tg::cuda>().requires_grad_();
    c.bd = c.b.to<tg::cuda>().requires_grad_();
    const std::int64_t before = tg::backend::cuda::gelu_epilogue_calls();
    c.y = tg::linear_gelu_tanh(c.xd, c.wd, c.bd);
    ASSERT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before + 1) << "call " << k << " did not take the epilogue";
    calls.push_back(std::move(c));
  }
  for (auto& c : calls) c.y.backward(c.u.to<tg::cuda>());
  for (std::size_t k = 0; k < calls.size(); ++k) {
    const Call& c = calls[k];
    const Results r = run_op<float>(false, c.x, c.w, c.b, c.u);
    EXPECT_LE(worst(values(c.y), r.y, 1e-5, 1e-5), 1.0) << "forward, call " << k;
    EXPECT_LE(worst(values(c.xd.grad()), r.dx, 1e-5 * max_abs(r.dx), 1e-5), 1.0) << "dx, call " << k;
    EXPECT_LE(worst(values(c.wd.grad()), r.dw, 1e-5 * max_abs(r.dw), 1e-5), 1.0) << "dw, call " << k;
    EXPECT_LE(worst(values(c.bd.grad()), r.db, 1e-5 * max_abs(r.db), 1e-5), 1.0) << "db, call " << k;
  }
}

// nn::BasicGPT<cuda>'s MLP calls linear_gelu_tanh with c_fc's weights: one epilogue call per block per
// forward in bf16 (4C = 128 is a multiple of 8).
TEST_F(CudaLinearGelu, GptMlpTakesTheEpilogueOncePerBlock) {
  const tg::nn::GPTConfig cfg{64, 16, 3, 2, 32, 0.f};
  tg::Generator gen(42);
  const tg::nn::GPT cpu_model(cfg, gen);
  const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
  auto idx = tg::Tensor<std::int64_t>::empty({2, 16});
  for (std::int64_t i = 0; i < idx.numel(); ++i) idx.data()[i] = (i * 7) % 64;
  const std::int64_t before = tg::backend::cuda::gelu_epilogue_calls();
  const auto logits = gpu_model.forward<tg::bf16>(idx);
  EXPECT_EQ(tg::backend::cuda::gelu_epilogue_calls(), before + cfg.n_layer);
  EXPECT_EQ(logits.shape(), (tg::Shape{2, 16, 64}));
}

}  // namespace

// Note [bias gradients in the weight GEMM]: linear's bias gradient comes from the dW GEMM's BGRADB epilogue
// (bgrad_epilogue_calls() counts it), in bf16 at GPT-2's c_fc shape and in fp32; db equals the column sums of
// the upstream gradient (fp64 sums of the values the GPU read) to the output type's rounding, and dW the
// CPU's GEMM. A frozen weight (no dW GEMM) still gets its bias gradient, from the reduction.
template <class T>
void check_bias_gradient(double rtol) {
  tg::Generator gen(20261206);
  const auto x = tg::Tensor<float>::normal({4, 64, 768}, 0.f, 1.f, gen).to<T>();
  const auto w = tg::Tensor<float>::normal({3072, 768}, 0.f, 0.02f, gen).to<T>();
  const auto b = tg::Tensor<float>::normal({3072}, 0.f, 0.1f, gen).to<T>();
  const auto u = tg::Tensor<float>::normal({4, 64, 3072}, 0.f, 1.f, gen).to<T>();
  std::vector<double> db_ref(3072, 0.0);
  const auto uv = values(u);
  for (std::size_t i = 0; i < uv.size(); ++i) db_ref[i % 3072] += uv[i];
  // dW on the CPU from the same values
  auto xc = x.detach().requires_grad_();
  auto wc = w.detach().requires_grad_();
  auto bc = b.detach().requires_grad_();
  tg::linear(xc, wc, bc).backward(u);
  const std::vector<double> dw_ref = values(wc.grad());

  auto xg = x.template to<tg::cuda>().requires_grad_();
  auto wg = w.template to<tg::cuda>().requires_grad_();
  auto bg = b.template to<tg::cuda>().requires_grad_();
  const std::int64_t before = tg::backend::cuda::bgrad_epilogue_calls();
  tg::linear(xg, wg, bg).backward(u.template to<tg::cuda>());
  EXPECT_EQ(tg::backend::cuda::bgrad_epilogue_calls(), before + 1) << "the bias gradient did not come from the epilogue";
  EXPECT_LE(worst(values(bg.grad()), db_ref, rtol * max_abs(db_ref), rtol), 1.0) << "db";
  EXPECT_LE(worst(values(wg.grad()), dw_ref, rtol * max_abs(dw_ref), 0), 1.0) << "dW";

  auto bf = b.template to<tg::cuda>().requires_grad_();  // frozen weight: only the reduction runs
  tg::linear(x.template to<tg::cuda>(), w.template to<tg::cuda>(), bf).backward(u.template to<tg::cuda>());
  EXPECT_EQ(tg::backend::cuda::bgrad_epilogue_calls(), before + 1);
  EXPECT_LE(worst(values(bf.grad()), db_ref, rtol * max_abs(db_ref), rtol), 1.0) << "db without dW";
}
TEST_F(CudaLinearGelu, BiasGradientComesFromTheWeightGemmInBf16) { check_bias_gradient<tg::bf16>(1e-2); }
TEST_F(CudaLinearGelu, BiasGradientComesFromTheWeightGemmInFp32) {
  tg::backend::cuda::set_allow_tf32(false);
  check_bias_gradient<float>(1e-4);
}

// Note [the fused GELU MLP]: GPT-2 small's MLP at B=4, T=64 as one op takes the DGELU_BGRAD epilogue in its
// backward (dgelu_epilogue_calls()) and BGRADB for c_proj's bias gradient, and matches the unfused pair
// linear(linear_gelu_tanh(...)) on the GPU: in bf16 within 2e-2 of each tensor's largest entry; in fp32 (no
// TF32), with pre-activations spread over about [-8, 8], within 1e-4, which tells the tanh-GELU derivative from
// the exact GELU's (they differ by up to 8.7e-4 there): the epilogue's derivative is the forward's.
template <class T>
void check_mlp_dgelu(float w_std, double tol) {
  tg::Generator gen(20261207);
  const auto x = tg::Tensor<float>::normal({4, 64, 768}, 0.f, 1.f, gen);
  const auto w = tg::Tensor<float>::normal({3072, 768}, 0.f, w_std, gen);
  const auto b = tg::Tensor<float>::normal({3072}, 0.f, 0.1f, gen);
  const auto p = tg::Tensor<float>::normal({768, 3072}, 0.f, 0.02f, gen);
  const auto c = tg::Tensor<float>::normal({768}, 0.f, 0.1f, gen);
  const auto u = tg::Tensor<float>::normal({4, 64, 768}, 0.f, 1.f, gen);
  auto run = [&](bool fused) {
    auto on = [](const tg::Tensor<float>& t) { return t.to<T>().template to<tg::cuda>().requires_grad_(); };
    auto xg = on(x), wg = on(w), bg = on(b), pg = on(p), cg = on(c);
    const auto y = fused ? tg::mlp_gelu_tanh(xg, wg, bg, pg, cg) : tg::linear(tg::linear_gelu_tanh(xg, wg, bg), pg, cg);
    y.backward(u.to<T>().template to<tg::cuda>());
    return std::vector<std::vector<double>>{values(y), values(xg.grad()), values(wg.grad()), values(bg.grad()),
                                            values(pg.grad()), values(cg.grad())};
  };
  const std::int64_t dgelu0 = tg::backend::cuda::dgelu_epilogue_calls(), bgrad0 = tg::backend::cuda::bgrad_epilogue_calls();
  const auto f = run(true);
  EXPECT_EQ(tg::backend::cuda::dgelu_epilogue_calls(), dgelu0 + 1) << "the MLP's backward did not take DGELU_BGRAD";
  EXPECT_EQ(tg::backend::cuda::bgrad_epilogue_calls(), bgrad0 + 1) << "c_proj's bias gradient: BGRADB (c_fc's: DGELU_BGRAD)";
  const auto u2 = run(false);
  const char* what[] = {"out", "dx", "dW_fc", "db_fc", "dW_proj", "db_proj"};
  for (std::size_t t = 0; t < f.size(); ++t) EXPECT_LE(worst(f[t], u2[t], tol * max_abs(u2[t]), 0), 1.0) << what[t];
}
TEST_F(CudaLinearGelu, MlpBackwardTakesTheDgeluEpilogueInBf16) { check_mlp_dgelu<tg::bf16>(0.02f, 2e-2); }
TEST_F(CudaLinearGelu, MlpBackwardsDgeluIsTheTanhGeluDerivativeInFp32) {
  tg::backend::cuda::set_allow_tf32(false);
  check_mlp_dgelu<float>(0.1f, 1e-4);
}

}  // namespace test_cuda_linear_gelu_cpp

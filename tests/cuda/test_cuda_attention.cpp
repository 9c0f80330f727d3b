// The fused causal attention on the GPU (Note [flash attention on the GPU] in backends/cuda/flash_attention.cu):
// bf16 and fp16, head sizes 64 and 128, T in {1, 17, 64, 1000, 1024}: the output and the three gradients
// against the CPU's fp32 attention of the same rounded inputs, and against the GPU composite (the fused
// kernels switched off); flash_attention_calls() shows which path ran. Each check runs both sets of fused
// kernels: the WMMA tiles and the register-resident mma.sync kernels (Note [flash attention in registers]).
// Every test skips with the reason when no CUDA device is present (the build machines have none).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include <typegrad/detail/cuda/attention.hpp>
#include <typegrad/ops/scale_masked_softmax.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_attention_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::backend::cuda::FlashKernels;
constexpr FlashKernels kBothKernels[] = {FlashKernels::tiles, FlashKernels::registers};
const char* name(FlashKernels k) { return k == FlashKernels::tiles ? "tiles" : "registers"; }

class CudaAttention : public tg::testing::GpuTest {
 protected:
  void SetUp() override {
    tg::testing::GpuTest::SetUp();
    if (IsSkipped()) return;
    kernels_ = tg::backend::cuda::flash_attention_kernels();
  }
  void TearDown() override {
    if (tg::backend::cuda::device_count() > 0) {
      tg::backend::cuda::set_flash_attention(true);
      tg::backend::cuda::set_flash_attention_kernels(kernels_);
    }
  }
  FlashKernels kernels_ = FlashKernels::tiles;
};

template <class T, class D>
std::vector<double> values(const tg::Tensor<T, D>& t) {
  const auto v = t.detach().template to<tg::fp32>().template to<tg::cpu>().to_vector();
  return {v.begin(), v.end()};
}

/// max_i |a_i − b_i| over max_i |b_i|: the error relative to the tensor's scale.
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double e = 0, m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    e = std::max(e, std::abs(a[i] - b[i]));
    m = std::max(m, std::abs(b[i]));
  }
  return m > 0 ? e / m : e;
}

struct Results {
  std::vector<double> y, dq, dk, dv;
};

template <class T, class D>
Results run_attention(const tg::Tensor<float>& qh, const tg::Tensor<float>& kh, const tg::Tensor<float>& vh,
                      const tg::Tensor<float>& uh) {
  auto q = qh.to<T>().template to<D>().requires_grad_();
  auto k = kh.to<T>().template to<D>().requires_grad_();
  auto v = vh.to<T>().template to<D>().requires_grad_();
  const auto y = tg::causal_attention(q, k, v);
  y.backward(uh.to<T>().template to<D>());
  return {values(y), values(q.grad()), values(k.grad()), values(v.grad())};
}

/// Inputs rounded to T once, so the CPU fp32 reference sees the GPU's values.
template <class T>
tg::Tensor<float> rounded(const tg::Tensor<float>& x) {
  return x.to<T>().template to<tg::fp32>();
}

template <class T>
void check(std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs) {
  SCOPED_TRACE(::testing::Message() << tg::dtype_traits<T>::name << " B=" << B << " H=" << H << " T=" << Tn << " hs=" << hs);
  tg::Generator gen(static_cast<std::uint64_t>(1000 * Tn + hs));
  const auto q = rounded<T>(tg::Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen));
  const auto k = rounded<T>(tg::Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen));
  const auto v = rounded<T>(tg::Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen));
  const auto u = rounded<T>(tg::Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen));
  const Results ref = run_attention<float, tg::cpu>(q, k, v, u);

  tg::backend::cuda::set_flash_attention(false);
  const std::int64_t calls0 = tg::backend::cuda::flash_attention_calls();
  const Results composite = run_attention<T, tg::cuda>(q, k, v, u);
  EXPECT_EQ(tg::backend::cuda::flash_attention_calls(), calls0) << "switched off: the composite ran";
  tg::backend::cuda::set_flash_attention(true);

  for (const FlashKernels kernels : kBothKernels) {
    SCOPED_TRACE(name(kernels));
    tg::backend::cuda::set_flash_attention_kernels(kernels);
    const std::int64_t calls1 = tg::backend::cuda::flash_attention_calls();
    const Results fused = run_attention<T, tg::cuda>(q, k, v, u);
    EXPECT_EQ(tg::backend::cuda::flash_attention_calls(), calls1 + 2) << "the forward and the backward ran fused";

    // 16-bit outputs and 16-bit P / dS in the products: a few units of T's rounding relative to each tensor's
    // scale (bf16 2^-8, fp16 2^-11); the composite has the same roundings in another order.
    const double tol = std::is_same_v<T, tg::bf16> ? 3e-2 : 6e-3;
    EXPECT_LE(rel_err(fused.y, ref.y), tol) << "out vs the CPU";
    EXPECT_LE(rel_err(fused.dq, ref.dq), tol) << "dq vs the CPU";
    EXPECT_LE(rel_err(fused.dk, ref.dk), tol) << "dk vs the CPU";
    EXPECT_LE(rel_err(fused.dv, ref.dv), tol) << "dv vs the CPU";
    EXPECT_LE(rel_err(fused.y, composite.y), tol) << "out vs the composite";
    EXPECT_LE(rel_err(fused.dq, composite.dq), tol) << "dq vs the composite";
    EXPECT_LE(rel_err(fused.dk, composite.dk), tol) << "dk vs the composite";
    EXPECT_LE(rel_err(fused.dv, composite.dv), tol) << "dv vs the composite";
  }
}

// Both sets of fused kernels, run twice on the same inputs, give the same bits (fixed summation orders, no
// atomics), and the two sets agree with each other within the roundings of T.
TEST_F(CudaAttention, FusedKernelsAreDeterministic) {
  tg::Generator gen(21);
  const auto x = rounded<tg::bf16>(tg::Tensor<float>::normal({2, 3, 1000, 64}, 0.f, 1.f, gen));
  const auto u = rounded<tg::bf16>(tg::Tensor<float>::normal({2, 3, 1000, 64}, 0.f, 1.f, gen));
  std::vector<Results> per_kernels;
  for (const FlashKernels kernels : kBothKernels) {
    SCOPED_TRACE(name(kernels));
    tg::backend::cuda::set_flash_attention_kernels(kernels);
    const Results a = run_attention<tg::bf16, tg::cuda>(x, x, x, u), b = run_attention<tg::bf16, tg::cuda>(x, x, x, u);
    EXPECT_EQ(a.y, b.y);
    EXPECT_EQ(a.dq, b.dq);
    EXPECT_EQ(a.dk, b.dk);
    EXPECT_EQ(a.dv, b.dv);
    per_kernels.push_back(a);
  }
  EXPECT_LE(rel_err(per_kernels[1].y, per_kernels[0].y), 3e-2) << "out";
  EXPECT_LE(rel_err(per_kernels[1].dq, per_kernels[0].dq), 3e-2) << "dq";
  EXPECT_LE(rel_err(per_kernels[1].dk, per_kernels[0].dk), 3e-2) << "dk";
  EXPECT_LE(rel_err(per_kernels[1].dv, per_kernels[0].dv), 3e-2) << "dv";
}

TEST_F(CudaAttention, Bf16HeadSize64) {
  for (std::int64_t Tn : {1, 17, 64, 1000, 1024}) check<tg::bf16>(2, 3, Tn, 64);
}
TEST_F(CudaAttention, Bf16HeadSize128) {
  for (std::int64_t Tn : {1, 17, 64, 1000, 1024}) check<tg::bf16>(1, 2, Tn, 128);
}
TEST_F(CudaAttention, Fp16HeadSize64) {
  for (std::int64_t Tn : {1, 17, 64, 1000, 1024}) check<tg::fp16>(2, 3, Tn, 64);
}
TEST_F(CudaAttention, Fp16HeadSize128) {
  for (std::int64_t Tn : {1, 17, 64, 1000, 1024}) check<tg::fp16>(1, 2, Tn, 128);
}

// causal_attention_qkv reads the heads in place from the fused projection's (B, T, 3C) output on the fused
// kernels (the packed layout's strides): output and dqkv against the CPU's fp32 op on the same rounded values.
TEST_F(CudaAttention, PackedQkvRunsTheFusedKernels) {
  for (std::int64_t Tn : {17, 1024}) {
    SCOPED_TRACE(::testing::Message() << "T=" << Tn);
    const std::int64_t B = 2, H = 3, hs = 64, C = H * hs;
    tg::Generator gen(static_cast<std::uint64_t>(Tn));
    const auto qkv = rounded<tg::bf16>(tg::Tensor<float>::normal({B, Tn, 3 * C}, 0.f, 1.f, gen));
    const auto u = rounded<tg::bf16>(tg::Tensor<float>::normal({B, Tn, C}, 0.f, 1.f, gen));
    auto xr = qkv.detach().requires_grad_();
    const auto yr = tg::causal_attention_qkv(xr, H);
    yr.backward(u);
    for (const FlashKernels kernels : kBothKernels) {
      SCOPED_TRACE(name(kernels));
      tg::backend::cuda::set_flash_attention_kernels(kernels);
      const std::int64_t calls0 = tg::backend::cuda::flash_attention_calls();
      auto xg = qkv.to<tg::bf16>().to<tg::cuda>().requires_grad_();
      const auto yg = tg::causal_attention_qkv(xg, H);
      yg.backward(u.to<tg::bf16>().to<tg::cuda>());
      EXPECT_EQ(tg::backend::cuda::flash_attention_calls(), calls0 + 2) << "the forward and the backward ran fused";
      EXPECT_LE(rel_err(values(yg), values(yr)), 3e-2) << "out";
      EXPECT_LE(rel_err(values(xg.grad()), values(xr.grad())), 3e-2) << "dqkv";
    }
  }
}

// A NaN in a query makes its row NaN, as in the composite and on the CPU, also where the row's only key is in
// the first tile (row 0); the other heads stay finite.
TEST_F(CudaAttention, NanInAQueryMakesItsRowNan) {
  tg::Generator gen(8);
  auto q = tg::Tensor<float>::normal({1, 2, 17, 64}, 0.f, 1.f, gen);
  q.data()[0] = NAN;  // head 0, row 0
  const auto kv = tg::Tensor<float>::normal({1, 2, 17, 64}, 0.f, 1.f, gen);
  for (const int path : {0, 1, 2}) {  // the composite, the WMMA tiles, the register kernels
    tg::backend::cuda::set_flash_attention(path != 0);
    if (path != 0) tg::backend::cuda::set_flash_attention_kernels(kBothKernels[path - 1]);
    const char* what = path == 0 ? "composite" : name(kBothKernels[path - 1]);
    const auto y = values(tg::causal_attention(q.to<tg::bf16>().to<tg::cuda>(), kv.to<tg::bf16>().to<tg::cuda>(),
                                               kv.to<tg::bf16>().to<tg::cuda>()));
    for (std::size_t c = 0; c < 64; ++c) EXPECT_TRUE(std::isnan(y[c])) << what << " column " << c;
    for (std::size_t i = 64; i < 17 * 64; ++i) ASSERT_TRUE(std::isfinite(y[i])) << what << ": head 0, a later row at " << i;
    for (std::size_t i = 17 * 64; i < y.size(); ++i) ASSERT_TRUE(std::isfinite(y[i])) << what << ": head 1 at " << i;
  }
  tg::backend::cuda::set_flash_attention(true);
}

// Head sizes the kernels do not cover, and fp32, run the composite.
TEST_F(CudaAttention, OtherHeadSizesAndFp32RunTheComposite) {
  tg::Generator gen(5);
  const std::int64_t calls0 = tg::backend::cuda::flash_attention_calls();
  const auto x = tg::Tensor<float>::normal({1, 2, 33, 32}, 0.f, 1.f, gen);
  (void)run_attention<tg::bf16, tg::cuda>(x, x, x, x);
  const auto y = tg::Tensor<float>::normal({1, 2, 33, 64}, 0.f, 1.f, gen);
  (void)run_attention<float, tg::cuda>(y, y, y, y);
  EXPECT_EQ(tg::backend::cuda::flash_attention_calls(), calls0);
}

// scale_masked_softmax on the GPU against the separate GPU ops (mul or div, masked_fill, softmax and their
// backward): the values and the gradient bit for bit (Note [fused scale, mask and softmax]), each form (0 mul, mask,
// softmax; 1 div, mask, softmax; 2 mul, softmax; 3 mask, softmax), an inexact scale, the causal mask, a broadcast
// random one and one broadcast along the rows (stride 0 in a row), in fp64, fp32, bf16 and fp16.
template <class T>
void scale_masked_softmax_equals_the_separate_ops(const tg::Shape& shape, const tg::Tensor<std::uint8_t>& mask_h, double fill,
                                                  int form) {
  tg::Generator gen(13);
  const auto xh = tg::Tensor<float>::normal(shape, 0.f, 2.f, gen), uh = tg::Tensor<float>::normal(shape, 0.f, 1.f, gen);
  const auto mask = mask_h.to<tg::cuda>();
  auto xf = xh.to<T>().template to<tg::cuda>().requires_grad_();
  auto xu = xh.to<T>().template to<tg::cuda>().requires_grad_();
  const auto u = uh.to<T>().template to<tg::cuda>();
  const double scale = 1.0 / 3.0;
  const auto s = tg::Tensor<T, tg::cuda>::full(tg::Shape(), scale);
  const bool scaled = form != 3, masked = form != 2, divide = form == 1;
  const auto f = tg::detail::scale_masked_softmax_at(xf, scaled ? &s : nullptr, divide, masked ? &mask : nullptr, fill);
  tg::Tensor<T, tg::cuda> v = xu;
  if (scaled) v = divide ? tg::div(v, scale) : tg::mul(v, scale);
  if (masked) v = tg::masked_fill(v, mask, fill);
  const auto y = tg::softmax(v);
  (f * u).backward(u);
  (y * u).backward(u);
  const auto fv = f.detach().template to<tg::cpu>().to_vector(), yv = y.detach().template to<tg::cpu>().to_vector();
  const auto gf = xf.grad().template to<tg::cpu>().to_vector(), gu = xu.grad().template to<tg::cpu>().to_vector();
  ASSERT_EQ(fv.size(), yv.size());
  EXPECT_EQ(std::memcmp(fv.data(), yv.data(), fv.size() * sizeof(T)), 0) << "the values, form " << form << ' ' << shape;
  EXPECT_EQ(std::memcmp(gf.data(), gu.data(), gf.size() * sizeof(T)), 0) << "dx, form " << form << ' ' << shape;
}

template <class T>
void scale_masked_softmax_every_form() {
  tg::Generator g(3);
  const auto random = tg::Tensor<float>::uniform({1, 1, 40}, 0.f, 2.f, g).to<std::uint8_t>();  // 0 or 1
  for (int form = 0; form < 4; ++form) {
    scale_masked_softmax_equals_the_separate_ops<T>({2, 4, 40, 40}, tg::causal_mask(40), -INFINITY, form);
    scale_masked_softmax_equals_the_separate_ops<T>({2, 4, 40, 40}, random, -30.0, form);
    scale_masked_softmax_equals_the_separate_ops<T>({3, 40, 40}, random.reshape({40, 1}), -30.0, form);  // a row's mask: stride 0
    scale_masked_softmax_equals_the_separate_ops<T>({3, 1100}, tg::causal_mask(1100).narrow(0, 700, 1), -INFINITY, form);
  }
}

TEST_F(CudaAttention, ScaleMaskedSoftmaxEqualsTheSeparateOpsBitForBit) {
  scale_masked_softmax_every_form<float>();
  scale_masked_softmax_every_form<tg::bf16>();
  scale_masked_softmax_every_form<tg::fp16>();
  scale_masked_softmax_every_form<double>();
}

}  // namespace

}  // namespace test_cuda_attention_cpp

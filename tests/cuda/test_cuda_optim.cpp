// The CUDA multi-tensor AdamW and the loss scaler's unscale + inf/NaN check. The element formula
// (math::adam_update) is checked against the CPU's adam_step here on every machine; the device kernels
// are compared with the CPU on a GPU and skip with the reason elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <typegrad/detail/cpu/optim_kernels.hpp>
#include <typegrad/typegrad.hpp>

namespace {

std::vector<float> random_values(std::int64_t n, std::uint64_t seed, float lo, float hi) {
  tg::Generator gen(seed);
  return tg::Tensor<float>::uniform({n}, lo, hi, gen).to_vector();
}

struct State {
  std::vector<float> p, g, m, v;
};
State make_state(std::int64_t n, std::uint64_t seed) {
  return {random_values(n, seed, -1.f, 1.f), random_values(n, seed + 1, -0.1f, 0.1f), random_values(n, seed + 2, -0.01f, 0.01f),
          random_values(n, seed + 3, 0.f, 1e-3f)};
}

tg::backend::cpu::AdamScalars scalars(bool decoupled, std::int64_t step) {
  tg::backend::cpu::AdamScalars s;
  s.lr = 3e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  s.decoupled = decoupled;
  s.step = step;
  return s;
}

/// |a - b| <= 4 ulp-ish relative to the magnitude (FMA contraction differs between translation units).
void expect_close_all(const std::vector<float>& got, const std::vector<float>& want, float floor, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 5e-7f * (floor + std::abs(want[i]))) << what << " element " << i;
}

// The shared element update is the CPU kernel's loop body: same fp32 constants, same operation order. The
// library may be compiled with FMA contraction (-march=native) and this test without, so the results
// agree to a few ulps rather than bit for bit.
TEST(SharedAdamMath, MatchesTheCpuAdamStep) {
  for (const bool decoupled : {true, false}) {
    for (const std::int64_t step : {std::int64_t{1}, std::int64_t{7}}) {
      State ref = make_state(1003, 11), mine = ref;
      const auto s = scalars(decoupled, step);
      tg::backend::cpu::adam_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), ref.v.data(), 1003, s);
      const auto c = tg::math::adam_consts<float>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step);
      for (std::size_t i = 0; i < mine.p.size(); ++i) tg::math::adam_update(mine.p[i], mine.g[i], mine.m[i], mine.v[i], c);
      SCOPED_TRACE(std::string("decoupled ") + (decoupled ? "yes" : "no") + ", step " + std::to_string(step));
      expect_close_all(mine.p, ref.p, 1.f, "p");
      expect_close_all(mine.m, ref.m, 1e-2f, "m");  // g + wd·p may cancel: an ulp of g is the floor
      expect_close_all(mine.v, ref.v, 1e-4f, "v");
      // and the update is not trivially zero: p moved by about lr
      double moved = 0;
      for (std::size_t i = 0; i < ref.p.size(); ++i) moved += std::abs(ref.p[i] - make_state(1003, 11).p[i]);
      EXPECT_GT(moved / 1003, 1e-4);
    }
  }
}

TEST(SharedAdamMath, IsFiniteSeparatesInfAndNan) {
  EXPECT_TRUE(tg::math::is_finite(0.f));
  EXPECT_TRUE(tg::math::is_finite(-3.4e38f));
  EXPECT_FALSE(tg::math::is_finite(std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(tg::math::is_finite(-std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(tg::math::is_finite(std::numeric_limits<float>::quiet_NaN()));
}

class CudaOptim : public ::testing::Test {
 protected:
  void SetUp() override {
    if (tg::backend::cuda::device_count() == 0)
      GTEST_SKIP() << "no CUDA device (" << tg::backend::cuda::device_description() << ")";
  }
};

tg::Tensor<float, tg::cuda> on_gpu(const std::vector<float>& v) {
  return tg::Tensor<float>::from_vector({static_cast<std::int64_t>(v.size())}, v).to<tg::cuda>();
}

TEST_F(CudaOptim, MultiTensorAdamWMatchesTheCpuPerTensor) {
  const std::vector<std::int64_t> sizes = {1, 1000, (1 << 16) + 3, 70001};  // chunk edges and a one-element tensor
  for (const bool decoupled : {true, false}) {
    std::vector<State> host;
    std::vector<tg::Tensor<float, tg::cuda>> p, g, m, v;
    std::vector<tg::backend::cuda::AdamTensor> list;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      host.push_back(make_state(sizes[k], 100 + 10 * k));
      p.push_back(on_gpu(host[k].p));
      g.push_back(on_gpu(host[k].g));
      m.push_back(on_gpu(host[k].m));
      v.push_back(on_gpu(host[k].v));
      list.push_back({p[k].data(), g[k].data(), m[k].data(), v[k].data(), sizes[k]});
    }
    const auto s = scalars(decoupled, 3);
    tg::backend::cuda::adam_step_multi(list.data(), static_cast<int>(list.size()), s.lr, s.beta1, s.beta2, s.eps,
                                       s.weight_decay, s.decoupled, s.step);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      State& h = host[k];
      tg::backend::cpu::adam_step<float>(h.p.data(), h.g.data(), h.m.data(), h.v.data(), sizes[k], s);
      const auto gp = p[k].to<tg::cpu>().to_vector(), gm = m[k].to<tg::cpu>().to_vector(), gv = v[k].to<tg::cpu>().to_vector();
      for (std::int64_t i = 0; i < sizes[k]; ++i) {  // the device may contract to FMA: a few ulps
        EXPECT_NEAR(gp[i], h.p[i], 1e-6f * (1 + std::abs(h.p[i]))) << "tensor " << k << " element " << i;
        EXPECT_NEAR(gm[i], h.m[i], 1e-6f * (1e-2f + std::abs(h.m[i])));  // g + wd·p may cancel
        EXPECT_NEAR(gv[i], h.v[i], 1e-6f * (1e-4f + std::abs(h.v[i])));
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

TEST_F(CudaOptim, UnscaleScalesEveryTensorAndFindsInfAndNan) {
  std::vector<tg::Tensor<float, tg::cuda>> gs = {on_gpu(random_values(5, 1, -4.f, 4.f)),
                                                 on_gpu(random_values((1 << 16) + 9, 2, -4.f, 4.f))};
  const std::vector<float> before0 = gs[0].to<tg::cpu>().to_vector(), before1 = gs[1].to<tg::cpu>().to_vector();
  std::vector<float*> ptrs = {gs[0].data(), gs[1].data()};
  std::vector<std::int64_t> sizes = {gs[0].numel(), gs[1].numel()};
  EXPECT_FALSE(tg::backend::cuda::unscale_and_check(ptrs.data(), sizes.data(), 2, 0.25f));
  const auto after1 = gs[1].to<tg::cpu>().to_vector();
  for (std::size_t i = 0; i < after1.size(); ++i) ASSERT_EQ(after1[i], before1[i] * 0.25f) << i;  // exact: a power of 2
  EXPECT_EQ(gs[0].to<tg::cpu>().to_vector()[4], before0[4] * 0.25f);

  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    auto h = gs[1].to<tg::cpu>().to_vector();
    h[(1 << 16) + 8] = bad;  // the last element of the second chunk
    gs[1] = on_gpu(h);
    ptrs[1] = gs[1].data();
    EXPECT_TRUE(tg::backend::cuda::unscale_and_check(ptrs.data(), sizes.data(), 2, 1.f)) << bad;
  }
}

}  // namespace

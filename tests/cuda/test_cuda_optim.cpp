// The CUDA optimizer kernels (multi-tensor AdamW; per-tensor SGD, LAMB, Adafactor) and the loss scaler's
// unscale + inf/NaN check. The shared element formulas (math::adam_update, sgd_update, lamb_moments /
// lamb_direction) are checked against the CPU kernels here on every machine; the device kernels are compared
// with the CPU on a GPU and skip with the reason elsewhere.
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

tg::backend::cpu::SgdScalars sgd_scalars(double momentum, bool nesterov, bool first) {
  tg::backend::cpu::SgdScalars s;
  s.lr = 0.05;
  s.momentum = momentum;
  s.dampening = nesterov ? 0.0 : 0.1;
  s.weight_decay = 0.01;
  s.nesterov = nesterov;
  s.first_step = first;
  return s;
}
tg::backend::cpu::LambScalars lamb_scalars(std::int64_t step) {
  tg::backend::cpu::LambScalars s;
  s.lr = 2e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.eps = 1e-6;
  s.weight_decay = 0.01;
  s.step = step;
  return s;
}
tg::backend::cpu::AdafactorScalars adafactor_scalars(double beta1) {
  tg::backend::cpu::AdafactorScalars s;
  s.rho = 1e-2;
  s.beta2 = 1.0 - std::pow(3.0, -0.8);  // beta2_t at t = 3
  s.beta1 = beta1;
  s.weight_decay = 0.01;
  return s;
}

TEST(SharedSgdMath, MatchesTheCpuSgdStep) {
  for (const double momentum : {0.0, 0.9})
    for (const bool nesterov : {false, true})
      for (const bool first : {true, false}) {
        if (nesterov && momentum == 0.0) continue;
        State ref = make_state(1003, 21), mine = ref;
        const auto s = sgd_scalars(momentum, nesterov, first);
        tg::backend::cpu::sgd_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), 1003, s);
        const auto c = tg::math::sgd_consts<float>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
        for (std::size_t i = 0; i < mine.p.size(); ++i) tg::math::sgd_update(mine.p[i], mine.g[i], mine.m[i], c);
        SCOPED_TRACE("momentum " + std::to_string(momentum) + (nesterov ? " nesterov" : "") + (first ? " first" : ""));
        expect_close_all(mine.p, ref.p, 1.f, "p");
        expect_close_all(mine.m, ref.m, 1e-2f, "momentum buffer");
        if (momentum == 0.0) EXPECT_EQ(mine.m, make_state(1003, 21).m) << "no momentum: the buffer is not touched";
        EXPECT_NE(mine.p, make_state(1003, 21).p);
      }
}

TEST(SharedLambMath, MatchesTheCpuLambStep) {
  State ref = make_state(2001, 31), mine = ref;
  const auto s = lamb_scalars(4);
  const double trust = tg::backend::cpu::lamb_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), ref.v.data(), 2001, s);
  const auto c = tg::math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  double pn = 0, un = 0;
  for (std::size_t i = 0; i < mine.p.size(); ++i) {
    tg::math::lamb_moments(mine.g[i], mine.m[i], mine.v[i], c);
    const float u = tg::math::lamb_direction(mine.p[i], mine.m[i], mine.v[i], c);
    pn += static_cast<double>(mine.p[i]) * mine.p[i];
    un += static_cast<double>(u) * u;
  }
  const double my_trust = tg::backend::cpu::lamb_trust_ratio(pn, un);
  EXPECT_NEAR(my_trust, trust, 1e-6 * trust);
  EXPECT_GT(trust, 0.0);
  EXPECT_NE(trust, 1.0) << "both norms are nonzero: the ratio is not the fallback";
  const float scale = static_cast<float>(s.lr * my_trust);
  for (std::size_t i = 0; i < mine.p.size(); ++i) mine.p[i] -= scale * tg::math::lamb_direction(mine.p[i], mine.m[i], mine.v[i], c);
  expect_close_all(mine.p, ref.p, 1.f, "p");
  expect_close_all(mine.m, ref.m, 1e-2f, "m");
  expect_close_all(mine.v, ref.v, 1e-4f, "v");
  EXPECT_EQ(tg::backend::cpu::lamb_trust_ratio(0.0, 4.0), 1.0);
  EXPECT_EQ(tg::backend::cpu::lamb_trust_ratio(4.0, 1.0), 2.0);
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

/// Copies device results back and compares them with the CPU's within a few ulps (the device may contract
/// to FMA differently and sums its fp64 partials in another order).
void expect_gpu_close(const tg::Tensor<float, tg::cuda>& got, const std::vector<float>& want, float floor, const char* what) {
  expect_close_all(got.to<tg::cpu>().to_vector(), want, floor, what);
}

TEST_F(CudaOptim, SgdMatchesTheCpu) {
  for (const double momentum : {0.0, 0.9})
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      State h = make_state(70001, 41);
      auto p = on_gpu(h.p), g = on_gpu(h.g), buf = on_gpu(h.m);
      const auto s = sgd_scalars(momentum, nesterov, false);
      tg::backend::cuda::sgd_step<float>(p.data(), g.data(), buf.data(), 70001, s);
      tg::backend::cpu::sgd_step<float>(h.p.data(), h.g.data(), h.m.data(), 70001, s);
      expect_gpu_close(p, h.p, 1.f, "sgd p");
      expect_gpu_close(buf, h.m, 1e-2f, "sgd momentum buffer");
    }
}

TEST_F(CudaOptim, LambMatchesTheCpuIncludingTheTrustRatio) {
  State h = make_state(300007, 51);  // several reduction blocks
  auto p = on_gpu(h.p), g = on_gpu(h.g), m = on_gpu(h.m), v = on_gpu(h.v);
  const auto s = lamb_scalars(2);
  const double gpu_trust = tg::backend::cuda::lamb_step<float>(p.data(), g.data(), m.data(), v.data(), 300007, s);
  const double cpu_trust = tg::backend::cpu::lamb_step<float>(h.p.data(), h.g.data(), h.m.data(), h.v.data(), 300007, s);
  EXPECT_NEAR(gpu_trust, cpu_trust, 1e-6 * cpu_trust);
  expect_gpu_close(p, h.p, 1.f, "lamb p");
  expect_gpu_close(m, h.m, 1e-2f, "lamb m");
  expect_gpu_close(v, h.v, 1e-4f, "lamb v");
}

TEST_F(CudaOptim, AdafactorFactoredAndFullMatchTheCpu) {
  for (const double beta1 : {0.0, 0.9}) {
    const std::int64_t rows = 96, cols = 1027;
    State h = make_state(rows * cols, 61);
    std::vector<float> r = random_values(rows, 62, 0.5f, 2.f), c = random_values(cols, 63, 0.5f, 2.f);
    auto p = on_gpu(h.p), g = on_gpu(h.g), m = on_gpu(h.m), gr = on_gpu(r), gc = on_gpu(c);
    const auto s = adafactor_scalars(beta1);
    tg::backend::cuda::adafactor_step_factored<float>(p.data(), g.data(), gr.data(), gc.data(), m.data(), rows, cols, s);
    tg::backend::cpu::adafactor_step_factored<float>(h.p.data(), h.g.data(), r.data(), c.data(), h.m.data(), rows, cols, s);
    expect_gpu_close(gr, r, 1e-3f, "adafactor row moments");
    expect_gpu_close(gc, c, 1e-3f, "adafactor column moments");
    expect_gpu_close(p, h.p, 1.f, "adafactor factored p");
    if (beta1 != 0.0) expect_gpu_close(m, h.m, 1e-2f, "adafactor m");

    State f = make_state(5003, 71);
    auto fp = on_gpu(f.p), fg = on_gpu(f.g), fv = on_gpu(f.v), fm = on_gpu(f.m);
    tg::backend::cuda::adafactor_step_full<float>(fp.data(), fg.data(), fv.data(), fm.data(), 5003, s);
    tg::backend::cpu::adafactor_step_full<float>(f.p.data(), f.g.data(), f.v.data(), f.m.data(), 5003, s);
    expect_gpu_close(fv, f.v, 1e-4f, "adafactor full v");
    expect_gpu_close(fp, f.p, 1.f, "adafactor full p");
  }
}

}  // namespace

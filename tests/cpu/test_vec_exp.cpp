// vec::exp_f32 (Note [vectorizable exp] in detail/cpu/vec_exp.hpp) against the correctly rounded e^x: within
// 2 ulp over the whole normal range, one subnormal step below it, exactly 0 / inf / NaN where expf gives
// them; vec::tanh_f32 within 4 ulp; and the row helpers sum_exp / exp_scaled against fp64 sums for fp32 and
// bf16 rows.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "typegrad/detail/cpu/vec_exp.hpp"

namespace {

using tg::backend::cpu::vec::exp_f32;

/// Distance in units in the last place of the correctly rounded fp32 value of e^x (computed in fp64).
double ulps_from_exact(float x) {
  const double exact = std::exp(static_cast<double>(x));
  const float got = exp_f32(x);
  const float rounded = static_cast<float>(exact);
  const float next = std::nextafter(rounded, std::numeric_limits<float>::infinity());
  const double ulp = static_cast<double>(next) - static_cast<double>(rounded);
  return std::abs(static_cast<double>(got) - exact) / ulp;
}

TEST(VecExp, WithinTwoUlpOverTheNormalRange) {
  // Every 97th fp32 value from -87.3 (e^x near the smallest normal) to 88.7 (near the largest finite).
  double worst = 0;
  float worst_x = 0;
  const std::uint32_t lo = std::bit_cast<std::uint32_t>(-87.3f), hi = std::bit_cast<std::uint32_t>(88.7f);
  // Negative floats: bit patterns from 0x80000000 (-0) up to lo; positive: 0 up to hi.
  for (std::uint32_t b = 0x80000000u; b <= lo; b += 97) {
    const float x = std::bit_cast<float>(b);
    const double u = ulps_from_exact(x);
    if (u > worst) worst = u, worst_x = x;
  }
  for (std::uint32_t b = 0; b <= hi; b += 97) {
    const float x = std::bit_cast<float>(b);
    const double u = ulps_from_exact(x);
    if (u > worst) worst = u, worst_x = x;
  }
  EXPECT_LE(worst, 2.0) << "worst at x = " << worst_x;
  std::printf("[vec_exp] largest error over the sampled normal range: %.3f ulp at x = %.9g\n", worst, worst_x);
  EXPECT_GT(worst, 0.0) << "a check that never sees an error checks nothing";
}

// vec::tanh_f32 against the correctly rounded tanh over every 61st fp32 value of [-20, 20] (beyond, both are
// ±1): within 4 ulp, including the switch from the polynomial to the exp form at |x| = 0.4, and its special values.
TEST(VecTanh, WithinFourUlpAndItsSpecialValues) {
  double worst = 0;
  float worst_x = 0;
  auto check = [&](float x) {
    const double exact = std::tanh(static_cast<double>(x));
    const float rounded = static_cast<float>(exact);
    const float next = std::nextafter(rounded, exact < 0 ? -std::numeric_limits<float>::infinity() : std::numeric_limits<float>::infinity());
    const double ulp = std::abs(static_cast<double>(next) - static_cast<double>(rounded));
    const double u = std::abs(static_cast<double>(tg::backend::cpu::vec::tanh_f32(x)) - exact) / ulp;
    if (u > worst) worst = u, worst_x = x;
  };
  const std::uint32_t top = std::bit_cast<std::uint32_t>(20.f);
  for (std::uint32_t b = 1; b <= top; b += 61) {  // positive, then negative (the same magnitudes)
    check(std::bit_cast<float>(b));
    check(-std::bit_cast<float>(b));
  }
  for (float x : {0.39999998f, 0.4f, 0.40000004f, -0.4f, 1e-30f, 3.f, 9.f}) check(x);
  EXPECT_LE(worst, 4.0) << "worst at x = " << worst_x;
  std::printf("[vec_tanh] largest error over the sampled range: %.3f ulp at x = %.9g\n", worst, worst_x);
  using tg::backend::cpu::vec::tanh_f32;
  EXPECT_EQ(tanh_f32(std::numeric_limits<float>::infinity()), 1.f);
  EXPECT_EQ(tanh_f32(-std::numeric_limits<float>::infinity()), -1.f);
  EXPECT_TRUE(std::isnan(tanh_f32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(std::signbit(tanh_f32(-0.f)) && tanh_f32(-0.f) == 0.f);
  EXPECT_EQ(tanh_f32(100.f), 1.f);
}

TEST(VecExp, SpecialValuesAndTheEdgesOfTheRange) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(exp_f32(0.f), 1.f);
  EXPECT_EQ(exp_f32(-0.f), 1.f);
  EXPECT_EQ(exp_f32(-inf), 0.f);
  EXPECT_EQ(exp_f32(inf), inf);
  EXPECT_TRUE(std::isnan(exp_f32(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_EQ(exp_f32(89.f), inf);
  EXPECT_EQ(exp_f32(1e30f), inf);
  EXPECT_EQ(exp_f32(-104.f), 0.f);
  EXPECT_EQ(exp_f32(-1e30f), 0.f);
  // The largest x whose e^x is finite in fp32 (ln FLT_MAX = 88.7228391...) and the next float above it.
  EXPECT_TRUE(std::isfinite(exp_f32(88.72283f)));
  EXPECT_NEAR(exp_f32(88.72283f) / std::exp(static_cast<double>(88.72283f)), 1.0, 3e-7);
  EXPECT_EQ(exp_f32(88.72284f), inf);
  // Subnormal results: within one subnormal step (2^-149) of e^x; the smallest round to 0 as e^x does.
  const double step = std::ldexp(1.0, -149);
  for (float x = -87.4f; x > -103.98f; x -= 0.013f)
    ASSERT_LE(std::abs(static_cast<double>(exp_f32(x)) - std::exp(static_cast<double>(x))), step) << "x = " << x;
  EXPECT_EQ(exp_f32(-103.98f), 0.f);  // e^x = 0.44 · 2^-149 rounds to 0
  EXPECT_GT(exp_f32(-103.2f), 0.f);   // e^x = 1.1 · 2^-149
}

TEST(VecExp, RowHelpersMatchFp64Sums) {
  std::mt19937 gen(20261204);
  std::normal_distribution<float> dist(0.f, 4.f);
  for (const std::int64_t n : {1, 15, 16, 17, 255, 256, 257, 50257}) {
    std::vector<float> x(static_cast<std::size_t>(n));
    for (float& v : x) v = dist(gen);
    x[0] = -std::numeric_limits<float>::infinity();  // a masked entry contributes exactly 0
    const float shift = 3.f;
    // The helpers subtract in fp32 (x − shift rounds first, as the kernels' scalar loops did), so the
    // reference is e^ of that fp32 difference.
    const auto exact_exp = [&](float v) { return std::exp(static_cast<double>(v - shift)); };
    double exact = 0;
    for (float v : x) exact += exact_exp(v);
    const float sum = tg::backend::cpu::vec::sum_exp(x.data(), n, shift);
    if (n == 1) {
      EXPECT_EQ(sum, 0.f);
    } else {
      EXPECT_NEAR(sum / exact, 1.0, 1e-6 * std::log2(static_cast<double>(n) + 2)) << "n = " << n;
    }

    std::vector<float> out(static_cast<std::size_t>(n));
    tg::backend::cpu::vec::exp_scaled(x.data(), n, shift, 0.5f, out.data());
    EXPECT_EQ(out[0], 0.f);
    for (std::int64_t j = 1; j < n; ++j) {
      const double want = 0.5 * exact_exp(x[static_cast<std::size_t>(j)]);
      ASSERT_NEAR(out[static_cast<std::size_t>(j)] / want, 1.0, 2.5e-7) << "n = " << n << ", j = " << j;
    }

    // bf16 rows: the same values rounded to bf16, widened exactly, give the same sum as their fp32 copies.
    std::vector<tg::bf16> xb(static_cast<std::size_t>(n));
    std::vector<float> xw(static_cast<std::size_t>(n));
    for (std::int64_t j = 0; j < n; ++j) {
      xb[static_cast<std::size_t>(j)] = tg::bf16(x[static_cast<std::size_t>(j)]);
      xw[static_cast<std::size_t>(j)] = static_cast<float>(xb[static_cast<std::size_t>(j)]);
    }
    EXPECT_EQ(tg::backend::cpu::vec::sum_exp(xb.data(), n, shift), tg::backend::cpu::vec::sum_exp(xw.data(), n, shift));
    std::vector<tg::bf16> ob(static_cast<std::size_t>(n));
    tg::backend::cpu::vec::exp_scaled(xb.data(), n, shift, 0.5f, ob.data());
    tg::backend::cpu::vec::exp_scaled(xw.data(), n, shift, 0.5f, out.data());
    for (std::int64_t j = 0; j < n; ++j)
      ASSERT_EQ(ob[static_cast<std::size_t>(j)].bits, tg::bf16(out[static_cast<std::size_t>(j)]).bits) << "j = " << j;
  }
}

}  // namespace

// Tests of core/random.hpp and the CPU random kernels: Philox4x32-10 known answers (Random123), draws
// independent of the thread count, seeds and offsets, and normal / uniform statistics.
//   ./build/cpu/tests/test_tensor --gtest_filter='Philox*:Generator*:RandomDraws*'
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "typegrad/typegrad.hpp"

namespace test_random_cpp {  // the file's own names (Note [unity test sources])

namespace {

using F = tg::Tensor<tg::fp32>;
using Words = std::array<std::uint32_t, 4>;

// Known-answer vectors of Random123 (Salmon et al., SC'11), file tests/kat_vectors, "philox4x32 10":
// counter (4 words), key (2 words) -> output (4 words).
TEST(Philox4x32_10, Random123KnownAnswers) {
  struct Kat {
    Words ctr;
    std::array<std::uint32_t, 2> key;
    Words out;
  };
  const Kat kats[] = {
      {{0x00000000u, 0x00000000u, 0x00000000u, 0x00000000u}, {0x00000000u, 0x00000000u},
       {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu},
       {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const auto& k : kats) {
    const Words got = tg::detail::philox4x32_10(k.ctr, k.key);
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(got[static_cast<std::size_t>(i)], k.out[static_cast<std::size_t>(i)])
          << "ctr[0]=" << std::hex << k.ctr[0] << " word " << i;
  }
}

TEST(Philox4x32_10, StreamMapsSeedToKeyAndIndexToCounter) {
  // philox_words(seed, index) is the block function at counter (index lo, index hi, 0, 0), key (seed lo, seed hi).
  const std::uint64_t seed = 0x0123456789abcdefull, index = 0xfedcba9876543210ull;
  const Words a = tg::detail::philox_words(seed, index);
  const Words b = tg::detail::philox4x32_10({0x76543210u, 0xfedcba98u, 0u, 0u}, {0x89abcdefu, 0x01234567u});
  EXPECT_EQ(a, b);
  EXPECT_EQ(tg::detail::philox_words(0, 0), (Words{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_NE(tg::detail::philox_words(seed, index), tg::detail::philox_words(seed, index + 1));
}

TEST(Philox4x32_10, BitConversions) {
  EXPECT_EQ(tg::detail::uniform_from_bits(0u), 0.f);
  EXPECT_EQ(tg::detail::uniform_from_bits(0xffffffffu), 1.f - std::ldexp(1.f, -24));  // < 1
  EXPECT_EQ(tg::detail::uniform_from_bits(0x80000000u), 0.5f);
  EXPECT_TRUE(std::isfinite(tg::detail::normal_from_bits(0xffffffffu, 0u)));  // u1 = 2^-24, log finite
  EXPECT_EQ(tg::detail::normal_from_bits(0u, 0u), 0.f);                       // u1 = 1: radius 0
}

template <class T>
std::vector<T> draw_normal(int threads, std::int64_t n, std::uint64_t seed, std::uint64_t offset) {
  tg::backend::cpu::set_num_threads(threads);
  tg::Generator g(seed);
  g.set_state(seed, offset);
  const auto t = tg::Tensor<T>::normal({n}, 0.5f, 2.f, g);
  return t.to_vector();
}
template <class T>
std::vector<T> draw_uniform(int threads, std::int64_t n, std::uint64_t seed) {
  tg::backend::cpu::set_num_threads(threads);
  tg::Generator g(seed);
  const auto t = tg::Tensor<T>::uniform({n}, -1.f, 3.f, g);
  return t.to_vector();
}
template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

TEST(RandomDraws, SameNumbersForAnyThreadCount) {
  const std::int64_t n = (1 << 17) + 3;  // above the kernels' parallel threshold, odd tail
  const auto n1 = draw_normal<float>(1, n, 42, 7);
  const auto n2 = draw_normal<float>(2, n, 42, 7);
  const auto u1 = draw_uniform<float>(1, n, 42);
  const auto u2 = draw_uniform<float>(2, n, 42);
  const auto b1 = draw_normal<tg::bf16>(1, n, 9, 0);
  const auto b2 = draw_normal<tg::bf16>(2, n, 9, 0);
  const auto d1 = draw_uniform<double>(1, n, 3);
  const auto d2 = draw_uniform<double>(2, n, 3);
  tg::backend::cpu::set_num_threads(0);  // restore the default
  EXPECT_TRUE(bitwise_equal(n1, n2));
  EXPECT_TRUE(bitwise_equal(u1, u2));
  EXPECT_TRUE(bitwise_equal(b1, b2));
  EXPECT_TRUE(bitwise_equal(d1, d2));
  // And element i is the documented function of counter offset + i (to a few ulps: the kernel may fuse
  // the multiply-add, and is compiled for the native ISA while this file is not).
  for (std::int64_t i : {std::int64_t{0}, std::int64_t{1}, n / 2, n - 1}) {
    const auto w = tg::detail::philox_words(42, 7 + static_cast<std::uint64_t>(i));
    EXPECT_FLOAT_EQ(n1[static_cast<std::size_t>(i)], 0.5f + 2.f * tg::detail::normal_from_bits(w[0], w[1])) << i;
    const auto v = tg::detail::philox_words(42, static_cast<std::uint64_t>(i));
    EXPECT_FLOAT_EQ(u1[static_cast<std::size_t>(i)], -1.f + 4.f * tg::detail::uniform_from_bits(v[0])) << i;
  }
}

TEST(RandomDraws, DifferentSeedsDiffer) {
  tg::Generator g1(1), g2(2);
  const auto a = F::normal({10000}, 0.f, 1.f, g1).to_vector();
  const auto b = F::normal({10000}, 0.f, 1.f, g2).to_vector();
  int equal = 0;
  for (std::size_t i = 0; i < a.size(); ++i) equal += a[i] == b[i];
  EXPECT_LE(equal, 2);
  // Consecutive draws of one generator differ too (the offset moved on).
  const auto c = F::normal({10000}, 0.f, 1.f, g1).to_vector();
  equal = 0;
  for (std::size_t i = 0; i < a.size(); ++i) equal += a[i] == c[i];
  EXPECT_LE(equal, 2);
}

TEST(Generator, OffsetAdvancesByTheDrawSize) {
  tg::Generator g(123);
  EXPECT_EQ(g.seed(), 123u);
  EXPECT_EQ(g.offset(), 0u);
  const F a = F::normal({10, 10}, 0.f, 1.f, g);
  EXPECT_EQ(g.offset(), 100u);
  const F b = F::uniform({7}, 0.f, 1.f, g);
  EXPECT_EQ(g.offset(), 107u);
  g.uniform();
  EXPECT_EQ(g.offset(), 108u);
  g.next_u64();
  EXPECT_EQ(g.offset(), 109u);
  EXPECT_EQ(g.advance(5), 109u);
  EXPECT_EQ(g.offset(), 114u);
  // The second draw continues the stream: it is the tail of one big draw of 107.
  tg::Generator h(123);
  const auto all = F::uniform({107}, 0.f, 1.f, h).to_vector();
  const auto bv = b.to_vector();
  for (int i = 0; i < 7; ++i) EXPECT_EQ(bv[static_cast<std::size_t>(i)], all[static_cast<std::size_t>(100 + i)]);
  EXPECT_EQ(tg::default_generator().seed(), 0x5eedu);
  const auto before = tg::default_generator().offset();
  (void)F::normal({13});
  EXPECT_EQ(tg::default_generator().offset(), before + 13);
}

TEST(Generator, SetStateReproduces) {
  tg::Generator g(77);
  (void)F::normal({50}, 0.f, 1.f, g);
  const auto seed = g.seed();
  const auto offset = g.offset();
  const auto first = F::normal({1000}, 0.f, 1.f, g).to_vector();
  const auto u = g.uniform();
  const auto k = g.next_u64();
  tg::Generator other(5);
  other.set_state(seed, offset);
  EXPECT_EQ(other.seed(), 77u);
  EXPECT_EQ(F::normal({1000}, 0.f, 1.f, other).to_vector(), first);
  EXPECT_EQ(other.uniform(), u);
  EXPECT_EQ(other.next_u64(), k);
  EXPECT_EQ(other.offset(), g.offset());
}

// Statistics of 1e6 draws. Tolerances are 5 standard errors of each estimator (for n samples of a
// distribution with standard deviation s: mean s/sqrt(n); variance s^2 sqrt(2/(n-1)) for a normal;
// a proportion p: sqrt(p(1-p)/n)), so a correct generator fails with probability about 1e-6 per check.
TEST(RandomDraws, NormalMeanStdWithinStandardErrors) {
  const std::int64_t n = 1'000'000;
  const float mu = 1.5f, sigma = 0.25f;
  tg::Generator g(2024);
  const auto v = F::normal({n}, mu, sigma, g).to_vector();
  double sum = 0, sum2 = 0, sum4 = 0, within1 = 0;
  for (float x : v) sum += x;
  const double mean = sum / static_cast<double>(n);
  for (float x : v) {
    const double d = x - mean;
    sum2 += d * d;
    sum4 += d * d * d * d;
    within1 += std::fabs(x - mu) < sigma;
  }
  const double var = sum2 / static_cast<double>(n - 1);
  const double kurt = sum4 / static_cast<double>(n) / (var * var);
  const double sn = std::sqrt(static_cast<double>(n));
  EXPECT_NEAR(mean, mu, 5 * sigma / sn);
  EXPECT_NEAR(var, sigma * sigma, 5 * sigma * sigma * std::sqrt(2.0 / static_cast<double>(n - 1)));
  EXPECT_NEAR(kurt, 3.0, 5 * std::sqrt(24.0 / static_cast<double>(n)));
  const double p1 = 0.6826894921370859;  // P(|Z| < 1)
  EXPECT_NEAR(within1 / static_cast<double>(n), p1, 5 * std::sqrt(p1 * (1 - p1) / static_cast<double>(n)));
  for (float x : v) ASSERT_TRUE(std::isfinite(x));
}

TEST(RandomDraws, UniformInRangeWithCorrectMean) {
  const std::int64_t n = 1'000'000;
  const float lo = -2.f, hi = 6.f;
  tg::Generator g(99);
  const auto v = F::uniform({n}, lo, hi, g).to_vector();
  double sum = 0, below_quarter = 0;
  float mn = hi, mx = lo;
  for (float x : v) {
    sum += x;
    mn = std::min(mn, x);
    mx = std::max(mx, x);
    below_quarter += x < lo + (hi - lo) / 4;
  }
  EXPECT_GE(mn, lo);
  EXPECT_LT(mx, hi);
  const double sn = std::sqrt(static_cast<double>(n));
  const double sd = (hi - lo) / std::sqrt(12.0);
  EXPECT_NEAR(sum / static_cast<double>(n), (lo + hi) / 2.0, 5 * sd / sn);
  EXPECT_NEAR(below_quarter / static_cast<double>(n), 0.25, 5 * std::sqrt(0.25 * 0.75) / sn);
  // The extremes are reached to within a few multiples of 1/n of the range.
  EXPECT_LT(mn, lo + (hi - lo) * 1e-4);
  EXPECT_GT(mx, hi - (hi - lo) * 1e-4);
  // Default range is [0, 1).
  tg::Generator g2(5);
  for (float x : F::uniform({10000}, 0.f, 1.f, g2).to_vector()) {
    ASSERT_GE(x, 0.f);
    ASSERT_LT(x, 1.f);
  }
}

}  // namespace

}  // namespace test_random_cpp

// Tests of core/dtype.hpp: fp16 / bf16 conversions (bit-exact round trips of all 65,536 patterns, and
// fp32 -> 16-bit rounding against an independent exact-arithmetic reference), traits, the DType list.
//   ./build/cpu/tests/test_dtype --gtest_filter='Fp16*'
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "typegrad/core/dtype.hpp"

namespace {

// ---- an independent reference ----------------------------------------------------------------------
// A binary16-like format with `mant_bits` stored mantissa bits and exponent bias `bias`. Every value is
// decoded with exact double arithmetic (ldexp), every non-negative pattern up to and including the
// +inf pattern is tabulated in increasing order (the +inf pattern is given the value 2^(emax+1), the
// next value of the unbounded exponent range, which is exactly IEEE 754's overflow rule: x rounds to
// inf iff |x| >= max_finite + ulp/2), and rounding picks the nearer neighbour, ties to the even pattern.
// Nothing here shares code or bit tricks with the library.
struct Format16 {
  int mant_bits;
  int bias;
  std::uint16_t inf_bits;      // +inf
  std::vector<double> values;  // values[p] for p in [0, inf_bits]

  Format16(int mant, int b) : mant_bits(mant), bias(b) {
    const int exp_bits = 15 - mant;
    inf_bits = static_cast<std::uint16_t>(((1u << exp_bits) - 1u) << mant);
    values.resize(inf_bits + 1u);
    for (std::uint32_t p = 0; p <= inf_bits; ++p) values[p] = decode_unbounded(static_cast<std::uint16_t>(p));
  }
  /// Value of a non-negative pattern treating the all-ones exponent as one more ordinary binade.
  double decode_unbounded(std::uint16_t p) const {
    const int e = p >> mant_bits;
    const double m = static_cast<double>(p & ((1u << mant_bits) - 1u));
    if (e == 0) return std::ldexp(m, 1 - bias - mant_bits);                              // subnormal
    return std::ldexp(m + std::ldexp(1.0, mant_bits), e - bias - mant_bits);              // normal
  }
  bool is_nan(std::uint16_t p) const { return (p & 0x7fffu) > inf_bits; }
  bool is_inf(std::uint16_t p) const { return (p & 0x7fffu) == inf_bits; }
  /// Exact value of any non-NaN pattern (inf included).
  double decode(std::uint16_t p) const {
    const double s = (p & 0x8000u) ? -1.0 : 1.0;
    if (is_inf(p)) return s * std::numeric_limits<double>::infinity();
    return s * values[p & 0x7fffu];
  }
  /// Round-to-nearest-even of a non-NaN float.
  std::uint16_t round(float f) const {
    const std::uint16_t sign = std::signbit(f) ? 0x8000u : 0u;
    const double x = std::fabs(static_cast<double>(f));  // exact
    if (std::isinf(x) || x >= values[inf_bits]) return static_cast<std::uint16_t>(sign | inf_bits);
    // hi: first tabulated value >= x; lo: the one before it.
    const auto it = std::lower_bound(values.begin(), values.end(), x);
    const auto hi = static_cast<std::uint16_t>(it - values.begin());
    if (values[hi] == x) return static_cast<std::uint16_t>(sign | hi);
    const auto lo = static_cast<std::uint16_t>(hi - 1);
    const double mid = (values[lo] + values[hi]) / 2;  // exact: both are short dyadic numbers
    std::uint16_t r;
    if (x < mid) r = lo;
    else if (x > mid) r = hi;
    else r = (lo % 2 == 0) ? lo : hi;
    return static_cast<std::uint16_t>(sign | r);
  }
};

const Format16& fp16_ref() {
  static const Format16 f(10, 15);
  return f;
}
const Format16& bf16_ref() {
  static const Format16 f(7, 127);
  return f;
}

float from_bits32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
std::uint32_t bits32(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

std::uint16_t lib_fp16(float f) { return tg::fp16(f).bits; }
std::uint16_t lib_bf16(float f) { return tg::bf16(f).bits; }

std::string hex(std::uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

/// Checks the library's fp32 -> 16-bit conversion of f against the reference (NaN must stay NaN).
template <class Lib>
::testing::AssertionResult rounds_like_reference(const Format16& ref, Lib lib, float f) {
  const std::uint16_t got = lib(f);
  if (std::isnan(f)) {
    if (!ref.is_nan(got)) return ::testing::AssertionFailure() << "NaN " << hex(bits32(f)) << " became " << hex(got);
    if ((got & 0x8000u) != ((bits32(f) >> 16) & 0x8000u))
      return ::testing::AssertionFailure() << "NaN " << hex(bits32(f)) << " lost its sign: " << hex(got);
    return ::testing::AssertionSuccess();
  }
  const std::uint16_t want = ref.round(f);
  if (got != want)
    return ::testing::AssertionFailure() << "fp32 " << hex(bits32(f)) << " (" << f << ") -> " << hex(got)
                                         << ", expected " << hex(want);
  return ::testing::AssertionSuccess();
}

// ---- 16 -> 32 -> 16 is the identity on every pattern ---------------------------------------------------

TEST(Fp16Conversion, AllPatternsRoundTripBitExact) {
  int failures = 0;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const tg::fp16 h = tg::fp16::from_bits(static_cast<std::uint16_t>(p));
    const float f = static_cast<float>(h);
    const std::uint16_t back = tg::fp16(f).bits;
    if (back != p && ++failures <= 10) ADD_FAILURE() << "fp16 " << hex(p) << " -> " << f << " -> " << hex(back);
    // The widened value is the exact value of the pattern (NaN for NaN patterns).
    if (fp16_ref().is_nan(static_cast<std::uint16_t>(p))) {
      if (!std::isnan(f) && ++failures <= 10) ADD_FAILURE() << "fp16 NaN " << hex(p) << " widened to " << f;
    } else if (static_cast<double>(f) != fp16_ref().decode(static_cast<std::uint16_t>(p)) && ++failures <= 10) {
      ADD_FAILURE() << "fp16 " << hex(p) << " widened to " << f << ", expected " << fp16_ref().decode(static_cast<std::uint16_t>(p));
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Bf16Conversion, AllPatternsRoundTripBitExact) {
  int failures = 0;
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const tg::bf16 h = tg::bf16::from_bits(static_cast<std::uint16_t>(p));
    const float f = static_cast<float>(h);
    const std::uint16_t back = tg::bf16(f).bits;
    if (back != p && ++failures <= 10) ADD_FAILURE() << "bf16 " << hex(p) << " -> " << f << " -> " << hex(back);
    if (bf16_ref().is_nan(static_cast<std::uint16_t>(p))) {
      if (!std::isnan(f) && ++failures <= 10) ADD_FAILURE() << "bf16 NaN " << hex(p) << " widened to " << f;
    } else if (static_cast<double>(f) != bf16_ref().decode(static_cast<std::uint16_t>(p)) && ++failures <= 10) {
      ADD_FAILURE() << "bf16 " << hex(p) << " widened to " << f << ", expected " << bf16_ref().decode(static_cast<std::uint16_t>(p));
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(Fp16Conversion, ReferenceSelfCheck) {
  // The reference itself agrees with well-known binary16 facts, so a bug in it cannot hide one in the library.
  EXPECT_EQ(fp16_ref().decode(0x3c00), 1.0);
  EXPECT_EQ(fp16_ref().decode(0x7bff), 65504.0);
  EXPECT_EQ(fp16_ref().decode(0x0001), std::ldexp(1.0, -24));
  EXPECT_EQ(fp16_ref().decode(0x0400), std::ldexp(1.0, -14));
  EXPECT_EQ(fp16_ref().decode(0xc000), -2.0);
  EXPECT_EQ(fp16_ref().round(65519.0f), 0x7bff);
  EXPECT_EQ(fp16_ref().round(65520.0f), 0x7c00);
  EXPECT_EQ(bf16_ref().decode(0x3f80), 1.0);
  EXPECT_EQ(bf16_ref().decode(0x7f7f), std::ldexp(255.0, 120));
  EXPECT_EQ(bf16_ref().decode(0x0001), std::ldexp(1.0, -133));
  EXPECT_EQ(bf16_ref().round(1.0f + 1.0f / 256), 0x3f80);       // tie, even
  EXPECT_EQ(bf16_ref().round(1.0f + 3.0f / 256), 0x3f82);       // tie, odd -> up
  EXPECT_TRUE(fp16_ref().is_nan(0x7e00));
  EXPECT_TRUE(fp16_ref().is_inf(0xfc00));
  EXPECT_TRUE(bf16_ref().is_nan(0xffc1));
}

// ---- fp32 -> 16-bit rounding on random values ------------------------------------------------------------

template <class Lib>
void check_random(const Format16& ref, Lib lib, int emin, int emax, std::uint32_t seed) {
  std::mt19937 rng(seed);
  int failures = 0;
  auto check = [&](float f) {
    auto r = rounds_like_reference(ref, lib, f);
    if (!r && ++failures <= 10) ADD_FAILURE() << r.message();
  };
  // Uniform over all 2^32 bit patterns: every exponent of fp32 (subnormals, NaNs, infs included).
  for (int i = 0; i < 2'000'000; ++i) check(from_bits32(rng()));
  // Concentrated on the target's range: random exponent in [emin, emax], random 23-bit mantissa.
  std::uniform_int_distribution<int> e(emin, emax);
  for (int i = 0; i < 2'000'000; ++i) {
    const std::uint32_t sign = rng() & 0x80000000u;
    const int ex = std::clamp(e(rng) + 127, 1, 254);
    check(from_bits32(sign | (static_cast<std::uint32_t>(ex) << 23) | (rng() & 0x7fffffu)));
  }
  // Exactly at, and one fp32 ulp either side of, the midpoint of two random adjacent finite values.
  std::uniform_int_distribution<std::uint32_t> pat(0, ref.inf_bits - 1u);
  for (int i = 0; i < 500'000; ++i) {
    const std::uint32_t lo = pat(rng);
    const double mid = (ref.values[lo] + ref.values[lo + 1]) / 2;
    const auto m = static_cast<float>(mid);
    if (static_cast<double>(m) != mid) continue;  // midpoint not representable in fp32 (tiny subnormals)
    const float sgn = (rng() & 1u) ? -1.f : 1.f;
    check(sgn * m);
    check(sgn * std::nextafter(m, 0.f));
    check(sgn * std::nextafter(m, std::numeric_limits<float>::infinity()));
  }
  EXPECT_EQ(failures, 0);
}

TEST(Fp16Conversion, RandomFloatsRoundToNearestEven) { check_random(fp16_ref(), lib_fp16, -27, 17, 1234); }
TEST(Bf16Conversion, RandomFloatsRoundToNearestEven) { check_random(bf16_ref(), lib_bf16, -136, 128, 5678); }

// ---- fp32 -> fp16 edge values ----------------------------------------------------------------------------

TEST(Fp16Conversion, EdgeValues) {
  const float two_m24 = std::ldexp(1.f, -24), two_m25 = std::ldexp(1.f, -25);
  struct Case {
    float in;
    std::uint16_t want;
  };
  const Case cases[] = {
      {0.f, 0x0000}, {-0.f, 0x8000}, {1.f, 0x3c00}, {-2.f, 0xc000},
      // exact ties in the normal range: 1 + 2^-11 (even lower neighbour) and 1 + 3*2^-11 (odd lower neighbour)
      {1.f + std::ldexp(1.f, -11), 0x3c00},
      {1.f + 3 * std::ldexp(1.f, -11), 0x3c02},
      {std::nextafter(1.f + std::ldexp(1.f, -11), 2.f), 0x3c01},
      {std::nextafter(1.f + std::ldexp(1.f, -11), 0.f), 0x3c00},
      {std::nextafter(1.f + 3 * std::ldexp(1.f, -11), 0.f), 0x3c01},
      // largest finite, just below halfway to inf, halfway (65520 -> inf), above, fp32 max
      {65504.f, 0x7bff}, {-65504.f, 0xfbff},
      {std::nextafter(65520.f, 0.f), 0x7bff},
      {65520.f, 0x7c00}, {-65520.f, 0xfc00}, {65536.f, 0x7c00}, {1e10f, 0x7c00},
      {std::numeric_limits<float>::max(), 0x7c00}, {-std::numeric_limits<float>::max(), 0xfc00},
      // subnormals of fp16
      {two_m24, 0x0001}, {-two_m24, 0x8001},
      {two_m25, 0x0000},                 // tie between 0 and 2^-24 -> 0 (even)
      {-two_m25, 0x8000},
      {std::nextafter(two_m25, 1.f), 0x0001},
      {std::nextafter(two_m25, 0.f), 0x0000},
      {3 * two_m25, 0x0002},             // tie between 1 and 2 ulps -> 2 (even)
      {5 * two_m25, 0x0002},             // tie between 2 and 3 -> 2
      {7 * two_m25, 0x0004},             // tie between 3 and 4 -> 4
      {1023 * two_m24, 0x03ff},          // largest subnormal
      {std::ldexp(1.f, -14), 0x0400},    // smallest normal
      {std::ldexp(1.f, -14) - two_m25, 0x0400},  // tie between largest subnormal (odd) and smallest normal
      {std::ldexp(1.f, -14) - 3 * two_m25, 0x03fe},
      // fp32 subnormals and tiny normals flush to (signed) zero by rounding
      {std::numeric_limits<float>::denorm_min(), 0x0000}, {-std::numeric_limits<float>::denorm_min(), 0x8000},
      {std::numeric_limits<float>::min(), 0x0000}, {std::ldexp(1.f, -30), 0x0000},
      // infinities
      {std::numeric_limits<float>::infinity(), 0x7c00}, {-std::numeric_limits<float>::infinity(), 0xfc00},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(lib_fp16(c.in), c.want) << "input " << c.in << " (" << hex(bits32(c.in)) << ")";
    EXPECT_EQ(fp16_ref().round(c.in), c.want) << "reference, input " << c.in;
  }
}

TEST(Fp16Conversion, NanStaysNan) {
  // quiet, signalling, payload only in the bits that truncate away, negative
  for (std::uint32_t b : {0x7fc00000u, 0x7f800001u, 0x7f801fffu, 0x7fa00000u, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const std::uint16_t h = lib_fp16(from_bits32(b));
    EXPECT_TRUE(fp16_ref().is_nan(h)) << hex(b) << " -> " << hex(h);
    EXPECT_EQ(h & 0x8000u, (b >> 16) & 0x8000u) << hex(b);
    EXPECT_TRUE(std::isnan(static_cast<float>(tg::fp16::from_bits(h))));
  }
  EXPECT_TRUE(std::isnan(static_cast<float>(tg::fp16(std::numeric_limits<float>::quiet_NaN()))));
}

// ---- fp32 -> bf16 edge values ----------------------------------------------------------------------------

TEST(Bf16Conversion, EdgeValues) {
  const float max_bf16 = std::ldexp(255.f, 120);  // (2 - 2^-7) * 2^127 = 0x7f7f
  const float halfway = std::ldexp(511.f, 119);   // (2 - 2^-8) * 2^127: tie between 0x7f7f (odd) and inf
  struct Case {
    float in;
    std::uint16_t want;
  };
  const Case cases[] = {
      {0.f, 0x0000}, {-0.f, 0x8000}, {1.f, 0x3f80}, {-1.f, 0xbf80},
      {1.f + std::ldexp(1.f, -8), 0x3f80},      // tie, even lower neighbour
      {1.f + 3 * std::ldexp(1.f, -8), 0x3f82},  // tie, odd lower neighbour -> up
      {std::nextafter(1.f + std::ldexp(1.f, -8), 2.f), 0x3f81},
      {std::nextafter(1.f + 3 * std::ldexp(1.f, -8), 0.f), 0x3f81},
      {3.14159265f, 0x4049},
      {max_bf16, 0x7f7f}, {-max_bf16, 0xff7f},
      {std::nextafter(halfway, 0.f), 0x7f7f},
      {halfway, 0x7f80}, {-halfway, 0xff80},  // halfway to inf rounds to inf
      {std::numeric_limits<float>::max(), 0x7f80},
      {std::numeric_limits<float>::infinity(), 0x7f80}, {-std::numeric_limits<float>::infinity(), 0xff80},
      // fp32 subnormals are bf16 subnormals (or round to them)
      {std::numeric_limits<float>::denorm_min(), 0x0000},      // 2^-149 < half of 2^-133
      {from_bits32(0x00008000u), 0x0000},                      // tie between 0 and 0x0001 -> 0
      {from_bits32(0x00008001u), 0x0001},
      {from_bits32(0x00018000u), 0x0002},                      // tie between 1 and 2 -> 2
      {from_bits32(0x00010000u), 0x0001},
      {from_bits32(0x807fffffu), 0x8080},                      // largest subnormal rounds up to -min normal
      {std::numeric_limits<float>::min(), 0x0080},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(lib_bf16(c.in), c.want) << "input " << c.in << " (" << hex(bits32(c.in)) << ")";
    EXPECT_EQ(bf16_ref().round(c.in), c.want) << "reference, input " << c.in;
  }
}

TEST(Bf16Conversion, NanStaysNan) {
  for (std::uint32_t b : {0x7fc00000u, 0x7f800001u, 0x7f80ffffu, 0x7fa00000u, 0xffc00000u, 0xff800001u, 0x7fffffffu}) {
    const std::uint16_t h = lib_bf16(from_bits32(b));
    EXPECT_TRUE(bf16_ref().is_nan(h)) << hex(b) << " -> " << hex(h);
    EXPECT_EQ(h & 0x8000u, (b >> 16) & 0x8000u) << hex(b);
  }
  // A NaN whose top payload bits survive keeps them.
  EXPECT_EQ(lib_bf16(from_bits32(0x7fa50000u)), 0x7fa5);
}

TEST(Fp16Conversion, DoubleAndIntConstructorsRound) {
  EXPECT_EQ(tg::fp16(2049).bits, tg::fp16(2048.f).bits);   // 2049 is a tie -> even (2048)
  EXPECT_EQ(tg::fp16(2051).bits, tg::fp16(2052.f).bits);   // tie -> 2052 (even mantissa)
  EXPECT_EQ(tg::fp16(0.1).bits, 0x2e66);
  EXPECT_EQ(tg::bf16(0.1).bits, 0x3dcd);
  EXPECT_EQ(static_cast<double>(tg::fp16(0.5)), 0.5);
  EXPECT_EQ(static_cast<double>(tg::bf16(-3)), -3.0);
}

// ---- traits and the master list --------------------------------------------------------------------------

TEST(DTypeTraits, FloatingTypes) {
  using tg::dtype_traits;
  EXPECT_EQ(dtype_traits<tg::fp16>::name, "fp16");
  EXPECT_EQ(dtype_traits<tg::bf16>::name, "bf16");
  EXPECT_EQ(dtype_traits<tg::fp32>::name, "fp32");
  EXPECT_EQ(dtype_traits<tg::fp64>::name, "fp64");
  EXPECT_EQ(dtype_traits<tg::fp16>::size, 2u);
  EXPECT_EQ(dtype_traits<tg::bf16>::size, 2u);
  EXPECT_EQ(dtype_traits<tg::fp32>::size, 4u);
  EXPECT_EQ(dtype_traits<tg::fp64>::size, 8u);
  static_assert(std::is_same_v<tg::accum_t<tg::fp16>, float>);
  static_assert(std::is_same_v<tg::accum_t<tg::bf16>, float>);
  static_assert(std::is_same_v<tg::accum_t<tg::fp32>, float>);
  static_assert(std::is_same_v<tg::accum_t<tg::fp64>, double>);
  static_assert(std::is_same_v<tg::accum_t<std::int32_t>, std::int64_t>);
  static_assert(tg::FloatingElement<tg::bf16> && !tg::FloatingElement<std::int64_t>);
  static_assert(tg::IndexElement<std::int32_t> && !tg::IndexElement<std::uint8_t>);

  // max_finite is the value of the largest finite pattern; epsilon is the gap from 1 to the next value.
  EXPECT_EQ(dtype_traits<tg::fp16>::max_finite(), fp16_ref().decode(0x7bff));
  EXPECT_EQ(dtype_traits<tg::bf16>::max_finite(), bf16_ref().decode(0x7f7f));
  EXPECT_EQ(dtype_traits<tg::fp16>::max_finite(), static_cast<double>(tg::fp16::from_bits(0x7bff)));
  EXPECT_EQ(dtype_traits<tg::bf16>::max_finite(), static_cast<double>(tg::bf16::from_bits(0x7f7f)));
  EXPECT_EQ(dtype_traits<tg::fp16>::epsilon(), fp16_ref().decode(0x3c01) - 1.0);
  EXPECT_EQ(dtype_traits<tg::bf16>::epsilon(), bf16_ref().decode(0x3f81) - 1.0);
  EXPECT_EQ(dtype_traits<tg::fp16>::min_normal(), fp16_ref().decode(0x0400));
  EXPECT_EQ(dtype_traits<tg::fp32>::max_finite(), static_cast<double>(std::numeric_limits<float>::max()));
  EXPECT_EQ(dtype_traits<tg::fp32>::epsilon(), static_cast<double>(std::numeric_limits<float>::epsilon()));
  EXPECT_EQ(dtype_traits<tg::fp64>::max_finite(), std::numeric_limits<double>::max());
  EXPECT_EQ(dtype_traits<tg::fp64>::epsilon(), std::numeric_limits<double>::epsilon());
  // The largest finite value converts to itself, one step beyond it overflows.
  EXPECT_EQ(tg::fp16(static_cast<float>(dtype_traits<tg::fp16>::max_finite())).bits, 0x7bff);
  EXPECT_EQ(tg::bf16(static_cast<float>(dtype_traits<tg::bf16>::max_finite())).bits, 0x7f7f);
}

TEST(DTypeTraits, IntegerTypes) {
  using tg::dtype_traits;
  EXPECT_EQ(dtype_traits<std::int64_t>::max_finite(), static_cast<double>(std::numeric_limits<std::int64_t>::max()));
  EXPECT_EQ(dtype_traits<std::int32_t>::max_finite(), 2147483647.0);
  EXPECT_EQ(dtype_traits<std::uint8_t>::max_finite(), 255.0);
  EXPECT_EQ(dtype_traits<std::uint8_t>::epsilon(), 1.0);
  EXPECT_FALSE(dtype_traits<std::int32_t>::is_floating);
  EXPECT_TRUE(dtype_traits<tg::bf16>::is_floating);
}

TEST(DTypeMasterList, EnumNameSizeAndTraitsAgreeForEveryEntry) {
  std::set<int> enum_values;
  std::set<std::string> names, st_names;
  int entries = 0;
#define TG_X(type, e, nm, st)                                                           \
  {                                                                                     \
    ++entries;                                                                          \
    SCOPED_TRACE(nm);                                                                   \
    EXPECT_EQ(tg::dtype_traits<type>::dtype, tg::DType::e);                             \
    EXPECT_EQ(tg::dtype_name(tg::DType::e), std::string_view(nm));                     \
    EXPECT_EQ(tg::dtype_traits<type>::name, std::string_view(nm));                      \
    EXPECT_EQ(tg::dtype_safetensors_name(tg::DType::e), std::string_view(st));          \
    EXPECT_EQ(tg::dtype_size(tg::DType::e), sizeof(type));                              \
    EXPECT_EQ(tg::dtype_traits<type>::size, sizeof(type));                              \
    EXPECT_EQ(tg::dtype_traits<type>::is_floating, !std::is_integral_v<type>);          \
    static_assert(tg::Element<type>);                                                   \
    enum_values.insert(static_cast<int>(tg::DType::e));                                 \
    names.insert(nm);                                                                   \
    st_names.insert(st);                                                                \
  }
  TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
  EXPECT_EQ(entries, 8);
  // Distinct, dense enum values starting at 0, distinct names.
  EXPECT_EQ(static_cast<int>(enum_values.size()), entries);
  EXPECT_EQ(*enum_values.begin(), 0);
  EXPECT_EQ(*enum_values.rbegin(), entries - 1);
  EXPECT_EQ(static_cast<int>(names.size()), entries);
  EXPECT_EQ(static_cast<int>(st_names.size()), entries);
  EXPECT_EQ(tg::dtype_name(static_cast<tg::DType>(200)), "?");
  EXPECT_EQ(tg::dtype_size(static_cast<tg::DType>(200)), 0u);
}

// ---- scalar_cast ----------------------------------------------------------------------------------------

TEST(ScalarCast, RoundTrips) {
  // Every fp16 / bf16 pattern survives a trip through fp32 bit-exactly, and through fp64 too except that
  // the float <-> double conversions may quiet a signalling NaN (IEEE 754 6.2: they are operations; x86
  // sets the quiet bit, an optimizer may elide the pair), so there a NaN may gain its quiet bit.
  for (std::uint32_t p = 0; p < 65536; ++p) {
    const auto h = tg::fp16::from_bits(static_cast<std::uint16_t>(p));
    const auto b = tg::bf16::from_bits(static_cast<std::uint16_t>(p));
    ASSERT_EQ(tg::scalar_cast<tg::fp16>(tg::scalar_cast<float>(h)).bits, p);
    ASSERT_EQ(tg::scalar_cast<tg::bf16>(tg::scalar_cast<float>(b)).bits, p);
    const std::uint16_t hd = tg::scalar_cast<tg::fp16>(tg::scalar_cast<double>(h)).bits;
    const std::uint16_t bd = tg::scalar_cast<tg::bf16>(tg::scalar_cast<double>(b)).bits;
    if (fp16_ref().is_nan(static_cast<std::uint16_t>(p))) {
      ASSERT_TRUE(hd == p || hd == (p | 0x0200u)) << hex(p) << " -> " << hex(hd);
    } else {
      ASSERT_EQ(hd, p);
    }
    if (bf16_ref().is_nan(static_cast<std::uint16_t>(p))) {
      ASSERT_TRUE(bd == p || bd == (p | 0x0040u)) << hex(p) << " -> " << hex(bd);
    } else {
      ASSERT_EQ(bd, p);
    }
  }
  // Integers exactly representable in the 16-bit types.
  for (int i = -2048; i <= 2048; ++i)
    ASSERT_EQ(tg::scalar_cast<std::int32_t>(tg::scalar_cast<tg::fp16>(i)), i);
  for (int i = -256; i <= 256; ++i)
    ASSERT_EQ(tg::scalar_cast<std::int64_t>(tg::scalar_cast<tg::bf16>(static_cast<std::int64_t>(i))), i);
  EXPECT_EQ(tg::scalar_cast<float>(tg::scalar_cast<double>(0.1f)), 0.1f);
  EXPECT_EQ(tg::scalar_cast<std::int64_t>(tg::scalar_cast<double>(std::int64_t{1} << 52)), std::int64_t{1} << 52);
  EXPECT_EQ(tg::scalar_cast<std::uint8_t>(tg::scalar_cast<tg::fp32>(std::uint8_t{200})), 200);
  // Between the 16-bit types the value goes through fp32 and rounds once.
  EXPECT_EQ(tg::scalar_cast<tg::bf16>(tg::fp16(1.f + std::ldexp(1.f, -10))).bits, 0x3f80);  // 1+2^-10 -> bf16 1.0
  EXPECT_EQ(tg::scalar_cast<tg::fp16>(tg::bf16::from_bits(0x4049)).bits, tg::fp16(3.140625f).bits);
  EXPECT_EQ(tg::scalar_cast<float>(tg::scalar_cast<tg::bf16>(1e30f)), static_cast<float>(tg::bf16(1e30f)));
  EXPECT_EQ(tg::scalar_cast<int>(2.75), 2);  // plain static_cast semantics for the rest
}

}  // namespace

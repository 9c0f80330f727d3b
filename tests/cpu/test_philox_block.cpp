// The CPU dropout keep rule over runs of elements (detail/cpu/philox_block.hpp, Note [dropout masks in vectors])
// against its scalar definition, at one ISA level per executable: tests/CMakeLists.txt compiles this file three
// times, for the scalar path (the baseline x86-64 flags), for AVX2 and for AVX-512, so one machine with AVX-512
// checks all three (the library itself is compiled for the build machine and runs only one of them). Each
// executable checks at compile time that the header took the path it was built for, and the vector ones skip
// where the CPU lacks their instructions.
//
// Checked: every word position's flag equals math::dropout_keep(dropout_uniform(seed, position + i), p) for runs
// of 0..kDropoutBlock elements starting at each position mod 4 (the scalar head), whole vectors of counters
// (one and two at a time) and the scalar tail; counters whose low word wraps inside a vector (the carry into the
// high word); seeds with both key words set; p = 0, 1 and values between.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "typegrad/detail/cpu/philox_block.hpp"

#if !defined(TG_TEST_PHILOX_ISA) || !defined(TG_TEST_PHILOX_SUITE)
#error "tests/CMakeLists.txt defines TG_TEST_PHILOX_ISA (0, 2 or 512) and TG_TEST_PHILOX_SUITE"
#endif
#if TG_TEST_PHILOX_ISA == 512 && !defined(TG_PHILOX_AVX512)
#error "built for AVX-512 but philox_block.hpp did not take its AVX-512 path"
#elif TG_TEST_PHILOX_ISA == 2 && (!defined(TG_PHILOX_AVX2) || defined(TG_PHILOX_AVX512))
#error "built for AVX2 but philox_block.hpp did not take its AVX2 path"
#elif TG_TEST_PHILOX_ISA == 0 && (defined(TG_PHILOX_AVX2) || defined(TG_PHILOX_AVX512))
#error "built for the scalar path but philox_block.hpp took a vector one"
#endif

namespace test_philox_block_cpp {
namespace {

using tg::backend::cpu::dropout_keep_block;
using tg::backend::cpu::kDropoutBlock;

/// Why the CPU cannot run this executable's path, or empty.
std::string missing_isa() {
#if TG_TEST_PHILOX_ISA == 512
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512vl"))
    return "this CPU lacks AVX-512 F/BW/VL";
#elif TG_TEST_PHILOX_ISA == 2
  if (!__builtin_cpu_supports("avx2")) return "this CPU lacks AVX2";
#endif
  return {};
}

#define TG_SKIP_WITHOUT_ISA()                                    \
  do {                                                           \
    if (const std::string why = missing_isa(); !why.empty())     \
      GTEST_SKIP() << why << "; the path is not run here";       \
  } while (0)

/// The first element where dropout_keep_block disagrees with the scalar definition, as text; empty if none.
std::string first_difference(std::uint64_t seed, std::uint64_t position, int n, float p) {
  std::vector<unsigned char> got(static_cast<std::size_t>(n) + 1, 2);  // 2: never written
  dropout_keep_block(seed, position, n, p, reinterpret_cast<bool*>(got.data()));
  if (got[static_cast<std::size_t>(n)] != 2) return "wrote past element " + std::to_string(n);
  for (int i = 0; i < n; ++i) {
    const bool want =
        tg::math::dropout_keep(tg::detail::dropout_uniform(seed, position + static_cast<std::uint64_t>(i)), p);
    if (got[static_cast<std::size_t>(i)] != (want ? 1 : 0))
      return "element " + std::to_string(i) + " (seed " + std::to_string(seed) + ", position " +
             std::to_string(position) + ", n " + std::to_string(n) + ", p " + std::to_string(p) + "): got " +
             std::to_string(got[static_cast<std::size_t>(i)]) + ", the definition says " + (want ? "1" : "0");
  }
  return {};
}

TEST(TG_TEST_PHILOX_SUITE, EveryLengthAndAlignmentIsTheDefinition) {
  TG_SKIP_WITHOUT_ISA();
  for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{1234567}, std::uint64_t{0xDEADBEEFCAFEF00Dull}})
    for (const std::uint64_t position : {std::uint64_t{0}, std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3},
                                         std::uint64_t{4096 + 6}})
      for (int n = 0; n <= kDropoutBlock; ++n) {
        const std::string diff = first_difference(seed, position, n, 0.1f);
        ASSERT_TRUE(diff.empty()) << diff;
      }
}

TEST(TG_TEST_PHILOX_SUITE, CounterLowWordWrapsInsideAVector) {
  TG_SKIP_WITHOUT_ISA();
  // Counter c = position / 4: positions around 4·2^32 put the low word's wrap (0xFFFFFFFF -> 0 with a carry into
  // the high word) at each lane of a vector, and around 4·(2^33 - 1) with a high word that is not zero.
  for (const std::uint64_t wrap : {std::uint64_t{1} << 32, (std::uint64_t{1} << 33) + (std::uint64_t{1} << 32)})
    for (std::uint64_t back = 0; back <= 70; back += 1) {
      const std::uint64_t position = 4 * (wrap - back) + back % 4;
      const std::string diff = first_difference(0x0123456789ABCDEFull, position, kDropoutBlock, 0.5f);
      ASSERT_TRUE(diff.empty()) << diff;
    }
}

TEST(TG_TEST_PHILOX_SUITE, KeepsAllAtPZeroAndNoneAtPOne) {
  TG_SKIP_WITHOUT_ISA();
  for (const float p : {0.f, 1.f, 0.25f, 0.9f}) {
    const std::string diff = first_difference(42, 8, kDropoutBlock, p);
    ASSERT_TRUE(diff.empty()) << diff;
  }
  std::vector<unsigned char> keep(kDropoutBlock);
  dropout_keep_block(42, 8, kDropoutBlock, 0.f, reinterpret_cast<bool*>(keep.data()));
  for (const unsigned char k : keep) ASSERT_EQ(k, 1);
  dropout_keep_block(42, 8, kDropoutBlock, 1.f, reinterpret_cast<bool*>(keep.data()));
  for (const unsigned char k : keep) ASSERT_EQ(k, 0);  // the uniform is below 1
}

TEST(TG_TEST_PHILOX_SUITE, KeepsAboutOneMinusPOfALongRun) {
  TG_SKIP_WITHOUT_ISA();
  // Not the definition again: the rate itself, so a path that agrees with a wrong definition still fails.
  constexpr int kRuns = 400;
  int kept = 0;
  std::vector<unsigned char> keep(kDropoutBlock);
  for (int r = 0; r < kRuns; ++r) {
    dropout_keep_block(7, static_cast<std::uint64_t>(r) * kDropoutBlock, kDropoutBlock, 0.3f,
                       reinterpret_cast<bool*>(keep.data()));
    for (const unsigned char k : keep) kept += k;
  }
  const double rate = static_cast<double>(kept) / (kRuns * kDropoutBlock);
  EXPECT_NEAR(rate, 0.7, 0.01);  // 102,400 draws: the standard deviation is 0.0014
}

}  // namespace
}  // namespace test_philox_block_cpp

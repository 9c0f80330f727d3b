// Tests of the CPU int8 GEMMs (gemm_int8.hpp) for every int8 kernel this CPU runs, each called directly
// (gemm_s8s8s32_with, PackedInt8Weights(..., kernel)) on 1 and 2 threads: exact equality with the reference
// loops at every blocking remainder, transposes, leading dimensions, accumulate, forced cache blocks, the
// int8 extremes at K = kInt8MaxK; the fused dequant epilogue bit for bit; kernel choice and errors.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "scoped_env.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/gemm_int8.hpp"

namespace {

using tg::backend::cpu::Int8Kernel;
using tg::backend::cpu::kInt8MaxK;
using tg::backend::cpu::PackedInt8Weights;
using tg::backend::cpu::Trans;
using i64 = std::int64_t;


/// The optimized kernels this CPU runs (the reference is what they are compared with).
std::vector<Int8Kernel> fast_kernels() {
  std::vector<Int8Kernel> ks;
  for (Int8Kernel k : {Int8Kernel::avx2, Int8Kernel::vnni, Int8Kernel::amx})
    if (tg::backend::cpu::int8_kernel_supported(k)) ks.push_back(k);
  return ks;
}

enum class Fill { random, min, max, mixed };

/// A rows x cols int8 operand with leading dimension cols + pad; the padding holds random bytes too, so a
/// kernel that read it would (almost surely) give a different sum.
struct Mat8 {
  i64 rows = 0, cols = 0, ld = 0;
  std::vector<std::int8_t> v;
  Mat8(i64 r, i64 c, i64 pad, std::mt19937& rng, Fill fill = Fill::random) : rows(r), cols(c), ld(c + pad) {
    v.resize(static_cast<std::size_t>(std::max<i64>(rows * ld, 1)));
    std::uniform_int_distribution<int> u(-128, 127);
    for (auto& x : v) x = static_cast<std::int8_t>(u(rng));
    for (i64 i = 0; i < rows; ++i)
      for (i64 j = 0; j < cols; ++j) {
        std::int8_t& x = v[static_cast<std::size_t>(i * ld + j)];
        switch (fill) {
          case Fill::random: break;
          case Fill::min: x = -128; break;
          case Fill::max: x = 127; break;
          case Fill::mixed: x = (i + j) % 3 == 0 ? std::int8_t(127) : std::int8_t(-128); break;
        }
      }
  }
};

struct Case {
  Trans ta = Trans::N, tb = Trans::T;
  i64 M = 1, N = 1, K = 1, pad = 3;
  bool accumulate = false;
  Fill fa = Fill::random, fb = Fill::random;
};

std::string describe(Int8Kernel k, int threads, const Case& c) {
  return tg::backend::cpu::int8_kernel_name(k) + " threads=" + std::to_string(threads) + " M=" + std::to_string(c.M) +
         " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) + " ta=" + (c.ta == Trans::T ? "T" : "N") +
         " tb=" + (c.tb == Trans::T ? "T" : "N") + (c.accumulate ? " accumulate" : "");
}

/// gemm_s8s8s32_with(k) against gemm_s8s8s32_reference on the same operands: every element of C (padding
/// included, which must stay as it was) equal. Returns false after the first mismatch (reported).
bool check_exact(Int8Kernel k, int threads, const Case& c, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const Mat8 A(c.ta == Trans::N ? c.M : c.K, c.ta == Trans::N ? c.K : c.M, c.pad, rng, c.fa);
  const Mat8 B(c.tb == Trans::N ? c.K : c.N, c.tb == Trans::N ? c.N : c.K, c.pad + 1, rng, c.fb);
  const i64 ldc = c.N + c.pad + 2;
  std::vector<std::int32_t> C(static_cast<std::size_t>(std::max<i64>(c.M * ldc, 1)));
  std::uniform_int_distribution<std::int32_t> u(std::numeric_limits<std::int32_t>::min(),
                                                std::numeric_limits<std::int32_t>::max());
  for (auto& x : C) x = u(rng);  // accumulate: any start value (the sum wraps mod 2^32 like the reference)
  std::vector<std::int32_t> want = C;
  tg::backend::cpu::gemm_s8s8s32_reference(c.ta, c.tb, c.M, c.N, c.K, A.v.data(), A.ld, B.v.data(), B.ld, want.data(),
                                           ldc, c.accumulate);
  tg::backend::cpu::gemm_s8s8s32_with(k, threads, c.ta, c.tb, c.M, c.N, c.K, A.v.data(), A.ld, B.v.data(), B.ld,
                                      C.data(), ldc, c.accumulate);
  for (i64 i = 0; i < c.M; ++i)
    for (i64 j = 0; j < ldc; ++j) {
      const std::size_t e = static_cast<std::size_t>(i * ldc + j);
      if (C[e] != want[e]) {
        ADD_FAILURE() << describe(k, threads, c) << ": C(" << i << "," << j << ") = " << C[e] << ", want " << want[e]
                      << (j >= c.N ? " (padding was written)" : "");
        return false;
      }
    }
  return true;
}

/// The dequantized product: y bit-equal to float(ref) · a_scale[m] · w_scale[n] (+ bias[n]), each operation
/// rounded to fp32 (this file is compiled with -ffp-contract=off), y's padding untouched.
bool check_dequant(Int8Kernel k, int threads, i64 M, i64 N, i64 K, bool with_bias, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const Mat8 A(M, K, 5, rng), W(N, K, 3, rng);
  std::uniform_real_distribution<float> us(1e-4f, 2e-2f), ub(-3.f, 3.f);
  std::vector<float> a_scale(static_cast<std::size_t>(M)), w_scale(static_cast<std::size_t>(N)),
      bias(static_cast<std::size_t>(N));
  for (auto& s : a_scale) s = us(rng);
  for (auto& s : w_scale) s = us(rng);
  for (auto& b : bias) b = ub(rng);
  const i64 ldy = N + 7;
  std::vector<float> y(static_cast<std::size_t>(std::max<i64>(M * ldy, 1)), -12345.f);
  std::vector<std::int32_t> ref(static_cast<std::size_t>(std::max<i64>(M * N, 1)));
  tg::backend::cpu::gemm_s8s8s32_reference(Trans::N, Trans::T, M, N, K, A.v.data(), A.ld, W.v.data(), W.ld, ref.data(),
                                           N);
  const PackedInt8Weights pw(W.v.data(), N, K, W.ld, k);
  EXPECT_EQ(pw.n(), N);
  EXPECT_EQ(pw.k(), K);
  EXPECT_EQ(pw.kernel(), k);
  tg::backend::cpu::gemm_s8_packed_dequant_with(threads, M, A.v.data(), A.ld, a_scale.data(), pw, w_scale.data(),
                                                with_bias ? bias.data() : nullptr, y.data(), ldy);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < ldy; ++j) {
      float want = -12345.f;
      if (j < N) {
        want = static_cast<float>(ref[static_cast<std::size_t>(i * N + j)]);
        want = want * a_scale[static_cast<std::size_t>(i)];
        want = want * w_scale[static_cast<std::size_t>(j)];
        if (with_bias) want = want + bias[static_cast<std::size_t>(j)];
      }
      const float got = y[static_cast<std::size_t>(i * ldy + j)];
      if (std::memcmp(&got, &want, sizeof got) != 0) {
        ADD_FAILURE() << tg::backend::cpu::int8_kernel_name(k) << " threads=" << threads << " M=" << M << " N=" << N
                      << " K=" << K << (with_bias ? " bias" : " no bias") << ": y(" << i << "," << j << ") = " << got
                      << ", want " << want;
        return false;
      }
    }
  return true;
}

// ---- exactness at every blocking remainder --------------------------------------------------------------

TEST(GemmInt8, SomeOptimizedKernelRunsHere) {
  // The CI machines have AVX2 at least; a CPU without it tests only the reference.
  if (!tg::backend::cpu::cpu_features().avx2) GTEST_SKIP() << "no AVX2: only the reference kernel";
  EXPECT_FALSE(fast_kernels().empty());
}

TEST(GemmInt8, EqualsReferenceAtEveryRemainderOfMNK) {
  for (Int8Kernel k : fast_kernels())
    for (int threads : {1, 2}) {
      std::uint32_t seed = 1;
      // One dimension swept at a time through the 12-row panels, 32-column panels and 4-k quads.
      for (i64 M = 1; M <= 26; ++M)
        if (!check_exact(k, threads, {.M = M, .N = 70, .K = 13}, seed++)) return;
      for (i64 N = 1; N <= 70; ++N)
        if (!check_exact(k, threads, {.M = 26, .N = N, .K = 13}, seed++)) return;
      for (i64 K = 1; K <= 13; ++K)
        if (!check_exact(k, threads, {.M = 26, .N = 70, .K = K}, seed++)) return;
      // And a grid of remainders in all three at once.
      for (i64 M : {1, 5, 12, 13, 25})
        for (i64 N : {1, 17, 31, 32, 33, 65})
          for (i64 K : {1, 3, 4, 5, 8, 63, 64, 65})
            if (!check_exact(k, threads, {.M = M, .N = N, .K = K}, seed++)) return;
    }
}

TEST(GemmInt8, EqualsReferenceForAllTransposesStridesAndAccumulate) {
  for (Int8Kernel k : fast_kernels())
    for (int threads : {1, 2})
      for (Trans ta : {Trans::N, Trans::T})
        for (Trans tb : {Trans::N, Trans::T})
          for (bool acc : {false, true}) {
            std::uint32_t seed = 100;
            const i64 shapes[][3] = {{29, 67, 37}, {7, 33, 130}, {40, 9, 6}, {1, 100, 77}};
            for (const auto& s : shapes)
              for (i64 pad : {0, 5})
                if (!check_exact(k, threads,
                                 {.ta = ta, .tb = tb, .M = s[0], .N = s[1], .K = s[2], .pad = pad, .accumulate = acc},
                                 seed++))
                  return;
          }
}

TEST(GemmInt8, EqualsReferenceAcrossForcedCacheBlocks) {
  // kc = 8 k (2 k-quads; AMX rounds to 64), mc = 24 rows (2 panels), nc = 64 columns (2 panels): every K, M
  // and column block boundary, and the int32 workspace of the earlier K blocks, at small sizes.
  for (const char* spec : {"8,24,64", "20,12,32", "64,36,96"}) {
    const ScopedEnv blocking("TG_INT8_BLOCKING", spec);
    for (Int8Kernel k : fast_kernels())
      for (int threads : {1, 2}) {
        std::uint32_t seed = 200;
        for (Trans ta : {Trans::N, Trans::T})
          for (Trans tb : {Trans::N, Trans::T})
            for (bool acc : {false, true})
              if (!check_exact(k, threads, {.ta = ta, .tb = tb, .M = 50, .N = 150, .K = 137, .accumulate = acc},
                               seed++))
                return;
        if (!check_dequant(k, threads, 50, 150, 137, true, seed++)) return;
        if (!check_dequant(k, threads, 37, 95, 300, false, seed++)) return;
      }
  }
}

TEST(GemmInt8, EqualsReferenceAcrossDefaultCacheBlocks) {
  // K = 5000 is two K blocks with a 1 MiB L2 (or more with a smaller one); 150 rows at K = 3072 are two A
  // blocks there.
  for (Int8Kernel k : fast_kernels())
    for (int threads : {1, 2}) {
      if (!check_exact(k, threads, {.M = 30, .N = 100, .K = 5000}, 300)) return;
      if (!check_exact(k, threads, {.ta = Trans::T, .tb = Trans::N, .M = 30, .N = 70, .K = 5001, .accumulate = true},
                       301))
        return;
      if (!check_exact(k, threads, {.M = 150, .N = 40, .K = 3072}, 302)) return;
      if (!check_dequant(k, threads, 27, 77, 5003, true, 303)) return;
    }
}

TEST(GemmInt8, ExactAtTheInt8ExtremesUpToTheLargestK) {
  // At K = kInt8MaxK: -128·-128·K = 2^30, 127·-128·K; VNNI's biased sum (A + 128 = 255 times B = -128 over
  // every k) is -2139095040, within int32 by 0.4%.
  for (Int8Kernel k : fast_kernels())
    for (int threads : {1, 2})
      for (Fill fa : {Fill::min, Fill::max, Fill::mixed})
        for (Fill fb : {Fill::min, Fill::max, Fill::mixed})
          for (i64 K : {i64{13}, kInt8MaxK})
            if (!check_exact(k, threads, {.M = 3, .N = 33, .K = K, .fa = fa, .fb = fb}, 400)) return;
}

TEST(GemmInt8, EmptyProducts) {
  for (Int8Kernel k : fast_kernels()) {
    std::vector<std::int8_t> a(64, 3), b(64, 5);
    std::vector<std::int32_t> c(64, 7);
    // K = 0: C = 0, or unchanged with accumulate.
    tg::backend::cpu::gemm_s8s8s32_with(k, 1, Trans::N, Trans::T, 2, 3, 0, a.data(), 1, b.data(), 1, c.data(), 3, true);
    for (int e = 0; e < 6; ++e) EXPECT_EQ(c[e], 7);
    tg::backend::cpu::gemm_s8s8s32_with(k, 1, Trans::N, Trans::T, 2, 3, 0, a.data(), 1, b.data(), 1, c.data(), 4);
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 4; ++j) EXPECT_EQ(c[i * 4 + j], j < 3 ? 0 : 7) << i << "," << j;
    // M = 0 or N = 0: nothing written.
    std::vector<std::int32_t> d(64, 9);
    tg::backend::cpu::gemm_s8s8s32_with(k, 1, Trans::N, Trans::T, 0, 3, 4, a.data(), 4, b.data(), 4, d.data(), 3);
    tg::backend::cpu::gemm_s8s8s32_with(k, 1, Trans::N, Trans::T, 3, 0, 4, a.data(), 4, b.data(), 4, d.data(), 1);
    for (int e = 0; e < 64; ++e) EXPECT_EQ(d[e], 9);
    // Packed weights with K = 0: y = 0 · a_scale · w_scale + bias.
    const PackedInt8Weights pw(b.data(), 3, 0, 0, k);
    const float as[2] = {2.f, 3.f}, ws[3] = {1.f, 4.f, 5.f}, bias[3] = {0.5f, -1.f, 2.f};
    float y[6] = {};
    tg::backend::cpu::gemm_s8_packed_dequant_with(1, 2, a.data(), 0, as, pw, ws, bias, y, 3);
    for (int e = 0; e < 6; ++e) EXPECT_EQ(y[e], bias[e % 3]);
  }
}

TEST(GemmInt8, EqualsReferenceInsideAParallelRegion) {
  // Called from inside a parallel region each call runs on its own thread (thread-local packing buffers).
  for (Int8Kernel k : fast_kernels()) {
    bool ok[2] = {true, true};
#pragma omp parallel num_threads(2)
    {
      const int t = omp_get_thread_num();
      if (t < 2)
        for (int r = 0; r < 3 && ok[t]; ++r) {
          std::mt19937 rng(500 + 10 * t + r);
          const i64 M = 20 + t, N = 70, K = 45;
          const Mat8 A(M, K, 1, rng), B(N, K, 2, rng);
          std::vector<std::int32_t> c(static_cast<std::size_t>(M * N)), want(c.size());
          tg::backend::cpu::gemm_s8s8s32_reference(Trans::N, Trans::T, M, N, K, A.v.data(), A.ld, B.v.data(), B.ld,
                                                   want.data(), N);
          tg::backend::cpu::gemm_s8s8s32_with(k, 0, Trans::N, Trans::T, M, N, K, A.v.data(), A.ld, B.v.data(), B.ld,
                                              c.data(), N);
          ok[t] = c == want;
        }
    }
    EXPECT_TRUE(ok[0] && ok[1]) << tg::backend::cpu::int8_kernel_name(k);
  }
}

// ---- the public entries and the dequant epilogue --------------------------------------------------------

TEST(GemmInt8, DequantIsBitEqualToTheScaledReference) {
  std::vector<Int8Kernel> ks = fast_kernels();
  ks.push_back(Int8Kernel::reference);
  for (Int8Kernel k : ks)
    for (int threads : {1, 2}) {
      std::uint32_t seed = 600;
      for (bool bias : {true, false}) {
        for (i64 M = 1; M <= 26; ++M)
          if (!check_dequant(k, threads, M, 45, 19, bias, seed++)) return;
        for (i64 N = 1; N <= 70; ++N)
          if (!check_dequant(k, threads, 14, N, 11, bias, seed++)) return;
        for (i64 K = 1; K <= 13; ++K)
          if (!check_dequant(k, threads, 13, 33, K, bias, seed++)) return;
        if (!check_dequant(k, threads, 64, 2304 / 8, 768, bias, seed++)) return;  // a GPT-2-like shape
      }
    }
}

TEST(GemmInt8, DefaultEntriesUseTheChosenKernel) {
  std::mt19937 rng(700);
  const i64 M = 33, N = 97, K = 71;
  const Mat8 A(M, K, 0, rng), W(N, K, 0, rng);
  std::vector<std::int32_t> want(static_cast<std::size_t>(M * N)), c(want.size());
  tg::backend::cpu::gemm_s8s8s32_reference(Trans::N, Trans::T, M, N, K, A.v.data(), K, W.v.data(), K, want.data(), N);
  tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, M, N, K, A.v.data(), K, W.v.data(), K, c.data(), N);
  EXPECT_EQ(c, want);
  std::vector<float> as(static_cast<std::size_t>(M), 0.5f), ws(static_cast<std::size_t>(N), 0.25f), y(c.size());
  const PackedInt8Weights pw(W.v.data(), N, K, K);
  EXPECT_EQ(pw.kernel(), tg::backend::cpu::int8_kernel());
  EXPECT_GT(pw.bytes(), N * K - 1);
  tg::backend::cpu::gemm_s8_packed_dequant(M, A.v.data(), K, as.data(), pw, ws.data(), nullptr, y.data(), N);
  for (std::size_t e = 0; e < y.size(); ++e) ASSERT_EQ(y[e], static_cast<float>(want[e]) * 0.5f * 0.25f) << e;
  // The best kernel is never the reference where an optimized one runs, and the name says which.
  const Int8Kernel best = tg::backend::cpu::int8_kernel();
  if (!fast_kernels().empty()) EXPECT_NE(best, Int8Kernel::reference);
  EXPECT_FALSE(tg::backend::cpu::gemm_int8_kernel_name().empty());
  // Moved weights keep working.
  PackedInt8Weights moved = PackedInt8Weights(W.v.data(), N, K, K);
  std::vector<float> y2(y.size());
  tg::backend::cpu::gemm_s8_packed_dequant(M, A.v.data(), K, as.data(), moved, ws.data(), nullptr, y2.data(), N);
  EXPECT_EQ(y, y2);
}

TEST(GemmInt8, EnvironmentForcesTheKernel) {
  for (Int8Kernel k : {Int8Kernel::reference, Int8Kernel::avx2, Int8Kernel::vnni, Int8Kernel::amx}) {
    if (!tg::backend::cpu::int8_kernel_supported(k)) continue;
    const ScopedEnv force("TG_INT8_KERNEL", tg::backend::cpu::int8_kernel_name(k));
    EXPECT_EQ(tg::backend::cpu::int8_kernel(), k);
    const PackedInt8Weights pw(std::vector<std::int8_t>(8, 1).data(), 2, 4, 4);
    EXPECT_EQ(pw.kernel(), k);
    EXPECT_TRUE(check_exact(k, 0, {.M = 13, .N = 33, .K = 9}, 800));
  }
  const ScopedEnv force("TG_INT8_KERNEL", "reference");
  EXPECT_EQ(tg::backend::cpu::gemm_int8_kernel_name(), "reference loops");
}

// ---- errors ---------------------------------------------------------------------------------------------

/// The message of the tg::Error that f throws ("" when it throws none).
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const tg::Error& e) {
    return e.what();
  }
  return "";
}

TEST(GemmInt8, RejectsKAboveTheLimitAndNegativeSizes) {
  std::vector<std::int8_t> a(16), b(16);
  std::vector<std::int32_t> c(16);
  const i64 K = kInt8MaxK + 1;
  for (Int8Kernel k : {Int8Kernel::reference, Int8Kernel::vnni, Int8Kernel::avx2}) {
    if (!tg::backend::cpu::int8_kernel_supported(k)) continue;
    const std::string msg = error_of([&] {
      tg::backend::cpu::gemm_s8s8s32_with(k, 1, Trans::N, Trans::T, 1, 1, K, a.data(), K, b.data(), K, c.data(), 1);
    });
    EXPECT_NE(msg.find("K = 65537"), std::string::npos) << msg;
    EXPECT_NE(msg.find("kInt8MaxK"), std::string::npos) << msg;
  }
  EXPECT_NE(error_of([&] {
              tg::backend::cpu::gemm_s8s8s32_reference(Trans::N, Trans::T, 1, 1, K, a.data(), K, b.data(), K, c.data(),
                                                       1);
            }).find("K = 65537"),
            std::string::npos);
  EXPECT_NE(error_of([&] { PackedInt8Weights pw(b.data(), 1, K, K); }).find("K = 65537"), std::string::npos);
  const std::string neg = error_of(
      [&] { tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, -1, 1, 1, a.data(), 1, b.data(), 1, c.data(), 1); });
  EXPECT_NE(neg.find("M = -1"), std::string::npos) << neg;
  EXPECT_NE(error_of([&] {
              tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, 2, 2, 4, a.data(), 3, b.data(), 4, c.data(), 2);
            }).find("lda = 3"),
            std::string::npos);
}

TEST(GemmInt8, RejectsAnUnknownKernelName) {
  const ScopedEnv force("TG_INT8_KERNEL", "avx9000");
  const std::string msg = error_of([] { (void)tg::backend::cpu::int8_kernel(); });
  EXPECT_NE(msg.find("avx9000"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected reference, avx2, vnni or amx"), std::string::npos) << msg;
  std::vector<std::int8_t> a(4, 1);
  std::vector<std::int32_t> c(1);
  EXPECT_THROW(tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, 1, 1, 4, a.data(), 4, a.data(), 4, c.data(), 1),
               tg::Error);
}

TEST(GemmInt8, RejectsForcingAKernelThisCpuLacks) {
  Int8Kernel missing = Int8Kernel::reference;
  for (Int8Kernel k : {Int8Kernel::amx, Int8Kernel::vnni, Int8Kernel::avx2})
    if (!tg::backend::cpu::int8_kernel_supported(k)) {
      missing = k;
      break;
    }
  if (missing == Int8Kernel::reference) GTEST_SKIP() << "this CPU runs every int8 kernel";
  const std::string name = tg::backend::cpu::int8_kernel_name(missing);
  {
    const ScopedEnv force("TG_INT8_KERNEL", name);
    const std::string msg = error_of([] { (void)tg::backend::cpu::int8_kernel(); });
    EXPECT_NE(msg.find("TG_INT8_KERNEL=" + name), std::string::npos) << msg;
    EXPECT_NE(msg.find("not supported by this CPU"), std::string::npos) << msg;
    EXPECT_NE(msg.find(tg::backend::cpu::cpu_features().vendor), std::string::npos) << msg;  // the detected features
  }
  std::vector<std::int8_t> a(16, 1);
  std::vector<std::int32_t> c(16);
  const std::string direct = error_of([&] {
    tg::backend::cpu::gemm_s8s8s32_with(missing, 1, Trans::N, Trans::T, 2, 2, 4, a.data(), 4, a.data(), 4, c.data(), 2);
  });
  EXPECT_NE(direct.find("'" + name + "' is not supported"), std::string::npos) << direct;
  EXPECT_NE(error_of([&] { PackedInt8Weights pw(a.data(), 2, 4, 4, missing); }).find("not supported"),
            std::string::npos);
}

}  // namespace

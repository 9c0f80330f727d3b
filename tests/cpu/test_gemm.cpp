// Tests of the CPU GEMMs (gemm, gemm_batched) for every kernel this CPU runs, against an fp64 triple loop:
// blocking remainders, transposes, leading dimensions, alpha/beta, NaN/inf, epilogue, batching, 16-bit bounds.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "scoped_env.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/gemm.hpp"
#include "typegrad/detail/cpu/kernels.hpp"

namespace {

using tg::bf16;
using tg::fp16;
using tg::backend::cpu::CpuIsa;
using tg::backend::cpu::Trans;
using i64 = std::int64_t;

constexpr double kU32 = 5.9604644775390625e-08;  // 2^-24, fp32 unit roundoff

template <class T>
float to_f(T x) {
  return static_cast<float>(x);
}
template <class T>
T from_f(float x) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) return static_cast<T>(x);
  else return T(x);
}
/// Unit roundoff of the output rounding (0 for fp32 / fp64 outputs: covered by the accumulation term).
template <class T>
double out_roundoff() {
  if constexpr (std::is_same_v<T, bf16>) return 1.0 / 256;   // 2^-8
  else if constexpr (std::is_same_v<T, fp16>) return 1.0 / 2048;  // 2^-11
  else return 0.0;
}

/// A rows x cols operand stored with leading dimension ld >= cols; the padding holds NaN (never read).
template <class T>
struct Mat {
  i64 rows = 0, cols = 0, ld = 0;
  std::vector<T> v;
  Mat(i64 r, i64 c, i64 pad, std::mt19937& rng, bool exact16) : rows(r), cols(c), ld(c + pad) {
    v.assign(static_cast<std::size_t>(std::max<i64>(rows * ld, 1)), from_f<T>(std::numeric_limits<float>::quiet_NaN()));
    std::uniform_int_distribution<int> q(-64, 64);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (i64 i = 0; i < rows; ++i)
      for (i64 j = 0; j < cols; ++j)
        v[i * ld + j] = from_f<T>(exact16 ? static_cast<float>(q(rng)) / 32.f : u(rng));
  }
  T& at(i64 i, i64 j) { return v[i * ld + j]; }
  double get(i64 i, i64 j) const { return static_cast<double>(to_f(v[i * ld + j])); }
};

struct Case {
  Trans ta = Trans::N, tb = Trans::N;
  i64 M = 1, N = 1, K = 1;
  float alpha = 1.f, beta = 0.f;
  i64 pad = 3;
};

std::string describe(const Case& c) {
  return "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) +
         " ta=" + (c.ta == Trans::T ? "T" : "N") + " tb=" + (c.tb == Trans::T ? "T" : "N") +
         " alpha=" + std::to_string(c.alpha) + " beta=" + std::to_string(c.beta);
}

/// Runs gemm<T> on random operands and checks every output against the fp64 triple loop within
///   |C - ref| <= out_roundoff * |ref| + 3 (K + 2) 2^-24 (|alpha| sum_k |a||b| + |beta c0|),
/// the fp32-accumulation bound (inputs exact in T, so only the K-term sum and the final rounding err).
/// Also checks that C's padding is untouched and, with an epilogue, the bias and (with_copy) the bf16 copy.
template <class T>
void check_gemm(const Case& c, std::uint32_t seed, bool with_epilogue = false, bool with_copy = true) {
  std::mt19937 rng(seed);
  const bool exact16 = !std::is_same_v<T, float>;
  Mat<T> A(c.ta == Trans::N ? c.M : c.K, c.ta == Trans::N ? c.K : c.M, c.pad, rng, exact16);
  Mat<T> B(c.tb == Trans::N ? c.K : c.N, c.tb == Trans::N ? c.N : c.K, c.pad + 1, rng, exact16);
  Mat<T> C(c.M, c.N, c.pad + 2, rng, exact16);
  if (c.beta == 0.f)  // beta == 0 must not read C: fill it with NaN
    for (i64 i = 0; i < c.M; ++i)
      for (i64 j = 0; j < c.N; ++j) C.at(i, j) = from_f<T>(std::numeric_limits<float>::quiet_NaN());
  const Mat<T> C0 = C;
  std::vector<float> bias(static_cast<std::size_t>(c.N));
  for (auto& b : bias) b = static_cast<float>(static_cast<int>(rng() % 17) - 8) / 4.f;
  const i64 ldo = c.N + 5;
  std::vector<bf16> out16(static_cast<std::size_t>(std::max<i64>(c.M * ldo, 1)), bf16(-7.f));
  tg::backend::cpu::GemmEpilogue ep;
  if (with_epilogue) ep = {bias.data(), with_copy ? out16.data() : nullptr, ldo};

  tg::backend::cpu::gemm<T>(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.v.data(), A.ld, B.v.data(), B.ld, c.beta,
                            C.v.data(), C.ld, ep);

  const auto a = [&](i64 i, i64 k) { return c.ta == Trans::N ? A.get(i, k) : A.get(k, i); };
  const auto b = [&](i64 k, i64 j) { return c.tb == Trans::N ? B.get(k, j) : B.get(j, k); };
  int bad = 0;
  for (i64 i = 0; i < c.M && bad < 5; ++i) {
    for (i64 j = 0; j < c.N && bad < 5; ++j) {
      double s = 0, sabs = 0;
      for (i64 k = 0; k < c.K; ++k) s += a(i, k) * b(k, j), sabs += std::abs(a(i, k) * b(k, j));
      const double c0 = c.beta == 0.f ? 0.0 : C0.get(i, j);
      double ref = static_cast<double>(c.alpha) * s + static_cast<double>(c.beta) * c0;
      if (with_epilogue) ref += bias[static_cast<std::size_t>(j)];
      const double tol = out_roundoff<T>() * std::abs(ref) +
                         3.0 * (static_cast<double>(c.K) + 2) * kU32 *
                             (std::abs(c.alpha) * sabs + std::abs(c.beta * c0) + (with_epilogue ? 8.0 : 0.0)) +
                         1e-30;
      const double got = C.get(i, j);
      if (!(std::abs(got - ref) <= tol)) {
        ADD_FAILURE() << describe(c) << ": C(" << i << "," << j << ") = " << got << ", want " << ref
                      << " (tol " << tol << ")";
        ++bad;
      }
      if (with_epilogue && with_copy) {
        const float want16 = static_cast<float>(bf16(to_f(C.at(i, j))));
        const float got16 = static_cast<float>(out16[static_cast<std::size_t>(i * ldo + j)]);
        // The copy is the bf16 rounding of the fp32 result; for fp16 C that may differ from bf16(C) by
        // one bf16 ulp (C itself was rounded to fp16 first).
        const double tol16 = std::is_same_v<T, fp16> ? std::abs(want16) / 128.0 : 0.0;
        if (!(std::abs(got16 - want16) <= tol16)) {
          ADD_FAILURE() << describe(c) << ": bf16 copy (" << i << "," << j << ") = " << got16 << ", want " << want16;
          ++bad;
        }
      }
    }
  }
  for (i64 i = 0; i < c.M; ++i)  // the padding of C (NaN) is never written
    for (i64 j = c.N; j < C.ld; ++j)
      if (std::memcmp(&C.v[i * C.ld + j], &C0.v[i * C0.ld + j], sizeof(T)) != 0) {
        ADD_FAILURE() << describe(c) << ": wrote C padding at (" << i << "," << j << ")";
        return;
      }
}


/// Forces TG_GEMM_KERNEL for the lifetime of the guard.
struct ForceKernel : ScopedEnv {
  explicit ForceKernel(CpuIsa isa) : ScopedEnv("TG_GEMM_KERNEL", std::string(tg::backend::cpu::cpu_isa_name(isa))) {}
  explicit ForceKernel(const char* name) : ScopedEnv("TG_GEMM_KERNEL", name) {}
};

const CpuIsa kAllIsas[] = {CpuIsa::reference, CpuIsa::avx2, CpuIsa::avx512, CpuIsa::avx512bf16};

// ---- feature detection and kernel selection ----------------------------------------------------------------

TEST(CpuFeatures, FlagsAreConsistentAndPrinted) {
  const auto& f = tg::backend::cpu::cpu_features();
  const std::string s = tg::backend::cpu::cpu_features_string();
  EXPECT_NE(s.find(f.vendor), std::string::npos) << s;
  if (f.avx2) EXPECT_NE(s.find(" avx2"), std::string::npos) << s;
  if (f.avx512bw || f.avx512vl || f.avx512dq || f.avx512_bf16) EXPECT_TRUE(f.avx512f) << s;
  if (f.avx2 || f.fma || f.f16c) EXPECT_TRUE(f.avx) << s;
  EXPECT_TRUE(tg::backend::cpu::cpu_supports(CpuIsa::reference));
  EXPECT_TRUE(tg::backend::cpu::cpu_supports(tg::backend::cpu::best_cpu_isa()));
  std::printf("cpu: %s; best GEMM level: %s\n", s.c_str(),
              std::string(tg::backend::cpu::cpu_isa_name(tg::backend::cpu::best_cpu_isa())).c_str());
}

/// Sets TG_GEMM_BLOCKING for the lifetime of the guard.
struct ForceBlocking : ScopedEnv {
  explicit ForceBlocking(const char* spec) : ScopedEnv("TG_GEMM_BLOCKING", spec) {}
};

TEST(CpuFeatures, CacheSizesArePlausibleAndPrinted) {
  const auto& c = tg::backend::cpu::cpu_cache_sizes();
  EXPECT_GE(c.l1d, 4 * 1024);
  EXPECT_GT(c.l2, c.l1d);
  EXPECT_GT(c.l3, 0);
  const std::string s = tg::backend::cpu::cpu_features_string();
  EXPECT_NE(s.find("; L1d " + std::to_string(c.l1d / 1024) + " KiB, L2 " + std::to_string(c.l2 / 1024) + " KiB"),
            std::string::npos)
      << s;
  const std::string source = c.source;
  EXPECT_TRUE(source == "sysfs" || source == "cpuid" || source == "defaults") << source;
  EXPECT_NE(s.find("(" + source + ")"), std::string::npos) << s;
}

TEST(GemmKernel, MalformedBlockingOverrideThrows) {
  float a = 1.f, b = 1.f, c = 0.f;
  for (const char* spec : {"64", "64,x,0", "-1,0,0", "64,0,0,0", "64,0,"}) {
    ForceBlocking blocking(spec);
    EXPECT_THROW(tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 1, 1, 1, 1.f, &a, 1, &b, 1, 0.f, &c, 1), tg::Error)
        << spec;
  }
}

TEST(GemmKernel, IsaNamesRoundTripAndUnknownNameThrows) {
  for (CpuIsa isa : kAllIsas) EXPECT_EQ(tg::backend::cpu::parse_cpu_isa(tg::backend::cpu::cpu_isa_name(isa)), isa);
  EXPECT_THROW(tg::backend::cpu::parse_cpu_isa("sse9"), tg::Error);
  ForceKernel force("sse9");
  float a = 1, b = 1, c = 0;
  EXPECT_THROW(tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 1, 1, 1, 1.f, &a, 1, &b, 1, 0.f, &c, 1), tg::Error);
}

TEST(GemmKernel, ForcingAnUnsupportedKernelThrows) {
  int unsupported = 0;
  for (CpuIsa isa : kAllIsas) {
    if (tg::backend::cpu::cpu_supports(isa)) continue;
    ++unsupported;
    ForceKernel force(isa);
    float a = 1, b = 1, c = 0;
    try {
      tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 1, 1, 1, 1.f, &a, 1, &b, 1, 0.f, &c, 1);
      ADD_FAILURE() << "forcing " << tg::backend::cpu::cpu_isa_name(isa) << " did not throw";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("not supported"), std::string::npos) << e.what();
    }
    EXPECT_THROW(tg::backend::cpu::gemm_kernel_name(tg::DType::f32), tg::Error);
  }
  if (unsupported == 0) GTEST_SKIP() << "this CPU supports every GEMM kernel level";
}

TEST(GemmKernel, DefaultIsTheBestLevelAndNamesTheConversion) {
  const std::string f32 = tg::backend::cpu::gemm_kernel_name(tg::DType::f32);
  const std::string b16 = tg::backend::cpu::gemm_kernel_name(tg::DType::bf16);
  std::printf("fp32: %s\nbf16: %s\nfp16: %s\n", f32.c_str(), b16.c_str(),
              tg::backend::cpu::gemm_kernel_name(tg::DType::f16).c_str());
  switch (tg::backend::cpu::best_cpu_isa()) {
    case CpuIsa::avx2:
      EXPECT_NE(f32.find("avx2-fma packed"), std::string::npos) << f32;
      EXPECT_NE(b16.find("bf16 converted to fp32 in packing"), std::string::npos) << b16;
      break;
    case CpuIsa::avx512:
      EXPECT_NE(f32.find("avx512 packed"), std::string::npos) << f32;
      break;
    case CpuIsa::avx512bf16: {  // Note [bf16 kernel choice]: the measured rate decides
      const double speedup = tg::backend::cpu::gemm_bf16_dot_speedup();
      EXPECT_GT(speedup, 0.2) << b16;
      EXPECT_LT(speedup, 8.0) << b16;
      EXPECT_NE(b16.find("vdpbf16ps measured at"), std::string::npos) << b16;
      if (speedup >= tg::backend::cpu::kBf16DotMinSpeedup)
        EXPECT_NE(b16.find("vdpbf16ps packed"), std::string::npos) << b16;
      else
        EXPECT_NE(b16.find("bf16 converted to fp32 in packing"), std::string::npos) << b16;
      break;
    }
    case CpuIsa::reference:
      EXPECT_NE(f32.find("eigen"), std::string::npos) << f32;
      break;
  }
  EXPECT_NE(tg::backend::cpu::gemm_kernel_name(tg::DType::f64).find("eigen"), std::string::npos);
  if (!tg::backend::cpu::cpu_supports(CpuIsa::avx512bf16)) EXPECT_EQ(tg::backend::cpu::gemm_bf16_dot_speedup(), 0.0);
}

TEST(GemmKernel, ForcingTheBf16DotLevelOverridesTheMeasuredChoice) {
  if (!tg::backend::cpu::cpu_supports(CpuIsa::avx512bf16))
    GTEST_SKIP() << "no avx512_bf16 (" << tg::backend::cpu::cpu_features_string() << ")";
  {
    ForceKernel force(CpuIsa::avx512bf16);
    const std::string b16 = tg::backend::cpu::gemm_kernel_name(tg::DType::bf16);
    EXPECT_NE(b16.find("vdpbf16ps packed"), std::string::npos) << b16;
    EXPECT_NE(b16.find("forced by TG_GEMM_KERNEL"), std::string::npos) << b16;
  }
  ForceKernel force(CpuIsa::avx512);
  const std::string b16 = tg::backend::cpu::gemm_kernel_name(tg::DType::bf16);
  EXPECT_NE(b16.find("bf16 converted to fp32 in packing"), std::string::npos) << b16;
}

// ---- every kernel level the CPU supports, forced through TG_GEMM_KERNEL -----------------------------------

class GemmByKernel : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!tg::backend::cpu::cpu_supports(GetParam()))
      GTEST_SKIP() << "this CPU cannot run the " << tg::backend::cpu::cpu_isa_name(GetParam()) << " kernels ("
                   << tg::backend::cpu::cpu_features_string() << ")";
    force_ = std::make_unique<ForceKernel>(GetParam());
  }
  void TearDown() override { force_.reset(); }
  std::unique_ptr<ForceKernel> force_;
};

const i64 kSizes[] = {1, 2, 3, 5, 7, 15, 16, 17, 31, 33, 63, 65, 255, 257};
const Trans kTr[] = {Trans::N, Trans::T};

/// Each remainder size in each of M, N, K (the other two at odd mid sizes), all four transposes.
template <class T>
void sweep_remainders(std::uint32_t seed) {
  for (i64 s : kSizes)
    for (Trans ta : kTr)
      for (Trans tb : kTr) {
        check_gemm<T>({ta, tb, s, 33, 17, 1.f, 0.f}, seed++);
        check_gemm<T>({ta, tb, 17, s, 33, 1.f, 0.f}, seed++);
        check_gemm<T>({ta, tb, 33, 17, s, 1.f, 0.f}, seed++);
      }
  std::mt19937 rng(seed);  // plus random triples of remainder sizes
  for (int r = 0; r < 24; ++r) {
    const i64 M = kSizes[rng() % 12], N = kSizes[rng() % 14], K = kSizes[rng() % 14];
    check_gemm<T>({kTr[r & 1], kTr[(r >> 1) & 1], M, N, K, 1.f, 0.f}, seed++);
  }
}

TEST_P(GemmByKernel, Fp32RemainderShapesAllTransposes) { sweep_remainders<float>(100); }
TEST_P(GemmByKernel, Bf16RemainderShapesAllTransposes) { sweep_remainders<bf16>(200); }
TEST_P(GemmByKernel, Fp16RemainderShapesAllTransposes) { sweep_remainders<fp16>(300); }

/// Sizes past KC (K = 400 > 384 >= every KC), past MC on 2 threads (M = 530 > 2 x 240) and past NC
/// (N = 4200 > 4096), all transposes; 16-bit C with K > KC exercises the fp32 workspace.
template <class T>
void sweep_large(std::uint32_t seed) {
  for (Trans ta : kTr)
    for (Trans tb : kTr) {
      check_gemm<T>({ta, tb, 530, 70, 400, 1.f, 0.f}, seed++);
      check_gemm<T>({ta, tb, 13, 4200, 400, 1.f, 0.5f}, seed++);
    }
  check_gemm<T>({Trans::N, Trans::T, 257, 300, 1100, 1.f, 1.f}, seed++);
}
TEST_P(GemmByKernel, Fp32LargerThanTheCacheBlocks) { sweep_large<float>(400); }
TEST_P(GemmByKernel, Bf16LargerThanTheCacheBlocks) { sweep_large<bf16>(500); }
TEST_P(GemmByKernel, Fp16LargerThanTheCacheBlocks) { sweep_large<fp16>(600); }

// Small forced blocks make every loop of the nest run several times, with partial blocks in each dimension.
TEST_P(GemmByKernel, ForcedSmallBlockingMatchesTheReference) {
  ForceBlocking blocking("20,12,64");
  std::uint32_t seed = 800;
  for (Trans ta : kTr)
    for (Trans tb : kTr) {
      check_gemm<float>({ta, tb, 50, 130, 75, 1.f, 0.5f}, seed++);
      check_gemm<bf16>({ta, tb, 50, 130, 75, 1.f, 0.f}, seed++);
      check_gemm<bf16>({ta, tb, 37, 97, 76, 0.5f, 1.f}, seed++, true);
    }
}

TEST_P(GemmByKernel, AlphaBetaAndBetaZeroIgnoresNanInC) {
  std::uint32_t seed = 700;
  for (Trans ta : kTr)
    for (Trans tb : kTr)
      for (float beta : {0.f, 1.f, -0.5f})
        for (i64 K : {5, 300}) {
          check_gemm<float>({ta, tb, 37, 45, K, 0.75f, beta}, seed++);
          check_gemm<bf16>({ta, tb, 37, 45, K, -1.5f, beta}, seed++);
        }
}

TEST_P(GemmByKernel, EpilogueBiasAndBf16Copy) {
  std::uint32_t seed = 800;
  for (i64 K : {7, 300})  // one K block, and several (the epilogue runs in the last one only)
    for (float beta : {0.f, 1.f}) {
      check_gemm<float>({Trans::N, Trans::T, 45, 70, K, 1.f, beta}, seed++, true);
      check_gemm<bf16>({Trans::N, Trans::T, 45, 70, K, 1.f, beta}, seed++, true);
      check_gemm<fp16>({Trans::T, Trans::N, 45, 70, K, 0.5f, beta}, seed++, true);
    }
}

// A bias without the bf16 copy lets full tiles of a bf16 C be finished from the registers (Note [direct bf16
// write-back]), in one K block and in the last of several (K = 1100 > every KC: through the fp32 workspace).
TEST_P(GemmByKernel, EpilogueBiasOnlyWithBf16Output) {
  std::uint32_t seed = 850;
  for (i64 K : {7, 300, 1100})
    for (float alpha : {1.f, -0.75f}) {
      check_gemm<bf16>({Trans::N, Trans::T, 45, 70, K, alpha, 0.f}, seed++, true, false);
      check_gemm<bf16>({Trans::T, Trans::N, 45, 70, K, alpha, 1.f}, seed++, true, false);
      check_gemm<float>({Trans::N, Trans::T, 45, 70, K, alpha, 0.f}, seed++, true, false);
    }
}

// Every kernel rounds a bf16 C the same way (round to nearest even, ties included, NaN stays NaN, overflow
// to inf): one full 12 x 32 tile whose fp32 results are x + y for x in {1, 0, 0x1.fep127} and y in a list of edge
// cases. (No denormals: vdpbf16ps flushes them, Note [bf16 dot-product kernel].)
TEST_P(GemmByKernel, Bf16OutputRoundsLikeTheScalarConversion) {
  const i64 M = 12, N = 32, K = 2;
  constexpr float kInf = std::numeric_limits<float>::infinity(), kNan = std::numeric_limits<float>::quiet_NaN();
  // Three cases: y with a NaN in every row; y without (the AVX512_BF16 kernel then rounds whole rows with
  // vcvtne2ps2bf16); and the same y with alpha = 2^-10, which makes x + y = 2^-120 an fp32 denormal (that
  // instruction would flush it to zero; vdpbf16ps flushes denormal inputs and sums, so alpha makes it here).
  const std::vector<float> with_nan = {0.f, 0x1p-8f, 0x1p-8f + 0x1p-7f, -0x1p-8f, 0x1p-9f, 0x1.8p-8f, 0x1p-7f, kInf,
                                       -kInf, kNan, 0x1p-120f, -0x1.fep-100f, 3.f, 0x1.fep+127f, 0x1p120f};
  const std::vector<float> no_nan = {0.f, 0x1p-8f, 0x1p-8f + 0x1p-7f, -0x1p-8f, 0x1p-9f, 0x1.8p-8f, 0x1p-7f, kInf,
                                     -kInf, 0x1p-120f, -0x1.fep-100f, 3.f, 0x1.fep+127f, 0x1p120f, -0x1.7p-3f};
  const std::pair<const std::vector<float>*, float> cases[] = {{&with_nan, 1.f}, {&no_nan, 1.f}, {&no_nan, 0x1p-10f}};
  for (const auto& [ys_ptr, alpha] : cases) {
    const std::vector<float>& ys = *ys_ptr;
    // C(i, j) = A(i, 0) * B(0, j) + A(i, 1) * B(1, j) with A(i, 0) = x_i, A(i, 1) = 1, B(0, j) = 1 and
    // B(1, j) = y_j: every product is exact and the one fp32 addition rounds alike in every kernel, so only
    // the final rounding to bf16 could differ between paths (0x1.fep127 + 0x1p120 ties to even: inf).
    std::vector<bf16> A(M * K), B(K * N), C(M * N, bf16(-1.f));
    std::vector<float> exact(M * N);
    for (i64 i = 0; i < M; ++i) {
      A[i * K] = bf16(i % 3 == 0 ? 1.f : i % 3 == 1 ? 0.f : 0x1.fep127f);
      A[i * K + 1] = bf16(1.f);
    }
    for (i64 j = 0; j < N; ++j) {
      B[j] = bf16(1.f);
      B[N + j] = bf16(ys[static_cast<std::size_t>(j) % ys.size()]);  // bf16-exact: at most 8 significant bits
    }
    for (i64 i = 0; i < M; ++i)
      for (i64 j = 0; j < N; ++j)
        exact[i * N + j] = alpha * (static_cast<float>(A[i * K]) + static_cast<float>(B[N + j]));  // alpha: 2^n
    tg::backend::cpu::gemm<bf16>(Trans::N, Trans::N, M, N, K, alpha, A.data(), K, B.data(), N, 0.f, C.data(), N, {});
    for (i64 i = 0; i < M; ++i)
      for (i64 j = 0; j < N; ++j) {
        const float want = static_cast<float>(bf16(exact[i * N + j])), got = static_cast<float>(C[i * N + j]);
        if (std::isnan(want)) {
          EXPECT_TRUE(std::isnan(got)) << i << "," << j;
        } else {
          EXPECT_EQ(got, want) << "C(" << i << "," << j << ") for " << alpha << " * (" << static_cast<float>(A[i * K])
                               << " + " << ys[static_cast<std::size_t>(j) % ys.size()] << ")";
          EXPECT_EQ(std::signbit(got), std::signbit(want)) << i << "," << j;
        }
      }
  }
}

TEST_P(GemmByKernel, EmptyKScalesCAndAppliesTheEpilogue) {
  std::vector<float> c = {1, 2, 3, 4}, bias = {10, 20};
  std::vector<bf16> o(4);
  const float dummy = 0;
  tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 2, 2, 0, 1.f, &dummy, 1, &dummy, 2, 0.5f, c.data(), 2,
                                {bias.data(), o.data(), 2});
  EXPECT_EQ(c, (std::vector<float>{10.5f, 21.f, 11.5f, 22.f}));
  EXPECT_EQ(static_cast<float>(o[3]), 22.f);
  tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 0, 2, 3, 1.f, &dummy, 3, &dummy, 2, 0.f, c.data(), 2);
  EXPECT_EQ(c[0], 10.5f);  // M = 0: nothing written
}

TEST_P(GemmByKernel, NanAndInfInAPropagateToTheirRowsOnly) {
  const i64 M = 20, N = 37, K = 300;
  std::mt19937 rng(900);
  Mat<float> A(M, K, 1, rng, false), B(K, N, 2, rng, false);
  for (i64 k = 0; k < K; ++k) B.at(k, 0) = 0.f;  // column 0 of B is zero: inf * 0 = NaN there
  A.at(3, 250) = std::numeric_limits<float>::quiet_NaN();
  A.at(13, 10) = std::numeric_limits<float>::infinity();
  std::vector<float> C(static_cast<std::size_t>(M * N), 0.f);
  tg::backend::cpu::gemm<float>(Trans::N, Trans::N, M, N, K, 1.f, A.v.data(), A.ld, B.v.data(), B.ld, 0.f,
                                C.data(), N);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < N; ++j) {
      const float v = C[static_cast<std::size_t>(i * N + j)];
      if (i == 3 || (i == 13 && j == 0)) EXPECT_TRUE(std::isnan(v)) << i << "," << j << ": " << v;
      else if (i == 13) EXPECT_TRUE(std::isinf(v)) << i << "," << j << ": " << v;
      else EXPECT_TRUE(std::isfinite(v)) << i << "," << j << ": " << v;
    }
}

TEST_P(GemmByKernel, ResultDoesNotDependOnTheThreadCount) {
  // 300x200x600, and small products a two-thread team splits from 1 MFLOP on (a tiny GPT's at 16 tokens), those with
  // a long K included: under 4 MFLOP K is never split between the threads (Note [GEMM K split]; a split product sums
  // in an order of the team's).
  for (const auto& [M, N, K] : {std::tuple<i64, i64, i64>{300, 200, 600}, {16, 384, 128}, {16, 512, 128}, {13, 200, 200},
                                {16, 128, 512}, {13, 64, 700}}) {
    std::mt19937 rng(1000);
    Mat<float> A(M, K, 0, rng, false), B(N, K, 0, rng, false);
    std::vector<float> c1(static_cast<std::size_t>(M * N)), c2 = c1;
    const int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    tg::backend::cpu::gemm<float>(Trans::N, Trans::T, M, N, K, 1.f, A.v.data(), K, B.v.data(), K, 0.f, c1.data(), N);
    omp_set_num_threads(2);
    tg::backend::cpu::gemm<float>(Trans::N, Trans::T, M, N, K, 1.f, A.v.data(), K, B.v.data(), K, 0.f, c2.data(), N);
    omp_set_num_threads(saved);
    if (GetParam() != CpuIsa::reference) EXPECT_EQ(c1, c2) << M << "x" << N << "x" << K;  // the K order per output is fixed by the blocking
  }
}

/// Runs the OpenMP code with `n` threads for the lifetime of the guard (CTest runs with OMP_NUM_THREADS=1).
/// Pins the team to n threads for a scope (set_num_threads also stops the library from adapting the team to
/// other programs' load, Note [threads under contention], which would undo omp_set_num_threads), then hands
/// the team size back to the library's default.
class ThreadCount {
 public:
  explicit ThreadCount(int n) { tg::backend::cpu::set_num_threads(n); }
  ~ThreadCount() { tg::backend::cpu::set_num_threads(0); }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;
};

/// Several jc blocks of different widths (N = 4200 over NC = 4096) and K blocks, on 2 threads: the
/// per-thread B shares then differ between blocks, and a thread running ahead must not overwrite a panel
/// its neighbour still reads. Repeated, since a race shows only sometimes.
TEST_P(GemmByKernel, ThreadsNeverShareAPanelAcrossBlocksRepeated) {
  const ThreadCount two(2);
  for (int r = 0; r < 8; ++r) {
    check_gemm<float>({Trans::N, Trans::N, 13, 4200, 400, 1.f, 0.5f}, 1400 + r);
    check_gemm<bf16>({Trans::T, Trans::N, 7, 4130, 300, 1.f, 0.f}, 1500 + r);
  }
}

/// 16-bit C with several K blocks keeps fp32 partial sums in a workspace. With several m-chunks
/// (M = 520 > 2^20 / nc rows) and jc blocks of different widths (N = 4100: 65 + 64 panels of 32) the
/// threads' column shares move between blocks (3 threads: panels [21, 43) in the first block, [42, 64) in
/// the second), so a workspace shared between threads would be overwritten by a thread running ahead into
/// the next m-chunk. 3 threads on purpose (on a 2-core machine one is often descheduled, so the others run
/// ahead); repeated, since a race shows only sometimes.
TEST_P(GemmByKernel, SixteenBitOutputWorkspaceIsPrivateToEachThread) {
  const ThreadCount three(3);
  for (int r = 0; r < 2; ++r) {
    check_gemm<bf16>({Trans::N, Trans::N, 520, 4100, 200, 1.f, 0.f}, 1600 + r);
    check_gemm<fp16>({Trans::N, Trans::T, 520, 4100, 200, 1.f, 0.5f}, 1700 + r);
  }
}

// Two threads on a 1 x 2 grid with one A block each (M = 100 or 37): several K blocks (800 > KC), two jc
// blocks (4130 > NC) of different widths, 16-bit outputs through the fp32 workspace, beta and the epilogue.
TEST_P(GemmByKernel, TwoThreadsAcrossKBlocksJcBlocksAndWorkspace) {
  const ThreadCount two(2);
  for (int r = 0; r < 2; ++r) {
    check_gemm<float>({Trans::N, Trans::T, 100, 4130, 800, 1.f, 0.5f}, 1800 + r, true);
    check_gemm<bf16>({Trans::N, Trans::N, 100, 4130, 800, 1.f, 0.f}, 1810 + r, true);
    check_gemm<bf16>({Trans::T, Trans::T, 37, 1000, 900, 0.5f, 1.f}, 1820 + r);
    check_gemm<fp16>({Trans::T, Trans::N, 100, 4130, 500, 1.f, 0.5f}, 1830 + r);
  }
}

/// Sets TG_GEMM_KSPLIT_RATIO for the lifetime of the guard.
struct ForceKSplitRatio : ScopedEnv {
  explicit ForceKSplitRatio(const char* spec) : ScopedEnv("TG_GEMM_KSPLIT_RATIO", spec) {}
};

// K at least 8x max(M, N) (the LM head's dX): the threads split K and sum fp32 partials (Note [GEMM K
// split]); 3 threads give uneven K shares (rounded to 16). alpha is applied per partial, beta, the bias and
// the bf16 copy once, after the sum; 16-bit C is rounded once.
TEST_P(GemmByKernel, LongKSplitBetweenThreadsSumsThePartialsOnce) {
  for (int threads : {2, 3}) {
    const ThreadCount team(threads);
    std::uint32_t seed = 1900 + 100 * static_cast<std::uint32_t>(threads);
    for (Trans ta : kTr)
      for (Trans tb : kTr) {
        check_gemm<float>({ta, tb, 40, 60, 2000, 1.f, 0.5f}, seed++, true);
        check_gemm<bf16>({ta, tb, 33, 50, 2001, 0.5f, 1.f}, seed++, true);
        check_gemm<fp16>({ta, tb, 64, 31, 1999, 1.f, 0.f}, seed++);
      }
  }
}

// The split really runs for such shapes: it changes the summation order, so its fp32 result differs (in
// the last bits, within the bound checked above) from the same call with the split disabled.
TEST_P(GemmByKernel, KSplitChangesTheSummationOrderAndCanBeDisabled) {
  if (GetParam() == CpuIsa::reference) GTEST_SKIP() << "the reference level has no packed loop nest";
  const ThreadCount two(2);
  const i64 M = 40, N = 60, K = 2000;
  std::mt19937 rng(2100);
  Mat<float> A(M, K, 0, rng, false), B(K, N, 0, rng, false);
  std::vector<float> split(static_cast<std::size_t>(M * N)), whole = split;
  tg::backend::cpu::gemm<float>(Trans::N, Trans::N, M, N, K, 1.f, A.v.data(), A.ld, B.v.data(), B.ld, 0.f, split.data(), N);
  {
    ForceKSplitRatio never("0");
    tg::backend::cpu::gemm<float>(Trans::N, Trans::N, M, N, K, 1.f, A.v.data(), A.ld, B.v.data(), B.ld, 0.f, whole.data(), N);
  }
  EXPECT_NE(split, whole);
}

// Note [one-row products]: M = 1 in fp32 runs as dot products (B stored [N, K]) or scaled-row sums (B stored
// [K, N]); widths around the 256-output blocks and the 16 partial sums, alpha/beta, the epilogue, 16-bit
// types (which keep the packed path), NaN propagation and independence from the team size.
TEST_P(GemmByKernel, OneRowProducts) {
  std::uint32_t seed = 870;
  for (Trans ta : kTr)
    for (Trans tb : kTr)
      for (i64 N : {1, 5, 255, 256, 257, 700})
        for (i64 K : {1, 15, 16, 17, 300}) {
          check_gemm<float>({ta, tb, 1, N, K, 1.f, 0.f}, seed++);
          if (K == 17) check_gemm<float>({ta, tb, 1, N, K, -0.75f, 0.5f}, seed++, true);
          if (K == 300 && N == 257) check_gemm<bf16>({ta, tb, 1, N, K, 1.f, 0.f}, seed++, true);
        }
  const i64 N = 3000, K = 2000;  // 12 MFLOP: gemm_threads gives a 2-thread team room
  std::mt19937 rng(871);
  Mat<float> a(1, K, 0, rng, false), bt(N, K, 0, rng, false), bn(K, N, 0, rng, false);
  a.at(0, 7) = std::numeric_limits<float>::quiet_NaN();
  for (Trans tb : kTr) {
    const float* b = tb == Trans::T ? bt.v.data() : bn.v.data();
    const i64 ldb = tb == Trans::T ? K : N;
    std::vector<float> c1(static_cast<std::size_t>(N)), c2 = c1, c3 = c1;
    {
      const ThreadCount one(1);
      tg::backend::cpu::gemm<float>(Trans::N, tb, 1, N, K, 1.f, a.v.data(), K, b, ldb, 0.f, c1.data(), N);
    }
    {
      const ThreadCount two(2);
      tg::backend::cpu::gemm<float>(Trans::N, tb, 1, N, K, 1.f, a.v.data(), K, b, ldb, 0.f, c2.data(), N);
    }
    for (i64 j = 0; j < N; ++j) EXPECT_TRUE(std::isnan(c1[static_cast<std::size_t>(j)])) << "output " << j;
    a.at(0, 7) = 0.25f;
    {
      const ThreadCount one(1);
      tg::backend::cpu::gemm<float>(Trans::N, tb, 1, N, K, 1.f, a.v.data(), K, b, ldb, 0.f, c1.data(), N);
    }
    {
      const ThreadCount two(2);
      tg::backend::cpu::gemm<float>(Trans::N, tb, 1, N, K, 1.f, a.v.data(), K, b, ldb, 0.f, c3.data(), N);
    }
    EXPECT_EQ(c1, c3) << "tb=" << (tb == Trans::T ? "T" : "N");
    a.at(0, 7) = std::numeric_limits<float>::quiet_NaN();
  }
}

TEST(GemmKernel, MalformedKSplitRatioThrows) {
  float a = 1.f, b = 1.f, c = 0.f;
  for (const char* spec : {"x", "-1", "4x", "1e3"}) {
    ForceKSplitRatio ratio(spec);
    EXPECT_THROW(tg::backend::cpu::gemm<float>(Trans::N, Trans::N, 1, 1, 1, 1.f, &a, 1, &b, 1, 0.f, &c, 1), tg::Error)
        << spec;
  }
}

/// gemm_batched against per-item checks: A strided, B broadcast (stride 0), C strided with padding.
template <class T>
void check_batched(i64 batch, i64 M, i64 N, i64 K, Trans ta, Trans tb, float beta, std::uint32_t seed) {
  std::mt19937 rng(seed);
  const bool exact16 = !std::is_same_v<T, float>;
  const i64 ar = ta == Trans::N ? M : K, ac = ta == Trans::N ? K : M;
  const i64 br = tb == Trans::N ? K : N, bc = tb == Trans::N ? N : K;
  Mat<T> A(batch * ar, ac, 1, rng, exact16), B(br, bc, 2, rng, exact16), C(batch * M, N, 3, rng, exact16);
  const Mat<T> C0 = C;
  tg::backend::cpu::gemm_batched<T>(ta, tb, M, N, K, 1.f, A.v.data(), A.ld, ar * A.ld, B.v.data(), B.ld, 0,
                                    beta, C.v.data(), C.ld, M * C.ld, batch);
  int bad = 0;
  for (i64 p = 0; p < batch && bad < 5; ++p)
    for (i64 i = 0; i < M; ++i)
      for (i64 j = 0; j < N; ++j) {
        double s = 0, sabs = 0;
        for (i64 k = 0; k < K; ++k) {
          const double a = ta == Trans::N ? A.get(p * ar + i, k) : A.get(p * ar + k, i);
          const double b = tb == Trans::N ? B.get(k, j) : B.get(j, k);
          s += a * b, sabs += std::abs(a * b);
        }
        const double c0 = C0.get(p * M + i, j), ref = s + beta * c0;
        const double tol = out_roundoff<T>() * std::abs(ref) + 3.0 * (K + 2) * kU32 * (sabs + std::abs(c0)) + 1e-30;
        if (!(std::abs(C.get(p * M + i, j) - ref) <= tol) && bad++ < 5)
          ADD_FAILURE() << "batch " << p << " C(" << i << "," << j << ") = " << C.get(p * M + i, j) << ", want " << ref;
      }
}

TEST_P(GemmByKernel, BatchedStridedWithBroadcastOperand) {
  check_batched<float>(48, 64, 64, 64, Trans::N, Trans::T, 0.f, 1100);  // attention-shaped: split over the batch
  check_batched<float>(5, 17, 33, 65, Trans::T, Trans::N, 1.f, 1101);
  check_batched<bf16>(12, 31, 16, 63, Trans::N, Trans::N, 0.f, 1102);
  check_batched<float>(2, 210, 200, 200, Trans::T, Trans::T, 0.5f, 1103);  // large items: threads inside each
  check_batched<fp16>(3, 7, 5, 3, Trans::N, Trans::T, 0.f, 1104);
}

/// 16-bit inputs exactly representable in bf16: only the fp32 accumulation (and the output rounding) err.
/// With an fp32-accumulating kernel the error stays inside 3 (K+2) 2^-24 sum|a||b| + 2^-8 |ref| even for a
/// long K, where bf16 accumulation would be off by ~K 2^-8.
TEST_P(GemmByKernel, Bf16AndFp16LongKStayWithinTheFp32AccumulationBound) {
  check_gemm<bf16>({Trans::N, Trans::T, 9, 40, 4099, 1.f, 0.f}, 1200);
  check_gemm<fp16>({Trans::T, Trans::N, 9, 40, 4099, 1.f, 0.f}, 1201);
  check_gemm<bf16>({Trans::T, Trans::T, 33, 17, 777, 1.f, 1.f}, 1202);
}

INSTANTIATE_TEST_SUITE_P(AllLevels, GemmByKernel, ::testing::ValuesIn(kAllIsas),
                         [](const ::testing::TestParamInfo<CpuIsa>& info) {
                           return std::string(tg::backend::cpu::cpu_isa_name(info.param));
                         });

TEST(GemmFp64, MatchesTheTripleLoop) {
  const i64 M = 17, N = 9, K = 33;
  std::mt19937 rng(1300);
  Mat<double> A(M, K, 1, rng, false), B(K, N, 0, rng, false);
  std::vector<double> C(static_cast<std::size_t>(M * N));
  tg::backend::cpu::gemm<double>(Trans::N, Trans::N, M, N, K, 2.f, A.v.data(), A.ld, B.v.data(), N, 0.f, C.data(), N);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < N; ++j) {
      double s = 0;
      for (i64 k = 0; k < K; ++k) s += A.get(i, k) * B.get(k, j);
      EXPECT_NEAR(C[static_cast<std::size_t>(i * N + j)], 2 * s, 1e-12);
    }
}

}  // namespace

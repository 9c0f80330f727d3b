// int8 GEMM benchmark: at the GPT-2-small linear shapes, the quantized forward y = dequant(x_q · W_qᵀ) + b
// (gemm_s8_packed_dequant on pre-packed weights, as inference runs it) and gemm_s8s8s32 (both operands packed
// per call) against the bf16 GEMM (gemm<bf16>(N, T), the vdpbf16ps kernel), measured alternately in one run.
//   build/release/benchmarks/bench_gemm_int8 --threads=2 --reps=9
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/gemm.hpp"
#include "typegrad/detail/cpu/gemm_int8.hpp"
#include "typegrad/detail/cpu/kernels.hpp"

namespace {

using tg::bf16;
using tg::backend::cpu::Trans;
using i64 = std::int64_t;
using Clock = std::chrono::steady_clock;

struct Shape {
  const char* name;
  i64 M, N, K;  // tokens, out features, in features: Y[M,N] = X[M,K] W[N,K]^T
  bool bias;
};
const Shape kShapes[] = {{"qkv", 256, 2304, 768, true},
                         {"attn_proj", 256, 768, 768, true},
                         {"fc", 256, 3072, 768, true},
                         {"fc_proj", 256, 768, 3072, true},
                         {"lm_head", 256, 50304, 768, false}};

// ---- peaks: independent accumulator chains --------------------------------------------------------------
// 24 instructions on 24 independent accumulators per loop trip (more than latency x throughput on Zen 4/5
// and Intel cores), written in assembly: the compiler kept the intrinsic version's accumulators in memory
// (half the vpdpbusd rate). Operands are zero: the rate does not depend on the values.
#define TG_X24(op)                                                                                                    \
  op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11) op(12) op(13) op(14) op(15) op(16) op(17) \
      op(18) op(19) op(20) op(21) op(22) op(23)
#define TG_VNNI(i) "vpdpbusd %%zmm24, %%zmm25, %%zmm" #i "\n"
#define TG_BF16(i) "vdpbf16ps %%zmm24, %%zmm25, %%zmm" #i "\n"
#define TG_CHAIN_LOOP(name, isa, body)                                                                                \
  __attribute__((target(isa), noinline)) void name(i64 n) {                                                           \
    __asm__ volatile("vpxord %%zmm24, %%zmm24, %%zmm24\n vpxord %%zmm25, %%zmm25, %%zmm25\n 1:\n" body                \
                     "dec %0\n jnz 1b\n"                                                                              \
                     : "+r"(n)                                                                                        \
                     :                                                                                                \
                     : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", \
                       "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20",      \
                       "xmm21", "xmm22", "xmm23", "xmm24", "xmm25");                                                  \
  }
constexpr int kChains = 24;
TG_CHAIN_LOOP(vnni_chains, "avx512f,avx512vnni", TG_X24(TG_VNNI))
TG_CHAIN_LOOP(bf16_chains, "avx512f,avx512bf16", TG_X24(TG_BF16))
/// Best of 12 runs on `threads` threads, G ops/s (int8: 2 · 64 per vpdpbusd; bf16: 2 · 32 per vdpbf16ps).
double peak(bool int8, int threads) {
  const auto& f = tg::backend::cpu::cpu_features();
  if (!f.avx512f || !(int8 ? f.avx512_vnni : f.avx512_bf16)) return 0;
  const i64 iters = 400'000;
  double best = 0;
  for (int r = 0; r < 12; ++r) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      if (int8)
        vnni_chains(iters);
      else
        bf16_chains(iters);
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, (int8 ? 128.0 : 64.0) * kChains * static_cast<double>(iters) * threads / s / 1e9);
  }
  return best;
}

// ---- timing -------------------------------------------------------------------------------------------
/// Seconds per call of f: calls repeated for at least `min_s` (at least 2 calls), the mean of one such run.
template <class F>
double time_per_call(F&& f, double min_s) {
  int calls = 0;
  const auto t0 = Clock::now();
  double s = 0;
  do {
    f();
    ++calls;
    s = std::chrono::duration<double>(Clock::now() - t0).count();
  } while (s < min_s || calls < 2);
  return s / calls;
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Options {
  int threads = 0;  // 0: 1 and then the whole team
  int reps = 7;
  double min_s = 0.04;
  std::string only;  // one shape by name
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&](const char* key) -> const char* {
      const std::size_t n = std::strlen(key);
      return a.compare(0, n, key) == 0 ? argv[i] + n : nullptr;
    };
    if (const char* v = value("--threads="))
      o.threads = std::atoi(v);
    else if (const char* v = value("--reps="))
      o.reps = std::max(1, std::atoi(v));
    else if (const char* v = value("--min_time="))
      o.min_s = std::atof(v);
    else if (const char* v = value("--shape="))
      o.only = v;
    else {
      std::fprintf(stderr,
                   "usage: %s [--threads=N] [--reps=R] [--min_time=S] [--shape=qkv|attn_proj|fc|fc_proj|lm_head]\n"
                   "  --threads: OpenMP threads (default: 1, then all of the team); --reps: alternated rounds, the\n"
                   "  median is reported; --min_time: seconds per timed run (default 0.04)\n",
                   argv[0]);
      std::exit(2);
    }
  }
  return o;
}

void run(const Options& o, int threads) {
  tg::backend::cpu::set_num_threads(threads);  // pinned: the same team for every product
  // Two passes, the best of each: as in bench_gemm.cpp, a first pass on a shared VM sometimes ran on one core
  // only (the second vCPU busy elsewhere), which put the 2-thread products at 180% of that "peak".
  double pk8 = peak(true, threads), pk16 = peak(false, threads);
  pk8 = std::max(pk8, peak(true, threads));
  pk16 = std::max(pk16, peak(false, threads));
  std::printf("\n== %d thread%s: peak vpdpbusd %.0f GOPS, vdpbf16ps %.0f GFLOPS (x%.2f) ==\n", threads,
              threads > 1 ? "s" : "", pk8, pk16, pk16 > 0 ? pk8 / pk16 : 0.0);
  std::printf("%-10s %-17s %9s %9s %9s %7s %7s %7s %7s\n", "shape", "MxNxK", "bf16", "int8pk", "int8s32", "pk/bf16",
              "s32/bf16", "%pk8", "%pk16");
  for (const Shape& s : kShapes) {
    if (!o.only.empty() && o.only != s.name) continue;
    const i64 M = s.M, N = s.N, K = s.K;
    std::vector<std::int8_t> xq(static_cast<std::size_t>(M * K)), wq(static_cast<std::size_t>(N * K));
    std::vector<bf16> x16(xq.size()), w16(wq.size()), y16(static_cast<std::size_t>(M * N));
    std::uint32_t st = 12345u;
    const auto next = [&st] { return st = st * 1664525u + 1013904223u; };
    for (std::size_t e = 0; e < xq.size(); ++e) {
      xq[e] = static_cast<std::int8_t>(next() >> 24);
      x16[e] = bf16(static_cast<float>(xq[e]) / 64.f);
    }
    for (std::size_t e = 0; e < wq.size(); ++e) {
      wq[e] = static_cast<std::int8_t>(next() >> 24);
      w16[e] = bf16(static_cast<float>(wq[e]) / 64.f);
    }
    std::vector<float> a_scale(static_cast<std::size_t>(M), 1.f / 64), w_scale(static_cast<std::size_t>(N), 1.f / 64),
        bias(static_cast<std::size_t>(N), 0.25f), y(static_cast<std::size_t>(M * N));
    std::vector<std::int32_t> c32(static_cast<std::size_t>(M * N));
    const tg::backend::cpu::PackedInt8Weights pw(wq.data(), N, K, K);
    tg::backend::cpu::GemmEpilogue ep;
    if (s.bias) ep.bias = bias.data();
    const float* b = s.bias ? bias.data() : nullptr;
    const auto bf16_fwd = [&] {
      tg::backend::cpu::gemm<bf16>(Trans::N, Trans::T, M, N, K, 1.f, x16.data(), K, w16.data(), K, 0.f, y16.data(), N,
                                   ep);
    };
    const auto int8_packed = [&] {
      tg::backend::cpu::gemm_s8_packed_dequant(M, xq.data(), K, a_scale.data(), pw, w_scale.data(), b, y.data(), N);
    };
    const auto int8_s32 = [&] {
      tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, M, N, K, xq.data(), K, wq.data(), K, c32.data(), N);
    };
    bf16_fwd(), int8_packed(), int8_s32();  // warm up (buffers, pages, clocks)
    std::vector<double> t16, t8p, t8s;
    for (int r = 0; r < o.reps; ++r) {  // alternated, so that a noisy second hits all three alike
      t16.push_back(time_per_call(bf16_fwd, o.min_s));
      t8p.push_back(time_per_call(int8_packed, o.min_s));
      t8s.push_back(time_per_call(int8_s32, o.min_s));
    }
    const double ops = 2.0 * M * N * K / 1e9;
    const double g16 = ops / median(t16), g8p = ops / median(t8p), g8s = ops / median(t8s);
    char dims[32];
    std::snprintf(dims, sizeof dims, "%lldx%lldx%lld", static_cast<long long>(M), static_cast<long long>(N),
                  static_cast<long long>(K));
    std::printf("%-10s %-17s %9.1f %9.1f %9.1f %7.2f %7.2f %6.0f%% %6.0f%%\n", s.name, dims, g16, g8p, g8s, g8p / g16,
                g8s / g16, pk8 > 0 ? 100 * g8p / pk8 : 0.0, pk16 > 0 ? 100 * g16 / pk16 : 0.0);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  std::printf("cpu: %s\n", tg::backend::cpu::cpu_features_string().c_str());
  std::printf("int8 kernel: %s; bf16 kernel: %s\n", tg::backend::cpu::gemm_int8_kernel_name().c_str(),
              tg::backend::cpu::gemm_kernel_name(tg::DType::bf16).c_str());
  std::printf(
      "G(FL)OPS = 2MNK / median seconds per call over %d alternated rounds; int8pk = gemm_s8_packed_dequant "
      "(pre-packed W, fp32 y with bias), int8s32 = gemm_s8s8s32 (both packed per call), bf16 = gemm<bf16>(N, "
      "T) with bias; %%pk8 / %%pk16: int8pk / bf16 as %% of the measured chain peaks\n",
      o.reps);
  const int team = omp_get_max_threads();
  if (o.threads > 0) {
    run(o, o.threads);
  } else {
    run(o, 1);
    if (team > 1) run(o, team);
  }
  return 0;
}

// CPU GEMM benchmarks: the machine's measured FMA peak, GPT-2-small GEMMs (forward and both backward
// products, fp32 and bf16, ours vs Eigen) with % of peak, and a batched attention-shaped case.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/gemm.hpp"

namespace {

using tg::bf16;
using tg::backend::cpu::Trans;
using i64 = std::int64_t;

// ---- (a) peak: independent FMA chains -------------------------------------------------------------------
// Note [measured FMA peak]
// Each thread runs `iters` rounds of A independent accumulator chains acc = acc * x + y (A = 12 ymm /
// 24 zmm, more than latency x ports on Zen 3-5 and Intel cores), so the FMA units never wait on a result:
// flops = iters * A * lanes * 2. The same loop on every thread of the OpenMP team gives the all-core peak
// under the same clock and SMT conditions as the GEMMs. The bf16 peak uses vdpbf16ps (64 flops / zmm op).
constexpr int kYmmChains = 12, kZmmChains = 24;

__attribute__((target("avx2,fma"), noinline)) float fma_chains_ymm(i64 iters) {
  __m256 acc[kYmmChains];
  for (int i = 0; i < kYmmChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-6f);
  for (i64 it = 0; it < iters; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < kYmmChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, y);
  __m256 s = acc[0];
  for (int i = 1; i < kYmmChains; ++i) s = _mm256_add_ps(s, acc[i]);
  return _mm256_cvtss_f32(s);
}
__attribute__((target("avx512f"), noinline)) float fma_chains_zmm(i64 iters) {
  __m512 acc[kZmmChains];
  for (int i = 0; i < kZmmChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-6f);
  for (i64 it = 0; it < iters; ++it)
#pragma GCC unroll 24
    for (int i = 0; i < kZmmChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  __m512 s = acc[0];
  for (int i = 1; i < kZmmChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}
__attribute__((target("avx512f,avx512bf16"), noinline)) float dpbf16_chains_zmm(i64 iters) {
  __m512 acc[kZmmChains];
  for (int i = 0; i < kZmmChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
  for (i64 it = 0; it < iters; ++it)
#pragma GCC unroll 24
    for (int i = 0; i < kZmmChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  __m512 s = acc[0];
  for (int i = 1; i < kZmmChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

enum class PeakKind { ymm_fma, zmm_fma, zmm_dpbf16 };
double flops_per_iter(PeakKind k) {
  switch (k) {
    case PeakKind::ymm_fma: return kYmmChains * 8 * 2.0;
    case PeakKind::zmm_fma: return kZmmChains * 16 * 2.0;
    case PeakKind::zmm_dpbf16: return kZmmChains * 16 * 4.0;
  }
  return 0;
}
bool peak_available(PeakKind k) {
  const auto& f = tg::backend::cpu::cpu_features();
  switch (k) {
    case PeakKind::ymm_fma: return f.avx2 && f.fma;
    case PeakKind::zmm_fma: return f.avx512f;
    case PeakKind::zmm_dpbf16: return f.avx512f && f.avx512_bf16;
  }
  return false;
}
volatile float g_sink = 0;
float run_chains(PeakKind k, i64 iters) {
  switch (k) {
    case PeakKind::ymm_fma: return fma_chains_ymm(iters);
    case PeakKind::zmm_fma: return fma_chains_zmm(iters);
    case PeakKind::zmm_dpbf16: return dpbf16_chains_zmm(iters);
  }
  return 0;
}
/// GFLOP/s of `threads` threads each running `iters` rounds.
double measure_peak(PeakKind k, int threads, i64 iters) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const float r = run_chains(k, iters);
#pragma omp critical
    g_sink = g_sink + r;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return flops_per_iter(k) * static_cast<double>(iters) * threads / s / 1e9;
}
/// Best of 12 runs of 10-40 ms each: on a shared machine a run that loses a core to another process only
/// lowers that run (a single long run measured half the 2-thread peak once), so more short runs are safer.
double best_peak(PeakKind k, int threads) {
  if (!peak_available(k)) return 0;
  double best = 0;
  for (int r = 0; r < 12; ++r) best = std::max(best, measure_peak(k, threads, 1'500'000));
  return best;
}

struct Peaks {
  double fp32_1t = 0, fp32_all = 0, bf16_1t = 0, bf16_all = 0;
  int threads = 1;
};
Peaks g_peaks;

void BM_peak(benchmark::State& state, PeakKind k, int threads) {
  if (!peak_available(k)) {
    state.SkipWithError("unavailable on this CPU (needs avx512_bf16 / avx512f)");
    return;
  }
  const i64 iters = 2'000'000;
  for (auto _ : state) {
#pragma omp parallel num_threads(threads)
    {
      const float r = run_chains(k, iters);
#pragma omp critical
      g_sink = g_sink + r;
    }
  }
  state.counters["GFLOPS"] = benchmark::Counter(flops_per_iter(k) * iters * threads / 1e9,
                                                benchmark::Counter::kIsIterationInvariantRate);
}

// ---- (b) GPT-2 small GEMMs ------------------------------------------------------------------------------
struct Shape {
  const char* name;
  i64 M, N, K;  // tokens, out features, in features: Y[M,N] = X[M,K] W[N,K]^T
};
const Shape kShapes[] = {{"qkv", 256, 2304, 768},      {"attn_proj", 256, 768, 768}, {"fc", 256, 3072, 768},
                         {"fc_proj", 256, 768, 3072}, {"lm_head", 256, 50304, 768}, {"square1024", 1024, 1024, 1024}};

// Products of a linear layer:  fwd  Y = X W^T  (A = X [M,K] N, B = W [N,K] T)        -> [M,N]
//                              dX   = dY W      (A = dY [M,N] N, B = W [N,K] N)       -> [M,K]
//                              dW   = dY^T X    (A = dY [M,N] T, B = X [M,K] N)       -> [N,K]
// fwd_bias is fwd with the bias epilogue, as a training step runs the layers that have a bias (all but the
// LM head); ours only, and not in compare_pytorch_gemm.py's table.
enum class Product { fwd, dX, dW, fwd_bias };
const char* product_name(Product p) {
  switch (p) {
    case Product::fwd: return "fwd";
    case Product::dX: return "dX";
    case Product::dW: return "dW";
    default: return "fwd_bias";
  }
}

/// Operand buffers, shared by all benchmarks (grown and filled once).
template <class T>
T* buffer(int id, std::size_t n) {
  static std::vector<T> bufs[4];
  std::vector<T>& b = bufs[id];
  if (b.size() < n) {
    const std::size_t old = b.size();
    b.resize(n);
    std::uint32_t s = 12345u + static_cast<std::uint32_t>(id);
    for (std::size_t i = old; i < n; ++i) {
      s = s * 1664525u + 1013904223u;
      b[i] = T(static_cast<float>(static_cast<int>(s >> 9) % 2001 - 1000) / 1000.f);
    }
  }
  return b.data();
}

enum class Impl { ours, eigen };

template <class T>
void BM_gpt_gemm(benchmark::State& state, Shape s, Product p, Impl impl) {
  const i64 M = s.M, N = s.N, K = s.K;
  const T* X = buffer<T>(0, static_cast<std::size_t>(M * K));
  const T* W = buffer<T>(1, static_cast<std::size_t>(N * K));
  const T* dY = buffer<T>(2, static_cast<std::size_t>(M * N));
  T* out = buffer<T>(3, static_cast<std::size_t>(std::max({M * N, M * K, N * K})));
  std::vector<float> bias(static_cast<std::size_t>(N));
  for (i64 j = 0; j < N; ++j) bias[static_cast<std::size_t>(j)] = static_cast<float>(j % 7) * 0.125f - 0.375f;
  tg::backend::cpu::GemmEpilogue epilogue;
  if (p == Product::fwd_bias) epilogue.bias = bias.data();
  const auto call = [&](Trans ta, Trans tb, i64 m, i64 n, i64 k, const T* a, i64 lda, const T* b, i64 ldb, i64 ldc) {
    if (impl == Impl::ours) tg::backend::cpu::gemm<T>(ta, tb, m, n, k, 1.f, a, lda, b, ldb, 0.f, out, ldc, epilogue);
    else tg::backend::cpu::gemm_reference<T>(ta, tb, m, n, k, 1.f, a, lda, b, ldb, 0.f, out, ldc);
  };
  for (auto _ : state) {
    switch (p) {
      case Product::fwd:
      case Product::fwd_bias: call(Trans::N, Trans::T, M, N, K, X, K, W, K, N); break;
      case Product::dX: call(Trans::N, Trans::N, M, K, N, dY, N, W, K, K); break;
      case Product::dW: call(Trans::T, Trans::N, N, K, M, dY, N, X, K, K); break;
    }
    benchmark::ClobberMemory();
  }
  const double gflop = 2.0 * M * N * K / 1e9;
  const bool is_bf16 = std::is_same_v<T, bf16>;
  state.counters["GFLOPS"] = benchmark::Counter(gflop, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_fp32_peak"] =
      benchmark::Counter(gflop * 100 / g_peaks.fp32_all, benchmark::Counter::kIsIterationInvariantRate);
  if (is_bf16) {  // % of the bf16 dot peak where the CPU has one, else of the fp32 peak (bf16 runs as fp32)
    const double peak = g_peaks.bf16_all > 0 ? g_peaks.bf16_all : g_peaks.fp32_all;
    state.counters["pct_bf16_peak"] = benchmark::Counter(gflop * 100 / peak, benchmark::Counter::kIsIterationInvariantRate);
  }
}

// ---- (c) batched attention: S = Q K^T and O = P V per head ------------------------------------------------
template <class T>
void BM_attention_batched(benchmark::State& state, bool scores) {
  const i64 batch = 48, T_ = 64, D = 64;  // 4 sequences x 12 heads, 64 tokens, head size 64
  const T* Q = buffer<T>(0, static_cast<std::size_t>(batch * T_ * D));
  const T* Kt = buffer<T>(1, static_cast<std::size_t>(batch * T_ * D));
  T* S = buffer<T>(3, static_cast<std::size_t>(batch * T_ * T_));
  for (auto _ : state) {
    if (scores)  // S[b] = Q[b] K[b]^T : (T,D) x (T,D)^T
      tg::backend::cpu::gemm_batched<T>(Trans::N, Trans::T, T_, T_, D, 0.125f, Q, D, T_ * D, Kt, D, T_ * D, 0.f, S,
                                        T_, T_ * T_, batch);
    else  // O[b] = P[b] V[b] : (T,T) x (T,D)
      tg::backend::cpu::gemm_batched<T>(Trans::N, Trans::N, T_, D, T_, 1.f, Q, T_, T_ * T_, Kt, D, T_ * D, 0.f, S, D,
                                        T_ * D, batch);
    benchmark::ClobberMemory();
  }
  const double gflop = 2.0 * batch * T_ * T_ * D / 1e9;
  state.counters["GFLOPS"] = benchmark::Counter(gflop, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["pct_fp32_peak"] =
      benchmark::Counter(gflop * 100 / g_peaks.fp32_all, benchmark::Counter::kIsIterationInvariantRate);
}

std::string fmt(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

void register_all() {
  for (PeakKind k : {PeakKind::ymm_fma, PeakKind::zmm_fma, PeakKind::zmm_dpbf16}) {
    const char* kn = k == PeakKind::ymm_fma ? "ymm_fma_fp32" : k == PeakKind::zmm_fma ? "zmm_fma_fp32" : "zmm_dpbf16";
    for (int t : {1, g_peaks.threads}) {
      benchmark::RegisterBenchmark((std::string("peak/") + kn + "/threads:" + std::to_string(t)).c_str(), BM_peak, k, t)
          ->UseRealTime();
      if (g_peaks.threads == 1) break;
    }
  }
  for (const Shape& s : kShapes)
    for (Product p : {Product::fwd, Product::dX, Product::dW}) {
      const std::string tail = std::string("/") + s.name + "/" + product_name(p);
      benchmark::RegisterBenchmark(("gemm/ours/fp32" + tail).c_str(), BM_gpt_gemm<float>, s, p, Impl::ours)
          ->UseRealTime()->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("gemm/ours/bf16" + tail).c_str(), BM_gpt_gemm<bf16>, s, p, Impl::ours)
          ->UseRealTime()->Unit(benchmark::kMillisecond);
      benchmark::RegisterBenchmark(("gemm/eigen/fp32" + tail).c_str(), BM_gpt_gemm<float>, s, p, Impl::eigen)
          ->UseRealTime()->Unit(benchmark::kMillisecond);
    }
  for (const Shape& s : kShapes) {
    if (std::string(s.name) == "lm_head" || std::string(s.name) == "square1024") continue;  // no bias there
    const std::string tail = std::string("/") + s.name + "/" + product_name(Product::fwd_bias);
    benchmark::RegisterBenchmark(("gemm/ours/fp32" + tail).c_str(), BM_gpt_gemm<float>, s, Product::fwd_bias, Impl::ours)
        ->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark(("gemm/ours/bf16" + tail).c_str(), BM_gpt_gemm<bf16>, s, Product::fwd_bias, Impl::ours)
        ->UseRealTime()->Unit(benchmark::kMillisecond);
  }
  for (bool sc : {true, false}) {
    const std::string n = sc ? "attention_batched/scores_QKt/48x64x64x64" : "attention_batched/PV/48x64x64x64";
    benchmark::RegisterBenchmark(("gemm/ours/fp32/" + n).c_str(), BM_attention_batched<float>, sc)->UseRealTime();
    benchmark::RegisterBenchmark(("gemm/ours/bf16/" + n).c_str(), BM_attention_batched<bf16>, sc)->UseRealTime();
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  g_peaks.threads = omp_get_max_threads();
  const double ymm1 = best_peak(PeakKind::ymm_fma, 1), zmm1 = best_peak(PeakKind::zmm_fma, 1);
  double ymmN = best_peak(PeakKind::ymm_fma, g_peaks.threads), zmmN = best_peak(PeakKind::zmm_fma, g_peaks.threads);
  g_peaks.bf16_1t = best_peak(PeakKind::zmm_dpbf16, 1);
  g_peaks.bf16_all = best_peak(PeakKind::zmm_dpbf16, g_peaks.threads);
  // A second pass over the all-thread peaks, a second or so later: on a Zen 4 VM (2026-12-04) every run of
  // a first pass sometimes measured the 1-thread rate for 2 threads (the second vCPU not running alongside),
  // which put the GEMMs at 130-150% of that "peak".
  ymmN = std::max(ymmN, best_peak(PeakKind::ymm_fma, g_peaks.threads));
  zmmN = std::max(zmmN, best_peak(PeakKind::zmm_fma, g_peaks.threads));
  g_peaks.bf16_all = std::max(g_peaks.bf16_all, best_peak(PeakKind::zmm_dpbf16, g_peaks.threads));
  g_peaks.fp32_1t = std::max(ymm1, zmm1);
  g_peaks.fp32_all = std::max(ymmN, zmmN);

  const std::string t = std::to_string(g_peaks.threads);
  benchmark::AddCustomContext("cpu_features", tg::backend::cpu::cpu_features_string());
  benchmark::AddCustomContext("gemm_kernel_fp32", tg::backend::cpu::gemm_kernel_name(tg::DType::f32));
  benchmark::AddCustomContext("gemm_kernel_bf16", tg::backend::cpu::gemm_kernel_name(tg::DType::bf16));
  benchmark::AddCustomContext("omp_threads", t);
  benchmark::AddCustomContext("peak_fp32_GFLOPS_1thread", fmt(g_peaks.fp32_1t) + " (ymm " + fmt(ymm1) +
                                                              (zmm1 > 0 ? ", zmm " + fmt(zmm1) : ", zmm unavailable") + ")");
  benchmark::AddCustomContext("peak_fp32_GFLOPS_" + t + "threads", fmt(g_peaks.fp32_all) + " (ymm " + fmt(ymmN) +
                                                                     (zmmN > 0 ? ", zmm " + fmt(zmmN) : ", zmm unavailable") + ")");
  benchmark::AddCustomContext("peak_bf16_GFLOPS_" + t + "threads",
                              g_peaks.bf16_all > 0 ? fmt(g_peaks.bf16_all) + " (vdpbf16ps)"
                                                   : "unavailable (no avx512_bf16: bf16 GEMMs run as fp32, "
                                                     "pct_bf16_peak is relative to the fp32 peak)");
  register_all();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

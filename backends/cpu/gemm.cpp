// GEMM dispatch: picks the packed kernel for this CPU (or TG_GEMM_KERNEL's), the thread count, and the
// batched strategy; the Eigen reference (gemm_eigen.cpp) serves fp64, empty K and TG_GEMM_KERNEL=reference.
#include <omp.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#include "gemm_packed.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu {

namespace {

template <class T>
void apply_epilogue(std::int64_t M, std::int64_t N, T* C, std::int64_t ldc, const GemmEpilogue& e) {
  if (!e.bias && !e.out_bf16) return;
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      float v = static_cast<float>(C[i * ldc + j]);
      if (e.bias) {
        v += e.bias[j];
        C[i * ldc + j] = scalar_cast<T>(v);
      }
      if (e.out_bf16) e.out_bf16[i * e.ldo + j] = bf16(v);
    }
  }
}

}  // namespace

double gemm_bf16_dot_speedup() {
  static const double speedup = cpu_supports(CpuIsa::avx512bf16) ? packed::measure_bf16_dot_speedup() : 0.0;
  return speedup;
}

namespace {

// Note [GEMM kernel selection]
// The ISA level is the best one cpu_supports() reports (Note [ISA kernel levels]) unless TG_GEMM_KERNEL
// names one; it is read on every call so tests can switch it. Per element type:
//   fp64                 -> Eigen (the packed kernels are fp32-accumulating; fp64 is for numerical checks)
//   fp32                 -> the level's fp32 kernel (avx512bf16 -> the avx512 fp32 kernel)
//   bf16                 -> avx512bf16: vdpbf16ps on bf16 pairs when it measured at least kBf16DotMinSpeedup
//                           times the fp32 FMA flop rate, else (and on avx2 / avx512) widened to fp32 in packing,
//                           so on CPUs without avx512_bf16 bf16 runs at fp32 speed (never faster)
//   fp16                 -> widened to fp32 in packing on every level (exact, keeps fp16's range)
CpuIsa requested_isa() {
  const char* env = std::getenv("TG_GEMM_KERNEL");
  if (env == nullptr || *env == '\0') return best_cpu_isa();
  const CpuIsa isa = parse_cpu_isa(env);
  TG_CHECK(cpu_supports(isa), "gemm: TG_GEMM_KERNEL=", env, " is not supported by this CPU (",
           cpu_features_string(), ")");
  return isa;
}

/// True when TG_GEMM_KERNEL names a level (the choice is then the user's, not the measurement's).
bool kernel_forced() {
  const char* env = std::getenv("TG_GEMM_KERNEL");
  return env != nullptr && *env != '\0';
}

template <class T>
CpuIsa isa_for(CpuIsa isa) {
  if constexpr (std::is_same_v<T, double>) return CpuIsa::reference;
  if (isa == CpuIsa::avx512bf16 && !std::is_same_v<T, bf16>) return CpuIsa::avx512;
  // Note [bf16 kernel choice]: by default vdpbf16ps only where it measured faster than widening to fp32.
  if (isa == CpuIsa::avx512bf16 && !kernel_forced() && gemm_bf16_dot_speedup() < kBf16DotMinSpeedup)
    return CpuIsa::avx512;
  return isa;
}

/// Cache sizes of this CPU, TG_GEMM_BLOCKING="kc,mc,nc" (elements; 0 keeps the derived value) and
/// TG_GEMM_KSPLIT_RATIO (Note [GEMM K split]; 0 = never split K).
packed::GemmBlocking gemm_blocking() {
  const CpuCacheSizes& caches = cpu_cache_sizes();
  packed::GemmBlocking b;
  b.l1d = caches.l1d;
  b.l2 = caches.l2;
  if (const char* ratio = std::getenv("TG_GEMM_KSPLIT_RATIO"); ratio != nullptr && *ratio != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(ratio, &end, 10);
    TG_CHECK(end != ratio && *end == '\0' && v >= 0 && v <= (1LL << 20), "gemm: TG_GEMM_KSPLIT_RATIO='", ratio,
             "' must be a non-negative integer (K is split between threads when K >= ratio * max(M, N); 0 = never)");
    b.k_split_ratio = v;
  }
  const char* env = std::getenv("TG_GEMM_BLOCKING");
  if (env == nullptr || *env == '\0') return b;
  std::int64_t* fields[3] = {&b.kc, &b.mc, &b.nc};
  const char* p = env;
  for (int i = 0; i < 3; ++i) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    TG_CHECK(end != p && v >= 0 && v <= (1LL << 20) && *end == (i < 2 ? ',' : '\0'),
             "gemm: TG_GEMM_BLOCKING='", env, "' must be three non-negative element counts 'kc,mc,nc' (0 = derived)");
    *fields[i] = v;
    p = end + 1;
  }
  return b;
}

/// Threads for one GEMM: 1 inside a parallel region or below 1 MFLOP, else about one per MFLOP, at least 2.
/// (A 1-2 MFLOP product takes some 20-40 µs on one core, a team's fork and join a few: the tiny GPT at B=1,
/// T=16, whose products are 0.5-2 MFLOP, trained 0.81x the time per step with these bounds as with the earlier
/// 4 MFLOP and 2 MFLOP per thread on the 2-core Zen 4 VM, 2026-12-06.) Results depend on the team size only
/// where K is split between the threads (Note [GEMM K split]).
int gemm_threads(std::int64_t M, std::int64_t N, std::int64_t K) {
  if (omp_in_parallel()) return 1;
  adapt_threads();  // Note [threads under contention]
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int max_threads = omp_get_max_threads();
  if (max_threads <= 1 || flops < 1.0e6) return 1;
  const double by_work = std::max(2.0, flops / 1.0e6);
  return by_work < max_threads ? static_cast<int>(by_work) : max_threads;
}

/// The reference path for 16-bit C with an epilogue: everything widened to fp32, C rounded once at the end.
template <class T>
void reference_fp32_epilogue(const packed::GemmArgs<T>& g) {
  const auto widen = [](const T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    std::vector<float> w(static_cast<std::size_t>(rows * cols));
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < cols; ++j) w[static_cast<std::size_t>(i * cols + j)] = static_cast<float>(p[i * ld + j]);
    return w;
  };
  const std::int64_t ar = g.ta == Trans::N ? g.M : g.K, ac = g.ta == Trans::N ? g.K : g.M;
  const std::int64_t br = g.tb == Trans::N ? g.K : g.N, bc = g.tb == Trans::N ? g.N : g.K;
  const std::vector<float> a = widen(g.A, ar, ac, g.lda), b = widen(g.B, br, bc, g.ldb);
  std::vector<float> c = g.beta != 0.f ? widen(g.C, g.M, g.N, g.ldc) : std::vector<float>(static_cast<std::size_t>(g.M * g.N));
  gemm_reference<float>(g.ta, g.tb, g.M, g.N, g.K, g.alpha, a.data(), ac, b.data(), bc, g.beta, c.data(), g.N);
  for (std::int64_t i = 0; i < g.M; ++i)
    for (std::int64_t j = 0; j < g.N; ++j) {
      float v = c[static_cast<std::size_t>(i * g.N + j)];
      if (g.ep.bias) v += g.ep.bias[j];
      g.C[i * g.ldc + j] = T(v);
      if (g.ep.out_bf16) g.ep.out_bf16[i * g.ep.ldo + j] = bf16(v);
    }
}

// Note [one-row products]
// A product with one row (a decoder's step, nn/generate.hpp: x (1, C) times a weight) reads each element of
// B once, so packing B first (the packed kernels' copy, transposing a weight stored [N, K]) costs as much as
// the product and more than a dot product per output: a 10M-parameter decoder spent most of a token there.
// So in fp32 on the packed levels M = 1 runs as one dot product per output when B is stored [N, K]
// (contiguous rows) and as a running sum of scaled B rows over blocks of outputs when it is stored [K, N].
// Each output is summed in one fixed order (16 interleaved partial sums, added in index order), so the
// result does not depend on the team size, which only splits the outputs.
void gemv_fp32(const packed::GemmArgs<float>& g, int threads) {
  const std::int64_t N = g.N, K = g.K, a_stride = g.ta == Trans::N ? 1 : g.lda;
  std::vector<float> a(static_cast<std::size_t>(K));
  for (std::int64_t k = 0; k < K; ++k) a[static_cast<std::size_t>(k)] = g.A[k * a_stride];
  auto store = [&](std::int64_t j, float acc) {
    const float v = g.alpha * acc;
    g.C[j] = g.beta != 0.f ? v + g.beta * g.C[j] : v;
  };
  constexpr std::int64_t kLanes = 16, kBlock = 256;
  const std::int64_t blocks = (N + kBlock - 1) / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (std::int64_t blk = 0; blk < blocks; ++blk) {
    const std::int64_t j0 = blk * kBlock, j1 = std::min(N, j0 + kBlock);
    if (g.tb == Trans::T) {  // B stored [N, K]: output j is the dot product of a and row j
      for (std::int64_t j = j0; j < j1; ++j) {
        const float* b = g.B + j * g.ldb;
        float lanes[kLanes] = {};
        std::int64_t k = 0;
        for (; k + kLanes <= K; k += kLanes)
          for (std::int64_t l = 0; l < kLanes; ++l) lanes[l] += a[static_cast<std::size_t>(k + l)] * b[k + l];
        float acc = 0.f;
        for (std::int64_t l = 0; l < kLanes; ++l) acc += lanes[l];
        for (; k < K; ++k) acc += a[static_cast<std::size_t>(k)] * b[k];
        store(j, acc);
      }
    } else {  // B stored [K, N]: outputs j0..j1 accumulate a[k] times row k's slice
      float acc[kBlock] = {};
      const std::int64_t n = j1 - j0;
      for (std::int64_t k = 0; k < K; ++k) {
        const float ak = a[static_cast<std::size_t>(k)];
        const float* b = g.B + k * g.ldb + j0;
        for (std::int64_t j = 0; j < n; ++j) acc[j] += ak * b[j];
      }
      for (std::int64_t j = 0; j < n; ++j) store(j0 + j, acc[j]);
    }
  }
  apply_epilogue(1, N, g.C, g.ldc, g.ep);
}

template <class T>
void run_one(CpuIsa isa, const packed::GemmArgs<T>& g, int threads) {
  if (g.M <= 0 || g.N <= 0) return;
  if (isa == CpuIsa::reference || g.K <= 0) {
    if constexpr (std::is_same_v<T, bf16> || std::is_same_v<T, fp16>) {
      if (g.ep.bias || g.ep.out_bf16) {  // round C once, after the bias (Note [GEMM conventions])
        reference_fp32_epilogue(g);
        return;
      }
    }
    gemm_reference<T>(g.ta, g.tb, g.M, g.N, g.K, g.alpha, g.A, g.lda, g.B, g.ldb, g.beta, g.C, g.ldc);
    apply_epilogue(g.M, g.N, g.C, g.ldc, g.ep);
    return;
  }
  if constexpr (std::is_same_v<T, float>) {
    if (g.M == 1) {  // Note [one-row products]
      gemv_fp32(g, threads);
      return;
    }
  }
  if constexpr (!std::is_same_v<T, double>) {
    switch (isa) {
      case CpuIsa::avx2:
        packed::gemm_avx2<T>(g, threads);
        return;
      case CpuIsa::avx512:
        packed::gemm_avx512<T>(g, threads);
        return;
      case CpuIsa::avx512bf16:
        if constexpr (std::is_same_v<T, bf16>) packed::gemm_avx512bf16(g, threads);
        else packed::gemm_avx512<T>(g, threads);
        return;
      case CpuIsa::reference:
        break;
    }
  }
}

}  // namespace

template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C, std::int64_t ldc,
          const GemmEpilogue& epilogue) {
  const packed::GemmArgs<T> g{ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, epilogue, gemm_blocking()};
  run_one<T>(isa_for<T>(requested_isa()), g, gemm_threads(M, N, K));
}

// Note [batched GEMM threading]
// A strided batch of small products (attention: batch = B*H, 64x64x64 each, ~0.5 MFLOP) gains nothing
// from splitting one product over threads (packing and barriers would dominate): the batch is split
// over the OpenMP team instead, each product running single-threaded with its own packing buffers.
// Products above ~16 MFLOP (or a batch smaller than the team) run one after another, each on all threads.
template <class T>
void gemm_batched(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  const T* A, std::int64_t lda, std::int64_t stride_a, const T* B, std::int64_t ldb,
                  std::int64_t stride_b, float beta, T* C, std::int64_t ldc, std::int64_t stride_c,
                  std::int64_t batch) {
  if (batch <= 0 || M <= 0 || N <= 0) return;
  const CpuIsa isa = isa_for<T>(requested_isa());
  const packed::GemmBlocking blocking = gemm_blocking();
  const auto args = [&](std::int64_t b) {
    return packed::GemmArgs<T>{ta, tb, M, N, K, alpha, A + b * stride_a, lda, B + b * stride_b, ldb, beta,
                               C + b * stride_c, ldc, GemmEpilogue{}, blocking};
  };
  const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int team = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (isa != CpuIsa::reference && team > 1 && batch >= 2 && flops < 1.6e7) {
    bool failed = false;
#pragma omp parallel for schedule(static) num_threads(batch < team ? static_cast<int>(batch) : team)
    for (std::int64_t b = 0; b < batch; ++b) {
      try {
        run_one<T>(isa, args(b), 1);
      } catch (...) {  // only std::bad_alloc can come from the packed kernels
#pragma omp atomic write
        failed = true;
      }
    }
    if (failed) throw std::bad_alloc();
    return;
  }
  const int threads = gemm_threads(M, N, K);
  for (std::int64_t b = 0; b < batch; ++b) run_one<T>(isa, args(b), threads);
}

std::string gemm_kernel_name(DType t) {
  if (t == DType::f64) return "eigen (fp64 reference)";
  TG_CHECK(t == DType::f32 || t == DType::bf16 || t == DType::f16, "gemm_kernel_name: no GEMM for dtype ",
           dtype_name(t));
  const CpuIsa requested = requested_isa();
  const CpuIsa isa = t == DType::bf16 ? isa_for<bf16>(requested) : isa_for<float>(requested);
  if (isa == CpuIsa::reference) return "eigen reference";
  std::string name = isa == CpuIsa::avx2     ? packed::kernel_desc_avx2()
                     : isa == CpuIsa::avx512 ? packed::kernel_desc_avx512()
                                             : packed::kernel_desc_avx512bf16();
  char speedup[96] = "";
  if (t == DType::bf16 && cpu_supports(CpuIsa::avx512bf16))
    std::snprintf(speedup, sizeof speedup, "; vdpbf16ps measured at %.2fx the fp32 FMA flop rate%s",
                  gemm_bf16_dot_speedup(), kernel_forced() ? ", level forced by TG_GEMM_KERNEL" : "");
  if (isa == CpuIsa::avx512bf16) return name + " (bf16 x bf16 -> fp32" + speedup + ")";
  if (t == DType::bf16) name += std::string(" (bf16 converted to fp32 in packing") + speedup + ")";
  if (t == DType::f16) name += " (fp16 converted to fp32 in packing)";
  return name;
}

#define TG_INSTANTIATE(T)                                                                             \
  template void gemm<T>(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float, const T*,     \
                        std::int64_t, const T*, std::int64_t, float, T*, std::int64_t,               \
                        const GemmEpilogue&);                                                        \
  template void gemm_batched<T>(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float,       \
                                const T*, std::int64_t, std::int64_t, const T*, std::int64_t,        \
                                std::int64_t, float, T*, std::int64_t, std::int64_t, std::int64_t);
TG_INSTANTIATE(double)
TG_INSTANTIATE(float)
TG_INSTANTIATE(bf16)
TG_INSTANTIATE(fp16)
#undef TG_INSTANTIATE

}  // namespace tg::backend::cpu

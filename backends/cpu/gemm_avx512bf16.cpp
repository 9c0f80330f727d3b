// AVX-512 BF16 packed GEMM: bf16 x bf16 -> fp32 with vdpbf16ps, 12x32 tiles over packed k-pairs.
#define TG_GEMM_ISA avx512bf16
#include "gemm_packed.hpp"

#include <time.h>

namespace tg::backend::cpu::packed::avx512bf16 {
namespace {

// Note [bf16 dot-product kernel]
// vdpbf16ps (_mm512_dpbf16_ps(c, a, b)) treats each 32-bit lane of a and b as a pair of bf16 and computes
//     c[l] += a[l].lo * b[l].lo + a[l].hi * b[l].hi
// with the products exact in fp32 and fp32 additions (round to nearest even; denormal inputs and outputs are
// flushed to zero, and MXCSR is ignored). So B is packed in k-pairs: lane l of a B vector holds
// (B(k, j+l), B(k+1, j+l)), and A's pair (A(i, k), A(i, k+1)) is broadcast as one 32-bit value. The error is
// that of an fp32 sum of K products (two roundings per pair), within the K * 2^-24 * sum|a||b| bound of
// the fp32 path, up to flushed denormals. fp16 operands do not come here: they are widened to fp32 and
// use the AVX-512 fp32 kernel (fp16 -> bf16 would lose 3 mantissa bits and fp16's subnormal range).
struct VecBf16Pairs {
  using elem = std::uint16_t;  // bf16 bits
  using acc = __m512;
  using areg = __m512bh;
  using breg = __m512bh;
  static constexpr int lanes = 16, kp = 2;
  static acc zero() { return _mm512_setzero_ps(); }
  static acc set1(float x) { return _mm512_set1_ps(x); }
  static breg load_b(const std::uint16_t* p) { return (__m512bh)_mm512_load_si512(p); }
  static areg bcast_a(const std::uint16_t* p) {
    std::uint32_t pair;
    std::memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
  }
  static acc fma(acc c, areg a, breg b) { return _mm512_dpbf16_ps(c, a, b); }
  static acc mul(acc a, acc b) { return _mm512_mul_ps(a, b); }
  static acc fmadd(acc a, acc b, acc c) { return _mm512_fmadd_ps(a, b, c); }
  static acc loadc(const float* p) { return _mm512_loadu_ps(p); }
  static void storec(float* p, acc v) { _mm512_storeu_ps(p, v); }
};

// Blocking as in Note [AVX-512 GEMM blocking]: a B micro-panel is 32 columns x 2 B per k and takes an eighth
// of L2 (1 MiB -> KC = 2048: K = 768 is one block, so a bf16 C needs no fp32 workspace there); the A block
// takes 6/8 of L2. KC is even, so only the last K block can be odd, and its missing partner is packed as
// zero on both sides.
struct Kernel : MicroKernels<VecBf16Pairs, 12, 32> {
  static constexpr bool kKcFromL2 = true;
  static constexpr std::int64_t kKcEighths = 1, kMcEighths = 6, NC = 4096;
  static constexpr bool kDirectBf16 = true;  // Note [direct bf16 write-back]
};

}  // namespace
}  // namespace tg::backend::cpu::packed::avx512bf16

namespace tg::backend::cpu::packed {

namespace {
constexpr int kChains = 16;

// clock_gettime rather than std::chrono: this file is compiled with -mavx512*, and an out-of-line copy of a
// std:: inline template from here could be the one the linker keeps (Note [GEMM ISA translation units]).
double now_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}  // > latency x ports for both instructions on Zen 4/5 and Intel cores

__attribute__((noinline)) float fma_chains(std::int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-6f);
  for (std::int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], x, y);
  for (int i = 1; i < kChains; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_reduce_add_ps(acc[0]);
}
__attribute__((noinline)) float dot_chains(std::int64_t iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i));
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x33d633d6);
  for (std::int64_t it = 0; it < iters; ++it)
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
  for (int i = 1; i < kChains; ++i) acc[0] = _mm512_add_ps(acc[0], acc[i]);
  return _mm512_reduce_add_ps(acc[0]);
}
}  // namespace

// Note [bf16 kernel choice]
// Whether vdpbf16ps beats widening bf16 to fp32 depends on the core: Zen 4/5 issue it at the zmm FMA rate
// (twice the flops), some Intel cores at about half that (no gain over fp32 FMAs then). A feature bit
// cannot tell them apart, so the rates are measured: the same number of independent-chain instructions of
// each kind, interleaved, best of 7 rounds (a preempted round only makes that round slower). Flops count 4
// per lane for vdpbf16ps and 2 for an FMA.
double measure_bf16_dot_speedup() {
  constexpr std::int64_t kIters = 4000;  // 64k instructions: ~20-40 us per call
  volatile float sink = 0;
  sink = sink + fma_chains(kIters) + dot_chains(kIters);  // warm up (clock, 512-bit units)
  double best_fma = 1e30, best_dot = 1e30;
  for (int r = 0; r < 7; ++r) {
    const double t0 = now_seconds();
    sink = sink + fma_chains(kIters);
    const double t1 = now_seconds();
    sink = sink + dot_chains(kIters);
    const double t2 = now_seconds();
    if (t1 - t0 < best_fma) best_fma = t1 - t0;
    if (t2 - t1 < best_dot) best_dot = t2 - t1;
  }
  return 2.0 * best_fma / best_dot;
}

void gemm_avx512bf16(const GemmArgs<bf16>& g, int threads) { avx512bf16::run<avx512bf16::Kernel>(g, threads); }

const char* kernel_desc_avx512bf16() { return "avx512-bf16 vdpbf16ps packed 12x32"; }

}  // namespace tg::backend::cpu::packed

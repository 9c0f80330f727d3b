// AVX-512 packed GEMM: 12x32 fp32 micro-kernel; bf16 and fp16 operands are widened to fp32 while packing.
#define TG_GEMM_ISA avx512
#include "gemm_packed.hpp"

namespace tg::backend::cpu::packed::avx512 {
namespace {

/// fp32 lanes in zmm registers (16 per vector).
struct VecF32x16 {
  using elem = float;
  using acc = __m512;
  using areg = __m512;
  using breg = __m512;
  static constexpr int lanes = 16, kp = 1;
  static acc zero() { return _mm512_setzero_ps(); }
  static acc set1(float x) { return _mm512_set1_ps(x); }
  static breg load_b(const float* p) { return _mm512_load_ps(p); }
  static areg bcast_a(const float* p) { return _mm512_set1_ps(*p); }
  static acc fma(acc c, areg a, breg b) { return _mm512_fmadd_ps(a, b, c); }
  static acc mul(acc a, acc b) { return _mm512_mul_ps(a, b); }
  static acc fmadd(acc a, acc b, acc c) { return _mm512_fmadd_ps(a, b, c); }
  static acc loadc(const float* p) { return _mm512_loadu_ps(p); }
  static void storec(float* p, acc v) { _mm512_storeu_ps(p, v); }
};

// Note [AVX-512 GEMM blocking] (written for Zen 4/5 and Sapphire Rapids: 32-48 KiB L1d, 1-2 MiB L2 per core)
// 12x32: 24 zmm accumulators, 2 for B, 1 broadcast (27 of 32 registers, no spills); 24 FMAs per k for
// 2 loads + 12 broadcasts (the broadcasts fold into the FMAs as {1to16} memory operands).
// KC (Note [GEMM blocking from cache sizes]): the B micro-panel takes an eighth of L2, not a share of L1d:
// per k the kernel reads 128 bytes of B and 48 of A for 12 cycles of FMAs, which L2 streams easily, and
// the GPT-2 products ran faster with whole K = 768 blocks than with L1-sized ones. Measured on a Zen 5
// (1 MiB L2, 2 threads, three interleaved rounds per setting, % of the fp32 peak, median of the 15 GPT-2
// products): KC = 192 / MC = 336 (the L1-derived values) 72.6%, KC = 384 / MC = 264 78.7%, KC = 768 / MC =
// 264 80.3%. 1 MiB L2 -> KC = 1024 (K = 768: one block; 3072: three).
// MC: the A block takes 6/8 of L2 (1 MiB, KC = 768 -> 252 rows), so a 256-token GEMM packs A in one or two
// blocks and re-reads B's panels at most twice.  NC = 4096: a B block up to 12 MiB, in L3.
struct Kernel : MicroKernels<VecF32x16, 12, 32> {
  static constexpr bool kKcFromL2 = true;
  static constexpr std::int64_t kKcEighths = 1, kMcEighths = 6, NC = 4096;
  static constexpr bool kDirectBf16 = true;  // Note [direct bf16 write-back]
};

}  // namespace
}  // namespace tg::backend::cpu::packed::avx512

namespace tg::backend::cpu::packed {

template <class T>
void gemm_avx512(const GemmArgs<T>& g, int threads) {
  avx512::run<avx512::Kernel>(g, threads);
}
template void gemm_avx512<float>(const GemmArgs<float>&, int);
template void gemm_avx512<bf16>(const GemmArgs<bf16>&, int);
template void gemm_avx512<fp16>(const GemmArgs<fp16>&, int);

const char* kernel_desc_avx512() { return "avx512 packed 12x32"; }

}  // namespace tg::backend::cpu::packed

// AVX2 + FMA packed GEMM: 6x16 fp32 micro-kernel; bf16 and fp16 operands are widened to fp32 while packing.
#define TG_GEMM_ISA avx2
#include "gemm_packed.hpp"

namespace tg::backend::cpu::packed::avx2 {
namespace {

/// fp32 lanes in ymm registers (8 per vector).
struct VecF32x8 {
  using elem = float;
  using acc = __m256;
  using areg = __m256;
  using breg = __m256;
  static constexpr int lanes = 8, kp = 1;
  static acc zero() { return _mm256_setzero_ps(); }
  static acc set1(float x) { return _mm256_set1_ps(x); }
  static breg load_b(const float* p) { return _mm256_load_ps(p); }
  static areg bcast_a(const float* p) { return _mm256_broadcast_ss(p); }
  static acc fma(acc c, areg a, breg b) { return _mm256_fmadd_ps(a, b, c); }
  static acc mul(acc a, acc b) { return _mm256_mul_ps(a, b); }
  static acc fmadd(acc a, acc b, acc c) { return _mm256_fmadd_ps(a, b, c); }
  static acc loadc(const float* p) { return _mm256_loadu_ps(p); }
  static void storec(float* p, acc v) { _mm256_storeu_ps(p, v); }
};

// Note [AVX2 GEMM blocking] (Zen 3: 32 KiB L1d, 512 KiB L2 per core, 32 MiB L3; 2 x 256-bit FMA, latency 4)
// 6x16: 12 ymm accumulators (>= 4 x 2 = 8 chains in flight), 2 for B, 1 for the A broadcast; per k it does
// 12 FMAs for 2 vector loads + 6 broadcasts, under Zen 3's 3 loads / cycle.
// KC: a B micro-panel takes half of L1d (32 KiB -> KC = 256, 16 KiB; the A micro-panel and C stream past it).
// MC: an A block takes a quarter of L2 (512 KiB, KC = 256 -> 126 rows; Note [GEMM blocking from cache sizes]).
// NC = 4096: a B block is 256 x 4096 x 4 B = 4 MiB, well inside L3 (on 2 threads each core packs and
// reads its own half of it: Note [GEMM blocking and threads]).
struct Kernel : MicroKernels<VecF32x8, 6, 16> {
  static constexpr bool kKcFromL2 = false;
  static constexpr std::int64_t kKcEighths = 4, kMcEighths = 2, NC = 4096;
  static constexpr bool kDirectBf16 = false;  // 16-bit C goes through write_tile
};

}  // namespace
}  // namespace tg::backend::cpu::packed::avx2

namespace tg::backend::cpu::packed {

template <class T>
void gemm_avx2(const GemmArgs<T>& g, int threads) {
  avx2::run<avx2::Kernel>(g, threads);
}
template void gemm_avx2<float>(const GemmArgs<float>&, int);
template void gemm_avx2<bf16>(const GemmArgs<bf16>&, int);
template void gemm_avx2<fp16>(const GemmArgs<fp16>&, int);

const char* kernel_desc_avx2() { return "avx2-fma packed 6x16"; }

}  // namespace tg::backend::cpu::packed

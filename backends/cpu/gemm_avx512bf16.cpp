// AVX-512 BF16 packed GEMM: bf16 x bf16 -> fp32 with vdpbf16ps, 12x32 tiles over packed k-pairs.
#define TG_GEMM_ISA avx512bf16
#include "gemm_packed.hpp"

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

// Blocking (see Note [AVX-512 GEMM blocking]): a B micro-panel is 32 columns x 2 B per k and takes 6/8 of
// L1d, so KC = 384 on a 32 KiB L1d (24 KiB); the A block takes a quarter of L2. KC is even, so only
// the last K block can be odd, and its missing partner is packed as zero on both sides.
struct Kernel {
  using elem = std::uint16_t;
  static constexpr int MR = 12, NR = 32, KP = 2;
  static constexpr std::int64_t kL1Eighths = 6, NC = 4096;
  static __attribute__((noinline)) void micro(std::int64_t kg, const std::uint16_t* a, const std::uint16_t* b,
                                              float* c, std::int64_t ldc, float alpha, float beta, bool direct) {
    micro_kernel<VecBf16Pairs, MR, NR / VecBf16Pairs::lanes>(kg, a, b, c, ldc, alpha, beta, direct);
  }
};

}  // namespace
}  // namespace tg::backend::cpu::packed::avx512bf16

namespace tg::backend::cpu::packed {

void gemm_avx512bf16(const GemmArgs<bf16>& g, int threads) { avx512bf16::run<avx512bf16::Kernel>(g, threads); }

const char* kernel_desc_avx512bf16() { return "avx512-bf16 vdpbf16ps packed 12x32"; }

}  // namespace tg::backend::cpu::packed

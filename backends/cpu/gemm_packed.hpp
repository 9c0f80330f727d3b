// The packed GEMM shared by every ISA: the BLIS/GotoBLAS loop nest, packing, write-back and threading.
//   #define TG_GEMM_ISA avx2                 // in backends/cpu/gemm_avx2.cpp, before the include
//   #include "gemm_packed.hpp"                // then: avx2::run<Kernel>(args, threads)
#pragma once

#include <cstdint>

#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu::packed {

/// What the cache blocking is derived from (Note [GEMM blocking from cache sizes]): the data cache sizes in
/// bytes, and kc / mc / nc forced by TG_GEMM_BLOCKING (0: derived). k_split_ratio: K is split between the
/// threads when K >= k_split_ratio * max(M, N) (Note [GEMM K split]; TG_GEMM_KSPLIT_RATIO, 0 = never).
struct GemmBlocking {
  std::int64_t l1d = 32 * 1024, l2 = 512 * 1024;
  std::int64_t kc = 0, mc = 0, nc = 0;
  std::int64_t k_split_ratio = 4;
};

/// One GEMM call, as in Note [GEMM conventions] (gemm.hpp).
template <class T>
struct GemmArgs {
  Trans ta = Trans::N, tb = Trans::N;
  std::int64_t M = 0, N = 0, K = 0;
  float alpha = 1.f;
  const T* A = nullptr;
  std::int64_t lda = 0;
  const T* B = nullptr;
  std::int64_t ldb = 0;
  float beta = 0.f;
  T* C = nullptr;
  std::int64_t ldc = 0;
  GemmEpilogue ep{};
  GemmBlocking blocking{};
};

// Entry points of the ISA translation units (gemm_avx2.cpp, gemm_avx512.cpp, gemm_avx512bf16.cpp).
// They require K > 0, M > 0, N > 0 (gemm.cpp handles the empty cases) and run on `threads` OpenMP threads
// (1: no parallel region is opened, so they may be called from inside one).
template <class T>
void gemm_avx2(const GemmArgs<T>& g, int threads);  // T = float, bf16, fp16
template <class T>
void gemm_avx512(const GemmArgs<T>& g, int threads);  // T = float, bf16, fp16
void gemm_avx512bf16(const GemmArgs<bf16>& g, int threads);
/// vdpbf16ps flops per second / zmm fp32 FMA flops per second on the calling thread (gemm_avx512bf16.cpp).
double measure_bf16_dot_speedup();
const char* kernel_desc_avx2();        // e.g. "avx2-fma packed 6x16"
const char* kernel_desc_avx512();
const char* kernel_desc_avx512bf16();

}  // namespace tg::backend::cpu::packed

#if defined(TG_GEMM_ISA)

#include <immintrin.h>
#include <omp.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>

// Note [GEMM ISA translation units]
// This part of the header is compiled once per ISA file, each with its own -m flags (backends/cpu/
// CMakeLists.txt), inside the namespace packed::TG_GEMM_ISA. Everything it defines therefore has a
// distinct mangled name per ISA: an inline function compiled with -mavx512f must never be merged by the
// linker with the AVX2 copy (the linker keeps one COMDAT copy, and an AVX-512 one would then run on a
// Zen 3 and fault). For the same reason this code calls no inline function of other headers that could
// be emitted out of line (no tg::bf16 members, no std::vector): 16-bit values are handled as raw bits
// here, and buffers come from std::aligned_alloc.

namespace tg::backend::cpu::packed::TG_GEMM_ISA {

using i64 = std::int64_t;

inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }
inline i64 imax(i64 a, i64 b) { return a > b ? a : b; }
inline i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
inline i64 round_up(i64 a, i64 b) { return ceil_div(a, b) * b; }

inline float bits_to_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline std::uint32_t f32_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
// fp32 -> bf16 bits, round to nearest even; NaN stays NaN (same rule as Note [16-bit conversions]).
// Branch-free (selects only), so write-back loops vectorize.
inline std::uint16_t f32_to_bf16_rne(float f) {
  const std::uint32_t x = f32_to_bits(f), upper = x >> 16;
  const std::uint32_t rounded = (x + 0x7fffu + (upper & 1u)) >> 16;
  const std::uint32_t nan = upper | ((upper & 0x7fu) == 0 ? 0x40u : 0u);
  return static_cast<std::uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

/// Element access as fp32: load_f32(x) = the exact fp32 value of x; store_f32 rounds to nearest even.
template <class T>
inline float load_f32(const T& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else if constexpr (std::is_same_v<T, bf16>) {
    return bits_to_f32(static_cast<std::uint32_t>(x.bits) << 16);
  } else {
    static_assert(std::is_same_v<T, fp16>, "gemm_packed: element type must be float, bf16 or fp16");
#if defined(__F16C__)
    return _cvtsh_ss(x.bits);
#else
    static_assert(!std::is_same_v<T, fp16>, "gemm_packed: fp16 needs F16C in this translation unit");
    return 0.f;
#endif
  }
}
template <class T>
inline void store_f32(T& x, float v) {
  if constexpr (std::is_same_v<T, float>) {
    x = v;
  } else if constexpr (std::is_same_v<T, bf16>) {
    x.bits = f32_to_bf16_rne(v);
  } else {
#if defined(__F16C__)
    x.bits = static_cast<std::uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT));
#else
    static_assert(!std::is_same_v<T, fp16>, "gemm_packed: fp16 needs F16C in this translation unit");
#endif
  }
}

/// Source element -> packed element: fp32 packs take the exact fp32 value, bf16 packs the raw bits.
template <class E, class T>
inline E to_packed(const T& x) {
  if constexpr (std::is_same_v<E, float>) {
    return load_f32(x);
  } else {
    static_assert(std::is_same_v<E, std::uint16_t> && std::is_same_v<T, bf16>,
                  "gemm_packed: bf16-pair packing takes bf16 operands only");
    return x.bits;
  }
}

// ---- register-blocked micro-kernel ---------------------------------------------------------------------
// Note [GEMM micro-kernel]
// acc[MR][NV] holds an MR x NR tile of C (NR = NV * V::lanes) in vector registers. Per packed k-group
// (KP = V::kp consecutive k: 1 for fp32, 2 for the bf16 pairs of vdpbf16ps) it loads NV vectors of the
// packed B micro-panel, broadcasts each of the MR packed A values (or pairs) and does MR * NV FMAs:
//     acc[i][v] += a(i, k) * b(k, v*lanes .. v*lanes + lanes-1).
// The accumulators are independent chains, so MR * NV >= (FMA latency) x (FMA ports) keeps the pipes full
// (Zen 3: 4 cycles x 2 ports = 8 <= 12 for 6x16). Finishing: `direct` tiles (full MR x NR, fp32 destination,
// no bf16 copy) are written straight from registers, C = alpha * acc + beta * C (+ bias in the last K block;
// beta == 0: C is not read);
// full tiles of a bf16 C likewise (micro_kernel_bf16_out, Note [direct bf16 write-back]); every other tile
// is stored raw to `c` (leading dimension NR) for write_tile.
// Note [B source prefetch]
// Packing was the largest cost outside the kernels (perf, fc_proj fwd: 7.6% of the time in the B transposes,
// qkv dX: 6.2% in the B copy), and not for the shuffles: the source rows came from L3 or memory. Each thread
// now packs its B panels lazily (Note [GEMM blocking and threads]), and the kernel calls on panel q prefetch
// the lines that come next into L2, a few per K loop: the source of panel q+1 while the first A block runs
// (so its packing reads L2), the packed panel q+1 in later A blocks. Spread through the K loop the
// prefetches overlap the FMAs; issued in bursts between kernel calls they measured 7 points slower. A/B on
// the Zen 5 VM (4 interleaved rounds, % of the fp32 peak), eager packing -> lazy with the source walk: qkv
// fwd 82.7 -> 86.6, fc_proj fwd 79.0 -> 82.3, fc_proj dX 78.2 -> 84.1 (lazy packing alone: 81.6 / 80.8);
// walking the packed panel in later A blocks instead of a burst added 1.4 points (median of 8 products).
/// Lines still to prefetch: `left` 64-byte lines in runs of `per_row`, the runs `stride` bytes apart.
struct LineWalk {
  const char* row = nullptr;
  i64 stride = 0, per_row = 1, col = 0, left = 0;
};
/// One step of a walk: prefetches line (row, col) into L2 and moves to the next line.
inline __attribute__((always_inline)) void prefetch_and_advance(const char*& row, i64& col, i64 per_row, i64 stride) {
  _mm_prefetch(row + col * 64, _MM_HINT_T1);
  if (++col == per_row) {
    col = 0;
    row += stride;
  }
}
/// Prefetches the next n lines of w into L2 now (before a kernel call that does not walk).
inline void walk_lines(LineWalk& w, i64 n) {
  for (; n > 0 && w.left > 0; --n, --w.left) prefetch_and_advance(w.row, w.col, w.per_row, w.stride);
}

// AS is the A panel's row count (the packed A step per k-group): a short kernel (MR < AS) runs on the first
// MR rows of a full-height panel (Note [short A panels]).
// kWalk: up to `quota` lines of *walk are prefetched, one every kgroups / quota k-groups. (A K loop in chunks
// with the prefetch between them, so that the FMA loop carries no counter, measured 2 points slower.)
template <class V, int MR, int NV, int AS = MR, bool kWalk = false>
inline __attribute__((always_inline)) void accumulate(i64 kgroups, const typename V::elem* a, const typename V::elem* b,
                                                       typename V::acc (&acc)[MR][NV], LineWalk* walk = nullptr,
                                                       i64 quota = 0) {
  constexpr int L = V::lanes, NR = NV * L, KP = V::kp;
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = V::zero();
  const char* w_row = nullptr;
  i64 w_col = 0, w_todo = 0, every = 1, countdown = 1;
  if constexpr (kWalk) {  // the walk's state in registers for the loop
    w_row = walk->row;
    w_col = walk->col;
    w_todo = imin(imin(quota, walk->left), kgroups);
    every = w_todo > 0 ? kgroups / w_todo : kgroups + 1;
    countdown = every;
  }
  const i64 walked = w_todo;
#pragma GCC unroll 2
  for (i64 k = 0; k < kgroups; ++k) {
    if constexpr (kWalk) {
      if (--countdown == 0) {
        countdown = every;
        if (w_todo > 0) {
          prefetch_and_advance(w_row, w_col, walk->per_row, walk->stride);
          --w_todo;
        }
      }
    }
    typename V::breg bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = V::load_b(b + v * L * KP);
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      const typename V::areg av = V::bcast_a(a + i * KP);
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] = V::fma(acc[i][v], av, bv[v]);
    }
    a += AS * KP;
    b += NR * KP;
  }
  if constexpr (kWalk) {
    walk->left -= walked - w_todo;
    walk->row = w_row;
    walk->col = w_col;
  }
}

template <class V, int MR, int NV, int AS = MR, bool kWalk = false>
inline __attribute__((always_inline)) void micro_kernel(i64 kgroups, const typename V::elem* a,
                                                         const typename V::elem* b, float* c, i64 ldc,
                                                         float alpha, float beta, bool direct,
                                                         LineWalk* walk = nullptr, i64 quota = 0,
                                                         const float* bias = nullptr) {
  constexpr int L = V::lanes, NR = NV * L;
  if (direct) {
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc + NR - 1), _MM_HINT_T0);
    }
  }
  typename V::acc acc[MR][NV];
  accumulate<V, MR, NV, AS, kWalk>(kgroups, a, b, acc, walk, quota);
  if (direct) {
    const typename V::acc va = V::set1(alpha), vb = V::set1(beta), one = V::set1(1.f);
    typename V::acc vbias[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) vbias[v] = bias ? V::loadc(bias + v * L) : V::zero();
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) {
        float* p = c + i * ldc + v * L;
        typename V::acc r = V::mul(acc[i][v], va);
        if (beta != 0.f) r = V::fmadd(vb, V::loadc(p), r);
        if (bias) r = V::fmadd(one, vbias[v], r);  // + bias, one rounding, as write_tile adds it
        V::storec(p, r);
      }
  } else {
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) V::storec(c + i * NR + v * L, acc[i][v]);
  }
}

// Note [short A panels]
// M is rarely a multiple of MR (GPT's 256 tokens are 21 panels of 12 and 4 rows), and the last A panel of a
// block used to run the full MR-row kernel on zero padding: 12 rows of FMAs for 4 rows of C, 3% of every
// 256-row product. The last panel instead runs a kernel of the next multiple of 4 rows (4 or 8), on the same
// packed panel (A step MR per k-group), into the raw tile that write_tile finishes. With 2 B vectors per
// row, a 4-row kernel still has 8 independent accumulators (FMA latency 4 x 2 ports).
template <class V, int MR, int NV>
inline __attribute__((always_inline)) void micro_kernel_short(int rows, i64 kgroups, const typename V::elem* a,
                                                               const typename V::elem* b, float* tile) {
  constexpr int NR = NV * V::lanes;
  if constexpr (MR > 4) {
    if (rows <= 4) return micro_kernel<V, 4, NV, MR>(kgroups, a, b, tile, NR, 1.f, 0.f, false);
  }
  if constexpr (MR > 8) {
    if (rows <= 8) return micro_kernel<V, 8, NV, MR>(kgroups, a, b, tile, NR, 1.f, 0.f, false);
  }
  micro_kernel<V, MR, NV>(kgroups, a, b, tile, NR, 1.f, 0.f, false);
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
/// 16 fp32 -> 16 bf16 bits at p, round to nearest even with f32_to_bf16_rne's NaN rule (bit-identical to it:
/// no denormal flushing, unlike vcvtneps2bf16).
inline void store_bf16x16(std::uint16_t* p, __m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i upper = _mm512_srli_epi32(x, 16);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(upper, _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
  const __mmask16 quiet_bit_needed = _mm512_testn_epi32_mask(upper, _mm512_set1_epi32(0x7f));
  const __m512i nan = _mm512_mask_or_epi32(upper, quiet_bit_needed, upper, _mm512_set1_epi32(0x40));
  const __mmask16 is_nan =
      _mm512_cmpgt_epu32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan)));
}

// Note [direct bf16 write-back]
// A full tile of a bf16 C is finished from the registers: c = bf16(alpha * acc (+ prev) (+ bias[j])), with
// prev an fp32 partial-sum tile (the workspace W of the earlier K blocks) or nullptr, rounded as write_tile
// rounds. Without it every bf16 tile went through the `tile` scratch and write_tile, a second pass that cost
// about 14% of a bf16 GEMM (perf, qkv/fc on Zen 4). 16-lane (zmm) kernels only.
template <class V, int MR, int NV, bool kWalk = false>
inline __attribute__((always_inline)) void micro_kernel_bf16_out(i64 kgroups, const typename V::elem* a,
                                                                  const typename V::elem* b, std::uint16_t* c,
                                                                  i64 ldc, float alpha, const float* prev, i64 ldp,
                                                                  const float* bias, LineWalk* walk = nullptr,
                                                                  i64 quota = 0) {
  static_assert(V::lanes == 16, "micro_kernel_bf16_out: zmm kernels only");
  constexpr int L = V::lanes;
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i) {
    _mm_prefetch(reinterpret_cast<const char*>(c + i * ldc), _MM_HINT_T0);
    if (prev) {
      _mm_prefetch(reinterpret_cast<const char*>(prev + i * ldp), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(prev + i * ldp + NV * L - 1), _MM_HINT_T0);
    }
  }
  typename V::acc acc[MR][NV];
  accumulate<V, MR, NV, MR, kWalk>(kgroups, a, b, acc, walk, quota);
  const __m512 va = _mm512_set1_ps(alpha);
  __m512 vbias[NV];
#pragma GCC unroll 8
  for (int v = 0; v < NV; ++v) vbias[v] = bias ? _mm512_loadu_ps(bias + v * L) : _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  // With AVX512_BF16, one vcvtne2ps2bf16 rounds a whole 32-column row (round to nearest even, like
  // f32_to_bf16_rne for every normal, zero or infinite input; no normal fp32 rounds to a bf16 denormal).
  // It flushes denormal inputs and quiets every NaN, so a row holding either takes the exact path.
  if constexpr (NV == 2) {
#pragma GCC unroll 32
    for (int i = 0; i < MR; ++i) {
      __m512 r[2];
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        r[v] = _mm512_mul_ps(acc[i][v], va);
        if (prev) r[v] = _mm512_add_ps(r[v], _mm512_loadu_ps(prev + i * ldp + v * L));
        if (bias) r[v] = _mm512_add_ps(r[v], vbias[v]);
      }
      constexpr int kNanOrDenormal = 0x01 | 0x20 | 0x80;  // fpclass: QNaN, denormal, SNaN
      if ((_mm512_fpclass_ps_mask(r[0], kNanOrDenormal) | _mm512_fpclass_ps_mask(r[1], kNanOrDenormal)) == 0) {
        _mm512_storeu_si512(c + i * ldc, (__m512i)_mm512_cvtne2ps_pbh(r[1], r[0]));
      } else {
        store_bf16x16(c + i * ldc, r[0]);
        store_bf16x16(c + i * ldc + L, r[1]);
      }
    }
    return;
  }
#endif
#pragma GCC unroll 32
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
      __m512 r = _mm512_mul_ps(acc[i][v], va);
      if (prev) r = _mm512_add_ps(r, _mm512_loadu_ps(prev + i * ldp + v * L));
      if (bias) r = _mm512_add_ps(r, vbias[v]);
      store_bf16x16(c + i * ldc + v * L, r);
    }
}
#endif

/// What every ISA's Kernel struct inherits: the tile shape (MR x NR over k-groups of KP) and the kernel entry
/// points for its vector type V, noinline, so each is one function per ISA and element type.
template <class V, int kMR, int kNR>
struct MicroKernels {
  using elem = typename V::elem;
  static constexpr int MR = kMR, NR = kNR, KP = V::kp;
  static constexpr int kNV = NR / V::lanes;
  static_assert(NR % V::lanes == 0, "MicroKernels: NR must be whole vectors");
  /// A full tile (direct) or the raw tile; with walk, also prefetches up to `quota` of its lines, spread over
  /// the K loop (Note [B source prefetch]).
  /// A direct tile may add bias[0 .. NR) to every row (the fp32 bias epilogue of the last K block).
  static __attribute__((noinline)) void micro(i64 kg, const elem* a, const elem* b, float* c, i64 ldc, float alpha,
                                              float beta, bool direct, LineWalk* walk = nullptr, i64 quota = 0,
                                              const float* bias = nullptr) {
    if (walk && quota > 0)
      micro_kernel<V, MR, kNV, MR, true>(kg, a, b, c, ldc, alpha, beta, direct, walk, quota, bias);
    else
      micro_kernel<V, MR, kNV>(kg, a, b, c, ldc, alpha, beta, direct, nullptr, 0, bias);
  }
  /// The last A panel of a block, `rows` < MR rows of it (Note [short A panels]): raw tile, leading dimension NR.
  static __attribute__((noinline)) void micro_short(int rows, i64 kg, const elem* a, const elem* b, float* tile) {
    micro_kernel_short<V, MR, kNV>(rows, kg, a, b, tile);
  }
#if defined(__AVX512F__) && defined(__AVX512BW__)
  /// A full tile of a bf16 C, rounded from the registers (Note [direct bf16 write-back]); walk as in micro.
  static __attribute__((noinline)) void micro_bf16(i64 kg, const elem* a, const elem* b, std::uint16_t* c, i64 ldc,
                                                   float alpha, const float* prev, i64 ldp, const float* bias,
                                                   LineWalk* walk = nullptr, i64 quota = 0) {
    if (walk && quota > 0) micro_kernel_bf16_out<V, MR, kNV, true>(kg, a, b, c, ldc, alpha, prev, ldp, bias, walk, quota);
    else micro_kernel_bf16_out<V, MR, kNV>(kg, a, b, c, ldc, alpha, prev, ldp, bias);
  }
#endif
};

// ---- write-back of edge tiles and epilogues ------------------------------------------------------------
/// dst = alpha * tile + beta * prev (+ bias[j]); prev == nullptr reads nothing (beta == 0 or a fresh
/// workspace); o16, when set, receives the bf16 rounding of the same fp32 value.
template <bool kPrev, bool kBias, bool kO16, class P, class D>
inline void write_tile_as(const float* tile, int nr_full, i64 mr, i64 nr, float alpha, float beta, const P* prev,
                          i64 ldp, D* dst, i64 ldd, const float* bias, std::uint16_t* o16, i64 ldo) {
  for (i64 i = 0; i < mr; ++i) {
    const float* t = tile + i * nr_full;
    D* d = dst + i * ldd;
    for (i64 j = 0; j < nr; ++j) {
      float v = alpha * t[j];
      if constexpr (kPrev) v += beta * load_f32(prev[i * ldp + j]);
      if constexpr (kBias) v += bias[j];
      store_f32(d[j], v);
      if constexpr (kO16) o16[i * ldo + j] = f32_to_bf16_rne(v);
    }
  }
}
template <class P, class D>
inline void write_tile(const float* tile, int nr_full, i64 mr, i64 nr, float alpha, float beta, const P* prev,
                       i64 ldp, D* dst, i64 ldd, const float* bias, std::uint16_t* o16, i64 ldo) {
  // One loop per (prev, bias, o16) combination, so each inner loop is branch-free.
  const int which = (prev ? 4 : 0) | (bias ? 2 : 0) | (o16 ? 1 : 0);
#define TG_GEMM_WRITE_CASE(n, a, b, c) \
  case n: return write_tile_as<a, b, c>(tile, nr_full, mr, nr, alpha, beta, prev, ldp, dst, ldd, bias, o16, ldo);
  switch (which) {
    TG_GEMM_WRITE_CASE(0, false, false, false)
    TG_GEMM_WRITE_CASE(1, false, false, true)
    TG_GEMM_WRITE_CASE(2, false, true, false)
    TG_GEMM_WRITE_CASE(3, false, true, true)
    TG_GEMM_WRITE_CASE(4, true, false, false)
    TG_GEMM_WRITE_CASE(5, true, false, true)
    TG_GEMM_WRITE_CASE(6, true, true, false)
    default: return write_tile_as<true, true, true>(tile, nr_full, mr, nr, alpha, beta, prev, ldp, dst, ldd, bias, o16, ldo);
  }
#undef TG_GEMM_WRITE_CASE
}

// ---- packing ---------------------------------------------------------------------------------------------
// Note [GEMM packing]
// A block op(A)[i0 : i0+mc, k0 : k0+kc] is packed as ceil(mc/MR) micro-panels of MR rows; B block
// op(B)[k0 : k0+kc, j0 : j0+nc] as ceil(nc/NR) micro-panels of NR columns. Within a panel, k is grouped by
// KP (the kernel's k-pairing) and element (k, r) of the panel sits at ((k / KP) * R + r) * KP + k % KP for
// R = MR (A) or NR (B): for KP = 1 that is plain k-major order, for KP = 2 each 32-bit lane holds the pair
// (k, k+1) that vdpbf16ps multiplies. Rows past mc, columns past nc and k past kc (up to a multiple of KP)
// are packed as zeros, so edge tiles run the full kernel; their padded outputs are never written (a zero
// times an inf in the other operand gives NaN only in those discarded outputs). Transposes and leading
// dimensions are resolved here: op(A)(i, k) = ta == N ? A[i*lda + k] : A[k*lda + i], likewise for B; each
// case walks the source along its contiguous dimension. 16-bit operands are converted while packing.
#if defined(__AVX2__)
/// Eight consecutive elements as fp32 (exact).
template <class T>
inline __m256 load8_f32(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, bf16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
#if defined(__F16C__)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    static_assert(!std::is_same_v<T, fp16>, "gemm_packed: fp16 needs F16C in this translation unit");
    return _mm256_setzero_ps();
#endif
  }
}
/// dst[c * ldd + r] = src[r * lds + c] for an 8 x 8 block (unpack / shuffle / lane-permute transpose).
template <class T>
inline void transpose8x8(const T* src, i64 lds, float* dst, i64 ldd) {
  __m256 r[8], t[8];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) r[i] = load8_f32(src + i * lds);
#pragma GCC unroll 4
  for (int i = 0; i < 8; i += 2) {  // t[i] = (r_i0 r_i+1,0 r_i1 r_i+1,1 | 4 5), t[i+1] = (2 3 | 6 7)
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 2
  for (int h = 0; h < 8; h += 4) {  // rows h..h+3 of columns (0|4), (1|5), (2|6), (3|7)
    r[h + 0] = _mm256_shuffle_ps(t[h + 0], t[h + 2], 0x44);
    r[h + 1] = _mm256_shuffle_ps(t[h + 0], t[h + 2], 0xee);
    r[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    r[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xee);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ldd, _mm256_permute2f128_ps(r[c], r[c + 4], 0x31));
  }
}
#endif

#if defined(__AVX2__)
/// Panel rows [0, R) of columns kk .. kk+7 of a 32-bit source (row r at src + r * lds) to k-major
/// dst[kk' * R + r]: 8 x 8 transposes, the last one overlapping the previous ones when R is not a multiple
/// of 8 (R = 12: rows 0-7, then 4-11; the overlapping rows get the same values twice).
template <int R, class T>
inline void transpose_rows8(const T* src, i64 lds, float* dst) {
  static_assert(R >= 8, "transpose_rows8: a panel has at least 8 rows");
#pragma GCC unroll 4
  for (int r = 0; r + 8 <= R; r += 8) transpose8x8(src + r * lds, lds, dst + r, R);
  if constexpr (R % 8 != 0) transpose8x8(src + (R - 8) * lds, lds, dst + (R - 8), R);
}
#endif

#if defined(__AVX512F__)
/// dst[c * ldd + r] = src[r * lds + c] for a 16 x 16 block of 32-bit values (fp32, or bf16 pairs as words):
/// in-lane unpacks and shuffles transpose the 4 x 4 blocks of each 128-bit lane, two rounds of 128-bit lane
/// shuffles put the blocks in place. Per 256 values: 16 loads and 16 stores of 64 bytes and 64 shuffles, against
/// 32 + 32 loads and stores of 32 bytes and 96 shuffles for four 8 x 8 transposes.
inline void transpose16x16(const float* src, i64 lds, float* dst, i64 ldd) {
  __m512 r[16], t[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * lds);
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  // r[4g + c], lane L: column 4L + c of rows 4g .. 4g+3.
#pragma GCC unroll 4
  for (int g = 0; g < 16; g += 4) {
    r[g + 0] = _mm512_shuffle_ps(t[g + 0], t[g + 2], 0x44);
    r[g + 1] = _mm512_shuffle_ps(t[g + 0], t[g + 2], 0xee);
    r[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
    r[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xee);
  }
#pragma GCC unroll 4
  for (int c = 0; c < 4; ++c) {
    const __m512 lo01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0x44), hi01 = _mm512_shuffle_f32x4(r[c], r[4 + c], 0xee);
    const __m512 lo23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0x44), hi23 = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], 0xee);
    _mm512_storeu_ps(dst + (0 + c) * ldd, _mm512_shuffle_f32x4(lo01, lo23, 0x88));
    _mm512_storeu_ps(dst + (4 + c) * ldd, _mm512_shuffle_f32x4(lo01, lo23, 0xdd));
    _mm512_storeu_ps(dst + (8 + c) * ldd, _mm512_shuffle_f32x4(hi01, hi23, 0x88));
    _mm512_storeu_ps(dst + (12 + c) * ldd, _mm512_shuffle_f32x4(hi01, hi23, 0xdd));
  }
}
/// Rows [0, R) x columns kk .. kk+15 of a 32-bit source to k-major dst[kk' * R + r], R a multiple of 16.
template <int R>
inline void transpose_rows16(const float* src, i64 lds, float* dst) {
  static_assert(R % 16 == 0, "transpose_rows16: whole 16-row blocks only");
#pragma GCC unroll 4
  for (int r = 0; r < R; r += 16) transpose16x16(src + r * lds, lds, dst + r, R);
}
#endif

template <class E, int R, int KP, class T>
void pack_panel(const T* src, i64 s_r, i64 s_k, bool k_contiguous, i64 rows, i64 kc, E* dst) {
  const i64 kcp = round_up(kc, KP);
  const auto at = [](i64 k, i64 r) { return ((k / KP) * R + r) * KP + k % KP; };
#if defined(__AVX2__)
  if constexpr (std::is_same_v<E, float> && KP == 1 && R >= 8) {
    if (k_contiguous && rows == R) {  // full panel, fp32 pack: 16 x 16 (AVX-512) and 8 x 8 transposes, then the k tail
      const i64 k8 = kc / 8 * 8;
      i64 k = 0;
#if defined(__AVX512F__)
      if constexpr (R % 16 == 0 && std::is_same_v<T, float>) {  // 16 x 16 zmm transposes while 16 k remain
        for (; k + 16 <= kc; k += 16) {
          for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(src + (R + r) * s_r + k), _MM_HINT_T1);
          transpose_rows16<R>(src + k, s_r, dst + k * R);
        }
      }
#endif
      for (; k < k8; k += 8) {
        if (k % 16 == 0)  // one line per row of the next panel, ahead of its use (no fault past the end)
          for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(src + (R + r) * s_r + k), _MM_HINT_T1);
        transpose_rows8<R>(src + k, s_r, dst + k * R);
      }
      for (i64 r = 0; r < R; ++r)
        for (i64 kt = k8; kt < kc; ++kt) dst[kt * R + r] = to_packed<E>(src[r * s_r + kt]);
      return;
    }
  }
  if constexpr (std::is_same_v<E, std::uint16_t> && KP == 2) {
    // bf16 pairs. A pair (k, k+1) of one row is one 32-bit word of the packed panel: word (k/2) * R + r.
    std::uint16_t* const d16 = dst;
    if (k_contiguous && rows == R && R >= 8 && s_r % 2 == 0) {
      // Contiguous pairs in the source: the word matrix is transposed like an fp32 panel (bits only).
      const float* sw = reinterpret_cast<const float*>(src);
      float* dw = reinterpret_cast<float*>(dst);
      const i64 lds = s_r / 2, pairs = kc / 2, p8 = pairs / 8 * 8;
      i64 kk = 0;
#if defined(__AVX512F__)
      if constexpr (R % 16 == 0) {  // 16 x 16 word transposes while 16 pairs remain
        for (; kk + 16 <= pairs; kk += 16) {
          for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(sw + (R + r) * lds + kk), _MM_HINT_T1);
          transpose_rows16<R>(sw + kk, lds, dw + kk * R);
        }
      }
#endif
      for (; kk < p8; kk += 8) {
        if (kk % 16 == 0)
          for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(sw + (R + r) * lds + kk), _MM_HINT_T1);
        transpose_rows8<R>(sw + kk, lds, dw + kk * R);
      }
      for (i64 r = 0; r < R; ++r)
        for (i64 kt = p8; kt < pairs; ++kt) std::memcpy(dw + kt * R + r, sw + r * lds + kt, 4);
      if (kc % 2 != 0)
        for (i64 r = 0; r < R; ++r) {
          d16[((kc / 2) * R + r) * 2] = src[r * s_r + kc - 1].bits;
          d16[((kc / 2) * R + r) * 2 + 1] = 0;
        }
      return;
    }
    if (!k_contiguous) {
#if defined(__AVX512BW__)
      // Rows k and k+1 of the source are interleaved 16 bits at a time, 32 panel rows per step: the in-lane
      // unpacks interleave 4-word groups, and one two-source qword permute per output puts the groups in
      // order. A partial step (an MR = 12 panel, the last panel of a block) uses masked loads and stores,
      // which never touch memory outside the mask.
      const __m512i order_lo = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
      const __m512i order_hi = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
      const auto low_bits = [](i64 n) { return n >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << n) - 1u); };
      for (i64 k = 0; k < kcp; k += 2) {
        const T* s0 = src + k * s_k;
        const bool pair = k + 1 < kc;  // else the last k of an odd kc: its partner is zero
        std::uint16_t* d = d16 + (k / 2) * R * 2;
        i64 r = 0;
        for (; r + 32 <= rows; r += 32) {
          const __m512i a = _mm512_loadu_si512(s0 + r);
          const __m512i b = pair ? _mm512_loadu_si512(s0 + s_k + r) : _mm512_setzero_si512();
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
          _mm512_storeu_si512(d + 2 * r, _mm512_permutex2var_epi64(lo, order_lo, hi));
          _mm512_storeu_si512(d + 2 * r + 32, _mm512_permutex2var_epi64(lo, order_hi, hi));
        }
        if (r < rows) {
          const i64 n = rows - r;
          const __mmask32 m = low_bits(n);
          const __m512i a = _mm512_maskz_loadu_epi16(m, s0 + r);
          const __m512i b = pair ? _mm512_maskz_loadu_epi16(m, s0 + s_k + r) : _mm512_setzero_si512();
          const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
          _mm512_mask_storeu_epi16(d + 2 * r, low_bits(2 * n), _mm512_permutex2var_epi64(lo, order_lo, hi));
          if (n > 16)
            _mm512_mask_storeu_epi16(d + 2 * r + 32, low_bits(2 * (n - 16)), _mm512_permutex2var_epi64(lo, order_hi, hi));
        }
        for (r = rows; r < R; ++r) d[2 * r] = d[2 * r + 1] = 0;
      }
      return;
#else
      // Rows k and k+1 of the source are interleaved 16 bits at a time, 8 panel rows per step.
      for (i64 k = 0; k < kcp; k += 2) {
        const T* s0 = src + k * s_k;
        const T* s1 = k + 1 < kc ? s0 + s_k : s0;
        std::uint16_t* d = d16 + (k / 2) * R * 2;
        i64 r = 0;
        if (k + 1 < kc) {
          for (; r + 8 <= rows; r += 8) {
            const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s0 + r));
            const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s1 + r));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * r), _mm_unpacklo_epi16(a, b));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d + 2 * r + 8), _mm_unpackhi_epi16(a, b));
          }
          for (; r < rows; ++r) {
            d[2 * r] = src[k * s_k + r].bits;
            d[2 * r + 1] = src[(k + 1) * s_k + r].bits;
          }
        } else {  // odd kc: the last k's partner is zero
          for (; r < rows; ++r) {
            d[2 * r] = src[k * s_k + r].bits;
            d[2 * r + 1] = 0;
          }
        }
        for (; r < R; ++r) d[2 * r] = d[2 * r + 1] = 0;
      }
      return;
#endif
    }
  }
#endif
  if (k_contiguous) {  // src(r, k) = src[r * s_r + k]
    for (i64 r = 0; r < rows; ++r) {
      const T* s = src + r * s_r;
      for (i64 k = 0; k < kc; ++k) dst[at(k, r)] = to_packed<E>(s[k]);
      for (i64 k = kc; k < kcp; ++k) dst[at(k, r)] = E(0);
    }
    for (i64 r = rows; r < R; ++r)
      for (i64 k = 0; k < kcp; ++k) dst[at(k, r)] = E(0);
  } else {  // src(r, k) = src[k * s_k + r]
    for (i64 k = 0; k < kc; ++k) {
      const T* s = src + k * s_k;
      if constexpr (KP == 1) {
        E* d = dst + k * R;
        for (i64 r = 0; r < rows; ++r) d[r] = to_packed<E>(s[r]);
        for (i64 r = rows; r < R; ++r) d[r] = E(0);
      } else {
        for (i64 r = 0; r < rows; ++r) dst[at(k, r)] = to_packed<E>(s[r]);
        for (i64 r = rows; r < R; ++r) dst[at(k, r)] = E(0);
      }
    }
    for (i64 k = kc; k < kcp; ++k)
      for (i64 r = 0; r < R; ++r) dst[at(k, r)] = E(0);
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] into MR-row micro-panels (Note [GEMM packing]).
template <class Kr, class T>
void pack_a(const GemmArgs<T>& g, i64 i0, i64 mc, i64 k0, i64 kc, typename Kr::elem* dst) {
  const i64 kcp = round_up(kc, Kr::KP);
  for (i64 p = 0; p * Kr::MR < mc; ++p) {
    const i64 i = i0 + p * Kr::MR, rows = imin(Kr::MR, mc - p * Kr::MR);
    typename Kr::elem* d = dst + p * Kr::MR * kcp;
    if (g.ta == Trans::N)
      pack_panel<typename Kr::elem, Kr::MR, Kr::KP>(g.A + i * g.lda + k0, g.lda, 0, true, rows, kc, d);
    else
      pack_panel<typename Kr::elem, Kr::MR, Kr::KP>(g.A + k0 * g.lda + i, 0, g.lda, false, rows, kc, d);
  }
}

/// Packs B micro-panels [p0, p1) of op(B)[k0 : k0+kc, j0 : j0+nc] (Note [GEMM packing]); panel p goes to
/// dst + (p - p_base) * NR * kcp.
template <class Kr, class T>
void pack_b(const GemmArgs<T>& g, i64 j0, i64 nc, i64 k0, i64 kc, i64 p0, i64 p1, i64 p_base, typename Kr::elem* dst) {
  const i64 kcp = round_up(kc, Kr::KP);
  if (g.tb == Trans::T) {
    for (i64 p = p0; p < p1; ++p) {
      const i64 j = j0 + p * Kr::NR, cols = imin(Kr::NR, nc - p * Kr::NR);
      pack_panel<typename Kr::elem, Kr::NR, Kr::KP>(g.B + j * g.ldb + k0, g.ldb, 0, true, cols, kc,
                                                     dst + (p - p_base) * Kr::NR * kcp);
    }
    return;
  }
  // op(B) rows are contiguous: walk 16 rows at a time across all panels, so the source is read row by
  // row (sequential, prefetch-friendly) instead of one 64-byte piece per row per panel.
  constexpr i64 kStep = 16;  // a multiple of KP: only the last step can be odd (and is padded)
  for (i64 kb = 0; kb < kc; kb += kStep) {
    const i64 kn = imin(kStep, kc - kb);
    for (i64 p = p0; p < p1; ++p) {
      const i64 j = j0 + p * Kr::NR, cols = imin(Kr::NR, nc - p * Kr::NR);
      pack_panel<typename Kr::elem, Kr::NR, Kr::KP>(g.B + (k0 + kb) * g.ldb + j, 0, g.ldb, false, cols, kn,
                                                     dst + (p - p_base) * Kr::NR * kcp + kb * Kr::NR);
    }
  }
}

/// The source lines pack_b reads for B micro-panel p of op(B)[k0 : k0+kc, j0 : j0+nc] (Note [B source prefetch]).
template <class Kr, class T>
LineWalk b_panel_source(const GemmArgs<T>& g, i64 j0, i64 nc, i64 k0, i64 kc, i64 p) {
  const i64 j = j0 + p * Kr::NR, cols = imin(Kr::NR, nc - p * Kr::NR);
  const bool by_rows = g.tb == Trans::T;  // a source run is one column of op(B): kc contiguous elements
  const T* first = by_rows ? g.B + j * g.ldb + k0 : g.B + k0 * g.ldb + j;
  const i64 run_bytes = (by_rows ? kc : cols) * static_cast<i64>(sizeof(T));
  const std::uintptr_t start = reinterpret_cast<std::uintptr_t>(first);
  LineWalk w;
  w.row = reinterpret_cast<const char*>(start & ~std::uintptr_t{63});
  w.stride = g.ldb * static_cast<i64>(sizeof(T));
  // Runs start at different offsets within their first line unless the stride is a multiple of 64.
  w.per_row = ceil_div(static_cast<i64>(start & 63) + run_bytes, 64) + (w.stride % 64 != 0 ? 1 : 0);
  w.left = (by_rows ? cols : kc) * w.per_row;
  return w;
}

// ---- buffers ---------------------------------------------------------------------------------------------
/// A grow-only 64-byte-aligned buffer; one set per thread (OpenMP pool threads live as long as the process).
struct Buffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { std::free(p); }
  void* get(std::size_t n) {
    if (n > bytes) {
      std::free(p);
      bytes = static_cast<std::size_t>(round_up(static_cast<i64>(n), 4096));
      p = std::aligned_alloc(64, bytes);
      if (!p) {
        bytes = 0;
        throw std::bad_alloc();
      }
    }
    return p;
  }
};
enum BufferId { kBufA = 0, kBufB = 1, kBufW = 2, kBufPartial = 3 };
inline Buffer& thread_buffer(int id) {
  thread_local Buffer buffers[4];
  return buffers[id];
}

/// Called by every thread of a parallel region (it holds a barrier): records this thread's failure in the
/// shared `failed` and tells whether the whole team succeeded. Exceptions cannot leave a parallel region, so
/// allocation failures are caught, agreed on here, and re-thrown after the region.
inline bool team_ok(bool my_ok, bool& failed) {
  if (!my_ok) {
#pragma omp atomic write
    failed = true;
  }
#pragma omp barrier
  bool any_failed;
#pragma omp atomic read
  any_failed = failed;
  return !any_failed;
}

// ---- the loop nest ----------------------------------------------------------------------------------------
// Note [GEMM blocking and threads]
// Loops, outermost first (Goto & van de Geijn 2008, "Anatomy of high-performance matrix multiplication";
// the BLIS five-loop form):
//   m-chunk (only for 16-bit C with K > KC, see below)
//   jc over N by nc  ->  pc over K by kc: pack op(B) block [kc x nc] (shared by all threads, in L3)
//   ic over this thread's rows by mc: pack op(A) block [mc x kc] (private, in L2)
//   jr over this thread's B micro-panels (kc x NR, stays in L1)  ->  ir over the A micro-panels  -> kernel
// kc, mc, nc (Note [GEMM blocking from cache sizes]) are evened out over the dimension (so K = 768 with KC = 256 is 3 x 256,
// not 256+256+256+0) and rounded to KP / MR / NR. Threads form a tm x tn grid (tm * tn = threads): thread
// (r, s) computes rows part r (whole MR panels) x B micro-panels part s of every block, and packs B panels
// [t * pn / nt, (t+1) * pn / nt) of the shared block. The grid minimising the largest per-thread tile
// wins; within 5% of it, the fewest row parts. With tm = 1 (the usual case: GPT shapes on 2 threads are
// 1 x 2) a thread's packing range is exactly its compute range, so no barrier is needed at all; each
// thread packs all of A, which costs (threads-1)/(2N) of the flops, and packs each of its B panels lazily,
// right before the first A block of the K block uses it (Note [B source prefetch]). With tm > 1 (N too
// narrow to split) a barrier follows the cooperative B packing and another precedes the next block's packing.
// The kernel calls on one B panel prefetch the next one into L2 (its source while packing lazily, else the
// packed panel), a line every few k-groups (Note [B source prefetch]).
// Accumulation over the K blocks is in fp32: for fp32 C the partial sums live in C itself (block 0 applies
// the user's beta, later blocks beta = 1); for 16-bit C with more than one K block they live in an fp32
// workspace W [m-chunk x nc] per thread (m-chunk chosen so W stays near 4 MiB) and C is rounded once, in the last
// block, where the epilogue (bias, bf16 copy) is applied too.
// C is `C` (element type TC, leading dimension g.ldc), not g.C: the K split (run, below) has each thread
// compute an fp32 partial product of 16-bit operands.
/// The smallest KC that Note [one A block for few rows] lowers the blocking to.
inline constexpr i64 kMinOneBlockKc = 256;
template <class Kr, class T, class TC>
void run_into(const GemmArgs<T>& g, TC* const C, int threads) {
  using E = typename Kr::elem;
  constexpr int MR = Kr::MR, NR = Kr::NR, KP = Kr::KP;
  constexpr bool c_is_f32 = std::is_same_v<TC, float>;
  constexpr bool kDirectBf16 = std::is_same_v<TC, bf16> && Kr::kDirectBf16;
  const i64 M = g.M, N = g.N, K = g.K;

  // Note [GEMM blocking from cache sizes]
  // KC: the B micro-panel (KC x NR elements) takes Kr::kKcEighths / 8 of L1d (Kr::kKcFromL2 false: the panel
  // stays in L1 while the A panels stream past it) or of L2 (true: cores whose L2 streams a panel to the FMA
  // units as fast as L1 would; fewer K blocks then mean fewer passes over C and less per-block packing
  // overhead). MC: the packed A block (MC x KC) takes Kr::kMcEighths / 8 of L2. NC: Kr::NC (the shared B
  // block lives in L3). Except for few rows: KC is then lowered so that all of A's rows make one A block
  // (Note [one A block for few rows]). TG_GEMM_BLOCKING=kc,mc,nc replaces any of them (0 keeps the derived
  // value; a given kc or mc also turns that exception off). All three are then evened out over their
  // dimension.
  const GemmBlocking& bk = g.blocking;
  const i64 nc_cap = bk.nc > 0 ? round_up(bk.nc, NR) : Kr::NC;
  const i64 nnb = ceil_div(N, nc_cap);
  const i64 nc_nom = round_up(ceil_div(N, nnb), NR);
  const i64 pn_nom = nc_nom / NR;

  // Thread grid: the largest per-thread tile area decides; among grids within 5% of the best, the one
  // with the fewest row parts wins (with one row part every thread packs only the B panels it uses, so
  // no barrier is needed; the price, each thread packing all of A, is (threads-1)/(2N) of the flops).
  // Except when A has at least 2x the rows of B's block (the dW products: qkv 2304 x 256 and the LM head's
  // 50304 x 256 against 256 x 768): then every thread packing all of A costs more than sharing the B packing
  // (two barriers per K block), and the grid with the most row parts wins. The threshold was 4 until an A/B
  // (6 rounds, Zen 5, 2 threads) put qkv dW at 76.7 -> 78.8% (fp32) and 78.6 -> 79.8% (bf16) with 2; at 1
  // (square shapes, attn_proj dW) the row split measured no better.
  const i64 pm_all = ceil_div(M, MR), pn_all = ceil_div(imin(N, nc_nom), NR);
  const auto row_parts = [&](int nt) {
    i64 best = -1;
    for (int d = 1; d <= nt; ++d)
      if (nt % d == 0) {
        const i64 cost = ceil_div(pm_all, d) * ceil_div(pn_all, nt / d);
        if (best < 0 || cost < best) best = cost;
      }
    const auto near_best = [&](int d) { return nt % d == 0 && ceil_div(pm_all, d) * ceil_div(pn_all, nt / d) * 100 <= best * 105; };
    if (M >= 2 * imin(N, nc_nom)) {  // A dominates the packing: split its rows (see the comment above)
      for (int d = nt; d >= 1; --d)
        if (near_best(d)) return d;
    }
    for (int d = 1; d <= nt; ++d)
      if (near_best(d)) return d;
    return nt;
  };

  // Note [one A block for few rows]
  // With one row part (the usual grid for few rows) every thread packs all of A's rows, and with the KC
  // above a GPT-sized M (256 tokens) needs two A blocks per K block (fp32, K = 768: 256 x 768 x 4 bytes
  // against 6/8 of a 1 MiB L2). Each B panel is then used by both blocks, so every thread keeps all its
  // packed panels (megabytes, in L3: each packing store fetched its line from there) and reads them back
  // for the second block. With KC lowered until one A block holds all of M's rows in 7/16 of L2 (fp32 at
  // 264 rows: KC 432, so K = 768 is two blocks of 384), each panel is used by one block right after its
  // packing, in one slot that stays in L1 / L2 (`one_b_slot` below), and the A block, the panel and the
  // next panel's source fit in L2 together; MC is then all of M's rows. Kernels whose KC comes from L1
  // (AVX2) keep their A block to kMcEighths of L2. Not below KC = 256 (more K blocks mean more passes over C).
  // The rule looks at M alone, never at the thread count, so that each output's K order (and so its
  // rounding) is the same on any number of threads. A/B on a Zen 4 VM (2 threads, 6 alternated rounds,
  // GFLOP/s, the 15 GPT-2 products): fp32 median 188.9 -> 193.4 (12 of 15 faster, qkv fwd 188.2 -> 199.8),
  // bf16 398.6 -> 412.1 (13 of 15); with forced blockings at K = 3072, KC 384 / 512 / 640 measured
  // 194 / 188 / 185 (fp32), and KC 256 / 320 5-10% less than 384.
  const i64 kc_cache = Kr::kKcFromL2 ? bk.l2 : bk.l1d;
  i64 kc_cap = bk.kc > 0 ? round_up(bk.kc, KP)
                         : imax(16, kc_cache * Kr::kKcEighths / 8 / (NR * static_cast<i64>(sizeof(E))) / 16 * 16);
  i64 one_block_rows = 0;  // all of M's rows, when they make one A block
  if (bk.kc <= 0 && bk.mc <= 0) {  // M only, not the thread grid: the K blocking fixes each output's K order
    const i64 a_block_bytes = Kr::kKcFromL2 ? bk.l2 * 7 / 16 : bk.l2 * Kr::kMcEighths / 8;
    const i64 one_block_kc = a_block_bytes / (round_up(M, MR) * static_cast<i64>(sizeof(E))) / 16 * 16;
    if (one_block_kc >= kMinOneBlockKc) {
      kc_cap = imin(kc_cap, one_block_kc);
      one_block_rows = round_up(M, MR);
    }
  }
  const i64 nkb = ceil_div(K, kc_cap);
  const i64 kc_nom = round_up(ceil_div(K, nkb), KP);

  const bool use_w = !c_is_f32 && nkb > 1;
  const i64 mch_nom = use_w ? imax(static_cast<i64>(MR) * (threads < 1 ? 1 : threads),
                                   round_up((i64{1} << 20) / nc_nom, MR))
                            : M;
  const i64 kcp_nom = round_up(kc_nom, KP);
  const i64 mc_from_l2 = imax(MR, bk.l2 * Kr::kMcEighths / 8 / (kcp_nom * static_cast<i64>(sizeof(E))) / MR * MR);
  const i64 mc_max = bk.mc > 0 ? round_up(bk.mc, MR) : one_block_rows > 0 ? one_block_rows : mc_from_l2;

  // Sized for the shared block and for any private share (so thread 0 never regrows it inside the region).
  E* bbuf = static_cast<E*>(thread_buffer(kBufB).get(sizeof(E) * (pn_nom + 1) * NR * kcp_nom));
  const std::size_t w_bytes = use_w ? sizeof(float) * mch_nom * nc_nom : 0;
  const float* bias = g.ep.bias;
  std::uint16_t* o16 = reinterpret_cast<std::uint16_t*>(g.ep.out_bf16);

  // Thread t of a team of nt (tm x tn grid). Every thread runs the same m-chunk / jc / kb trip counts, so
  // all of them meet every barrier.
  // With one row part (tm = 1) every thread packs exactly the B panels it computes on, into its own
  // buffer: the threads then share nothing and need no barrier. (A shared buffer would not do: the panel
  // split differs between jc blocks of different widths, so a thread running ahead would overwrite a
  // panel its neighbour still reads.)
  const auto private_b_bytes = [&](int nt) { return sizeof(E) * (ceil_div(pn_nom, nt) + 1) * NR * kcp_nom; };
  const auto body = [&](int t, int nt) {
    const int tm = row_parts(nt), tn = nt / tm;
    const int tr = t / tn, ts = t % tn;
    E* abuf = static_cast<E*>(thread_buffer(kBufA).get(sizeof(E) * mc_max * kcp_nom));
    E* const b_own = tm == 1 ? static_cast<E*>(thread_buffer(kBufB).get(private_b_bytes(nt))) : bbuf;
    // W is private to each thread: threads are not synchronised between m-chunks or jc blocks, and the
    // column split changes with a narrower last jc block, so a thread running ahead into the next block
    // would otherwise overwrite partial sums its neighbour has not rounded into C yet.
    float* const wbuf = use_w ? static_cast<float*>(thread_buffer(kBufW).get(w_bytes)) : nullptr;
    alignas(64) float tile[MR * NR];
    for (i64 m_lo = 0; m_lo < M; m_lo += mch_nom) {
      const i64 mch = imin(mch_nom, M - m_lo), pm = ceil_div(mch, MR);
      const i64 r0 = m_lo + (tr * pm / tm) * MR, r1 = imin(m_lo + mch, m_lo + ((tr + 1) * pm / tm) * MR);
      // This thread's rows in ceil(rows / MC) even blocks of whole MR panels.
      const i64 my_rows = imax(r1 - r0, 0);
      const i64 mc_nom = my_rows ? imin(mc_max, round_up(ceil_div(my_rows, ceil_div(my_rows, mc_max)), MR)) : MR;
      // With one row part and one A block, a packed B panel is used by that block alone, right after it is
      // packed: every panel then goes to the same slot, whose lines stay in L1 / L2, instead of a slot of
      // its own in a buffer of all the thread's panels (megabytes, whose lines each store fetched from L3).
      const bool one_b_slot = tm == 1 && my_rows <= mc_nom;
      for (i64 jc = 0; jc < N; jc += nc_nom) {
        const i64 nc = imin(nc_nom, N - jc), pn = ceil_div(nc, NR);
        const i64 q0 = ts * pn / tn, q1 = (ts + 1) * pn / tn;
        for (i64 kb = 0; kb < nkb; ++kb) {
          const i64 k0 = kb * kc_nom, kc = imin(kc_nom, K - k0), kcp = round_up(kc, KP);
          const bool first = kb == 0, last = kb == nkb - 1;
          const float beta_k = first ? g.beta : 1.f;
          if (tm > 1) {  // B panels packed by one thread are used by others
            pack_b<Kr>(g, jc, nc, k0, kc, t * pn / nt, (t + 1) * pn / nt, 0, bbuf);
#pragma omp barrier
          }
          for (i64 ic = r0; ic < r1; ic += mc_nom) {
            const i64 mc = imin(mc_nom, r1 - ic);
            // With one row part, each B panel is packed right before the first A block uses it (lazily):
            // its source was prefetched into L2 while the previous panel ran (Note [B source prefetch]).
            const bool pack_b_now = tm == 1 && ic == r0;
            pack_a<Kr>(g, ic, mc, k0, kc, abuf);
            for (i64 q = q0; q < q1; ++q) {
              const i64 j = jc + q * NR, nr = imin(NR, N - j);
              if (pack_b_now) pack_b<Kr>(g, jc, nc, k0, kc, q, q + 1, one_b_slot ? q : q0, b_own);
              const E* bp = tm == 1 ? b_own + (one_b_slot ? 0 : q - q0) * NR * kcp : bbuf + q * NR * kcp;
              const float* bias_j = (last && bias) ? bias + j : nullptr;
              // What the kernel calls on this panel prefetch into L2: the next panel's source (lazy
              // packing) or the next packed panel (from L3).
              LineWalk walk{};
              if (q + 1 < q1) {
                if (pack_b_now) {
                  walk = b_panel_source<Kr>(g, jc, nc, k0, kc, q + 1);
                } else {
                  walk.row = reinterpret_cast<const char*>(bp + NR * kcp);
                  walk.per_row = walk.left = NR * kcp * static_cast<i64>(sizeof(E)) / 64;
                }
              }
              const i64 a_panels = ceil_div(mc, MR);
              for (i64 ip = 0; ip * MR < mc; ++ip) {
                // This call's share of the walk; calls on an edge or epilogue tile take it as a burst.
                const i64 quota = ceil_div(walk.left, a_panels - ip);
                const i64 i = ic + ip * MR, mr = imin(MR, mc - ip * MR);
                const E* ap = abuf + ip * MR * kcp;
                const bool full = mr == MR && nr == NR;
                std::uint16_t* o16_ij = (last && o16) ? o16 + i * g.ep.ldo + j : nullptr;
                TC* cij = C + i * g.ldc + j;
                if constexpr (c_is_f32) {
                  if (full && !o16_ij) {  // straight from the registers, with the bias when this is the last K block
                    Kr::micro(kcp / KP, ap, bp, cij, g.ldc, g.alpha, beta_k, true, &walk, quota, bias_j);
                  } else {
                    walk_lines(walk, quota);
                    Kr::micro_short(static_cast<int>(mr), kcp / KP, ap, bp, tile);
                    const float* prev = (first && g.beta == 0.f) ? nullptr : cij;
                    write_tile(tile, NR, mr, nr, g.alpha, beta_k, prev, g.ldc, cij, g.ldc, bias_j, o16_ij, g.ep.ldo);
                  }
                } else if (!use_w) {  // one K block: C (16-bit) read with beta, rounded once
                  if constexpr (kDirectBf16) {
                    if (full && g.beta == 0.f && !o16_ij) {
                      Kr::micro_bf16(kcp / KP, ap, bp, reinterpret_cast<std::uint16_t*>(cij), g.ldc, g.alpha, nullptr,
                                     0, bias_j, &walk, quota);
                      continue;
                    }
                  }
                  walk_lines(walk, quota);
                  Kr::micro_short(static_cast<int>(mr), kcp / KP, ap, bp, tile);
                  const TC* prev = g.beta == 0.f ? nullptr : cij;
                  write_tile(tile, NR, mr, nr, g.alpha, g.beta, prev, g.ldc, cij, g.ldc, bias_j, o16_ij, g.ep.ldo);
                } else {  // fp32 partial sums in W; C rounded once, in the last K block
                  float* wij = wbuf + (i - m_lo) * nc_nom + (j - jc);
                  if (full && !last && (!first || g.beta == 0.f)) {  // W = alpha * acc (+ W)
                    Kr::micro(kcp / KP, ap, bp, wij, nc_nom, g.alpha, first ? 0.f : 1.f, true, &walk, quota);
                    continue;
                  }
                  if constexpr (kDirectBf16) {
                    if (full && last && !o16_ij) {  // C = bf16(alpha * acc + W (+ bias))
                      Kr::micro_bf16(kcp / KP, ap, bp, reinterpret_cast<std::uint16_t*>(cij), g.ldc, g.alpha, wij,
                                     nc_nom, bias_j, &walk, quota);
                      continue;
                    }
                  }
                  walk_lines(walk, quota);
                  Kr::micro_short(static_cast<int>(mr), kcp / KP, ap, bp, tile);
                  if (first) {
                    const TC* prev = g.beta == 0.f ? nullptr : cij;
                    write_tile(tile, NR, mr, nr, g.alpha, g.beta, prev, g.ldc, wij, nc_nom, nullptr, nullptr, 0);
                  } else if (!last) {
                    write_tile(tile, NR, mr, nr, g.alpha, 1.f, wij, nc_nom, wij, nc_nom, nullptr, nullptr, 0);
                  } else {
                    write_tile(tile, NR, mr, nr, g.alpha, 1.f, wij, nc_nom, cij, g.ldc, bias_j, o16_ij, g.ep.ldo);
                  }
                }
              }
            }
          }
          if (tm > 1) {  // B panels packed by one thread are used by others
#pragma omp barrier
          }
        }
      }
    }
  };

  if (threads <= 1) {
    body(0, 1);
    return;
  }
  // The team can be smaller than asked (OMP_DYNAMIC, thread limits); the grid follows the actual team.
  // Exceptions cannot leave a parallel region: only std::bad_alloc can be thrown here, and the A buffer
  // is grown (and may throw) before any barrier, so a failure is caught and re-thrown after the region.
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    bool ok = true;
    try {
      (void)thread_buffer(kBufA).get(sizeof(E) * mc_max * kcp_nom);
      if (use_w) (void)thread_buffer(kBufW).get(w_bytes);
      const int team = omp_get_num_threads();
      if (row_parts(team) == 1 && omp_get_thread_num() != 0) (void)thread_buffer(kBufB).get(private_b_bytes(team));
    } catch (...) {
      ok = false;
    }
    if (team_ok(ok, failed)) body(omp_get_thread_num(), omp_get_num_threads());
  }
  if (failed) throw std::bad_alloc();
}

// Note [GEMM K split]
// When K dwarfs both M and N (the LM head's dX = dY W: K = 50304 against 256 x 768), splitting C between
// the threads makes every thread pack (and read from memory) all of A or all of B for a small share of C.
// Instead each thread takes a contiguous share of K: it computes the fp32 partial product of its K range
// for the whole M x N into a private buffer (one thread each, no synchronisation), and after one barrier
// the threads sum the partials row by row into C, applying beta, the bias and the bf16 copy there (C is
// rounded once). Each operand is then read and packed once in all, at the price of M x N x threads fp32
// partials (capped at kKSplitMaxPartialBytes per thread) and one pass over them. The summation order of
// each output depends on the team size, like any change of the K blocking.
// The split needs K >= 4 max(M, N) by default (TG_GEMM_KSPLIT_RATIO), which takes the K = 3072 products
// (fc_proj fwd, fc dX) and the LM head's dX (ratio 65). The ratio was 8 for a while: once B's source was
// prefetched inside the kernel (Note [B source prefetch]) the C split ran the K = 3072 products faster
// (6 rounds, Zen 5: fc dX 76.4 -> 79.3% fp32, 78.1 -> 79.9% bf16; fc_proj fwd 75.6 -> 76.8 / 76.2 -> 80.7).
// With one A block per K block (Note [one A block for few rows]) the K split is ahead again, as it halves
// each thread's A packing: 16 alternated rounds on a Zen 4 VM, GFLOP/s, ratio 8 / 4: fp32 fc dX 194.6 /
// 196.4, fc_proj fwd 180.8 / 190.9; bf16 377.3 / 387.9 and 388.7 / 390.1 (two earlier 8-round A/Bs
// likewise: 4 ahead on all four, by 0.4-7%).
// Products under kKSplitMinFlops never split K: a team takes products from 1 MFLOP on (gemm_threads), and a split
// there would make a small model's results depend on the team size, which adapt_threads changes under load
// (Note [threads under contention]); the products that split K are the large ones they were before.
inline constexpr i64 kKSplitMaxPartialBytes = i64{8} << 20;
inline constexpr int kKSplitMaxThreads = 64;
inline constexpr double kKSplitMinFlops = 4.0e6;
inline bool k_split_pays(const GemmBlocking& bk, i64 M, i64 N, i64 K, int threads) {
  return threads > 1 && threads <= kKSplitMaxThreads && bk.k_split_ratio > 0 && K >= bk.k_split_ratio * imax(M, N) &&
         M * N * static_cast<i64>(sizeof(float)) <= kKSplitMaxPartialBytes && K >= 64 * threads &&
         2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) >= kKSplitMinFlops;
}

template <class Kr, class T>
void run(const GemmArgs<T>& g, int threads) {
  if (!k_split_pays(g.blocking, g.M, g.N, g.K, threads)) return run_into<Kr, T, T>(g, g.C, threads);
  const i64 M = g.M, N = g.N, K = g.K;
  float* partials[kKSplitMaxThreads] = {};
  bool failed = false;
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    bool ok = true;
    try {
      float* const partial = static_cast<float*>(thread_buffer(kBufPartial).get(sizeof(float) * M * N));
      partials[t] = partial;
      // This thread's K range, in multiples of 16 (so of KP): [k_lo, k_hi).
      const i64 k_lo = imin(K, round_up(K * t / nt, 16)), k_hi = t + 1 == nt ? K : imin(K, round_up(K * (t + 1) / nt, 16));
      if (k_hi > k_lo) {
        GemmArgs<T> part = g;
        part.K = k_hi - k_lo;
        part.A = g.ta == Trans::N ? g.A + k_lo : g.A + k_lo * g.lda;
        part.B = g.tb == Trans::N ? g.B + k_lo * g.ldb : g.B + k_lo;
        part.beta = 0.f;
        part.C = nullptr;
        part.ldc = N;
        part.ep = GemmEpilogue{};
        run_into<Kr, T, float>(part, partial, 1);
      } else {
        std::memset(partial, 0, sizeof(float) * M * N);
      }
    } catch (...) {
      ok = false;
    }
    if (team_ok(ok, failed)) {
      // Sum this thread's rows of all partials into partial 0, then write them to C like an edge tile.
      const i64 r0 = M * t / nt, r1 = M * (t + 1) / nt, n = (r1 - r0) * N;
      if (n > 0) {
        float* const sum = partials[0] + r0 * N;
        for (int u = 1; u < nt; ++u) {
          const float* const q = partials[u] + r0 * N;
          for (i64 e = 0; e < n; ++e) sum[e] += q[e];
        }
        std::uint16_t* const o16 = reinterpret_cast<std::uint16_t*>(g.ep.out_bf16);
        T* const c = g.C + r0 * g.ldc;
        write_tile(sum, static_cast<int>(N), r1 - r0, N, 1.f, g.beta, g.beta == 0.f ? nullptr : c, g.ldc, c, g.ldc,
                   g.ep.bias, o16 ? o16 + r0 * g.ep.ldo : nullptr, g.ep.ldo);
      }
    }
  }
  if (failed) throw std::bad_alloc();
}

}  // namespace tg::backend::cpu::packed::TG_GEMM_ISA

#endif  // TG_GEMM_ISA

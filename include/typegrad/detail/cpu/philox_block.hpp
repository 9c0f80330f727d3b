// The dropout keep rule over a run of consecutive Philox counters, 16 counters per AVX-512 vector where the
// build has AVX-512 (Note [dropout masks in vectors]). A private helper of the CPU backend (unary.cpp,
// dropout_add.cpp).
#pragma once

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TG_PHILOX_AVX512 1
#include <immintrin.h>
#endif

#include "typegrad/core/random.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cpu {

// Note [dropout masks in vectors]
// Dropout keeps element i iff uniform_from_bits(philox_words(seed, offset + i)[0]) >= p (Note [dropout replays
// its mask]): one Philox4x32-10 block per element, which took 29% of a CPU training step with dropout 0.1
// (bench_fusion --step block --width 64, perf, 2026-12-06). dropout_keep_block computes the keep bits of up to
// kDropoutBlock consecutive counters. With AVX-512 it runs 16 counters per vector, two vectors at a time: the
// counter's low word is the lane's (with the carry into the high word where it wraps), each round's two 32x32->64
// products come from vpmuludq on the even and the odd lanes (the high and low halves blended back), and the
// uniform is (w >> 8) converted exactly and scaled by 2^-24, the scalar formula's. The integer arithmetic is
// Philox's own, so the bits equal the scalar definition's (and the GPU's) for every counter, the carry
// included (OpDb_dropout_behaviour.MaskIsTheDefinitionOverBlocksAndTheCarry). 1.9x the scalar loop on the
// Zen 4 VM (zmm multiplies are double-pumped there); the tail runs the scalar definition.
inline constexpr int kDropoutBlock = 256;

#if defined(TG_PHILOX_AVX512)
namespace detail_philox {
struct Products {
  __m512i lo, hi;
};
/// The low and high words of a·k per 32-bit lane.
inline Products mul_wide(__m512i a, __m512i k) {
  const __m512i even = _mm512_mul_epu32(a, k), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), k);
  return {_mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32)),
          _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd)};
}
/// The first output word of Philox4x32-10 for the 16·V counters index0 + [0, 16·V).
template <int V>
inline void first_words(std::uint64_t seed, std::uint64_t index0, __m512i (&w)[V]) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(0xD2511F53u)), m1 = _mm512_set1_epi32(static_cast<int>(0xCD9E8D57u));
  __m512i c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    const std::uint64_t base = index0 + static_cast<std::uint64_t>(16 * v);
    const __m512i lo = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(base)));
    const __m512i hi = _mm512_set1_epi32(static_cast<int>(static_cast<std::uint32_t>(base >> 32)));
    c0[v] = _mm512_add_epi32(lo, lane);
    c1[v] = _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(c0[v], lo), hi, _mm512_set1_epi32(1));  // the carry
    c2[v] = c3[v] = _mm512_setzero_si512();
  }
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const __m512i key0 = _mm512_set1_epi32(static_cast<int>(k0)), key1 = _mm512_set1_epi32(static_cast<int>(k1));
    for (int v = 0; v < V; ++v) {
      const Products p0 = mul_wide(c0[v], m0), p1 = mul_wide(c2[v], m1);
      c0[v] = _mm512_ternarylogic_epi32(p1.hi, c1[v], key0, 0x96);  // hi(p1) ^ c1 ^ key0
      c2[v] = _mm512_ternarylogic_epi32(p0.hi, c3[v], key1, 0x96);  // hi(p0) ^ c3 ^ key1
      c1[v] = p1.lo;
      c3[v] = p0.lo;
    }
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  for (int v = 0; v < V; ++v) w[v] = c0[v];
}
/// uniform_from_bits(w) >= p per lane: (w >> 8) is below 2^24, so its conversion and the scaling are exact.
inline __mmask16 keep_lanes(__m512i w, __m512 p) {
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 8)), _mm512_set1_ps(5.9604644775390625e-8f));
  return _mm512_cmp_ps_mask(u, p, _CMP_GE_OQ);
}
}  // namespace detail_philox
#endif

/// keep[i] = whether dropout keeps the element of counter index0 + i, for i in [0, n), n <= kDropoutBlock.
inline void dropout_keep_block(std::uint64_t seed, std::uint64_t index0, int n, float p, bool* keep) {
  int i = 0;
#if defined(TG_PHILOX_AVX512)
  const __m512 pv = _mm512_set1_ps(p);
  for (; i + 32 <= n; i += 32) {
    __m512i w[2];
    detail_philox::first_words<2>(seed, index0 + static_cast<std::uint64_t>(i), w);
    for (int v = 0; v < 2; ++v) {
      const __mmask16 m = detail_philox::keep_lanes(w[v], pv);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + i + 16 * v), _mm_maskz_set1_epi8(m, 1));
    }
  }
#endif
  for (; i < n; ++i)
    keep[i] = math::dropout_keep(tg::detail::uniform_from_bits(tg::detail::philox_words(seed, index0 + static_cast<std::uint64_t>(i))[0]), p);
}

}  // namespace tg::backend::cpu

// The dropout keep rule over a run of consecutive elements, four per Philox counter, 16 counters per AVX-512
// vector or 8 per AVX2 vector where the build has them (Note [dropout masks in vectors]). A private helper of
// the CPU backend (unary.cpp, dropout_add.cpp).
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define TG_PHILOX_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__)
#define TG_PHILOX_AVX2 1
#include <immintrin.h>
#endif

#include "typegrad/core/random.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cpu {

// Note [dropout masks in vectors]
// Dropout keeps element i of a mask at word position P iff uniform_from_bits(w) >= p, w being word (P + i) % 4 of
// philox_words(seed, (P + i) / 4) (Note [dropout replays its mask]): one Philox4x32-10 block gives four
// elements. (Until 2026-12-07 each element took a block of its own and read its first word only; its Philox
// blocks were 29% of a CPU training step with dropout 0.1 on the Zen 4 VM, bench_fusion --step block --width 64,
// perf, 2026-12-06, and 19% on an AVX2-only EPYC, which ran them one scalar block at a time.)
// dropout_keep_block computes the keep flags of n consecutive word positions. Where the build has AVX-512 it runs 16
// counters per vector (64 elements), two vectors at a time; with AVX2, 8 counters per vector (32 elements). The
// counter's low word is the lane's (with the carry into the high word where it wraps), each round's two
// 32x32->64 products come from the unsigned even-lane multiply on the even and the odd lanes (the high and low
// halves blended back), and the uniform is (w >> 8) converted exactly and scaled by 2^-24, the scalar formula's.
// The four words' keep flags come out word-major (lane by lane for word 0, then word 1, ...) and a 4 x 4 byte
// transpose puts them in element order. The integer arithmetic is Philox's own, so the bits equal the scalar
// definition's (and the GPU's) for every counter, the carry included
// (OpDb_dropout_behaviour.MaskIsTheDefinitionOverBlocksAndTheCarry). A run that starts inside a counter (a
// position not a multiple of 4) and the tail run the scalar definition.
// The rounds are written once (detail_philox::philox_words<L, V>) over the ISA's lane set L (Avx512Lanes,
// Avx2Lanes: its vector of 32-bit lanes, the carry, the wide products). test_philox_scalar, test_philox_avx2 and
// test_philox_avx512 (tests/cpu/test_philox_block.cpp) compile this header at each level and check it against the
// definition, so one AVX-512 machine runs all three paths.
inline constexpr int kDropoutBlock = 256;

#if defined(TG_PHILOX_AVX512) || defined(TG_PHILOX_AVX2)
namespace detail_philox {
inline constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u, kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
/// The 4 x 4 byte transpose inside each 16 bytes: byte 4·j + l goes to 4·l + j.
inline __m128i transpose4x4_bytes(__m128i v) {
  return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
}
inline int as_int(std::uint32_t u) { return static_cast<int>(u); }

/// The four output words of Philox4x32-10 for the L::kLanes·V counters counter0 + [0, L::kLanes·V): w[v][j] is
/// word j. L is the ISA's lane set (Avx512Lanes, Avx2Lanes below): its 32-bit lanes, the counters' low words
/// with the carry into the high word, and the 32x32 -> 64 products.
template <class L, int V>
inline void philox_words(std::uint64_t seed, std::uint64_t counter0, typename L::Vec (&w)[V][4]) {
  using Vec = typename L::Vec;
  const Vec m0 = L::set1(kMul0), m1 = L::set1(kMul1);
  Vec c0[V], c1[V], c2[V], c3[V];
  for (int v = 0; v < V; ++v) {
    const std::uint64_t base = counter0 + static_cast<std::uint64_t>(L::kLanes * v);
    const Vec lo = L::set1(static_cast<std::uint32_t>(base)), hi = L::set1(static_cast<std::uint32_t>(base >> 32));
    c0[v] = L::add(lo, L::lane_ids());
    c1[v] = L::add_carry(hi, lo, c0[v]);
    c2[v] = c3[v] = L::zero();
  }
  std::uint32_t k0 = static_cast<std::uint32_t>(seed), k1 = static_cast<std::uint32_t>(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    const Vec key0 = L::set1(k0), key1 = L::set1(k1);
    for (int v = 0; v < V; ++v) {
      const typename L::Products p0 = L::mul_wide(c0[v], m0), p1 = L::mul_wide(c2[v], m1);
      c0[v] = L::xor3(p1.hi, c1[v], key0);
      c2[v] = L::xor3(p0.hi, c3[v], key1);
      c1[v] = p1.lo;
      c3[v] = p0.lo;
    }
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  for (int v = 0; v < V; ++v) {
    w[v][0] = c0[v];
    w[v][1] = c1[v];
    w[v][2] = c2[v];
    w[v][3] = c3[v];
  }
}
}  // namespace detail_philox
#endif

#if defined(TG_PHILOX_AVX512)
namespace detail_philox {
struct Avx512Lanes {
  using Vec = __m512i;
  static constexpr int kLanes = 16;
  struct Products {
    Vec lo, hi;
  };
  static Vec set1(std::uint32_t u) { return _mm512_set1_epi32(as_int(u)); }
  static Vec zero() { return _mm512_setzero_si512(); }
  static Vec lane_ids() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static Vec add(Vec a, Vec b) { return _mm512_add_epi32(a, b); }
  /// hi + 1 in the lanes where lo + lane wrapped (sum < lo unsigned), hi elsewhere.
  static Vec add_carry(Vec hi, Vec lo, Vec sum) {
    return _mm512_mask_add_epi32(hi, _mm512_cmplt_epu32_mask(sum, lo), hi, _mm512_set1_epi32(1));
  }
  /// The low and high words of a·k per 32-bit lane.
  static Products mul_wide(Vec a, Vec k) {
    const Vec even = _mm512_mul_epu32(a, k), odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), k);
    return {_mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32)),
            _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd)};
  }
  static Vec xor3(Vec a, Vec b, Vec c) { return _mm512_ternarylogic_epi32(a, b, c, 0x96); }
};
/// uniform_from_bits(w) >= p per lane: (w >> 8) is below 2^24, so its conversion and the scaling are exact.
inline __mmask16 keep_lanes(__m512i w, __m512 p) {
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(w, 8)), _mm512_set1_ps(5.9604644775390625e-8f));
  return _mm512_cmp_ps_mask(u, p, _CMP_GE_OQ);
}
/// The keep flags (0 or 1) of the 64 elements of 16 counters' words w[0..3], in element order.
inline void store_keep(const __m512i (&w)[4], __m512 p, bool* keep) {
  __m128i b[4];  // b[j]: word j's flag per lane
  for (int j = 0; j < 4; ++j) b[j] = _mm_maskz_set1_epi8(keep_lanes(w[j], p), 1);
  // 4 x 16 -> 16 x 4: bytes (lane l, word j) to 4·l + j.
  const __m128i t0 = _mm_unpacklo_epi8(b[0], b[1]), t1 = _mm_unpackhi_epi8(b[0], b[1]);
  const __m128i t2 = _mm_unpacklo_epi8(b[2], b[3]), t3 = _mm_unpackhi_epi8(b[2], b[3]);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep), _mm_unpacklo_epi16(t0, t2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + 16), _mm_unpackhi_epi16(t0, t2));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + 32), _mm_unpacklo_epi16(t1, t3));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + 48), _mm_unpackhi_epi16(t1, t3));
}
using Lanes = Avx512Lanes;
inline __m512 splat(float p) { return _mm512_set1_ps(p); }
}  // namespace detail_philox
#elif defined(TG_PHILOX_AVX2)
namespace detail_philox {
struct Avx2Lanes {
  using Vec = __m256i;
  static constexpr int kLanes = 8;
  struct Products {
    Vec lo, hi;
  };
  static Vec set1(std::uint32_t u) { return _mm256_set1_epi32(as_int(u)); }
  static Vec zero() { return _mm256_setzero_si256(); }
  static Vec lane_ids() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static Vec add(Vec a, Vec b) { return _mm256_add_epi32(a, b); }
  /// hi + 1 in the lanes where lo + lane wrapped: sum < lo unsigned, compared as signed after flipping the sign
  /// bits (-1 where it wrapped, subtracted).
  static Vec add_carry(Vec hi, Vec lo, Vec sum) {
    const Vec sign = set1(0x80000000u);
    return _mm256_sub_epi32(hi, _mm256_cmpgt_epi32(_mm256_xor_si256(lo, sign), _mm256_xor_si256(sum, sign)));
  }
  /// The low and high words of a·k per 32-bit lane.
  static Products mul_wide(Vec a, Vec k) {
    const Vec even = _mm256_mul_epu32(a, k), odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), k);
    return {_mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA),
            _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA)};
  }
  static Vec xor3(Vec a, Vec b, Vec c) { return _mm256_xor_si256(_mm256_xor_si256(a, b), c); }
};
/// uniform_from_bits(w) >= p per lane as 0 / -1: (w >> 8) is below 2^24, so its conversion and the scaling are exact.
inline __m256i keep_lanes(__m256i w, __m256 p) {
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(w, 8)), _mm256_set1_ps(5.9604644775390625e-8f));
  return _mm256_castps_si256(_mm256_cmp_ps(u, p, _CMP_GE_OQ));
}
/// The keep flags (0 or 1) of the 32 elements of 8 counters' words w[0..3], in element order.
inline void store_keep(const __m256i (&w)[4], __m256 p, bool* keep) {
  // Packing narrows within each 128-bit half: the low half holds lanes 0-3 as bytes 4·j + l, the high half
  // lanes 4-7 likewise; the transpose makes each half 4·l + j.
  const __m256i w01 = _mm256_packs_epi32(keep_lanes(w[0], p), keep_lanes(w[1], p));
  const __m256i w23 = _mm256_packs_epi32(keep_lanes(w[2], p), keep_lanes(w[3], p));
  const __m256i bytes = _mm256_and_si256(_mm256_packs_epi16(w01, w23), _mm256_set1_epi8(1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep), transpose4x4_bytes(_mm256_castsi256_si128(bytes)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(keep + 16), transpose4x4_bytes(_mm256_extracti128_si256(bytes, 1)));
}
using Lanes = Avx2Lanes;
inline __m256 splat(float p) { return _mm256_set1_ps(p); }
}  // namespace detail_philox
#endif

/// keep[i] = whether dropout keeps the element of word position `position` + i (Note [dropout replays its
/// mask]: element i of a mask at position p reads word p + i), for i in [0, n), n <= kDropoutBlock.
inline void dropout_keep_block(std::uint64_t seed, std::uint64_t position, int n, float p, bool* keep) {
  int i = 0;
#if defined(TG_PHILOX_AVX512) || defined(TG_PHILOX_AVX2)
  // The scalar definition up to the next counter's first word, then whole counters in vectors.
  for (const int head = std::min<int>(n, static_cast<int>((4 - position % 4) % 4)); i < head; ++i)
    keep[i] = math::dropout_keep(tg::detail::dropout_uniform(seed, position + static_cast<std::uint64_t>(i)), p);
  using L = detail_philox::Lanes;
  constexpr int kElems = 4 * L::kLanes;  // the elements of one vector of counters
  const auto pv = detail_philox::splat(p);
  for (; i + 2 * kElems <= n; i += 2 * kElems) {
    L::Vec w[2][4];
    detail_philox::philox_words<L, 2>(seed, (position + static_cast<std::uint64_t>(i)) / 4, w);
    detail_philox::store_keep(w[0], pv, keep + i);
    detail_philox::store_keep(w[1], pv, keep + i + kElems);
  }
  for (; i + kElems <= n; i += kElems) {
    L::Vec w[1][4];
    detail_philox::philox_words<L, 1>(seed, (position + static_cast<std::uint64_t>(i)) / 4, w);
    detail_philox::store_keep(w[0], pv, keep + i);
  }
#endif
  // The rest: one Philox block per four words.
  while (i < n) {
    const std::uint64_t at = position + static_cast<std::uint64_t>(i);
    const auto w = tg::detail::philox_words(seed, at / 4);
    for (auto j = at % 4; j < 4 && i < n; ++j, ++i) keep[i] = math::dropout_keep(tg::detail::uniform_from_bits(w[j]), p);
  }
}

}  // namespace tg::backend::cpu

// AVX-512 VNNI int8 tiles: vpdpbusd on (A + 128) x B, 12 rows x 32 columns of int32 sums in 24 zmm; the
// B packing of the weights layout (16 x 16 transposes of k-quads). Compiled with -mavx512vnni (and F/BW/VL/DQ).
//   int8::tile_vnni(kq, a_panel, 0, b_panel, rows, cols, io);   // Note [int8 tile write-back]
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_int8_kernels.hpp"

// Note [GEMM ISA translation units] (gemm_packed.hpp) applies: everything here is in an anonymous namespace
// or a plain function of the int8 interface, and nothing calls an inline function of another header.

namespace tg::backend::cpu::int8 {
namespace {

// Note [VNNI int8 tile]
// vpdpbusd (_mm512_dpbusd_epi32(acc, u, s)) treats each 32-bit lane as 4 bytes, unsigned in u and signed in s,
// and adds the 4 products to the lane's int32, exactly (no saturation; the int32 add wraps). With B packed in
// k-quads (Note [int8 packed layout]) lane l of the panel's vector v at k-quad q is op(B)(4q .. 4q+3, 16v + l),
// and broadcasting row r's quad (A(r, 4q .. 4q+3) + 128, as 4 uint8) gives
//     acc[r][v][l] += Σ_{t<4} (A(r, 4q+t) + 128) · B(4q+t, 16v+l).
// Over all k-quads acc = Σ_k A·B + 128 · Σ_k B(k, n): the write-back subtracts corr[n] = 128 · colsum(n). Every
// quantity fits int32 for K <= kInt8MaxK (|acc| <= K · 255 · 128 < 2^31), and the wrap-around adds make the
// result exact even where an intermediate would not. Per k-quad: 2 B loads, 12 broadcasts, 24 vpdpbusd into
// 24 independent accumulators, 27 of the 32 zmm. Zen 4 issues one zmm vpdpbusd per cycle, as many as
// vdpbf16ps (measured: 3.67 G/s each on one core), so int8 does 64 MACs where bf16 does 32. A tile of fewer
// rows (the last panel of M) runs the same loop on the first `rows` rows of the full-height panel; columns
// past `cols` are computed (B is zero there) and masked off at the write-back.
// The K loop starts from zero in its own always-inline function (as gemm_packed.hpp's accumulate), and the
// earlier K blocks' sums are added after it. A first version, which loaded them into the accumulators before
// the loop in the same function, compiled (GCC 12) to a stack store after every vpdpbusd and ran the GPT-2
// products at 56% of the vpdpbusd peak; this form keeps all 24 in registers and runs them at ~90%.

using u32 = std::uint32_t;

__mmask16 lane_mask(int n) { return n >= 16 ? __mmask16(0xffff) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1u); }

/// One k-quad: acc[r][v] += (A(r, quad) + 128) · B(quad, 16v ..) for the MR rows.
template <int MR>
inline __attribute__((always_inline)) void step(const std::uint8_t* a, const std::int8_t* b, __m512i (&acc)[MR][2]) {
  const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    u32 quad;
    std::memcpy(&quad, a + 4 * r, 4);
    const __m512i av = _mm512_set1_epi32(static_cast<int>(quad));
    acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], av, b0);
    acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], av, b1);
  }
}

/// acc[r][v] = Σ over kq k-quads of the products above (the K loop, all in registers), prefetching io's lines
/// two per k-quad in the first iterations (Note [int8 B prefetch]).
template <int MR>
inline __attribute__((always_inline)) void accumulate(i64 kq, const std::uint8_t* a, const std::int8_t* b,
                                                      __m512i (&acc)[MR][2], const TileIo& io) {
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  i64 left = io.pf_count, col = io.pf_col;
  const char* row = io.pf_row;
  i64 q = 0;
  for (; q < kq && left > 0; ++q) {
    for (int t = 0; t < 2 && left > 0; ++t, --left) {
      _mm_prefetch(row + 64 * col, _MM_HINT_T1);
      if (++col == io.pf_per_row) {
        col = 0;
        row += io.pf_stride;
      }
    }
    step<MR>(a, b, acc);
    a += kMR * 4;
    b += kNR * 4;
  }
#pragma GCC unroll 2
  for (; q < kq; ++q) {
    step<MR>(a, b, acc);
    a += kMR * 4;
    b += kNR * 4;
  }
}

template <int MR>
__attribute__((noinline)) void tile_rows(i64 kq, const std::uint8_t* a, const std::int8_t* b, int cols,
                                         const TileIo& io) {
  const __mmask16 m[2] = {lane_mask(cols), lane_mask(cols - 16)};
  // The output rows' lines, fetched for writing while the K loop runs: the LM head writes 51 MB of fp32 per
  // product, and its tiles waited on those store misses at the write-back (Note [int8 B prefetch]).
  {
    char* out = io.mode == TileIo::Mode::carry   ? reinterpret_cast<char*>(io.carry_out)
                : io.mode == TileIo::Mode::int32 ? reinterpret_cast<char*>(io.c)
                                                 : reinterpret_cast<char*>(io.y);
    const i64 ld = 4 * (io.mode == TileIo::Mode::carry ? io.ldw : io.mode == TileIo::Mode::int32 ? io.ldc : io.ldy);
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r) {
      __builtin_prefetch(out + r * ld, 1, 3);
      __builtin_prefetch(out + r * ld + 64, 1, 3);
      __builtin_prefetch(out + r * ld + 127, 1, 3);
    }
  }
  __m512i acc[MR][2];
  accumulate<MR>(kq, a, b, acc, io);
  if (io.carry_in) {  // the sums of the earlier K blocks
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v)
        acc[r][v] = _mm512_add_epi32(acc[r][v], _mm512_maskz_loadu_epi32(m[v], io.carry_in + r * io.ldw + 16 * v));
  }
  // Write-back, Note [int8 tile write-back].
  if (io.mode == TileIo::Mode::carry) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) _mm512_mask_storeu_epi32(io.carry_out + r * io.ldw + 16 * v, m[v], acc[r][v]);
    return;
  }
  __m512i corr[2];
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v)
    corr[v] = io.corr ? _mm512_maskz_loadu_epi32(m[v], io.corr + 16 * v) : _mm512_setzero_si512();
  if (io.mode == TileIo::Mode::int32) {
#pragma GCC unroll 12
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int v = 0; v < 2; ++v) {
        std::int32_t* c = io.c + r * io.ldc + 16 * v;
        __m512i s = _mm512_sub_epi32(acc[r][v], corr[v]);
        if (io.accumulate) s = _mm512_add_epi32(s, _mm512_maskz_loadu_epi32(m[v], c));
        _mm512_mask_storeu_epi32(c, m[v], s);
      }
    return;
  }
  // dequant: y = float(S - corr) · a_scale[r] · w_scale[c] (+ bias[c]), one rounding per operation.
  __m512 ws[2], bias[2];
#pragma GCC unroll 2
  for (int v = 0; v < 2; ++v) {
    ws[v] = _mm512_maskz_loadu_ps(m[v], io.w_scale + 16 * v);
    bias[v] = io.bias ? _mm512_maskz_loadu_ps(m[v], io.bias + 16 * v) : _mm512_setzero_ps();
  }
#pragma GCC unroll 12
  for (int r = 0; r < MR; ++r) {
    const __m512 as = _mm512_set1_ps(io.a_scale[r]);
#pragma GCC unroll 2
    for (int v = 0; v < 2; ++v) {
      __m512 f = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][v], corr[v]));
      f = _mm512_mul_ps(f, as);
      f = _mm512_mul_ps(f, ws[v]);
      if (io.bias) f = _mm512_add_ps(f, bias[v]);
      _mm512_mask_storeu_ps(io.y + r * io.ldy + 16 * v, m[v], f);
    }
  }
}

/// out[j] = column j of the 16 x 16 matrix of 32-bit words whose rows are r[0..15] (out[j] lane i = r[i] lane j).
void transpose16x16_epi32(const __m512i (&r)[16], __m512i (&out)[16]) {
  __m512i t[16], u[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: t[i] = (r_i.0, r_i+1.0, r_i.1, r_i+1.1), t[i+1] = (.2, .3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < 16; g += 4) {  // u[g + c], 128-bit lane L: word 4L + c of rows g .. g+3
    u[g + 0] = _mm512_unpacklo_epi64(t[g + 0], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g + 0], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
#pragma GCC unroll 4
  // A 4 x 4 transpose of 128-bit lanes: out[4L + c] = (u[c].L, u[4+c].L, u[8+c].L, u[12+c].L).
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
    const __m512i y0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                  y1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
    out[0 + c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    out[4 + c] = _mm512_shuffle_i32x4(x0, y0, 0xdd);
    out[8 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    out[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xdd);
  }
}

std::uint64_t byte_mask(i64 n) { return n >= 64 ? ~std::uint64_t{0} : n <= 0 ? 0 : (std::uint64_t{1} << n) - 1; }

}  // namespace

void tile_vnni(i64 kq, const void* a, i64 /*a_ld*/, const std::int8_t* b, int rows, int cols, const TileIo& io) {
  const auto* au = static_cast<const std::uint8_t*>(a);
  switch (rows) {
    case 1: return tile_rows<1>(kq, au, b, cols, io);
    case 2: return tile_rows<2>(kq, au, b, cols, io);
    case 3: return tile_rows<3>(kq, au, b, cols, io);
    case 4: return tile_rows<4>(kq, au, b, cols, io);
    case 5: return tile_rows<5>(kq, au, b, cols, io);
    case 6: return tile_rows<6>(kq, au, b, cols, io);
    case 7: return tile_rows<7>(kq, au, b, cols, io);
    case 8: return tile_rows<8>(kq, au, b, cols, io);
    case 9: return tile_rows<9>(kq, au, b, cols, io);
    case 10: return tile_rows<10>(kq, au, b, cols, io);
    case 11: return tile_rows<11>(kq, au, b, cols, io);
    default: return tile_rows<12>(kq, au, b, cols, io);
  }
}

// Packing of a row-major A (op(A) = A, [M, K], row stride lda) for the vnni tiles: the panel's rows' 64-byte
// runs (masked at K; zero rows past `rows`), biased by 128 (x ^ 0x80), are transposed as 16 x 16 words and
// the first 12 words of each result (k-quad q of the 12 rows) stored: 48 bytes per k-quad. Padding packs as
// 0x80 (a = 0). About ten times the scalar loop's speed: at 256 x 768 the scalar packing was 3% of the qkv
// product on one thread and 8% of attn_proj.
void pack_a_rows_vnni(const std::int8_t* A, i64 lda, i64 rows, i64 K, i64 kqp, std::uint8_t* dst) {
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  for (i64 q0 = 0; q0 < kqp; q0 += 16) {
    const __mmask64 km = byte_mask(K - 4 * q0);
    __m512i r[16], out[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      r[i] =
          _mm512_xor_si512(i < rows ? _mm512_maskz_loadu_epi8(km, A + i * lda + 4 * q0) : _mm512_setzero_si512(), bias);
    transpose16x16_epi32(r, out);
    const i64 n = kqp - q0 < 16 ? kqp - q0 : 16;
    for (i64 j = 0; j < n; ++j) _mm512_mask_storeu_epi32(dst + (q0 + j) * kMR * 4, __mmask16(0x0fff), out[j]);
  }
}

// Packing of op(B) = Bᵀ, B stored [N, K] (the weights): per 16-column half of a panel and 16 k-quads, the 16
// rows' 64-byte runs (masked at K; zero for rows past N) are transposed as 16 x 16 words, which puts the k-quad
// q of every column in one vector: row q of the half-panel. The column sums come from the same vectors:
// vpdpbusd with all-ones unsigned bytes adds each lane's 4 signed bytes.
void pack_b_rows_vnni(const std::int8_t* B, i64 ldb, i64 N, i64 K, i64 p, i64 kq0, i64 nq, std::int8_t* dst,
                      std::int32_t* corr, bool add_corr) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int h = 0; h < 2; ++h) {
    const i64 n0 = p * kNR + 16 * h;
    __m512i sum = _mm512_setzero_si512();
    for (i64 j0 = 0; j0 < nq; j0 += 16) {
      const i64 q = kq0 + j0;
      const __mmask64 km = byte_mask(K - 4 * q);
      __m512i r[16], out[16];
#pragma GCC unroll 16
      for (int i = 0; i < 16; ++i)
        r[i] = n0 + i < N ? _mm512_maskz_loadu_epi8(km, B + (n0 + i) * ldb + 4 * q) : _mm512_setzero_si512();
      transpose16x16_epi32(r, out);
      const i64 n = nq - j0 < 16 ? nq - j0 : 16;
      for (i64 j = 0; j < n; ++j) {
        _mm512_storeu_si512(dst + (j0 + j) * 128 + 64 * h, out[j]);
        sum = _mm512_dpbusd_epi32(sum, ones, out[j]);
      }
    }
    std::int32_t* c = corr + 16 * h;
    sum = _mm512_slli_epi32(sum, 7);  // 128 · colsum
    if (add_corr) sum = _mm512_add_epi32(sum, _mm512_loadu_si512(c));
    _mm512_storeu_si512(c, sum);
  }
}

}  // namespace tg::backend::cpu::int8

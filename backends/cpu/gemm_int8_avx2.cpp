// AVX2 int8 tiles, exact: bytes widened to int16 and multiplied in pairs with vpmaddwd (int32 sums), for CPUs
// without AVX-512 VNNI. Compiled with -mavx2 (the *_avx2.cpp rule of backends/cpu/CMakeLists.txt).
//   int8::tile_avx2(kq, a_panel, 0, b_panel, rows, cols, io);   // Note [int8 tile write-back]
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm_int8_kernels.hpp"

// Note [GEMM ISA translation units] (gemm_packed.hpp) applies: nothing here calls an inline function of
// another header.

namespace tg::backend::cpu::int8 {
namespace {

// Note [AVX2 int8 tile]
// A is packed as int16 k-quads (12 rows x 4 int16 per k-quad), B in the shared k-quad layout (Note [int8
// packed layout]). For 4 columns, 16 bytes of a B k-quad row sign-extended (vpmovsxbw) are the int16 vector
// (b(0,c), b(1,c), b(2,c), b(3,c))_{c<4}; vpmaddwd with the row's broadcast quad (a0, a1, a2, a3) x 4 gives
// the int32 lanes (a0·b0 + a1·b1, a2·b2 + a3·b3) per column: |each| <= 2 · 128 · 128, exact. The lanes are
// summed over the k-quads, then adjacent lanes (vphaddd) give each column's sum. A pass is 4 rows x 8 columns:
// 8 accumulators, 2 B vectors, the broadcast quad and the product fit the 16 ymm (3 rows x 16 columns
// spilled); a 12 x 32 tile is 12 passes, whose A and B reads hit L1. The accumulating vpaddd is written as
// assembly: GCC otherwise renamed the accumulators every k-quad (8 register moves per 8 vpmaddwd).
template <int R>
__attribute__((noinline)) void pass(i64 kq, const std::int16_t* a, const std::int8_t* b, std::int32_t* out) {
  __m256i acc[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  for (i64 q = 0; q < kq; ++q) {
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      long long quad;
      std::memcpy(&quad, a + 4 * r, 8);
      const __m256i av = _mm256_set1_epi64x(quad);
      const __m256i p0 = _mm256_madd_epi16(av, b0), p1 = _mm256_madd_epi16(av, b1);
      __asm__("vpaddd %1, %0, %0" : "+x"(acc[r][0]) : "x"(p0));
      __asm__("vpaddd %1, %0, %0" : "+x"(acc[r][1]) : "x"(p1));
    }
    a += kMR * 4;
    b += kNR * 4;
  }
  // acc[r][v] lanes (2c, 2c+1) are column 4v + c's two partial sums. hadd within 128-bit lanes of (cols 0-3,
  // cols 4-7) gives (c0 c1 c4 c5 | c2 c3 c6 c7); the 64-bit permute (0, 2, 1, 3) orders it.
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * kNR),
                        _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[r][0], acc[r][1]), 0xd8));
}

void pass_rows(int rows, i64 kq, const std::int16_t* a, const std::int8_t* b, std::int32_t* out) {
  switch (rows) {
    case 1: return pass<1>(kq, a, b, out);
    case 2: return pass<2>(kq, a, b, out);
    case 3: return pass<3>(kq, a, b, out);
    default: return pass<4>(kq, a, b, out);
  }
}

/// Lanes [0, n) of a ymm of 32-bit values, as the sign-bit mask vpmaskmovd takes.
__m256i lane_mask8(int n) {
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), idx);
}

/// Note [int8 tile write-back] for a finished rows x cols tile t (row stride kNR), 8 columns at a time with
/// masked loads and stores (nothing outside rows x cols is touched): the scalar loop was 10-15% of a tile.
void write_tile_avx2(const std::int32_t* t, int rows, int cols, const TileIo& io) {
  for (int c0 = 0; c0 < cols; c0 += 8) {
    const __m256i m = lane_mask8(cols - c0);
    const __m256i corr = io.corr ? _mm256_maskload_epi32(io.corr + c0, m) : _mm256_setzero_si256();
    __m256 ws = _mm256_setzero_ps(), bias = _mm256_setzero_ps();
    if (io.mode == TileIo::Mode::dequant) {
      ws = _mm256_maskload_ps(io.w_scale + c0, m);
      if (io.bias) bias = _mm256_maskload_ps(io.bias + c0, m);
    }
    for (int r = 0; r < rows; ++r) {
      __m256i s = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(t + r * kNR + c0));
      if (io.carry_in) s = _mm256_add_epi32(s, _mm256_maskload_epi32(io.carry_in + r * io.ldw + c0, m));
      switch (io.mode) {
        case TileIo::Mode::carry: _mm256_maskstore_epi32(io.carry_out + r * io.ldw + c0, m, s); break;
        case TileIo::Mode::int32: {
          std::int32_t* c = io.c + r * io.ldc + c0;
          s = _mm256_sub_epi32(s, corr);
          if (io.accumulate) s = _mm256_add_epi32(s, _mm256_maskload_epi32(c, m));
          _mm256_maskstore_epi32(c, m, s);
          break;
        }
        case TileIo::Mode::dequant: {  // one rounding per operation (this file: -ffp-contract=off)
          __m256 f = _mm256_cvtepi32_ps(_mm256_sub_epi32(s, corr));
          f = _mm256_mul_ps(f, _mm256_set1_ps(io.a_scale[r]));
          f = _mm256_mul_ps(f, ws);
          if (io.bias) f = _mm256_add_ps(f, bias);
          _mm256_maskstore_ps(io.y + r * io.ldy + c0, m, f);
          break;
        }
      }
    }
  }
}

}  // namespace

void tile_avx2(i64 kq, const void* a, i64 /*a_ld*/, const std::int8_t* b, int rows, int cols, const TileIo& io) {
  const auto* a16 = static_cast<const std::int16_t*>(a);
  alignas(64) std::int32_t out[kMR * kNR];
  for (int r0 = 0; r0 < rows; r0 += 4)
    for (int c0 = 0; c0 < cols; c0 += 8)
      pass_rows(rows - r0 < 4 ? rows - r0 : 4, kq, a16 + 4 * r0, b + 4 * c0, out + r0 * kNR + c0);
  write_tile_avx2(out, rows, cols, io);
}

}  // namespace tg::backend::cpu::int8

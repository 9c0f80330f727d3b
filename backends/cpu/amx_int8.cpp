// AMX int8 tiles (tdpbssd, signed x signed -> int32) for the int8 GEMM driver: a 16 x 32 tile of C in two
// accumulator tiles per call, A and B read straight from their packed panels. Compiled for the baseline ISA;
// the AMX code is in functions with target attributes and runs only where amx_int8_granted().
//   if (int8::amx_int8_granted()) { int8::amx_thread_begin(); int8::tile_amx(...); int8::amx_thread_end(); }
#include <immintrin.h>

#include <cstdint>

#include "gemm_int8_kernels.hpp"
#include "typegrad/detail/cpu/amx.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"

namespace tg::backend::cpu::int8 {
namespace {

// Note [AMX int8 tile]
// tdpbssd tmm_c, tmm_a, tmm_b: C[m][n] += Σ_{q<16} Σ_{t<4} A[m][4q + t] · B[q][4n + t], all signed bytes, int32
// sums (exact, wrapping). With the packed layouts (Note [int8 packed layout]) every operand tile is a plain
// strided load:
//   A tile (16 rows x 64 bytes = 16 k-quads): the amx A panel [16][4·kqp] at byte 64·t, row stride 4·kqp;
//   B tile (16 k-quads x 16 columns x 4 bytes): the B panel at k-quad 16·t, row stride 128 (a k-quad row of
//   the panel holds 32 columns), columns 0-15 at byte 0 and 16-31 at byte 64.
// kqp and every K block are multiples of 16 k-quads (kq_align = 16), zero-padded, so all tiles are full;
// rows and columns past M and N are computed on padding and not written. The two C tiles are stored to a
// 16 x 32 int32 buffer and finished by write_tile_scalar.
constexpr int kRows = 16;

__attribute__((target("amx-tile,amx-int8"))) void tiles_16x32(i64 kt, const std::int8_t* a, i64 a_ld,
                                                              const std::int8_t* b, std::int32_t* out) {
  _tile_zero(0);
  _tile_zero(1);
  for (i64 t = 0; t < kt; ++t) {
    _tile_loadd(2, a + 64 * t, a_ld);
    _tile_loadd(3, b + t * kRows * 128, 128);
    _tile_loadd(4, b + t * kRows * 128 + 64, 128);
    _tile_dpbssd(0, 2, 3);
    _tile_dpbssd(1, 2, 4);
  }
  _tile_stored(0, out, kNR * 4);
  _tile_stored(1, out + 16, kNR * 4);
}

__attribute__((target("amx-tile"))) void load_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 5; ++t) {  // 0, 1: C (16 x 16 int32); 2: A (16 x 64 bytes); 3, 4: B (16 k-quads x 64 bytes)
    cfg.colsb[t] = 64;
    cfg.rows[t] = kRows;
  }
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

}  // namespace

bool amx_int8_granted() {
  static const bool ok = cpu_features().amx_int8 && amx_tile_permission();
  return ok;
}

void amx_thread_begin() { load_config(); }
void amx_thread_end() { release_tiles(); }

void tile_amx(i64 kq, const void* a, i64 a_ld, const std::int8_t* b, int rows, int cols, const TileIo& io) {
  alignas(64) std::int32_t out[kRows * kNR];
  tiles_16x32(kq / 16, static_cast<const std::int8_t*>(a), a_ld, b, out);
  write_tile_scalar(out, kNR, rows, cols, io);
}

}  // namespace tg::backend::cpu::int8

// The int8 GEMM's internal interface between the driver (gemm_int8.cpp: packing, blocking, threads) and the
// ISA translation units that hold the tile kernels (gemm_int8_vnni.cpp, gemm_int8_avx2.cpp, amx_int8.cpp).
//   int8::TileIo io{...};                                  // where a finished tile goes (Note [int8 tile write-back])
//   int8::tile_vnni(kq, a_panel, 0, b_panel, rows, cols, io);
#pragma once

#include <cstdint>

namespace tg::backend::cpu::int8 {

using i64 = std::int64_t;

// Note [int8 packed layout]
// B (op(B) [K, N], the weights) is packed in panels of kNR = 32 columns. A panel is kqp "k-quads" of 128 bytes:
// bytes [128·q + 4·c, 128·q + 4·c + 4) hold op(B)(4q .. 4q+3, 32·p + c), the four consecutive k of column c that
// one 32-bit lane of vpdpbusd (and one row of an AMX B tile: 16 columns x 4 bytes, row stride 128) multiplies.
// k >= K and columns >= N are zero, so padded products vanish whatever A holds there. kqp = ceil(K/4)
// rounded up to the kernel's kq_align (16 for AMX: whole 64-k tiles; 1 otherwise). With the panel goes
// corr[n] = 128 · Σ_k op(B)(k, n) (int32; zero past N), the offset of the unsigned VNNI product.
// A (op(A) [M, K], the activations) is packed per call, in the kernel's own format:
//   vnni: panels of kMR = 12 rows, kqp k-quads of 12 rows x 4 bytes, each byte A + 128 (a ^ 0x80, as uint8)
//   avx2: the same panels with each byte widened to int16 (12 rows x 4 int16 per k-quad)
//   amx : panels of 16 rows, row-major [16][4·kqp] signed bytes (one 16x64 A tile per 16 k-quads)
// Rows past M are padded (their outputs are never written); so are k past K (B is zero there).
inline constexpr int kNR = 32;
inline constexpr int kMR = 12;     // rows per A panel of the vnni and avx2 kernels
inline constexpr int kAmxMR = 16;  // rows per A panel of the AMX kernel

// Note [int8 tile write-back]
// A tile is rows (<= the panel's MR) x cols (<= 32) of C over a range of k-quads. Its int32 sum S (plus
// carry_in[r·ldw + c] when carry_in is set: the sums of the earlier K blocks) goes, by mode, to
//   carry   : carry_out[r·ldw + c] = S                                    (not the last K block)
//   int32   : c[r·ldc + c] = S - corr[c] (+ c[r·ldc + c] when accumulate)  (all int32 adds wrap mod 2^32)
//   dequant : y[r·ldy + c] = float(S - corr[c]) · a_scale[r] · w_scale[c] (+ bias[c]), in fp32, one rounding
//             per operation in that order (the ISA files are compiled with -ffp-contract=off)
// corr is null for the signed x signed kernels (avx2, amx). Every pointer is already offset to the tile's
// first row and column; no element outside rows x cols is read from or written to user memory.
struct TileIo {
  enum class Mode : int { carry, int32, dequant };
  Mode mode = Mode::int32;
  const std::int32_t* carry_in = nullptr;
  std::int32_t* carry_out = nullptr;
  i64 ldw = 0;
  const std::int32_t* corr = nullptr;
  std::int32_t* c = nullptr;
  i64 ldc = 0;
  bool accumulate = false;
  float* y = nullptr;
  i64 ldy = 0;
  const float* a_scale = nullptr;
  const float* w_scale = nullptr;
  const float* bias = nullptr;
  // Note [int8 B prefetch]: pf_count 64-byte lines to prefetch into L2 during the K loop (two per k-quad),
  // in runs of pf_per_row lines pf_stride bytes apart, from line pf_col of the run at pf_row.
  const char* pf_row = nullptr;
  i64 pf_stride = 0, pf_per_row = 1, pf_col = 0, pf_count = 0;
};

/// One tile over `kq` k-quads: `a` is the A panel at the tile's first k-quad (for amx: its first row, rows
/// a_ld bytes apart), `b` the B panel at that k-quad. rows in [1, panel MR], cols in [1, 32], kq >= 0.
using TileFn = void (*)(i64 kq, const void* a, i64 a_ld, const std::int8_t* b, int rows, int cols, const TileIo& io);

/// The scalar write-back of a finished rows x cols int32 tile t (row stride ldt), for kernels whose sums do not
/// end in vector registers of the output's shape (gemm_int8.cpp).
void write_tile_scalar(const std::int32_t* t, i64 ldt, int rows, int cols, const TileIo& io);

// gemm_int8_vnni.cpp (AVX-512 F/BW/VNNI)
void tile_vnni(i64 kq, const void* a, i64 a_ld, const std::int8_t* b, int rows, int cols, const TileIo& io);
/// Packs a vnni A panel (Note [int8 packed layout]) of `rows` <= 12 rows of a row-major A (row stride lda).
void pack_a_rows_vnni(const std::int8_t* A, i64 lda, i64 rows, i64 K, i64 kqp, std::uint8_t* dst);
/// Packs k-quads [kq0, kq0 + nq) of B panel p of op(B) = Bᵀ (B stored [N, K], row stride ldb) into dst (rows 0 ..
/// nq-1 of Note [int8 packed layout]), and 128 · their column sums into corr[0 .. 32) (added to it with add_corr).
void pack_b_rows_vnni(const std::int8_t* B, i64 ldb, i64 N, i64 K, i64 p, i64 kq0, i64 nq, std::int8_t* dst,
                      std::int32_t* corr, bool add_corr);

// gemm_int8_avx2.cpp (AVX2)
void tile_avx2(i64 kq, const void* a, i64 a_ld, const std::int8_t* b, int rows, int cols, const TileIo& io);

// amx_int8.cpp (AMX-TILE / AMX-INT8, via target attributes)
/// Whether the CPU reports amx_int8 and Linux granted the tile data state (asked once per process).
bool amx_int8_granted();
void tile_amx(i64 kq, const void* a, i64 a_ld, const std::int8_t* b, int rows, int cols, const TileIo& io);
/// Loads this thread's tile configuration / releases the tile state: around each thread's tile calls.
void amx_thread_begin();
void amx_thread_end();

}  // namespace tg::backend::cpu::int8

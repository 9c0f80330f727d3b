// Where the register-resident attention kernels (backends/cuda/flash_attention_mma.cuh, Note [flash attention
// in registers]) put and find 16-bit tiles: the swizzled shared-memory layout, the row each lane hands to
// ldmatrix, and which element of a tile each register of an mma.sync m16n8k16 fragment holds. Plain C++ (no
// CUDA headers), so tests/cuda/test_cuda_mma_layout.cpp checks the kernels' index arithmetic on the CPU
// against an emulation of ldmatrix and mma.sync written from the PTX ISA's fragment tables.
//   const int off = mma::swizzled<64>(row, col);            // element (row, col) of a [rows, 64] tile
//   const mma::RowCol at = mma::a_source(lane, r0, k0);      // the row this lane gives ldmatrix.x4 for A
#pragma once

#include "typegrad/detail/macros.hpp"

namespace tg::backend::cuda::detail::mma {

/// A tile coordinate (row, column) in elements.
struct RowCol {
  int row, col;
};

/// Element offset of (row, col) in a row-major [rows, HS] tile of 16-bit elements whose 16-byte chunks are
/// stored at chunk index (col / 8) xor (row mod 8): eight consecutive rows read at one column (ldmatrix's
/// eight row addresses) then fall in eight different bank groups, without padding. HS is 64 or 128.
template <int HS>
TG_HOST_DEVICE constexpr int swizzled(int row, int col) {
  static_assert(HS % 64 == 0, "swizzled tiles have rows of a multiple of 64 elements");
  return row * HS + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

/// ldmatrix.x4 for an A operand: the 16x16 block at (r0, k0) of a row-major [rows, k] tile. Lane l gives the
/// start of row r0 + l % 16 at column k0 + 8·(l / 16); register i of every lane then holds A's fragment
/// register i (matrices: rows 0-7 / 8-15 at columns 0-7, then the same at columns 8-15).
TG_HOST_DEVICE constexpr RowCol a_source(int lane, int r0, int k0) { return {r0 + (lane & 15), k0 + ((lane >> 4) << 3)}; }

/// ldmatrix.x4 (no transpose) for the B operands of two adjacent n-tiles, from a tile stored [n][k] (Bᵀ
/// row-major: the keys of S = Q·Kᵀ): rows n0 .. n0 + 15, columns k0 .. k0 + 15. Registers 0 and 1 are the
/// fragment (b0, b1) of n-tile n0, registers 2 and 3 that of n-tile n0 + 8.
TG_HOST_DEVICE constexpr RowCol bt_source(int lane, int n0, int k0) {
  const int m = lane >> 3;
  return {n0 + ((m >> 1) << 3) + (lane & 7), k0 + ((m & 1) << 3)};
}

/// ldmatrix.x4.trans for the B operands of two adjacent n-tiles, from a tile stored [k][n] (B row-major: V
/// in P·V): rows k0 .. k0 + 15, columns n0 .. n0 + 15. Registers 0 and 1 are the fragment of n-tile n0,
/// registers 2 and 3 that of n-tile n0 + 8.
TG_HOST_DEVICE constexpr RowCol b_source_trans(int lane, int k0, int n0) {
  const int m = lane >> 3;
  return {k0 + ((m & 1) << 3) + (lane & 7), n0 + ((m >> 1) << 3)};
}

/// The element of a 16x8 fp32 accumulator (C/D) fragment that register e (0..3) of `lane` holds.
TG_HOST_DEVICE constexpr RowCol c_element(int lane, int e) { return {(lane >> 2) + ((e >> 1) << 3), ((lane & 3) << 1) + (e & 1)}; }

/// A-operand register i (0..3) built from the accumulators of the two n-tiles that cover k columns 16·kk ..
/// 16·kk + 15: its low and high halves are registers (lo, lo + 1) of n-tile `tile` (2·kk or 2·kk + 1). The
/// accumulator layout of a 16x16 product is the A layout of m16n8k16, so P and dS go from one GEMM to the
/// next in registers.
struct ASourceOfC {
  int tile, lo;
};
TG_HOST_DEVICE constexpr ASourceOfC a_from_c(int kk, int i) { return {2 * kk + (i >> 1), (i & 1) << 1}; }

}  // namespace tg::backend::cuda::detail::mma

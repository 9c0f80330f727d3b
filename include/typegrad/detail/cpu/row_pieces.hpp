// How the CPU backend's elementwise loops share rows between OpenMP threads and find a row's operands.
// A private helper of the backend (backends/cpu), not part of the API.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>

namespace tg::backend::cpu {

/// Rows enough to give every thread a share of whole rows.
inline constexpr std::int64_t kRowsEnough = 64;
/// Elements per piece when rows are cut.
inline constexpr std::int64_t kRowPiece = 1 << 14;

/// Calls f(o, i0, i1) for elements [i0, i1) of every row o < outer of `inner` elements, in parallel when
/// outer · inner > grain: whole rows when there are at least kRowsEnough of them, else each row cut into
/// pieces of about kRowPiece elements, so that one long row (a contiguous tensor, which the loops see as a
/// single row) still runs on every thread.
template <class F>
void for_row_pieces(std::int64_t outer, std::int64_t inner, std::int64_t grain, F f) {
  const std::int64_t pieces = outer >= kRowsEnough ? 1 : std::max<std::int64_t>(1, inner / kRowPiece);
#pragma omp parallel for schedule(static) if (outer * inner > grain)
  for (std::int64_t w = 0; w < outer * pieces; ++w) {
    const std::int64_t o = w / pieces, piece = w % pieces;
    f(o, inner * piece / pieces, inner * (piece + 1) / pieces);
  }
}

/// The offsets, in two operands with strides s0 and s1, of the first element of row o of an array whose
/// rows are its dimension `last` (the innermost): o is decoded into indices over dimensions [0, last) of
/// `sizes`, last one fastest. Sizes and strides are anything indexable by dimension (a Shape, an array).
template <class Sizes, class Strides0, class Strides1>
std::pair<std::int64_t, std::int64_t> row_offsets(std::int64_t o, int last, const Sizes& sizes, const Strides0& s0,
                                                  const Strides1& s1) {
  std::int64_t off0 = 0, off1 = 0;
  for (int d = last - 1; d >= 0; --d) {
    const std::int64_t idx = o % sizes[d];
    o /= sizes[d];
    off0 += idx * s0[d];
    off1 += idx * s1[d];
  }
  return {off0, off1};
}

}  // namespace tg::backend::cpu

// The CPU backend's own functions (compiled in backends/cpu/): copies, fills, random draws, the OpenMP team,
// GEMM operand geometry. The op kernels both devices have are declared once in detail/kernels/ (Note
// [kernels declared once]) and included here. Raw pointers + shapes only: no tensors, no autodiff.
//   tg::backend::cpu::copy_strided<float, tg::bf16>(src, src_strides, dst, dst_strides, sizes);   // convert + copy
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/attention.hpp"
#include "typegrad/detail/kernels/core.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/detail/kernels/matmul.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/detail/kernels/reduce.hpp"

namespace tg::pw {
struct ChainProgram;
}

namespace tg::backend::cpu {

/// tg::pointwise_chain's two passes (Note [fusion rewrites]; backends/cpu/unary.cpp). Forward: out
/// (contiguous over `shape`) = the chain over its p.inputs inputs x[k], each read at strides st[k] over `shape`
/// (0 where broadcast). Backward: dx[k] (contiguous over `shape`; null when not needed) = dout · ∂out/∂x_k.
template <class T>
void pointwise_chain_forward(const pw::ChainProgram& p, const T* const* x, const Shape* st, T* out, const Shape& shape);
template <class T>
void pointwise_chain_backward(const pw::ChainProgram& p, const T* const* x, const Shape* st, const T* dout, T* const* dx,
                              const Shape& shape);

/// Sets the number of OpenMP threads every CPU kernel uses (n > 0 pins it); 0 restores the default:
/// OMP_NUM_THREADS when set, else the CPUs of the affinity mask, or the cgroup's CPU quota when lower, fewer
/// while other programs keep CPUs busy (Note [OpenMP on a shared machine], Note [threads under contention],
/// kernels.cpp).
void set_num_threads(int n);
/// Re-counts the other programs' runnable threads (at most every 100 ms) and resizes a default-sized team
/// to the CPUs they leave; a no-op for a pinned team or inside a parallel region.
void adapt_threads();
/// The team for `other_running` runnable threads of other programs: default_team less them, at least 1.
int team_for_load(int default_team, double other_running);
int num_threads();
/// Whether the library bounded libgomp's spinning at start-up (no OMP_WAIT_POLICY / GOMP_SPINCOUNT given;
/// Note [OpenMP on a shared machine]).
bool omp_spin_bounded();

}  // namespace tg::backend::cpu

// ==== GEMM operands (backends/cpu/matmul.cpp; also the CUDA GEMMs' host geometry) ======================
#include "typegrad/detail/cpu/gemm.hpp"
namespace tg::backend::cpu {
/// Whether a [rows, cols] matrix with strides (rs, cs) can be a GEMM operand without a copy (unit stride
/// on one of its dims; size-1 dims are free), and as which Trans flag and leading dimension.
inline bool gemm_operand(std::int64_t rows, std::int64_t cols, std::int64_t rs, std::int64_t cs, Trans& t,
                         std::int64_t& ld) {
  if (rows <= 1 && cols <= 1) { t = Trans::N; ld = 1; return true; }
  if (cols <= 1) {  // a column: unit row stride is a transposed row, otherwise rows of length 1
    if (rs == 1) { t = Trans::T; ld = rows; return true; }
    if (rs >= 1) { t = Trans::N; ld = rs; return true; }
    return false;
  }
  if (rows <= 1) {
    if (cs == 1) { t = Trans::N; ld = cols; return true; }
    if (cs >= 1) { t = Trans::T; ld = cs; return true; }
    return false;
  }
  if (cs == 1 && rs >= cols) { t = Trans::N; ld = rs; return true; }
  if (rs == 1 && cs >= rows) { t = Trans::T; ld = cs; return true; }
  return false;
}
inline bool gemm_operand_ok(std::int64_t rows, std::int64_t cols, std::int64_t rs, std::int64_t cs) {
  Trans t;
  std::int64_t ld;
  return gemm_operand(rows, cols, rs, cs, t, ld);
}
}  // namespace tg::backend::cpu
// ==== end GEMM operands =============================================================================

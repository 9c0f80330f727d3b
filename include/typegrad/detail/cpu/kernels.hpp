// Declarations of the CPU backend's non-GEMM kernels (compiled in backends/cpu/, explicitly instantiated
// for every element type of the master list). Raw pointers + shapes only: no tensors, no autodiff.
//   tg::backend::cpu::copy_strided<float, tg::bf16>(src, src_strides, dst, dst_strides, sizes);   // convert + copy
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"

namespace tg::backend::cpu {

/// dst[i] = S->T(src[i]) for every index i of `sizes`, both sides strided (strides in elements).
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes);

template <class T>
void fill(T* dst, std::int64_t n, T value);

/// Counter-based draws: element i uses Philox counter offset + i of `seed` (see core/random.hpp).
template <class T>
void random_uniform(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float lo, float hi);
template <class T>
void random_normal(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float mean, float stddev);

template <class T>
void arange(T* dst, std::int64_t n, double start, double step);

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

namespace tg::backend::cpu {
/// dst[i] += src[i] (contiguous; accumulation in fp32 for 16-bit types).
template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n);
}  // namespace tg::backend::cpu

namespace tg::backend::cpu {
/// out[o, i] = sum_k in[o, k, i] over a contiguous [outer, n, inner] block (fp32/fp64 accumulation).
template <class T>
void reduce_sum(const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner);
/// out[o, i] = max_k in[o, k, i], argmax (first maximum; NaN wins) into `index` when it is not null.
template <class T>
void reduce_max(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n, std::int64_t inner);
}  // namespace tg::backend::cpu

#include "typegrad/detail/math.hpp"
namespace tg::backend::cpu {
/// out = a op b over out_shape; sa / sb are a's and b's strides in out's index space (0 = broadcast).
template <class T>
void binary(math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out, const Shape& out_shape);
}  // namespace tg::backend::cpu

// ==== unary, dropout, masked_fill (backends/cpu/unary.cpp) ==========================================
// Inputs are strided (strides in elements, one per dim of `shape`); outputs are contiguous row-major.
// Element i of a dropout draw is the row-major index of `shape`, so the mask does not depend on layout.
namespace tg::backend::cpu {
/// y = f(x) (math::apply).
template <class T>
void unary_forward(math::Unary op, const T* x, const Shape& sx, T* y, const Shape& shape);
/// dx = dy · f'(saved), saved being x or y as math::uses_output(op) says.
template <class T>
void unary_backward(math::Unary op, const T* saved, const Shape& ss, const T* dy, const Shape& sdy, T* dx,
                    const Shape& shape);
/// y_i = keep_i ? x_i / (1 - p) : 0, keep_i = uniform(philox(seed, offset + i)) >= p. Also the backward
/// (x = dy, y = dx): the mask is recomputed from (seed, offset), never stored.
template <class T>
void dropout_forward(const T* x, const Shape& sx, T* y, const Shape& shape, std::uint64_t seed, std::uint64_t offset,
                     double p);
/// y = mask ? value : x; sm are the mask's strides in `shape` (0 on broadcast dims). Also the backward
/// (x = dy, value = 0).
template <class T>
void masked_fill(const T* x, const Shape& sx, const std::uint8_t* mask, const Shape& sm, T value, T* y,
                 const Shape& shape);
}  // namespace tg::backend::cpu
// ==== end unary, dropout, masked_fill ===============================================================

// ==== nn ops: matmul, linear, softmax, layernorm, rmsnorm, embedding, cross_entropy, attention =======
// (backends/cpu/matmul.cpp, backends/cpu/nn.cpp, backends/cpu/attention.cpp). Row ops work on a
// contiguous [rows, n] block, math in accum_t<T> (fp32 for 16-bit storage, fp64 for fp64); per-row
// statistics are stored in accum_t<T>. Rows are split over the OpenMP team.
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
/// C[i] = A[i]·B[i] for every index i of `batch` (A [M,K], B [K,N], C [M,N]). sa / sb / sc hold the batch
/// strides (in batch's index space; 0 = broadcast) followed by the matrix's (row, col) strides; A and B
/// must satisfy gemm_operand_ok, C needs col stride 1. A batch stride of 0 in sc reduces over that dim
/// (C accumulates in order). Collapsible batch dims become one gemm_batched call or fold into M or K.
template <class T>
void matmul_strided(const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,
                    const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K);
/// y[M,N] = x[M,K]·w[N,K]ᵀ (+ bias[N]); x and w are given by their (row, col) strides (gemm_operand_ok).
template <class T>
void linear_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, std::int64_t wcs,
                    const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K);
/// pre[M,N] = x[M,K]·w[N,K]ᵀ (+ bias[N]) and y[M,N] = gelu_tanh(pre), both contiguous (ops/linear_gelu.hpp).
/// The CPU runs linear_forward then unary_forward(gelu_tanh) over the rounded pre: the composite, bit for bit.
template <class T>
void linear_gelu_tanh_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,
                              std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N,
                              std::int64_t K);

/// y = softmax(x) (or log_softmax when `log`) over each row, max-subtracted.
template <class T>
void softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t n, bool log);
/// softmax: dx = y ∘ (dy − Σ dy∘y); log_softmax: dx = dy − exp(y) · Σ dy (y is the saved output).
template <class T>
void softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log);

/// y = (x − mean) · rstd · w + b per row, rstd = 1/sqrt(var + eps) (biased variance); writes mean, rstd.
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* y, accum_t<T>* mean, accum_t<T>* rstd,
                       std::int64_t rows, std::int64_t n, double eps);
/// x̂ = (x − mean)·rstd, g = dy∘w: dx = rstd·(g − mean(g) − x̂·mean(g∘x̂)), dw = Σ_rows dy∘x̂, db = Σ_rows dy.
/// mean == nullptr means RMSNorm (x̂ = x·rstd, no mean(g) term). Any of dx, dw, db may be null.
template <class T>
void layernorm_backward(const T* x, const T* w, const accum_t<T>* mean, const accum_t<T>* rstd, const T* dy, T* dx,
                        T* dw, T* db, std::int64_t rows, std::int64_t n);
/// y = x · rstd · w per row, rstd = 1/sqrt(mean(x²) + eps); writes rstd.
template <class T>
void rmsnorm_forward(const T* x, const T* w, T* y, accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps);

/// out[i, :] = w[idx[i], :] for i < n (w [V, C]; indices already checked).
template <class T>
void embedding_forward(const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C);
/// dw[v, :] = Σ_{i: idx[i] = v} dout[i, :] (dw [V, C] overwritten), summed in index order in accum_t<T>:
/// deterministic whatever the thread count.
template <class T>
void embedding_backward(const T* dout, const std::int64_t* idx, T* dw, std::int64_t n, std::int64_t V, std::int64_t C);

/// Per row r with target t_r ≠ ignore_index: loss_r = lse_r − x[r, t_r], lse_r = log Σ exp x[r, :].
/// Writes lse (every row), returns Σ loss_r (summed in row order, fp64) and the count of counted rows.
template <class T>
double cross_entropy_forward(const T* logits, const std::int64_t* targets, accum_t<T>* lse, std::int64_t rows,
                             std::int64_t V, std::int64_t ignore_index, std::int64_t* count);
/// dlogits[r, :] = scale · (exp(x[r, :] − lse_r) − onehot(t_r)), zero for ignored rows.
template <class T>
void cross_entropy_backward(const T* logits, const std::int64_t* targets, const accum_t<T>* lse, double scale,
                            T* dlogits, std::int64_t rows, std::int64_t V, std::int64_t ignore_index);

/// Fused scaled-dot-product attention over BH contiguous heads of [Tn, hs]: out = softmax(scale·QKᵀ + mask)·V,
/// causal mask when `causal`. Saves the per-row logsumexp of the scaled scores (flash attention), not P.
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH, std::int64_t Tn,
                       std::int64_t hs, double scale, bool causal);
/// Recomputes P = exp(scale·QKᵀ − lse); Dᵢ = Σ dOᵢ∘Oᵢ, dS = P∘(dO·Vᵀ − D): dQ = scale·dS·K, dK = scale·dSᵀ·Q,
/// dV = Pᵀ·dO.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse, T* dq,
                        T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal);
}  // namespace tg::backend::cpu
// ==== end nn ops ====================================================================================

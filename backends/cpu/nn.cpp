// Row kernels of the nn ops: softmax / log_softmax, layernorm / rmsnorm, embedding, cross_entropy.
// Each row of a contiguous [rows, n] block is one OpenMP work item; math in the op's autocast math type
// (amp::kernel_math_t: fp32 for 16-bit storage), rounded once on store. Column reductions (dweight, dbias, embedding rows) are computed by one
// thread per output column block, summing rows in order: results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "typegrad/amp/rule.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/vec_exp.hpp"
#include "layernorm_row.hpp"
#include "parallel.hpp"

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kColBlock = 64;          // columns per work item of a column reduction

template <class A, class T>
A row_max(const T* x, std::int64_t n) {
  if constexpr (std::is_same_v<A, float>) {
    return vec::max_of(x, n);  // the same value, vectorized
  } else {
    A m = -std::numeric_limits<A>::infinity();
    for (std::int64_t j = 0; j < n; ++j) {
      const A v = scalar_cast<A>(x[j]);
      m = v > m ? v : m;
    }
    return m;
  }
}
}  // namespace

// ---- softmax -----------------------------------------------------------------------------------------
namespace {
/// One row of softmax_forward; scale_masked_softmax_forward runs it too (the same bits).
template <class A, class T>
void softmax_row(const T* xr, T* yr, std::int64_t n, bool log) {
  const A m = row_max<A>(xr, n);
  if constexpr (std::is_same_v<A, float>) {  // Note [vectorizable exp]
    const A s = vec::sum_exp(xr, n, m);      // a row of -inf gives NaN (x − m is NaN), as std::exp does
    if (log) {
      const A ls = m + std::log(s);
      for (std::int64_t j = 0; j < n; ++j) yr[j] = scalar_cast<T>(scalar_cast<A>(xr[j]) - ls);
    } else {
      vec::exp_scaled(xr, n, m, A(1) / s, yr);  // exp recomputed: cheaper than a second pass over y
    }
  } else {  // fp64
    A s = 0;
    if (log) {
      for (std::int64_t j = 0; j < n; ++j) s += std::exp(xr[j] - m);
      const A ls = m + std::log(s);
      for (std::int64_t j = 0; j < n; ++j) yr[j] = xr[j] - ls;
    } else {
      for (std::int64_t j = 0; j < n; ++j) {
        const A e = std::exp(xr[j] - m);
        yr[j] = e;
        s += e;
      }
      const A inv = A(1) / s;
      for (std::int64_t j = 0; j < n; ++j) yr[j] *= inv;
    }
  }
}

/// One row of softmax_backward; scale_masked_softmax_backward runs it too.
template <class A, class T>
void softmax_backward_row(const T* yr, const T* gr, T* dr, std::int64_t n, bool log) {
  A s = 0;
  if (log) {
    for (std::int64_t j = 0; j < n; ++j) s += scalar_cast<A>(gr[j]);
    if constexpr (std::is_same_v<A, float>) {  // Note [vectorizable exp]
      for (std::int64_t j = 0; j < n; ++j)
        dr[j] = scalar_cast<T>(scalar_cast<A>(gr[j]) - vec::exp_f32(scalar_cast<A>(yr[j])) * s);
    } else {
      for (std::int64_t j = 0; j < n; ++j) dr[j] = gr[j] - std::exp(yr[j]) * s;
    }
  } else {
    for (std::int64_t j = 0; j < n; ++j) s += scalar_cast<A>(gr[j]) * scalar_cast<A>(yr[j]);
    for (std::int64_t j = 0; j < n; ++j) dr[j] = scalar_cast<T>(scalar_cast<A>(yr[j]) * (scalar_cast<A>(gr[j]) - s));
  }
}

/// The offset of row r's mask in a mask of strides sm over `shape` (rows: every dim but the last).
inline std::int64_t mask_row_offset(std::int64_t r, const Shape& shape, const Shape& sm) {
  std::int64_t off = 0;
  for (int d = shape.size() - 2; d >= 0; --d) {
    off += r % shape[d] * sm[d];
    r /= shape[d];
  }
  return off;
}
}  // namespace

template <class T>
void softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t n, bool log) {
  using A = amp::kernel_math_t<amp::op::softmax, T>;  // Note [autocast rules]
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) softmax_row<A>(x + r * n, y + r * n, n, log);
}

template <class T>
void softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log) {
  using A = amp::kernel_math_t<amp::op::softmax, T>;  // Note [autocast rules]
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) softmax_backward_row<A>(y + r * n, dy + r * n, dx + r * n, n, log);
}

// ---- scale, mask and softmax in one pass (Note [fused scale, mask and softmax]) --------------------------
// Each row's scaled and masked values are written to a row buffer in T, as mul and masked_fill store them, and
// softmax_row runs over it: the product is rounded (and stored) before the softmax subtracts the maximum, so no
// multiply-add can join the two.
template <class T>
void scale_masked_softmax_forward(const T* x, const T* scale, bool divide, const std::uint8_t* mask, const Shape& sm, T fill,
                                  T* y, const Shape& shape) {
  using A = amp::kernel_math_t<amp::op::softmax, T>;
  using M = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the binary ops' register type
  const int rank = shape.size();
  const std::int64_t n = rank ? shape[rank - 1] : 1, total = shape.numel(), rows = n ? total / n : 0;
  const std::int64_t ms = mask && rank ? sm[rank - 1] : 0;
  const M s = scale ? scalar_cast<M>(*scale) : M(1);
#pragma omp parallel if (total > kParallelMin)
  {
    thread_local std::vector<T> v;  // the row buffer, kept by each thread across calls
    if (v.size() < static_cast<std::size_t>(n)) v.resize(static_cast<std::size_t>(n));
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * n;
      T* vr = v.data();
      if (!scale) {
        std::copy(xr, xr + n, vr);
      } else if (divide) {
        for (std::int64_t j = 0; j < n; ++j) vr[j] = scalar_cast<T>(scalar_cast<M>(xr[j]) / s);
      } else {
        for (std::int64_t j = 0; j < n; ++j) vr[j] = scalar_cast<T>(scalar_cast<M>(xr[j]) * s);
      }
      if (mask) {
        const std::uint8_t* mr = mask + mask_row_offset(r, shape, sm);
        for (std::int64_t j = 0; j < n; ++j) vr[j] = mr[j * ms] ? fill : vr[j];
      }
      softmax_row<A>(static_cast<const T*>(vr), y + r * n, n, false);
    }
  }
}

template <class T>
void scale_masked_softmax_backward(const T* y, const T* dy, const T* scale, bool divide, const std::uint8_t* mask, const Shape& sm,
                                   T* dx, const Shape& shape) {
  using A = amp::kernel_math_t<amp::op::softmax, T>;
  using M = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int rank = shape.size();
  const std::int64_t n = rank ? shape[rank - 1] : 1, total = shape.numel(), rows = n ? total / n : 0;
  const std::int64_t ms = mask && rank ? sm[rank - 1] : 0;
  const M s = scale ? scalar_cast<M>(*scale) : M(1);
  const T zero = scalar_cast<T>(0.0);
#pragma omp parallel for schedule(static) if (total > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    T* dr = dx + r * n;
    softmax_backward_row<A>(y + r * n, dy + r * n, dr, n, false);
    if (mask) {  // masked_fill's backward
      const std::uint8_t* mr = mask + mask_row_offset(r, shape, sm);
      for (std::int64_t j = 0; j < n; ++j) dr[j] = mr[j * ms] ? zero : dr[j];
    }
    if (scale) {  // mul's (div's) backward: the gradient times (over) the scale, rounded
      if (divide) {
        for (std::int64_t j = 0; j < n; ++j) dr[j] = scalar_cast<T>(scalar_cast<M>(dr[j]) / s);
      } else {
        for (std::int64_t j = 0; j < n; ++j) dr[j] = scalar_cast<T>(scalar_cast<M>(dr[j]) * s);
      }
    }
  }
}

// ---- layernorm / rmsnorm -----------------------------------------------------------------------------
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* y, accum_t<T>* mean, accum_t<T>* rstd,
                       std::int64_t rows, std::int64_t n, double eps) {
  using A = amp::kernel_math_t<amp::op::layernorm, T>;  // Note [autocast rules]
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A s = 0;
    for (std::int64_t j = 0; j < n; ++j) s += scalar_cast<A>(xr[j]);
    layernorm_row_from_sum<A>(xr, s, w, b, yr, mean[r], rstd[r], n, eps);
  }
}

template <class T>
void rmsnorm_forward(const T* x, const T* w, T* y, accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps) {
  using A = amp::kernel_math_t<amp::op::rmsnorm, T>;  // Note [autocast rules]
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A s = 0;
    for (std::int64_t j = 0; j < n; ++j) {
      const A v = scalar_cast<A>(xr[j]);
      s += v * v;
    }
    const A rs = A(1) / std::sqrt(s / static_cast<A>(n) + static_cast<A>(eps));
    rstd[r] = rs;
    for (std::int64_t j = 0; j < n; ++j) yr[j] = scalar_cast<T>(scalar_cast<A>(xr[j]) * rs * scalar_cast<A>(w[j]));
  }
}

template <class T>
void layernorm_backward(const T* x, const T* w, const accum_t<T>* mean, const accum_t<T>* rstd, const T* dy, T* dx,
                        T* dw, T* db, std::int64_t rows, std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::layernorm, T>;  // Note [autocast rules]
  const bool par = rows * n > kParallelMin;
  if (dx) {
#pragma omp parallel for schedule(static) if (par)
    for (std::int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * n;
      const T* gr = dy + r * n;
      const A mu = mean ? mean[r] : A(0), rs = rstd[r];
      A mg = 0, mgx = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        const A xh = (scalar_cast<A>(xr[j]) - mu) * rs;
        const A g = scalar_cast<A>(gr[j]) * scalar_cast<A>(w[j]);
        mg += g;
        mgx += g * xh;
      }
      mg = mean ? mg / static_cast<A>(n) : A(0);
      mgx /= static_cast<A>(n);
      T* dr = dx + r * n;
      for (std::int64_t j = 0; j < n; ++j) {
        const A xh = (scalar_cast<A>(xr[j]) - mu) * rs;
        const A g = scalar_cast<A>(gr[j]) * scalar_cast<A>(w[j]);
        dr[j] = scalar_cast<T>(rs * (g - mg - xh * mgx));
      }
    }
  }
  if (dw || db) {
    const std::int64_t blocks = (n + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (par)
    for (std::int64_t cb = 0; cb < blocks; ++cb) {
      const std::int64_t c0 = cb * kColBlock, c1 = std::min(n, c0 + kColBlock);
      A aw[kColBlock] = {}, ab[kColBlock] = {};
      for (std::int64_t r = 0; r < rows; ++r) {
        const T* xr = x + r * n;
        const T* gr = dy + r * n;
        const A mu = mean ? mean[r] : A(0), rs = rstd[r];
        for (std::int64_t j = c0; j < c1; ++j) {
          const A g = scalar_cast<A>(gr[j]);
          aw[j - c0] += g * (scalar_cast<A>(xr[j]) - mu) * rs;
          ab[j - c0] += g;
        }
      }
      for (std::int64_t j = c0; j < c1; ++j) {
        if (dw) dw[j] = scalar_cast<T>(aw[j - c0]);
        if (db) db[j] = scalar_cast<T>(ab[j - c0]);
      }
    }
  }
}

// ---- embedding ---------------------------------------------------------------------------------------
template <class T>
void embedding_forward(const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C) {
#pragma omp parallel for schedule(static) if (n * C > kParallelMin)
  for (std::int64_t i = 0; i < n; ++i) std::copy_n(w + idx[i] * C, C, out + i * C);
}

template <class T>
void embedding_backward(const T* dout, const std::int64_t* idx, T* dw, std::int64_t n, std::int64_t V, std::int64_t C) {
  using A = amp::kernel_math_t<amp::op::embedding, T>;  // Note [autocast rules]
  // Stable counting sort of positions by index: rows of dw are then independent work items, each summing
  // its occurrences in their original order.
  std::vector<std::int64_t> start(static_cast<std::size_t>(V + 1), 0), order(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) ++start[static_cast<std::size_t>(idx[i] + 1)];
  for (std::int64_t v = 0; v < V; ++v) start[static_cast<std::size_t>(v + 1)] += start[static_cast<std::size_t>(v)];
  {
    std::vector<std::int64_t> pos(start.begin(), start.end() - 1);
    for (std::int64_t i = 0; i < n; ++i) order[static_cast<std::size_t>(pos[static_cast<std::size_t>(idx[i])]++)] = i;
  }
  const bool par = V * C > kParallelMin;
#pragma omp parallel if (par)
  {
    std::vector<A> acc(static_cast<std::size_t>(C));
#pragma omp for schedule(dynamic, 64)
    for (std::int64_t v = 0; v < V; ++v) {
      T* row = dw + v * C;
      const std::int64_t p0 = start[static_cast<std::size_t>(v)], p1 = start[static_cast<std::size_t>(v + 1)];
      if (p0 == p1) {
        std::fill_n(row, C, scalar_cast<T>(0.0));
        continue;
      }
      std::fill(acc.begin(), acc.end(), A(0));
      for (std::int64_t p = p0; p < p1; ++p) {
        const T* g = dout + order[static_cast<std::size_t>(p)] * C;
        for (std::int64_t j = 0; j < C; ++j) acc[static_cast<std::size_t>(j)] += scalar_cast<A>(g[j]);
      }
      for (std::int64_t j = 0; j < C; ++j) row[j] = scalar_cast<T>(acc[static_cast<std::size_t>(j)]);
    }
  }
}

// ---- cross_entropy -----------------------------------------------------------------------------------
template <class T>
void cross_entropy_forward(const T* logits, const std::int64_t* targets, accum_t<T>* lse, accum_t<T>* loss_out,
                           std::int64_t rows, std::int64_t V, std::int64_t ld, std::int64_t ignore_index,
                           std::int64_t count) {
  using A = amp::kernel_math_t<amp::op::cross_entropy, T>;  // Note [autocast rules]
  std::vector<double> loss(static_cast<std::size_t>(rows));
#pragma omp parallel for schedule(static) if (rows * V > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = logits + r * ld;
    const A m = row_max<A>(xr, V);
    A s = 0;
    if constexpr (std::is_same_v<A, float>) {  // Note [vectorizable exp]
      s = vec::sum_exp(xr, V, m);
    } else {
      for (std::int64_t j = 0; j < V; ++j) s += std::exp(scalar_cast<A>(xr[j]) - m);
    }
    const A l = m + std::log(s);
    lse[r] = l;
    const std::int64_t t = targets[r];
    loss[static_cast<std::size_t>(r)] = t == ignore_index ? 0.0 : static_cast<double>(l - scalar_cast<A>(xr[t]));
  }
  double total = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) continue;
    total += loss[static_cast<std::size_t>(r)];
  }
  *loss_out = static_cast<accum_t<T>>(count ? total / static_cast<double>(count) : std::nan(""));
}

template <class T>
void cross_entropy_backward(const T* logits, const std::int64_t* targets, const accum_t<T>* lse, const accum_t<T>* dloss,
                            std::int64_t count, T* dlogits, std::int64_t rows, std::int64_t V, std::int64_t ld,
                            std::int64_t ld_out, std::int64_t ignore_index) {
  using A = amp::kernel_math_t<amp::op::cross_entropy, T>;  // Note [autocast rules]
  const A sc = static_cast<A>(count ? static_cast<double>(*dloss) / static_cast<double>(count) : 0.0);
#pragma omp parallel for schedule(static) if (rows * V > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = logits + r * ld;
    T* dr = dlogits + r * ld_out;
    std::fill(dr + V, dr + ld_out, scalar_cast<T>(0.0));  // the padding columns
    const std::int64_t t = targets[r];
    if (t == ignore_index) {
      std::fill_n(dr, V, scalar_cast<T>(0.0));
      continue;
    }
    const A l = lse[r];
    if constexpr (std::is_same_v<A, float>) {  // Note [vectorizable exp]
      vec::exp_scaled(xr, V, l, sc, dr);
    } else {
      for (std::int64_t j = 0; j < V; ++j) dr[j] = scalar_cast<T>(sc * std::exp(scalar_cast<A>(xr[j]) - l));
    }
    dr[t] = scalar_cast<T>(sc * (std::exp(scalar_cast<A>(xr[t]) - l) - A(1)));
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_NN, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

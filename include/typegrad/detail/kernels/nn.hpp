// Row kernels of the nn ops, declared once for every device (Note [kernels declared once]): softmax /
// log_softmax, layernorm / rmsnorm, embedding, cross-entropy. Defined in backends/cpu/nn.cpp and
// backends/cuda/nn.cu. Row ops work on a contiguous [rows, n] block, math in accum_t<T> (fp32 for 16-bit
// storage, fp64 for fp64); per-row statistics are stored in accum_t<T>. On the GPU the index pointers
// (embedding indices, cross-entropy targets) are HOST pointers (Note [CUDA entry points]).
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// softmax_forward:        y = softmax(x) (log_softmax when `log`) over each row, max-subtracted.
// softmax_backward:       softmax: dx = y ∘ (dy − Σ dy∘y); log_softmax: dx = dy − exp(y) · Σ dy (y: the output).
// scale_masked_softmax_forward: y = softmax(v) over each row of the contiguous x viewed as `shape` (its last
//                         dim n), v_j = T(x_j · s) (T(x_j / s) when `divide`; x_j when scale is null, s = *scale,
//                         a one-element tensor on the kernel's device), then v_j = fill where mask is nonzero (mask
//                         null: none; mask_strides are its strides in `shape`, 0 on broadcast dims). Each v_j is
//                         rounded to T as the separate ops store it, so y is softmax(masked_fill(mul(x, s), mask,
//                         fill)) bit for bit (Note [fused scale, mask and softmax]).
// scale_masked_softmax_backward: dx_j = T(T(mask_j ? 0 : T(y_j·(dy_j − Σ dy∘y))) · s) (or / s; no scale: the
//                         middle value), the separate ops' backward formulas and roundings in one pass.
// layernorm_forward:      y = (x − mean) · rstd · w + b per row, rstd = 1/sqrt(var + eps) (biased variance);
//                         writes mean, rstd.
// layernorm_backward:     x̂ = (x − mean)·rstd, g = dy∘w: dx = rstd·(g − mean(g) − x̂·mean(g∘x̂)),
//                         dw = Σ_rows dy∘x̂, db = Σ_rows dy, column sums in a fixed order. mean == nullptr
//                         means RMSNorm (x̂ = x·rstd, no mean(g) term). Any of dx, dw, db may be null.
// rmsnorm_forward:        y = x · rstd · w per row, rstd = 1/sqrt(mean(x²) + eps); writes rstd.
// embedding_forward:      out[i, :] = w[idx[i], :] for i < n (w [V, C]; indices already checked).
// embedding_backward:     dw[v, :] = Σ_{i: idx[i] = v} dout[i, :] (dw [V, C] overwritten), summed in position
//                         order in accum_t<T>: deterministic whatever the thread count.
// cross_entropy_forward:  per row r with target t_r ≠ ignore_index: loss_r = lse_r − x[r, t_r], row r of the
//                         logits being V elements from logits + r·ld (ld ≥ V: a narrowed view reads in place),
//                         lse_r = log Σ exp x[r, :]. Writes lse (every row) and loss[0] = (Σ loss_r in fp64) /
//                         count rounded to accum_t<T> (NaN when count is 0), count being the rows whose target
//                         is not ignore_index (the caller counts them on the host). The sum runs in row order
//                         on the CPU and in a fixed order on the GPU; nothing is read back (Note [the loss
//                         stays on the device]).
// cross_entropy_backward: dlogits[r, :] = s · (exp(x[r, :] − lse_r) − onehot(t_r)), zero for ignored rows, with
//                         s = dloss[0] / count rounded to the math type (0 when count is 0); dloss is the mean's
//                         upstream gradient, one accum_t<T> on the kernel's device. Row r of the logits starts
//                         at logits + r·ld, of dlogits at dlogits + r·ld_out (both ≥ V); dlogits' columns
//                         [V, ld_out) are written zero.
#define TG_KERNELS_NN(K, ...)                                                                                      \
  K(void, softmax_forward, (const T* x, T* y, std::int64_t rows, std::int64_t n, bool log), __VA_ARGS__)           \
  K(void, softmax_backward, (const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log),         \
    __VA_ARGS__)                                                                                                   \
  K(void, scale_masked_softmax_forward, (const T* x, const T* scale, bool divide, const std::uint8_t* mask,         \
                                         const Shape& mask_strides, T fill, T* y, const Shape& shape), __VA_ARGS__) \
  K(void, scale_masked_softmax_backward, (const T* y, const T* dy, const T* scale, bool divide,                     \
                                          const std::uint8_t* mask, const Shape& mask_strides, T* dx,              \
                                          const Shape& shape), __VA_ARGS__)                                        \
  K(void, layernorm_forward, (const T* x, const T* w, const T* b, T* y, accum_t<T>* mean, accum_t<T>* rstd,       \
                              std::int64_t rows, std::int64_t n, double eps), __VA_ARGS__)                         \
  K(void, layernorm_backward, (const T* x, const T* w, const accum_t<T>* mean, const accum_t<T>* rstd,             \
                               const T* dy, T* dx, T* dw, T* db, std::int64_t rows, std::int64_t n), __VA_ARGS__)  \
  K(void, rmsnorm_forward, (const T* x, const T* w, T* y, accum_t<T>* rstd, std::int64_t rows, std::int64_t n,    \
                            double eps), __VA_ARGS__)                                                              \
  K(void, embedding_forward, (const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C),        \
    __VA_ARGS__)                                                                                                   \
  K(void, embedding_backward, (const T* dout, const std::int64_t* idx, T* dw, std::int64_t n, std::int64_t V,      \
                               std::int64_t C), __VA_ARGS__)                                                       \
  K(void, cross_entropy_forward, (const T* logits, const std::int64_t* targets, accum_t<T>* lse,                   \
                                  accum_t<T>* loss, std::int64_t rows, std::int64_t V, std::int64_t ld,            \
                                  std::int64_t ignore_index, std::int64_t count), __VA_ARGS__)                     \
  K(void, cross_entropy_backward, (const T* logits, const std::int64_t* targets, const accum_t<T>* lse,            \
                                   const accum_t<T>* dloss, std::int64_t count, T* dlogits, std::int64_t rows,     \
                                   std::int64_t V, std::int64_t ld, std::int64_t ld_out, std::int64_t ignore_index), \
    __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_NN)

// Declarations of the CPU backend's fused optimizer kernels (backends/cpu/optim.cpp): one pass per tensor
// over contiguous buffers, OpenMP-parallel, explicitly instantiated for fp32 (and fp64 for checks).
//   tg::backend::cpu::adam_step<float>(p, g, m, v, n, tg::backend::cpu::AdamScalars{...});
//   double ss = tg::backend::cpu::sum_squares<float>(g, n);          // fp64 accumulation
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tg::backend::cpu {

// Note [optimizer scalars]
// Per-step scalars (bias corrections, step sizes) are computed by the caller in fp64 and rounded once to
// fp32 here, as PyTorch does when a Python float meets an fp32 tensor; element math is fp32 (T).

/// sum_i x[i]^2 in fp64.
template <class T>
double sum_squares(const T* x, std::int64_t n);
/// x[i] *= s.
template <class T>
void scale_inplace(T* x, std::int64_t n, double s);

struct SgdScalars {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first_step = false;  // buf is initialised to d_p (PyTorch's "clone on first use")
};
/// torch.optim.SGD for one tensor; `buf` may be null when momentum == 0.
template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars& s);

struct AdamScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = false;  // false: Adam (L2 added to g); true: AdamW (p *= 1 - lr*wd first)
  std::int64_t step = 1;   // this tensor's step count t >= 1, after increment
};
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars& s);

struct LambScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::int64_t step = 1;
};
/// Returns the trust ratio it used (1 when either norm is 0).
template <class T>
double lamb_step(T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s);
/// LAMB's trust ratio ||p|| / ||u|| from the sums of squares (1 when either is 0); shared with the CUDA kernel.
inline double lamb_trust_ratio(double p_sq_sum, double u_sq_sum) {
  return (p_sq_sum > 0 && u_sq_sum > 0) ? std::sqrt(p_sq_sum) / std::sqrt(u_sq_sum) : 1.0;
}

struct AdafactorScalars {
  double rho = 0;            // relative (or absolute) step size before parameter scaling
  bool scale_parameter = true;
  double beta2 = 0;          // beta2_t = 1 - t^(-decay)
  double eps1 = 1e-30, eps2 = 1e-3, clip_threshold = 1.0;
  double beta1 = 0;          // 0: no first moment (m may be null)
  double weight_decay = 0;
};
/// Factored second moment over a [rows, cols] view: r has rows entries, c has cols entries.
template <class T>
void adafactor_step_factored(T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,
                             const AdafactorScalars& s);
/// Full second moment v (vectors and scalars).
template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s);

/// The shared tail of Adafactor (CPU and CUDA): from sum U² and sum X² over n elements, the step size
/// alpha = rho * max(eps2, RMS(X)) (or rho) and the clipping divisor max(1, RMS(U) / d); the update is then
/// U / clip_div, [m = beta1 m + (1 - beta1) U], X -= alpha wd X + alpha (m or U).
struct AdafactorApply {
  double alpha, clip_div;
};
inline AdafactorApply adafactor_apply(const AdafactorScalars& s, double u_sq_sum, double p_sq_sum, std::int64_t n) {
  const double rms_u = std::sqrt(u_sq_sum / static_cast<double>(n));
  const double rms_p = std::sqrt(p_sq_sum / static_cast<double>(n));
  const double alpha = s.scale_parameter ? s.rho * std::max(s.eps2, rms_p) : s.rho;
  return {alpha, std::max(1.0, rms_u / s.clip_threshold)};
}

}  // namespace tg::backend::cpu

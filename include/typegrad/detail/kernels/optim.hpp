// Optimizer kernels shared by the devices, declared once (Note [kernels declared once]), with their scalar
// structs and the host-side helpers both backends use: per-tensor kernels (one pass per tensor over
// contiguous buffers; backends/cpu/optim.cpp for fp32 and fp64, backends/cuda/optim_tensor.cu for fp32) and
// the multi-tensor steps every optimizer of optim/ calls (one call per group of tensors sharing the scalars:
// one launch, or a fixed few, for the whole group on CUDA, backends/cuda/optim.cu and optim_tensor.cu; the
// per-tensor kernels in a loop on the CPU, backends/cpu/optim.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "typegrad/detail/kernels/declare.hpp"

namespace tg::backend {

// Note [optimizer scalars]
// Per-step scalars (bias corrections, step sizes) are computed by the caller in fp64 and rounded once to
// fp32 here, as PyTorch does when a Python float meets an fp32 tensor; element math is fp32 (T).

struct SgdScalars {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first_step = false;  // buf is initialised to d_p (PyTorch's "clone on first use")
};

struct AdamScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = false;  // false: Adam (L2 added to g); true: AdamW (p *= 1 - lr*wd first)
  std::int64_t step = 1;   // this tensor's step count t >= 1, after increment
};

struct LambScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::int64_t step = 1;
};
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

/// The 16-bit compute copy an Adam step writes with each updated element (Note [the optimizer writes the
/// weight copies]), or none.
enum class WeightCopyType : std::uint8_t { none, bf16, fp16 };
/// One parameter of a multi-tensor step: contiguous buffers of n elements on the kernel's device. With
/// copy_type != none (Adam / AdamW over fp32 masters only), `copy` holds n elements of that type and the step
/// writes copy[i] = its updated p[i] rounded to nearest even, as the weight copies' refresh converts it.
template <class T>
struct AdamTensor {
  T* p;
  const T* g;
  T* m;
  T* v;
  std::int64_t n;
  void* copy = nullptr;
  WeightCopyType copy_type = WeightCopyType::none;
};
/// One parameter of a multi-tensor SGD step; `buf` (the momentum buffer) may be null without momentum.
template <class T>
struct SgdTensor {
  T* p;
  const T* g;
  T* buf;
  std::int64_t n;
};
/// One parameter of a multi-tensor LAMB step (m, v: its moments).
template <class T>
using LambTensor = AdamTensor<T>;
/// One parameter of a multi-tensor Adafactor step, viewed as [rows, cols] (adafactor_rows / _cols). A
/// factored one has r (rows entries) and c (cols entries) and v == nullptr; a full one has v (rows·cols
/// entries) and r == c == nullptr. m (the first moment) may be null when beta1 == 0.
template <class T>
struct AdafactorTensor {
  T* p;
  const T* g;
  T* r;
  T* c;
  T* v;
  T* m;
  std::int64_t rows, cols;
};

}  // namespace tg::backend

// sgd_step:                torch.optim.SGD for one tensor; `buf` may be null when momentum == 0.
// lamb_step:               LAMB for one tensor; returns the trust ratio it used (1 when either norm is 0).
// adafactor_step_factored: factored second moment over a [rows, cols] view: r has rows entries, c has cols.
// adafactor_step_full:     full second moment v (vectors and scalars).
#define TG_KERNELS_OPTIM(K, ...)                                                                                     K(void, sgd_step, (T* p, const T* g, T* buf, std::int64_t n, const SgdScalars& s), __VA_ARGS__)                   K(double, lamb_step, (T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s), __VA_ARGS__)            K(void, adafactor_step_factored, (T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,                                         const AdafactorScalars& s), __VA_ARGS__)                                         K(void, adafactor_step_full, (T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s),             __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_OPTIM)

// The multi-tensor steps: `count` tensors sharing one set of scalars (Note [optimizer state]: one parameter
// group's lr and weight decay, one step count). Each element runs the per-tensor kernels' formula
// (detail/math.hpp's element functions), so a multi-tensor step equals its tensors' per-tensor steps.
// adam_step_multi:      Adam / AdamW (Note [Adam update]).
// sgd_step_multi:       torch.optim.SGD; every buf must be set when momentum != 0.
// lamb_step_multi:      LAMB; writes each tensor's trust ratio to trust_ratios (host memory, count entries)
//                       when it is not null. CUDA: two launches and one read-back of per-chunk fp64 sums.
// adafactor_step_multi: Adafactor, factored or full per tensor. CUDA: six launches and one read-back.
#define TG_KERNELS_OPTIM_MULTI(K, ...)                                                                              \
  K(void, adam_step_multi, (const AdamTensor<T>* tensors, int count, const AdamScalars& s), __VA_ARGS__)              \
  K(void, sgd_step_multi, (const SgdTensor<T>* tensors, int count, const SgdScalars& s), __VA_ARGS__)                 \
  K(void, lamb_step_multi, (const LambTensor<T>* tensors, int count, const LambScalars& s, double* trust_ratios),     \
    __VA_ARGS__)                                                                                                     \
  K(void, adafactor_step_multi, (const AdafactorTensor<T>* tensors, int count, const AdafactorScalars& s), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_OPTIM_MULTI)

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
#include "typegrad/detail/macros.hpp"

namespace tg::backend {

// Note [optimizer scalars]
// Per-step scalars (bias corrections, step sizes) are computed by the caller in fp64 and rounded once to
// fp32 here, as PyTorch does when a Python float meets an fp32 tensor; element math is fp32 (T).

struct SgdScalars {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first_step = false;  // buf is initialised to d_p (PyTorch's "clone on first use")
  /// Note [the step boundary on the device]: as AdamScalars::boundary (skip and lr; SGD has no step count).
  const double* boundary = nullptr;
  float lr_scale = 1.f;
};

struct AdamScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = false;  // false: Adam (L2 added to g); true: AdamW (p *= 1 - lr*wd first)
  std::int64_t step = 1;   // this tensor's step count t >= 1, after increment
  /// Note [the step boundary on the device]: when set, the kernel reads the step from this state on its
  /// device instead of lr and step above: nothing is updated when state[kSkip] != 0, else lr =
  /// float(state[kLr]) · lr_scale (the group's lr, as set_lr computes it) and the bias corrections of
  /// t = state[kStep] + 1 are state[kBiasCorrection1], [kBiasCorrection2] (the host's pow, written by begin).
  const double* boundary = nullptr;
  float lr_scale = 1.f;
  double bc1 = 0, bc2 = 0;  // set by resolve_boundary
};

// Note [the step boundary on the device]
// A training step's boundary (unscale, the inf/NaN check, clipping, the optimizer step) decides on values the
// step computed: the losses, whether a gradient overflowed, the global norm. The host boundary
// (optim/grad_accum.hpp) reads them to decide; on a GPU each read waits for the queue to drain, and a step
// captured as one CUDA graph cannot read at all. The device boundary (optim/device_boundary.hpp) keeps every
// such value in one small fp64 state on the step's device, written and read by these kernels in the stream's
// order:
//   boundary_begin       the host's part, once per step before its first forward: the schedule's lr, the
//                        optimizer's update count t-1 and its step constants (Adam's bias corrections of
//                        t, computed on the host as the host boundary computes them), the loss scale S, and
//                        the backward's loss factor float(S / n) (n micro-batches); the rest cleared. It reads
//                        them from memory on its device (a BoundaryStart, the first part of the step inputs
//                        that DeviceBoundary::begin uploads), so its arguments are the same every step (Note
//                        [graph blockers]).
//   boundary_note_loss   each micro-batch: loss sum += loss / n; the first non-finite loss remembered.
//   boundary_unscale     g *= float(1 / S) for every gradient; found_inf when any was inf or NaN.
//   boundary_sum_squares Σ g² in fp64 over the gradients the norm counts.
//   boundary_decide      skip = found_inf (with a scaler that scales the loss) or, under OnNonFinite stop or
//                        skip, a non-finite loss or norm; the norm and the clipping factor.
//   boundary_clip        g *= float(coef) when the step is taken and coef < 1.
// In a data-parallel step the ranks' losses, flags and (for sharded gradients) squared norms are summed in
// place over the ranks between boundary_sum_squares and boundary_decide, on the device (Note [the device
// boundary across ranks]).
// The optimizer's kernel then reads skip, lr and t from the state (AdamScalars::boundary). The host reads the
// state once after the step (one download) to report it and to advance its own counters (the scaler's
// update, the schedule, the step counts) exactly as the host boundary does; the next begin hands the new
// scale back. Every value is computed with the host boundary's fp64 arithmetic and its kernels (Adam's bias
// corrections are the host's, handed over by begin), so the two boundaries are the same bit for bit: on the CPU
// (tests/train/test_device_boundary.cpp) and, by the same construction, on a GPU (tests/cuda/test_cuda_boundary.cpp).
enum BoundarySlot : int {
  kLr = 0,          // the schedule's lr for this step (host-written)
  kStep,            // the optimizer's update count before this step (host-written)
  kScale,           // the loss scale S of this step's backward (host-written; 1 without a scaler)
  // kLoss .. kSumSquares are adjacent: a data-parallel step sums them over the ranks in place (Note [the
  // device boundary across ranks], optim/device_boundary.hpp).
  kLoss,            // Σ micro-batch loss / n (over the ranks: their sum)
  kBadLoss,         // 1 when a micro-batch loss was inf or NaN (over the ranks: how many had one)
  kFoundInf,        // 1 when unscale met an inf or NaN gradient (over the ranks: how many did)
  kSumSquares,      // Σ g² of the gradients the norm counts (sharded gradients: over the ranks)
  kBadLossValue,    // this rank's first non-finite loss (0 when it had none)
  kNorm,            // sqrt(kSumSquares)
  kNormMeasured,    // 1 when the norm was measured (clipping or a non-finite check, and no overflow)
  kCoef,            // the clipping factor (1: no clipping)
  kSkip,            // 1 when the step is skipped: the optimizer updates nothing
  kBiasCorrection1, // Adam's 1 - β1^t for this step's t (host-written)
  kBiasCorrection2, // Adam's 1 - β2^t
  kBoundarySize
};
/// What boundary_begin writes: the host's values of the step.
struct BoundaryStart {
  double lr = 0;      // the schedule's lr
  double step = 0;    // the optimizer's update count before the step (t - 1)
  double bc1 = 1, bc2 = 1;  // the optimizer's step constants for t (Adam's 1 - β1^t, 1 - β2^t; 1 otherwise)
  double scale = 1;   // the loss scale S
  double inv_n = 1;   // 1 / micro-batches
};
/// What the host writes to the step's device before each step decided there: the boundary's start and the
/// Philox base of the step's dropouts (Note [the Philox base in memory]), one upload.
struct StepInputs {
  BoundaryStart start;
  std::uint64_t philox_base = 0;
};
/// What boundary_decide decides by (constant over a run).
struct BoundaryRule {
  bool scaler_checks = false;     // a loss scaler scales the loss: its overflow check decides (fp16)
  bool check_non_finite = false;  // OnNonFinite stop or skip, without a checking scaler
  bool clip = false;
  double max_norm = 0;
};

struct LambScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  std::int64_t step = 1;
  /// Note [the step boundary on the device]: as AdamScalars::boundary (skip, lr · lr_scale, t and the bias
  /// corrections 1 - β^t, which LAMB shares with Adam, from the state).
  const double* boundary = nullptr;
  float lr_scale = 1.f;
  double bc1 = 0, bc2 = 0;  // set by resolve_boundary
};
/// LAMB's trust ratio ||p|| / ||u|| from the sums of squares (1 when either is 0); shared with the CUDA kernel.
TG_HOST_DEVICE inline double lamb_trust_ratio(double p_sq_sum, double u_sq_sum) {
  return (p_sq_sum > 0 && u_sq_sum > 0) ? std::sqrt(p_sq_sum) / std::sqrt(u_sq_sum) : 1.0;
}

struct AdafactorScalars {
  double rho = 0;            // relative (or absolute) step size before parameter scaling
  bool scale_parameter = true;
  double beta2 = 0;          // beta2_t = 1 - t^(-decay)
  double eps1 = 1e-30, eps2 = 1e-3, clip_threshold = 1.0;
  double beta1 = 0;          // 0: no first moment (m may be null)
  double weight_decay = 0;
  /// Note [the step boundary on the device]: when set, the kernels take skip, lr (float(state[kLr]) ·
  /// lr_scale) and the step constants from the state: β̂2_t = state[kBiasCorrection1] and 1/sqrt(t) =
  /// state[kBiasCorrection2] (the host's, written by begin), ρ = min(lr, 1/sqrt(t)) with relative_step, else lr.
  const double* boundary = nullptr;
  float lr_scale = 1.f;
  bool relative_step = false;
};

/// The shared tail of Adafactor (CPU and CUDA): from sum U² and sum X² over n elements, the step size
/// alpha = rho * max(eps2, RMS(X)) (or rho) and the clipping divisor max(1, RMS(U) / d); the update is then
/// U / clip_div, [m = beta1 m + (1 - beta1) U], X -= alpha wd X + alpha (m or U).
struct AdafactorApply {
  double alpha, clip_div;
};
TG_HOST_DEVICE inline AdafactorApply adafactor_apply(const AdafactorScalars& s, double u_sq_sum, double p_sq_sum, std::int64_t n) {
  const double rms_u = std::sqrt(u_sq_sum / static_cast<double>(n));
  const double rms_p = std::sqrt(p_sq_sum / static_cast<double>(n));
  const double alpha = s.scale_parameter ? s.rho * (s.eps2 < rms_p ? rms_p : s.eps2) : s.rho;  // std::max's choice, NaN included
  const double ratio = rms_u / s.clip_threshold;
  return {alpha, 1.0 < ratio ? ratio : 1.0};
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
// lamb_step_multi:      LAMB; writes each tensor's trust ratio to trust_ratios (count fp64 entries on the
//                       kernel's device) when it is not null and the step is taken. CUDA: three launches
//                       (moments and per-chunk fp64 sums; per-tensor ratios; the update) and no read-back.
// adafactor_step_multi: Adafactor, factored or full per tensor. CUDA: seven launches (the step sizes
//                       computed per tensor on the device) and no read-back.
#define TG_KERNELS_OPTIM_MULTI(K, ...)                                                                              \
  K(void, adam_step_multi, (const AdamTensor<T>* tensors, int count, const AdamScalars& s), __VA_ARGS__)              \
  K(void, sgd_step_multi, (const SgdTensor<T>* tensors, int count, const SgdScalars& s), __VA_ARGS__)                 \
  K(void, lamb_step_multi, (const LambTensor<T>* tensors, int count, const LambScalars& s, double* trust_ratios),     \
    __VA_ARGS__)                                                                                                     \
  K(void, adafactor_step_multi, (const AdafactorTensor<T>* tensors, int count, const AdafactorScalars& s), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_OPTIM_MULTI)

// The device boundary's kernels (Note [the step boundary on the device]); `state` holds kBoundarySize fp64
// values on the kernel's device; `grads` and `sizes` are host arrays of `count` contiguous fp32 gradients.
#define TG_KERNELS_BOUNDARY(K, ...)                                                                                \
  K(void, boundary_begin, (double* state, T* loss_factor, const BoundaryStart* start), __VA_ARGS__)                \
  K(void, boundary_note_loss, (double* state, const T* loss, double n), __VA_ARGS__)                               \
  K(void, boundary_unscale, (T* const* grads, const std::int64_t* sizes, int count, double* state), __VA_ARGS__)   \
  K(void, boundary_sum_squares, (const T* const* grads, const std::int64_t* sizes, int count, double* state),      \
    __VA_ARGS__)                                                                                                   \
  K(void, boundary_decide, (double* state, const BoundaryRule& rule), __VA_ARGS__)                                 \
  K(void, boundary_clip, (T* const* grads, const std::int64_t* sizes, int count, const double* state), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_BOUNDARY)

namespace tg::backend {
/// std::isfinite for the device: x - x is 0 for finite x and NaN for inf or NaN.
TG_HOST_DEVICE inline bool boundary_finite(double x) { return x - x == 0.0; }
/// boundary_decide's arithmetic, shared by the CPU and the CUDA kernel (one thread): the host boundary's
/// order and formulas (optim/grad_accum.hpp, optim/clip.hpp), the same fp64 operations.
TG_HOST_DEVICE inline void boundary_decide_values(double* st, const BoundaryRule& r) {
  const bool found_inf = r.scaler_checks && st[kFoundInf] != 0;
  const bool check = r.check_non_finite && !r.scaler_checks;
  const double norm = std::sqrt(st[kSumSquares]);
  bool skip = found_inf;
  if (!found_inf && check) skip = st[kBadLoss] != 0 || !boundary_finite(norm);
  st[kNorm] = norm;
  st[kNormMeasured] = !found_inf && (r.clip || check) ? 1.0 : 0.0;
  double coef = 1.0;
  if (!skip && r.clip && boundary_finite(norm)) {
    const double c = r.max_norm / (norm + 1e-6);
    if (c < 1.0) coef = c;
  }
  st[kCoef] = coef;
  st[kSkip] = skip ? 1.0 : 0.0;
}
/// boundary_begin's writes, shared by the CPU and the CUDA kernel (one thread).
template <class T>
TG_HOST_DEVICE inline void boundary_begin_values(double* st, T* loss_factor, const BoundaryStart& b) {
  for (int i = 0; i < kBoundarySize; ++i) st[i] = 0;
  st[kLr] = b.lr;
  st[kStep] = b.step;
  st[kBiasCorrection1] = b.bc1;
  st[kBiasCorrection2] = b.bc2;
  st[kScale] = b.scale;
  st[kCoef] = 1;
  *loss_factor = static_cast<T>(b.scale * b.inv_n);  // accum.scale(loss, scaler)'s factor
}
/// The Adafactor scalars of a step decided on the device (AdafactorScalars::boundary); false: the step is skipped.
TG_HOST_DEVICE inline bool resolve_boundary(AdafactorScalars& s) {
  if (!s.boundary) return true;
  if (s.boundary[kSkip] != 0) return false;
  const double lr = static_cast<double>(static_cast<float>(s.boundary[kLr]) * s.lr_scale);
  const double inv_sqrt_t = s.boundary[kBiasCorrection2];
  s.rho = s.relative_step ? (inv_sqrt_t < lr ? inv_sqrt_t : lr) : lr;  // std::min(lr, 1/sqrt(t))
  s.beta2 = s.boundary[kBiasCorrection1];
  return true;
}
/// The SGD scalars of a step decided on the device (SgdScalars::boundary); false: the step is skipped.
TG_HOST_DEVICE inline bool resolve_boundary(SgdScalars& s) {
  if (!s.boundary) return true;
  if (s.boundary[kSkip] != 0) return false;
  s.lr = static_cast<double>(static_cast<float>(s.boundary[kLr]) * s.lr_scale);
  return true;
}
/// Adam's and LAMB's scalars of a step decided on the device (their `boundary`): skip, lr · lr_scale, t and the
/// bias corrections 1 - β^t from the state; false: the step is skipped.
template <class Scalars>
TG_HOST_DEVICE inline bool resolve_bias_corrected(Scalars& s) {
  if (!s.boundary) return true;
  if (s.boundary[kSkip] != 0) return false;
  s.lr = static_cast<double>(static_cast<float>(s.boundary[kLr]) * s.lr_scale);
  s.step = static_cast<std::int64_t>(s.boundary[kStep]) + 1;
  s.bc1 = s.boundary[kBiasCorrection1];
  s.bc2 = s.boundary[kBiasCorrection2];
  return true;
}
/// The LAMB scalars of a step decided on the device (LambScalars::boundary); false: the step is skipped.
TG_HOST_DEVICE inline bool resolve_boundary(LambScalars& s) { return resolve_bias_corrected(s); }
/// The Adam scalars of a step decided on the device (AdamScalars::boundary); false: the step is skipped.
TG_HOST_DEVICE inline bool resolve_boundary(AdamScalars& s) { return resolve_bias_corrected(s); }
}  // namespace tg::backend

// Scalar math shared by CPU and CUDA kernels (__host__ __device__), so the GPU's elementwise formulas
// are the ones tested on the CPU. All in the accumulation type (fp32 for 16-bit storage).
//   float y = tg::math::gelu_tanh(x);  float dy = tg::math::gelu_tanh_grad(x);
#pragma once

#include <cmath>

#include "typegrad/detail/macros.hpp"

namespace tg::math {

enum class Binary : unsigned char { add, sub, mul, div };

template <class A>
TG_HOST_DEVICE TG_INLINE A apply(Binary op, A a, A b) {
  switch (op) {
    case Binary::add: return a + b;
    case Binary::sub: return a - b;
    case Binary::mul: return a * b;
    case Binary::div: return a / b;
  }
  return a;
}

}  // namespace tg::math

// ---- unary elementwise ops (ops/unary.hpp) ----------------------------------------------------------
// Forward y = f(x) and derivative dy/dx, in the accumulation type A. grad(op, x, y) reads only the
// value the op's backward saves: the output for exp, sqrt, rsqrt, tanh, sigmoid, relu (uses_output),
// the input otherwise; the other argument is ignored and may be anything.
namespace tg::math {

enum class Unary : unsigned char { exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu_tanh, gelu_erf, silu };

/// Whether the backward of `op` saves its output (true) or its input (false).
TG_HOST_DEVICE constexpr bool uses_output(Unary op) {
  return op == Unary::exp || op == Unary::sqrt || op == Unary::rsqrt || op == Unary::tanh || op == Unary::sigmoid ||
         op == Unary::relu;
}

/// 1 / (1 + e^-x); for x < 0 computed as e^x / (1 + e^x) so e^-x never overflows.
template <class A>
TG_HOST_DEVICE TG_INLINE A sigmoid(A x) {
  if (x >= A(0)) return A(1) / (A(1) + std::exp(-x));
  const A e = std::exp(x);
  return e / (A(1) + e);
}

// GELU, tanh form (Hendrycks & Gimpel 2016, eq. in §2; GPT-2's "gelu_new"):
//   gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Evaluated as x·sigmoid(2u) (0.5(1 + tanh u) = sigmoid(2u)), which avoids the cancellation of 1 + tanh u
// for negative x.
template <class A>
TG_HOST_DEVICE TG_INLINE A gelu_tanh(A x) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  return x * sigmoid(A(2) * k * (x + c * x * x * x));
}
/// d/dx gelu_tanh = s + x s (1 - s) · 2 sqrt(2/pi) (1 + 3·0.044715 x^2), s = sigmoid(2u).
template <class A>
TG_HOST_DEVICE TG_INLINE A gelu_tanh_grad(A x) {
  const A k = A(0.7978845608028654), c = A(0.044715);
  const A s = sigmoid(A(2) * k * (x + c * x * x * x));
  return s + x * s * (A(1) - s) * A(2) * k * (A(1) + A(3) * c * x * x);
}

// GELU, exact form: gelu(x) = x Φ(x) = 0.5 x erfc(-x / sqrt 2) (erfc keeps precision for x << 0).
template <class A>
TG_HOST_DEVICE TG_INLINE A gelu_erf(A x) {
  return A(0.5) * x * std::erfc(-x * A(0.7071067811865476));
}
/// d/dx gelu_erf = Φ(x) + x φ(x), φ(x) = e^{-x^2/2} / sqrt(2 pi).
template <class A>
TG_HOST_DEVICE TG_INLINE A gelu_erf_grad(A x) {
  return A(0.5) * std::erfc(-x * A(0.7071067811865476)) + x * A(0.3989422804014327) * std::exp(A(-0.5) * x * x);
}

template <class A>
TG_HOST_DEVICE TG_INLINE A apply(Unary op, A x) {
  switch (op) {
    case Unary::exp: return std::exp(x);
    case Unary::log: return std::log(x);
    case Unary::sqrt: return std::sqrt(x);
    case Unary::rsqrt: return A(1) / std::sqrt(x);
    case Unary::tanh: return std::tanh(x);
    case Unary::sigmoid: return sigmoid(x);
    case Unary::relu: return x < A(0) ? A(0) : x;  // NaN propagates
    case Unary::gelu_tanh: return gelu_tanh(x);
    case Unary::gelu_erf: return gelu_erf(x);
    case Unary::silu: return x * sigmoid(x);
  }
  return x;
}

/// dy/dx of `op` at x (with y = apply(op, x)); reads y when uses_output(op), else x.
template <class A>
TG_HOST_DEVICE TG_INLINE A grad(Unary op, A x, A y) {
  switch (op) {
    case Unary::exp: return y;                            // d e^x = e^x
    case Unary::log: return A(1) / x;                     // d log x = 1/x
    case Unary::sqrt: return A(0.5) / y;                  // d sqrt x = 1 / (2 sqrt x)
    case Unary::rsqrt: return A(-0.5) * y * y * y;        // d x^-1/2 = -x^-3/2 / 2
    case Unary::tanh: return A(1) - y * y;                // d tanh = 1 - tanh^2
    case Unary::sigmoid: return y * (A(1) - y);           // d s = s (1 - s)
    case Unary::relu: return y > A(0) ? A(1) : A(0);      // subgradient 0 at x = 0
    case Unary::gelu_tanh: return gelu_tanh_grad(x);
    case Unary::gelu_erf: return gelu_erf_grad(x);
    case Unary::silu: {                                   // d x s(x) = s (1 + x (1 - s))
      const A s = sigmoid(x);
      return s * (A(1) + x * (A(1) - s));
    }
  }
  return A(0);
}

/// Dropout's keep rule (ops/dropout.hpp): element i survives iff its uniform draw u_i >= p.
TG_HOST_DEVICE TG_INLINE bool dropout_keep(float u, float p) { return u >= p; }

}  // namespace tg::math

// ---- optimizer element updates (backends/cpu/optim.cpp's Adam loop, and the CUDA multi-tensor kernel) -------
namespace tg::math {

/// Per-step Adam constants, computed in fp64 and rounded once to T (Note [optimizer scalars]).
template <class T>
struct AdamConsts {
  T step_size, bc2_sqrt, b1, b2, one_b1, one_b2, eps, wd, decay;
  bool l2, decoupled;
};
/// The bias corrections 1 - β^t of step t >= 1 (the host's pow; a device boundary gets them from the host).
inline double adam_bias_correction(double beta, long long step) { return 1.0 - std::pow(beta, static_cast<double>(step)); }
/// adam_consts from the bias corrections bc1 = 1 - β1^t, bc2 = 1 - β2^t. Every fp64 operation is rounded on
/// its own on both devices (no fused multiply-add on the GPU), so both compute the same constants.
template <class T>
TG_HOST_DEVICE inline AdamConsts<T> adam_consts_from(double lr, double bc1, double bc2, double beta1, double beta2, double eps,
                                                     double weight_decay, bool decoupled) {
#ifdef __CUDA_ARCH__
  const double decay = __dsub_rn(1.0, __dmul_rn(lr, weight_decay));
#else
  const double decay = 1.0 - lr * weight_decay;
#endif
  return {static_cast<T>(lr / bc1),       static_cast<T>(std::sqrt(bc2)), static_cast<T>(beta1),
          static_cast<T>(beta2),          static_cast<T>(1.0 - beta1),    static_cast<T>(1.0 - beta2),
          static_cast<T>(eps),            static_cast<T>(weight_decay),   static_cast<T>(decay),
          !decoupled && weight_decay != 0.0, decoupled && weight_decay != 0.0};
}
/// decoupled: AdamW (p *= 1 - lr·wd before the update); else Adam with L2 (g += wd·p). step >= 1.
template <class T>
inline AdamConsts<T> adam_consts(double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled,
                                 long long step) {
  return adam_consts_from<T>(lr, adam_bias_correction(beta1, step), adam_bias_correction(beta2, step), beta1, beta2, eps,
                             weight_decay, decoupled);
}
/// One element of Adam / AdamW: m = β1 m + (1-β1) g, v = β2 v + (1-β2) g², p -= lr/bc1 · m / (√v/√bc2 + ε).
template <class T>
TG_HOST_DEVICE TG_INLINE void adam_update(T& p, T g, T& m, T& v, const AdamConsts<T>& c) {
  if (c.decoupled) p = p * c.decay;
  if (c.l2) g = g + c.wd * p;
  m = m * c.b1 + c.one_b1 * g;
  v = v * c.b2 + c.one_b2 * g * g;
  const T denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p - c.step_size * m / denom;
}

/// Per-step SGD constants (torch.optim.SGD), rounded once to T.
template <class T>
struct SgdConsts {
  T lr, mu, wd, damp;
  bool use_mom, first, nesterov, use_wd;
};
template <class T>
inline SgdConsts<T> sgd_consts(double lr, double momentum, double dampening, double weight_decay, bool nesterov,
                               bool first_step) {
  return {static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(weight_decay), static_cast<T>(1.0 - dampening),
          momentum != 0.0, first_step, nesterov, weight_decay != 0.0};
}
/// One element of SGD: d = g + wd·p; buf = μ·buf + (1-τ)·d (d on the first step); d = nesterov ? d + μ·buf : buf;
/// p -= lr·d. `buf` is not touched without momentum.
template <class T>
TG_HOST_DEVICE TG_INLINE void sgd_update(T& p, T g, T& buf, const SgdConsts<T>& c) {
  T d = g;
  if (c.use_wd) d = d + c.wd * p;
  if (c.use_mom) {
    const T b = c.first ? d : c.mu * buf + c.damp * d;
    buf = b;
    d = c.nesterov ? d + c.mu * b : b;
  }
  p = p - c.lr * d;
}

/// Per-step LAMB constants, rounded once to T.
template <class T>
struct LambConsts {
  T inv_bc1, inv_bc2, b1, b2, one_b1, one_b2, eps, wd;
};
/// lamb_consts from the bias corrections bc1 = 1 - β1^t, bc2 = 1 - β2^t (a device boundary's, written by the
/// host): single fp64 operations, rounded alike on both devices.
template <class T>
TG_HOST_DEVICE inline LambConsts<T> lamb_consts_from(double bc1, double bc2, double beta1, double beta2, double eps,
                                                     double weight_decay) {
  return {static_cast<T>(1.0 / bc1),      static_cast<T>(1.0 / bc2),      static_cast<T>(beta1), static_cast<T>(beta2),
          static_cast<T>(1.0 - beta1),    static_cast<T>(1.0 - beta2),    static_cast<T>(eps),   static_cast<T>(weight_decay)};
}
/// LAMB's constants of step t >= 1.
template <class T>
inline LambConsts<T> lamb_consts(double beta1, double beta2, double eps, double weight_decay, long long step) {
  return lamb_consts_from<T>(adam_bias_correction(beta1, step), adam_bias_correction(beta2, step), beta1, beta2, eps, weight_decay);
}
/// LAMB's moments for one element: m = β1 m + (1-β1) g, v = β2 v + (1-β2) g².
template <class T>
TG_HOST_DEVICE TG_INLINE void lamb_moments(T g, T& m, T& v, const LambConsts<T>& c) {
  m = m * c.b1 + c.one_b1 * g;
  v = v * c.b2 + c.one_b2 * g * g;
}
/// LAMB's update direction for one element: u = m̂ / (√v̂ + ε) + wd·p (both passes compute it the same way).
template <class T>
TG_HOST_DEVICE TG_INLINE T lamb_direction(T p, T m, T v, const LambConsts<T>& c) {
  return (m * c.inv_bc1) / (std::sqrt(v * c.inv_bc2) + c.eps) + c.wd * p;
}

/// Adafactor's full second moment for one element (vectors and scalars): v = β2_t·v + (1 − β2_t)·(g² + ε1).
template <class T>
TG_HOST_DEVICE TG_INLINE T adafactor_moment(T v, T g, T b2, T one_b2, T eps1) {
  return b2 * v + one_b2 * (g * g + eps1);
}
/// Adafactor's per-tensor update constants (Note [Adafactor update]): the step size α and the clipping
/// divisor from backend::adafactor_apply, the decay, β1; rounded once to T.
template <class T>
struct AdafactorConsts {
  T alpha, inv_clip, wd, b1, one_b1;
  bool use_m;
};
template <class T>
inline AdafactorConsts<T> adafactor_consts(double alpha, double clip_div, double weight_decay, double beta1) {
  return {static_cast<T>(alpha), static_cast<T>(1.0 / clip_div), static_cast<T>(weight_decay), static_cast<T>(beta1),
          static_cast<T>(1.0 - beta1), beta1 != 0.0};
}
/// U = g / sqrt(V̂) for one element (the norms pass and the update compute it the same way).
template <class T>
TG_HOST_DEVICE TG_INLINE T adafactor_u(T g, T v_hat) {
  return g / std::sqrt(v_hat);
}
/// One element of Adafactor's update: Û = U / clip; [m = β1·m + (1 − β1)·Û, Û = m]; p = p − α·λ·p − α·Û.
/// `m` may be null (no first moment).
template <class T>
TG_HOST_DEVICE TG_INLINE void adafactor_update(T& p, T g, T v_hat, T* m, const AdafactorConsts<T>& c) {
  T upd = adafactor_u(g, v_hat) * c.inv_clip;
  if (c.use_m && m) upd = *m = c.b1 * *m + c.one_b1 * upd;
  p = p - c.alpha * c.wd * p - c.alpha * upd;
}

/// Finite (not inf, not NaN) without relying on libm: x - x is 0 exactly for finite x, NaN otherwise.
TG_HOST_DEVICE TG_INLINE bool is_finite(float x) { return x - x == 0.0f; }

}  // namespace tg::math

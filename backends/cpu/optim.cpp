// Fused optimizer kernels: SGD, LAMB and Adafactor (declared once for both devices in detail/kernels/optim.hpp),
// Adam and the norms (detail/cpu/optim_kernels.hpp). Each reads and writes a tensor's
// parameter, gradient and state once per pass; none allocates. The update rules, with their references,
// are written out in include/typegrad/optim/*.hpp; the comments here only map them to passes.
#include <algorithm>
#include <cmath>

#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kGrain = 1 << 14;  // elements below which a loop stays on one thread
constexpr std::int64_t kColBlock = 64;    // Adafactor column sums: columns per thread-local block
}  // namespace

template <class T>
double sum_squares(const T* x, std::int64_t n) {
  double acc = 0;
#pragma omp parallel for schedule(static) reduction(+ : acc) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) acc += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return acc;
}

template <class T>
void scale_inplace(T* x, std::int64_t n, double s) {
  const T sc = static_cast<T>(s);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) x[i] *= sc;
}

// One pass: d = g + wd·p; buf = μ·buf + (1-τ)·d (buf = d on the first step); d = nesterov ? d + μ·buf : buf;
// p -= lr·d.
template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars& s) {
  const auto c = math::sgd_consts<T>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
  if (c.use_mom) {
#pragma omp parallel for schedule(static) if (n > kGrain)
    for (std::int64_t i = 0; i < n; ++i) math::sgd_update(p[i], g[i], buf[i], c);
  } else {
#pragma omp parallel for schedule(static) if (n > kGrain)
    for (std::int64_t i = 0; i < n; ++i) {
      T unused{};
      math::sgd_update(p[i], g[i], unused, c);
    }
  }
}

// One pass (PyTorch's single-tensor order): [AdamW: p *= 1 - lr·wd] [Adam: g += wd·p];
// m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²; p -= (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + ε).
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars& s) {
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const T step_size = static_cast<T>(s.lr / bc1), bc2_sqrt = static_cast<T>(std::sqrt(bc2));
  const T b1 = static_cast<T>(s.beta1), b2 = static_cast<T>(s.beta2);
  const T one_b1 = static_cast<T>(1.0 - s.beta1), one_b2 = static_cast<T>(1.0 - s.beta2);
  const T eps = static_cast<T>(s.eps), wd = static_cast<T>(s.weight_decay);
  const T decay = static_cast<T>(1.0 - s.lr * s.weight_decay);
  const bool l2 = !s.decoupled && s.weight_decay != 0.0, decoupled = s.decoupled && s.weight_decay != 0.0;
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    T pi = p[i], gi = g[i];
    if (decoupled) pi = pi * decay;
    if (l2) gi = gi + wd * pi;
    const T mi = m[i] * b1 + one_b1 * gi;
    const T vi = v[i] * b2 + one_b2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const T denom = std::sqrt(vi) / bc2_sqrt + eps;
    p[i] = pi - step_size * mi / denom;
  }
}

// Pass 1 updates m, v and accumulates ||p||², ||u||² with u = m̂/(sqrt(v̂)+ε) + wd·p; pass 2 recomputes u
// (cheaper than a scratch buffer) and applies p -= lr·trust·u.
template <class T>
double lamb_step(T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s) {
  const auto c = math::lamb_consts<T>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  double pn = 0, un = 0;
#pragma omp parallel for schedule(static) reduction(+ : pn, un) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    math::lamb_moments(g[i], m[i], v[i], c);
    const T u = math::lamb_direction(p[i], m[i], v[i], c);
    pn += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    un += static_cast<double>(u) * static_cast<double>(u);
  }
  const double trust = lamb_trust_ratio(pn, un);
  const T scale = static_cast<T>(s.lr * trust);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) p[i] = p[i] - scale * math::lamb_direction(p[i], m[i], v[i], c);
  return trust;
}


// Pass 1: row sums of G²+ε1 (parallel over rows) and column sums (parallel over blocks of columns, a
// thread-local fp64 accumulator per block), then R, C updated with β2_t. Pass 2: RMS(U), RMS(X).
// Pass 3: the update.
template <class T>
void adafactor_step_factored(T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,
                             const AdafactorScalars& s) {
  const std::int64_t n = rows * cols;
  const double b2 = s.beta2, one_b2 = 1.0 - s.beta2, eps1 = s.eps1;
  double r_total = 0;
#pragma omp parallel for schedule(static) reduction(+ : r_total) if (n > kGrain)
  for (std::int64_t i = 0; i < rows; ++i) {
    double acc = 0;
    const T* gi = g + i * cols;
    for (std::int64_t j = 0; j < cols; ++j) acc += static_cast<double>(gi[j]) * gi[j] + eps1;
    const T ri = static_cast<T>(b2 * static_cast<double>(r[i]) + one_b2 * acc);
    r[i] = ri;
    r_total += static_cast<double>(ri);
  }
  const std::int64_t blocks = (cols + kColBlock - 1) / kColBlock;
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t j0 = b * kColBlock, j1 = std::min(cols, j0 + kColBlock);
    double acc[kColBlock] = {};
    for (std::int64_t i = 0; i < rows; ++i) {
      const T* gi = g + i * cols;
      for (std::int64_t j = j0; j < j1; ++j) acc[j - j0] += static_cast<double>(gi[j]) * gi[j] + eps1;
    }
    for (std::int64_t j = j0; j < j1; ++j) c[j] = static_cast<T>(b2 * static_cast<double>(c[j]) + one_b2 * acc[j - j0]);
  }
  // V̂_ij = R_i·C_j / ΣR; U_ij = G_ij / sqrt(V̂_ij).
  const T inv_total = static_cast<T>(1.0 / r_total);
  double u_sq = 0, p_sq = 0;
#pragma omp parallel for schedule(static) reduction(+ : u_sq, p_sq) if (n > kGrain)
  for (std::int64_t i = 0; i < rows; ++i) {
    const T ri = r[i] * inv_total;
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t k = i * cols + j;
      const T u = g[k] / std::sqrt(ri * c[j]);
      u_sq += static_cast<double>(u) * u;
      p_sq += static_cast<double>(p[k]) * p[k];
    }
  }
  const AdafactorApply a = adafactor_apply(s, u_sq, p_sq, n);
  const T alpha = static_cast<T>(a.alpha), inv_clip = static_cast<T>(1.0 / a.clip_div);
  const T wd = static_cast<T>(s.weight_decay);
  const T b1 = static_cast<T>(s.beta1), one_b1 = static_cast<T>(1.0 - s.beta1);
  const bool use_m = s.beta1 != 0.0 && m != nullptr;
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < rows; ++i) {
    const T ri = r[i] * inv_total;
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t k = i * cols + j;
      T upd = g[k] / std::sqrt(ri * c[j]) * inv_clip;
      if (use_m) upd = m[k] = b1 * m[k] + one_b1 * upd;
      p[k] = p[k] - alpha * wd * p[k] - alpha * upd;
    }
  }
}

template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s) {
  const T b2 = static_cast<T>(s.beta2), one_b2 = static_cast<T>(1.0 - s.beta2), eps1 = static_cast<T>(s.eps1);
  double u_sq = 0, p_sq = 0;
#pragma omp parallel for schedule(static) reduction(+ : u_sq, p_sq) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    const T vi = b2 * v[i] + one_b2 * (g[i] * g[i] + eps1);
    v[i] = vi;
    const T u = g[i] / std::sqrt(vi);
    u_sq += static_cast<double>(u) * u;
    p_sq += static_cast<double>(p[i]) * p[i];
  }
  const AdafactorApply a = adafactor_apply(s, u_sq, p_sq, n);
  const T alpha = static_cast<T>(a.alpha), inv_clip = static_cast<T>(1.0 / a.clip_div);
  const T wd = static_cast<T>(s.weight_decay);
  const T b1 = static_cast<T>(s.beta1), one_b1 = static_cast<T>(1.0 - s.beta1);
  const bool use_m = s.beta1 != 0.0 && m != nullptr;
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    T upd = g[i] / std::sqrt(v[i]) * inv_clip;
    if (use_m) upd = m[i] = b1 * m[i] + one_b1 * upd;
    p[i] = p[i] - alpha * wd * p[i] - alpha * upd;
  }
}

#define TG_INSTANTIATE_OPTIM(T)                                                                              \
  template double sum_squares<T>(const T*, std::int64_t);                                                  \
  template void scale_inplace<T>(T*, std::int64_t, double);                                                \
  template void adam_step<T>(T*, const T*, T*, T*, std::int64_t, const AdamScalars&);
TG_INSTANTIATE_OPTIM(float)
TG_INSTANTIATE_OPTIM(double)
#undef TG_INSTANTIATE_OPTIM
TG_INSTANTIATE_KERNELS(TG_KERNELS_OPTIM, TG_FP32_FP64_TYPES)

}  // namespace tg::backend::cpu

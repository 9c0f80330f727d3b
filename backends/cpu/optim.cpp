// Fused optimizer kernels of the CPU: SGD, LAMB, Adafactor and the multi-tensor steps (declared once for both
// devices in detail/kernels/optim.hpp) and Adam's per-tensor step (detail/cpu/optim_kernels.hpp). Each reads
// and writes a tensor's parameter, gradient and state once per pass; none allocates. The element math is
// detail/math.hpp's (the CUDA kernels run the same functions); the update rules, with their references, are
// written out in include/typegrad/optim/*.hpp; the comments here only map them to passes.
#include <algorithm>
#include <cmath>

#include <omp.h>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kGrain = 1 << 14;  // elements below which a loop stays on one thread
constexpr std::int64_t kColBlock = 64;    // Adafactor column sums: columns per thread-local block
}  // namespace

// Σ x² in fp64, and x *= s: the CPU's global-norm clipping (optim/clip.hpp), one pass each.
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

// One pass of math::adam_update (PyTorch's single-tensor order; the CUDA kernel's element function).
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars& s) {
  const auto c = math::adam_consts<T>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) math::adam_update(p[i], g[i], m[i], v[i], c);
}

// Pass 1 updates m, v and accumulates ||p||², ||u||² with u = m̂/(sqrt(v̂)+ε) + wd·p; pass 2 recomputes u
// (cheaper than a scratch buffer) and applies p -= lr·trust·u.
namespace {
template <class T>
double lamb_tensor(T* p, const T* g, T* m, T* v, std::int64_t n, const math::LambConsts<T>& c, double lr) {
  double pn = 0, un = 0;
#pragma omp parallel for schedule(static) reduction(+ : pn, un) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    math::lamb_moments(g[i], m[i], v[i], c);
    const T u = math::lamb_direction(p[i], m[i], v[i], c);
    pn += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    un += static_cast<double>(u) * static_cast<double>(u);
  }
  const double trust = lamb_trust_ratio(pn, un);
  const T scale = static_cast<T>(lr * trust);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) p[i] = p[i] - scale * math::lamb_direction(p[i], m[i], v[i], c);
  return trust;
}
}  // namespace
template <class T>
double lamb_step(T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s) {
  return lamb_tensor<T>(p, g, m, v, n, math::lamb_consts<T>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step), s.lr);
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
      const T u = math::adafactor_u(g[k], ri * c[j]);
      u_sq += static_cast<double>(u) * u;
      p_sq += static_cast<double>(p[k]) * p[k];
    }
  }
  const AdafactorApply a = adafactor_apply(s, u_sq, p_sq, n);
  const auto ac = math::adafactor_consts<T>(a.alpha, a.clip_div, s.weight_decay, s.beta1);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < rows; ++i) {
    const T ri = r[i] * inv_total;
    for (std::int64_t j = 0; j < cols; ++j) {
      const std::int64_t k = i * cols + j;
      math::adafactor_update(p[k], g[k], ri * c[j], m ? m + k : nullptr, ac);
    }
  }
}

template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s) {
  const T b2 = static_cast<T>(s.beta2), one_b2 = static_cast<T>(1.0 - s.beta2), eps1 = static_cast<T>(s.eps1);
  double u_sq = 0, p_sq = 0;
#pragma omp parallel for schedule(static) reduction(+ : u_sq, p_sq) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    const T vi = math::adafactor_moment(v[i], g[i], b2, one_b2, eps1);
    v[i] = vi;
    const T u = math::adafactor_u(g[i], vi);
    u_sq += static_cast<double>(u) * u;
    p_sq += static_cast<double>(p[i]) * p[i];
  }
  const AdafactorApply a = adafactor_apply(s, u_sq, p_sq, n);
  const auto ac = math::adafactor_consts<T>(a.alpha, a.clip_div, s.weight_decay, s.beta1);
#pragma omp parallel for schedule(static) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) math::adafactor_update(p[i], g[i], v[i], m ? m + i : nullptr, ac);
}

// ---- multi-tensor steps: the per-tensor kernels, tensor after tensor (the CUDA backend launches once) ----
// Note [one parallel region per multi-tensor step]
// A group's Adam step is one OpenMP region over the group's elements laid end to end: each thread takes an
// equal contiguous share, which may span several tensors, and runs math::adam_update on it. The element
// function and its constants are the per-tensor step's, so the values are the same bit for bit; what goes is
// one fork and join per tensor (a GPT's ~100 small tensors cost more in barriers than in arithmetic on a
// small model). No allocation: each thread finds its tensors by walking the sizes.
// With a weight copy (Note [the optimizer writes the weight copies]) each block of updated elements is also
// rounded into the copy while it is in L1, so the copies' refresh pass (a read of every master from memory and
// a write of every copy) goes. Two loops per block: one loop doing both made a bf16 GPT-2 CPU step 22% slower
// (its update no longer vectorized).
constexpr std::int64_t kCopyBlock = 2048;  // elements updated, then converted, while in L1
template <class T>
void adam_step_multi(const AdamTensor<T>* tensors, int count, const AdamScalars& scalars) {
  AdamScalars s = scalars;
  if (!resolve_boundary(s)) return;  // Note [the step boundary on the device]: a skipped step
  std::int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    total += tensors[i].n;
    if constexpr (!std::is_same_v<T, float>)
      TG_CHECK(tensors[i].copy_type == WeightCopyType::none, "adam_step_multi: tensor ", i,
               " asks for a weight copy, and copies are written from fp32 masters only");
  }
  const auto c = s.boundary ? math::adam_consts_from<T>(s.lr, s.bc1, s.bc2, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled)
                            : math::adam_consts<T>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step);
  auto run = [&](std::int64_t lo, std::int64_t hi) {  // elements [lo, hi) of the concatenation
    std::int64_t start = 0;
    for (int i = 0; i < count && start < hi; ++i) {
      const AdamTensor<T>& x = tensors[i];
      const std::int64_t a = std::max(lo, start) - start, b = std::min(hi, start + x.n) - start;
      auto update = [&](auto copy) {  // copy: bf16*, fp16* or nullptr
        if constexpr (std::is_same_v<decltype(copy), std::nullptr_t>) {
          for (std::int64_t j = a; j < b; ++j) math::adam_update(x.p[j], x.g[j], x.m[j], x.v[j], c);
        } else {  // blocks that stay in L1: the update's loop and the conversion's loop each vectorize
          for (std::int64_t j0 = a; j0 < b; j0 += kCopyBlock) {
            const std::int64_t j1 = std::min(b, j0 + kCopyBlock);
            for (std::int64_t j = j0; j < j1; ++j) math::adam_update(x.p[j], x.g[j], x.m[j], x.v[j], c);
            for (std::int64_t j = j0; j < j1; ++j) copy[j] = scalar_cast<std::remove_pointer_t<decltype(copy)>>(x.p[j]);
          }
        }
      };
      if constexpr (std::is_same_v<T, float>) {
        if (x.copy_type == WeightCopyType::bf16) update(static_cast<tg::bf16*>(x.copy));
        else if (x.copy_type == WeightCopyType::fp16) update(static_cast<tg::fp16*>(x.copy));
        else update(nullptr);
      } else {
        update(nullptr);
      }
      start += x.n;
    }
  };
  if (total <= kGrain) {
    run(0, total);
    return;
  }
#pragma omp parallel
  {
    const std::int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
    run(total * t / nt, total * (t + 1) / nt);
  }
}
template <class T>
void sgd_step_multi(const SgdTensor<T>* tensors, int count, const SgdScalars& scalars) {
  SgdScalars s = scalars;
  if (!resolve_boundary(s)) return;  // Note [the step boundary on the device]: a skipped step
  for (int i = 0; i < count; ++i) sgd_step<T>(tensors[i].p, tensors[i].g, tensors[i].buf, tensors[i].n, s);
}
template <class T>
void lamb_step_multi(const LambTensor<T>* tensors, int count, const LambScalars& scalars, double* trust_ratios) {
  LambScalars s = scalars;
  if (!resolve_boundary(s)) return;  // Note [the step boundary on the device]: a skipped step
  const auto c = s.boundary ? math::lamb_consts_from<T>(s.bc1, s.bc2, s.beta1, s.beta2, s.eps, s.weight_decay)
                            : math::lamb_consts<T>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  for (int i = 0; i < count; ++i) {
    const double r = lamb_tensor<T>(tensors[i].p, tensors[i].g, tensors[i].m, tensors[i].v, tensors[i].n, c, s.lr);
    if (trust_ratios) trust_ratios[i] = r;
  }
}
template <class T>
void adafactor_step_multi(const AdafactorTensor<T>* tensors, int count, const AdafactorScalars& scalars) {
  AdafactorScalars s = scalars;
  if (!resolve_boundary(s)) return;  // Note [the step boundary on the device]: a skipped step
  for (int i = 0; i < count; ++i) {
    const AdafactorTensor<T>& x = tensors[i];
    if (x.rows * x.cols == 0) continue;
    if (x.v) adafactor_step_full<T>(x.p, x.g, x.v, x.m, x.rows * x.cols, s);
    else adafactor_step_factored<T>(x.p, x.g, x.r, x.c, x.m, x.rows, x.cols, s);
  }
}

template double sum_squares<float>(const float*, std::int64_t);
template double sum_squares<double>(const double*, std::int64_t);
template void scale_inplace<float>(float*, std::int64_t, double);
template void scale_inplace<double>(double*, std::int64_t, double);
template void adam_step<float>(float*, const float*, float*, float*, std::int64_t, const AdamScalars&);
template void adam_step<double>(double*, const double*, double*, double*, std::int64_t, const AdamScalars&);
TG_INSTANTIATE_KERNELS(TG_KERNELS_OPTIM, TG_FP32_FP64_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_OPTIM_MULTI, TG_FP32_FP64_TYPES)

}  // namespace tg::backend::cpu

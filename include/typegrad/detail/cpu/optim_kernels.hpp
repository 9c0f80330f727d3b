// The CPU backend's per-tensor Adam kernel (backends/cpu/optim.cpp), explicitly instantiated for fp32 (and
// fp64 for checks). Every other optimizer kernel, per-tensor and multi-tensor, is declared once for both
// devices in detail/kernels/optim.hpp; the optimizers call adam_step_multi, this is its one-tensor case.
//   tg::backend::cpu::adam_step<float>(p, g, m, v, n, tg::backend::cpu::AdamScalars{...});
#pragma once

#include <cstdint>

#include "typegrad/detail/kernels/optim.hpp"

namespace tg::backend::cpu {

using backend::AdafactorApply;
using backend::AdafactorScalars;
using backend::AdamScalars;
using backend::adafactor_apply;
using backend::lamb_trust_ratio;
using backend::LambScalars;
using backend::SgdScalars;

/// Σ x² over n elements, accumulated in fp64 (one read of x: the CPU's global-norm clipping).
template <class T>
double sum_squares(const T* x, std::int64_t n);
/// x *= s in place, s rounded once to T.
template <class T>
void scale_inplace(T* x, std::int64_t n, double s);

/// Adam / AdamW for one tensor (Note [Adam update]): math::adam_update over the elements, as the CUDA
/// multi-tensor kernel runs it.
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars& s);

}  // namespace tg::backend::cpu

// The CPU backend's fused optimizer kernels (backends/cpu/optim.cpp): one pass per tensor over contiguous
// buffers, OpenMP-parallel, explicitly instantiated for fp32 (and fp64 for checks). The kernels both devices
// have (SGD, LAMB, Adafactor) and the scalar structs are declared in detail/kernels/optim.hpp; Adam's and the
// norms' CPU kernels here.
//   tg::backend::cpu::adam_step<float>(p, g, m, v, n, tg::backend::cpu::AdamScalars{...});
//   double ss = tg::backend::cpu::sum_squares<float>(g, n);          // fp64 accumulation
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

/// sum_i x[i]^2 in fp64.
template <class T>
double sum_squares(const T* x, std::int64_t n);
/// x[i] *= s.
template <class T>
void scale_inplace(T* x, std::int64_t n, double s);
/// Adam / AdamW for one tensor (Note [Adam update]); the GPU runs adam_step_multi.
template <class T>
void adam_step(T* p, const T* g, T* m, T* v, std::int64_t n, const AdamScalars& s);

}  // namespace tg::backend::cpu

// Mixed-precision kernels (backends/cpu/amp.cpp): gradient unscaling with the inf/NaN check of a loss
// scaler, and the fp32 -> 16-bit conversion that refreshes the per-step weight copies.
//   bool found_inf = tg::backend::cpu::unscale_and_check<float>(g, n, 1.0f / 65536);
//   tg::backend::cpu::convert_contiguous<float, tg::bf16>(master, copy, n);
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"

namespace tg::backend::cpu {

/// g[i] *= inv_scale for every i; returns true when any g[i] (before scaling) is inf or NaN. One pass.
template <class T>
bool unscale_and_check(T* g, std::int64_t n, float inv_scale);

/// dst[i] = S->T(src[i]) (round to nearest even), contiguous, vectorized and split over the OpenMP team.
template <class S, class T>
void convert_contiguous(const S* src, T* dst, std::int64_t n);

}  // namespace tg::backend::cpu

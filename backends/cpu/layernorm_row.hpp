// The LayerNorm of one row once its sum is known, shared by layernorm_forward (nn.cpp) and
// add_layernorm_forward (add_layernorm.cpp), so the fused op computes what the unfused pair does, bit for bit
// (Note [fused residual add and LayerNorm]). A private helper of the CPU backend.
#pragma once

#include <cmath>
#include <cstdint>

#include "typegrad/core/dtype.hpp"

namespace tg::backend::cpu {

/// x[0, n) with s = Σ x[j] summed in order in A: mean = s / n, the variance of the centred values (a second
/// pass: it does not cancel), y = (x − mean)·rstd·w (+ b when b is not null); writes mean and rstd.
template <class A, class T>
inline void layernorm_row_from_sum(const T* x, A s, const T* w, const T* b, T* y, A& mean, A& rstd, std::int64_t n,
                                   double eps) {
  const A mu = s / static_cast<A>(n);
  A v = 0;
  for (std::int64_t j = 0; j < n; ++j) {
    const A d = scalar_cast<A>(x[j]) - mu;
    v += d * d;
  }
  const A rs = A(1) / std::sqrt(v / static_cast<A>(n) + static_cast<A>(eps));
  mean = mu;
  rstd = rs;
  for (std::int64_t j = 0; j < n; ++j) {
    const A o = (scalar_cast<A>(x[j]) - mu) * rs * scalar_cast<A>(w[j]);
    y[j] = scalar_cast<T>(b ? o + scalar_cast<A>(b[j]) : o);
  }
}

}  // namespace tg::backend::cpu

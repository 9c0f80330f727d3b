// Reduction kernels over one dimension of a contiguous [outer, n, inner] block.
#include <cmath>
#include <vector>

#include "typegrad/detail/cpu/kernels.hpp"

namespace tg::backend::cpu {

template <class T>
void reduce_sum(const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
#pragma omp parallel for schedule(static) if (outer * n * inner > (1 << 15))
  for (std::int64_t o = 0; o < outer; ++o) {
    if (inner == 1) {
      A acc = 0;
      const T* p = in + o * n;
      for (std::int64_t k = 0; k < n; ++k) acc += scalar_cast<A>(p[k]);
      out[o] = scalar_cast<T>(acc);
    } else {
      std::vector<A> acc(static_cast<std::size_t>(inner), A(0));
      for (std::int64_t k = 0; k < n; ++k) {
        const T* p = in + (o * n + k) * inner;
        for (std::int64_t i = 0; i < inner; ++i) acc[i] += scalar_cast<A>(p[i]);
      }
      for (std::int64_t i = 0; i < inner; ++i) out[o * inner + i] = scalar_cast<T>(acc[i]);
    }
  }
}

template <class T>
void reduce_max(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n, std::int64_t inner) {
  using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
#pragma omp parallel for schedule(static) if (outer * n * inner > (1 << 15))
  for (std::int64_t o = 0; o < outer; ++o) {
    for (std::int64_t i = 0; i < inner; ++i) {
      const T* p = in + o * n * inner + i;
      A best = scalar_cast<A>(p[0]);
      std::int64_t arg = 0;
      for (std::int64_t k = 1; k < n && !std::isnan(best); ++k) {
        const A v = scalar_cast<A>(p[k * inner]);
        if (v > best || std::isnan(v)) {
          best = v;
          arg = k;
        }
      }
      out[o * inner + i] = scalar_cast<T>(best);
      if (index) index[o * inner + i] = arg;
    }
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_REDUCE, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

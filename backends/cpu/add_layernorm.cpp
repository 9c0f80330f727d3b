// add_layernorm's CPU kernel (Note [fused residual add and LayerNorm] in ops/add_layernorm.hpp): one OpenMP
// work item per row; h = x + r in the elementwise ops' register type (fp32 for 16-bit storage) rounded to T on
// store, the mean summed in order from the stored values (for 16-bit T in a loop after the add's, so that the add
// and its conversions vectorize), then layernorm_forward's variance and
// output passes over h. Bit for bit `add` followed by `layernorm`.
#include <cmath>
#include <type_traits>

#define TG_KERNELS_ONLY
#include "typegrad/ops/add_layernorm.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "layernorm_row.hpp"
#include "parallel.hpp"

namespace tg::backend::cpu {

template <class T>
void add_layernorm_forward(const T* x, const T* r, const T* w, const T* b, T* h, T* y, accum_t<T>* mean,
                           accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps) {
  using E = std::conditional_t<std::is_same_v<T, double>, double, float>;  // binary add's register type
  using A = amp::kernel_math_t<amp::op::layernorm, T>;                      // layernorm's (Note [autocast rules])
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t i = 0; i < rows; ++i) {
    const T* xr = x + i * n;
    const T* rr = r + i * n;
    T* hr = h + i * n;
    T* yr = y + i * n;
    A s = 0;
    if constexpr (std::is_same_v<T, E>) {  // fp32, fp64: the add rides along the sum's serial chain
      for (std::int64_t j = 0; j < n; ++j) {
        hr[j] = xr[j] + rr[j];
        s += scalar_cast<A>(hr[j]);
      }
    } else {  // 16-bit T: the add and its conversions in a loop of their own (it vectorizes), then the sum in order
      for (std::int64_t j = 0; j < n; ++j) hr[j] = scalar_cast<T>(scalar_cast<E>(xr[j]) + scalar_cast<E>(rr[j]));
      for (std::int64_t j = 0; j < n; ++j) s += scalar_cast<A>(hr[j]);
    }
    layernorm_row_from_sum<A>(hr, s, w, b, yr, mean[i], rstd[i], n, eps);  // layernorm_forward's passes over h
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ADD_LAYERNORM, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

// swiglu's CPU kernels (Note [swiglu halves] in ops/swiglu.hpp): one OpenMP work item per row of the
// contiguous [rows, 2n] input, the shared scalar formulas math::swiglu / math::swiglu_grad in
// kernel_math_t (fp32 for 16-bit storage), each result rounded once on store.
#define TG_KERNELS_ONLY
#include "typegrad/ops/swiglu.hpp"
#include "parallel.hpp"

namespace tg::backend::cpu {

template <class T>
void swiglu_forward(const T* x, T* out, std::int64_t rows, std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::swiglu, T>;
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* a = x + r * 2 * n;
    const T* b = a + n;
    T* o = out + r * n;
    for (std::int64_t j = 0; j < n; ++j) o[j] = scalar_cast<T>(math::swiglu(scalar_cast<A>(a[j]), scalar_cast<A>(b[j])));
  }
}

template <class T>
void swiglu_backward(const T* x, const T* dout, T* dx, std::int64_t rows, std::int64_t n) {
  using A = amp::kernel_math_t<amp::op::swiglu, T>;
#pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* a = x + r * 2 * n;
    const T* b = a + n;
    const T* g = dout + r * n;
    T* da = dx + r * 2 * n;
    T* db = da + n;
    for (std::int64_t j = 0; j < n; ++j) {
      A ga, gb;
      math::swiglu_grad(scalar_cast<A>(a[j]), scalar_cast<A>(b[j]), scalar_cast<A>(g[j]), ga, gb);
      da[j] = scalar_cast<T>(ga);
      db[j] = scalar_cast<T>(gb);
    }
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_SWIGLU, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

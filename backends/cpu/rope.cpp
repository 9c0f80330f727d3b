// rope's CPU kernel (Note [rope: rotate half] in ops/rope.hpp): a table of cos / sin per (position, pair)
// computed once per call in fp64 and rounded to the math type, then one OpenMP work item per (row, position),
// math in kernel_math_t (fp32 for 16-bit storage), each output rounded once on store.
#include <cmath>
#include <vector>

#define TG_KERNELS_ONLY
#include "typegrad/ops/rope.hpp"

namespace tg::backend::cpu {

template <class T>
void rope_rotate(const T* x, T* y, std::int64_t rows, std::int64_t t, std::int64_t dh, std::int64_t r,
                 std::int64_t offset, double theta, int sign) {
  using A = amp::kernel_math_t<amp::op::rope, T>;
  const std::int64_t half = r / 2;
  if (rows * t * dh == 0) return;
  std::vector<A> cs(static_cast<std::size_t>(t * half)), sn(cs.size());
#pragma omp parallel for schedule(static) if (t * half > (1 << 12))
  for (std::int64_t p = 0; p < t; ++p)
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = detail::rope_angle(offset + p, i, r, theta);
      cs[static_cast<std::size_t>(p * half + i)] = static_cast<A>(std::cos(a));
      sn[static_cast<std::size_t>(p * half + i)] = static_cast<A>(sign * std::sin(a));
    }
#pragma omp parallel for schedule(static) if (rows * t * dh > (1 << 15))
  for (std::int64_t rt = 0; rt < rows * t; ++rt) {
    const T* xr = x + rt * dh;
    T* yr = y + rt * dh;
    const A* c = cs.data() + (rt % t) * half;
    const A* s = sn.data() + (rt % t) * half;
    for (std::int64_t i = 0; i < half; ++i) {
      const A x1 = scalar_cast<A>(xr[i]), x2 = scalar_cast<A>(xr[i + half]);
      yr[i] = scalar_cast<T>(x1 * c[i] - x2 * s[i]);
      yr[i + half] = scalar_cast<T>(x2 * c[i] + x1 * s[i]);
    }
    for (std::int64_t j = r; j < dh; ++j) yr[j] = xr[j];
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ROPE, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

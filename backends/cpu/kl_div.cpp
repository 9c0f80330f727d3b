// kl_div's CPU kernels (Note [kl_div: batchmean over rows] in ops/kl_div.hpp): one OpenMP work item per
// row of the contiguous [rows, v] inputs, the shared scalar formulas math::kl_div_term / math::kl_div_grad in
// kernel_math_t (fp32 for 16-bit storage). The forward sums each row in index order and the rows in row
// order (fp64), so its value does not depend on the thread count, and stores the mean; the backward takes its
// upstream gradient from memory, as the CUDA kernel does; gradients are rounded once on store.
#define TG_KERNELS_ONLY
#include "typegrad/ops/kl_div.hpp"

#include <cmath>
#include <vector>
#include "parallel.hpp"

namespace tg::backend::cpu {

template <class T>
void kl_div_forward(const T* x, const T* t, std::int64_t rows, std::int64_t v, double* loss) {
  using A = amp::kernel_math_t<amp::op::kl_div, T>;
  std::vector<double> row_sum(static_cast<std::size_t>(rows));
#pragma omp parallel for schedule(static) if (rows * v > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * v;
    const T* tr = t + r * v;
    A s = 0;
    for (std::int64_t j = 0; j < v; ++j) s += math::kl_div_term(scalar_cast<A>(xr[j]), scalar_cast<A>(tr[j]));
    row_sum[static_cast<std::size_t>(r)] = static_cast<double>(s);
  }
  double total = 0;
  for (const double s : row_sum) total += s;
  loss[0] = rows ? total / static_cast<double>(rows) : std::nan("");
}

template <class T>
void kl_div_backward(const T* x, const T* t, const double* dloss, T* dx, T* dt, std::int64_t rows, std::int64_t v) {
  using A = amp::kernel_math_t<amp::op::kl_div, T>;
  const double scale = rows ? dloss[0] / static_cast<double>(rows) : 0.0;
  const A sc = static_cast<A>(scale);
#pragma omp parallel for schedule(static) if (rows * v > kParallelMin)
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t j = r * v; j < (r + 1) * v; ++j) {
      A gx, gt;
      math::kl_div_grad(scalar_cast<A>(x[j]), scalar_cast<A>(t[j]), sc, gx, gt);
      if (dx) dx[j] = scalar_cast<T>(gx);
      if (dt) dt[j] = scalar_cast<T>(gt);
    }
  }
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_KL_DIV, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

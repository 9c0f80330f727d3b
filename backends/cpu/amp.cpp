// Mixed-precision kernels: unscale + inf/NaN check (one pass over each gradient) and fp32 -> 16-bit
// conversion for the per-step weight copies. Both are memory-bound: one read (and one write) per element.
#include <cmath>
#include <cstring>

#include "typegrad/detail/cpu/amp_kernels.hpp"

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kGrain = 1 << 15;  // elements below which a loop stays on one thread
}

template <class T>
bool unscale_and_check(T* g, std::int64_t n, float inv_scale) {
  const T s = static_cast<T>(inv_scale);
  int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (n > kGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    const T v = g[i];
    // x − x is 0 for finite x and NaN for inf and NaN: branch-free, so the loop vectorizes.
    bad |= static_cast<int>((v - v) != T(0));
    g[i] = v * s;
  }
  return bad != 0;
}

template <class S, class T>
void convert_contiguous(const S* src, T* dst, std::int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, static_cast<std::size_t>(n) * sizeof(T));
  } else {
#pragma omp parallel for schedule(static) if (n > kGrain)
    for (std::int64_t i = 0; i < n; ++i) dst[i] = scalar_cast<T>(src[i]);
  }
}

template bool unscale_and_check<float>(float*, std::int64_t, float);
template bool unscale_and_check<double>(double*, std::int64_t, float);
template void convert_contiguous<float, float>(const float*, float*, std::int64_t);
template void convert_contiguous<float, bf16>(const float*, bf16*, std::int64_t);
template void convert_contiguous<float, fp16>(const float*, fp16*, std::int64_t);
template void convert_contiguous<double, double>(const double*, double*, std::int64_t);
template void convert_contiguous<double, bf16>(const double*, bf16*, std::int64_t);
template void convert_contiguous<double, fp16>(const double*, fp16*, std::int64_t);
template void convert_contiguous<double, float>(const double*, float*, std::int64_t);

}  // namespace tg::backend::cpu

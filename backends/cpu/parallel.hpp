// What the CPU row kernels (nn.cpp, swiglu.cpp, kl_div.cpp) share about going parallel.
//   #pragma omp parallel for schedule(static) if (rows * n > kParallelMin)
#pragma once

#include <cstdint>

namespace tg::backend::cpu {

/// Elements below which a row kernel stays single-threaded: a parallel region costs more than it saves there.
inline constexpr std::int64_t kParallelMin = 1 << 14;

}  // namespace tg::backend::cpu

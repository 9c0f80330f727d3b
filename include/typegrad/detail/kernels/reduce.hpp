// Reduction kernels, declared once for every device (Note [kernels declared once]). Defined in
// backends/cpu/reduce.cpp and backends/cuda/reduce.cu. A reduction works on a contiguous [outer, n, inner]
// block, accumulating in accum_t<T> in a fixed order (deterministic: no atomics).
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// reduce_sum:   out[o, i] = Σ_k in[o, k, i].
// reduce_max:   out[o, i] = max_k in[o, k, i]; the first maximum's k into `index` when it is not null; NaN wins.
#define TG_KERNELS_REDUCE(K, ...)                                                                                   \
  K(void, reduce_sum, (const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner), __VA_ARGS__)  \
  K(void, reduce_max, (const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n,               \
                       std::int64_t inner), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_REDUCE)

// max_backward: din (contiguous [outer, n, inner], overwritten) = 0 except din[o, index[o, i], i] = dout[o, i].
// The GPU's only: the CPU scatters in ops/reduce.hpp.
#define TG_KERNELS_REDUCE_GPU(K, ...)                                                                               \
  K(void, max_backward, (const T* dout, const std::int64_t* index, T* din, std::int64_t outer, std::int64_t n,      \
                         std::int64_t inner), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_REDUCE_GPU)

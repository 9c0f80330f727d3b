// dropout_add's CUDA kernel (Note [fused dropout and residual add] in ops/dropout_add.hpp): one thread per
// Philox counter, four elements each (grid-stride), over the contiguous operands; the CPU's Philox stream and
// keep rule, the dropped-out value rounded to T before the add: `add(x, dropout(r))` bit for bit in one launch.
#define TG_KERNELS_ONLY
#include <type_traits>

#include "common.cuh"
#include "typegrad/core/random.hpp"
#include "typegrad/detail/math.hpp"
#include "typegrad/ops/dropout_add.hpp"

namespace tg::backend::cuda {

using detail::acc_t;
using detail::kThreads;

namespace {

#include "dropout_add_kernel.cuh"

}  // namespace

template <class T>
void dropout_add_forward(const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed, std::uint64_t offset,
                         const std::uint64_t* base, double p) {
  if (n == 0) return;
  const auto scale = static_cast<acc_t<T>>(1.0 / (1.0 - p));  // rounded as dropout_forward rounds it
  // one thread per counter (a base in memory is a word position, a multiple of 4: the same lead)
  const std::int64_t counters = (static_cast<std::int64_t>(offset % 4) + n + 3) / 4;
  dropout_add_kernel<T><<<detail::grid_for(counters), kThreads, 0, detail::stream()>>>(x, r, out, n, seed, offset, base,
                                                                                static_cast<float>(p), scale);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_DROPOUT_ADD, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

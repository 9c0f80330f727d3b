// dropout_add's CUDA kernel (Note [fused dropout and residual add] in ops/dropout_add.hpp): one thread per
// element (grid-stride) over the contiguous operands, the CPU's Philox stream and keep rule, the dropped-out
// value rounded to T before the add: `add(x, dropout(r))` bit for bit in one launch.
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

// The product rounded on its own, never merged into a fused multiply-add with the add that follows: the
// unfused pair stores it first.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }

template <class T>
__global__ void dropout_add_kernel(const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed,
                                   std::uint64_t offset, float p, acc_t<T> scale) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(i, n) {
    const auto w = ::tg::detail::philox_words(seed, offset + static_cast<std::uint64_t>(i));
    const bool keep = math::dropout_keep(::tg::detail::uniform_from_bits(w[0]), p);
    const T d = scalar_cast<T>(keep ? mul_rn(scalar_cast<A>(r[i]), scale) : A(0));
    out[i] = scalar_cast<T>(scalar_cast<A>(x[i]) + scalar_cast<A>(d));
  }
}

}  // namespace

template <class T>
void dropout_add_forward(const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed, std::uint64_t offset,
                         double p) {
  if (n == 0) return;
  const auto scale = static_cast<acc_t<T>>(1.0 / (1.0 - p));  // rounded as dropout_forward rounds it
  dropout_add_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(x, r, out, n, seed, offset,
                                                                                static_cast<float>(p), scale);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_DROPOUT_ADD, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

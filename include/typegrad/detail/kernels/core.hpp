// The kernels core/ needs, declared once for every device (Note [kernels declared once]): strided copies with
// conversion, fills, in-place accumulation, and the CPU's random draws and ranges (tensors are created on the
// CPU and moved). Defined in backends/cpu/kernels.cpp, backends/cuda/elementwise.cu and runtime.cu. core/
// includes this header and no backend's.
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// fill:        dst[i] = value for i < n.
// add_inplace: dst[i] += src[i] (contiguous; accumulation in fp32 for 16-bit types).
#define TG_KERNELS_FILL(K, ...) K(void, fill, (T * dst, std::int64_t n, T value), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_FILL)
#define TG_KERNELS_ADD_INPLACE(K, ...) K(void, add_inplace, (T * dst, const T* src, std::int64_t n), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_ADD_INPLACE)

// copy_strided<S, T>: dst[i] = S->T(src[i]) for every index i of `sizes`, both sides strided (strides in elements);
// instantiated for every pair of the master list. Two element types, so declared here by hand, once.
namespace tg::backend::cpu {
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes);
}  // namespace tg::backend::cpu
namespace tg::backend::cuda {
#if TG_HAVE_CUDA
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes);
#else
template <class S, class T>
[[noreturn]] inline void copy_strided(const S*, const Shape&, T*, const Shape&, const Shape&) {
  ::tg::backend::no_cuda_backend("copy_strided");
}
#endif
}  // namespace tg::backend::cuda
namespace tg::backend::watched {  // Note [launch watch]
template <class S, class T>
inline constexpr ::tg::backend::Watched<&::tg::backend::cpu::copy_strided<S, T>> copy_strided{"copy_strided"};
}  // namespace tg::backend::watched
namespace tg::backend::watched_cuda {
template <class S, class T>
inline constexpr ::tg::backend::Watched<&::tg::backend::cuda::copy_strided<S, T>> copy_strided{"copy_strided"};
}  // namespace tg::backend::watched_cuda

namespace tg::backend::cpu {
/// Counter-based draws: element i uses Philox counter offset + i of `seed` (see core/random.hpp).
template <class T>
void random_uniform(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float lo, float hi);
template <class T>
void random_normal(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float mean, float stddev);
/// dst[i] = start + i·step.
template <class T>
void arange(T* dst, std::int64_t n, double start, double step);
}  // namespace tg::backend::cpu

// Declarations of the CPU backend's non-GEMM kernels (compiled in backends/cpu/, explicitly instantiated
// for every element type of the master list). Raw pointers + shapes only: no tensors, no autodiff.
//   tg::backend::cpu::copy_strided<float, tg::bf16>(src, src_strides, dst, dst_strides, sizes);   // convert + copy
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"

namespace tg::backend::cpu {

/// dst[i] = S->T(src[i]) for every index i of `sizes`, both sides strided (strides in elements).
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes);

template <class T>
void fill(T* dst, std::int64_t n, T value);

/// Counter-based draws: element i uses Philox counter offset + i of `seed` (see core/random.hpp).
template <class T>
void random_uniform(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float lo, float hi);
template <class T>
void random_normal(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float mean, float stddev);

template <class T>
void arange(T* dst, std::int64_t n, double start, double step);

/// Sets the number of OpenMP threads every CPU kernel uses; 0 restores the default.
void set_num_threads(int n);
int num_threads();

}  // namespace tg::backend::cpu

namespace tg::backend::cpu {
/// dst[i] += src[i] (contiguous; accumulation in fp32 for 16-bit types).
template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n);
}  // namespace tg::backend::cpu

namespace tg::backend::cpu {
/// out[o, i] = sum_k in[o, k, i] over a contiguous [outer, n, inner] block (fp32/fp64 accumulation).
template <class T>
void reduce_sum(const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner);
/// out[o, i] = max_k in[o, k, i], argmax (first maximum; NaN wins) into `index` when it is not null.
template <class T>
void reduce_max(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n, std::int64_t inner);
}  // namespace tg::backend::cpu

#include "typegrad/detail/math.hpp"
namespace tg::backend::cpu {
/// out = a op b over out_shape; sa / sb are a's and b's strides in out's index space (0 = broadcast).
template <class T>
void binary(math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out, const Shape& out_shape);
}  // namespace tg::backend::cpu

// Elementwise CUDA kernels: strided copies and casts, binary ops with broadcasting, unary ops forward and
// backward, dropout (the CPU's Philox stream, so masks match bit for bit) and masked_fill. The scalar
// formulas are math::apply / math::grad / math::dropout_keep (detail/math.hpp), the functions the CPU
// kernels call and the CPU tests cover; only indexing is new here. Kernels first, launchers after.
#include "common.cuh"
#include "typegrad/core/random.hpp"
#include "vector_map.cuh"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

using detail::acc_t;
using detail::Geo;
using detail::kThreads;

namespace {

// The kernels and the vector maps' element functions.
#include "elementwise_kernels.cuh"

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------------
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes) {
  const std::int64_t n = sizes.numel();
  if (n == 0) return;
  if (detail::dense_layout(sizes, src_strides) && detail::dense_layout(sizes, dst_strides)) {
    if constexpr (std::is_same_v<S, T>) {  // the copy engine's path, at memory bandwidth
      TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * sizeof(T), cudaMemcpyDeviceToDevice, detail::stream()));
      return;
    } else if (detail::vector_map_fits(dst, src)) {
      detail::vector_map(CastTo<T>{}, dst, n, src);
      return;
    } else {
      copy_contiguous_kernel<S, T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(src, dst, n);
    }
  } else {
    copy_kernel<S, T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(src, dst, n, detail::make_geo(sizes, src_strides, dst_strides));
  }
  TG_CUDA_LAUNCHED();
}

template <class T>
void binary(math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out, const Shape& out_shape) {
  const std::int64_t n = out_shape.numel();
  if (n == 0) return;
  if (detail::dense_layout(out_shape, sa) && detail::dense_layout(out_shape, sb) && detail::vector_map_fits(out, a, b))
    return detail::vector_map(BinaryFn<T>{op}, out, n, a, b);
  binary_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(op, a, b, out, n, detail::make_geo(out_shape, sa, sb));
  TG_CUDA_LAUNCHED();
}

template <class T>
void unary_forward(math::Unary op, const T* x, const Shape& sx, T* y, const Shape& shape) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  if (detail::dense_layout(shape, sx) && detail::vector_map_fits(y, x)) return detail::vector_map(UnaryFn<T>{op}, y, n, x);
  unary_forward_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(op, x, y, n, detail::make_geo(shape, sx));
  TG_CUDA_LAUNCHED();
}

template <class T>
void unary_backward(math::Unary op, const T* saved, const Shape& ss, const T* dy, const Shape& sdy, T* dx,
                    const Shape& shape) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  if (detail::dense_layout(shape, ss) && detail::dense_layout(shape, sdy) && detail::vector_map_fits(dx, saved, dy))
    return detail::vector_map(UnaryGradFn<T>{op, math::uses_output(op)}, dx, n, saved, dy);
  unary_backward_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(op, saved, dy, dx, n, detail::make_geo(shape, ss, sdy));
  TG_CUDA_LAUNCHED();
}

template <class T>
void dropout_forward(const T* x, const Shape& sx, T* y, const Shape& shape, std::uint64_t seed, std::uint64_t offset,
                     const std::uint64_t* base, double p) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  // p and the scale rounded exactly as the CPU kernel rounds them
  const auto scale = static_cast<acc_t<T>>(1.0 / (1.0 - p));
  // one thread per counter (a base in memory is a word position, a multiple of 4: the same lead)
  const std::int64_t counters = (static_cast<std::int64_t>(offset % 4) + n + 3) / 4;
  dropout_kernel<T><<<detail::grid_for(counters), kThreads, 0, detail::stream()>>>(x, y, n, detail::make_geo(shape, sx), seed, offset,
                                                       base, static_cast<float>(p), scale);
  TG_CUDA_LAUNCHED();
}

template <class T>
void masked_fill(const T* x, const Shape& sx, const std::uint8_t* mask, const Shape& sm, T value, T* y,
                 const Shape& shape) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  masked_fill_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(x, mask, value, y, n, detail::make_geo(shape, sx, sm));
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_BINARY, TG_FLOATING_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_UNARY, TG_FLOATING_TYPES)

// Every (source, destination) pair of the dtype master list, as on the CPU.
#define TG_COPY_PAIR(S, T) template void copy_strided<S, T>(const S*, const Shape&, T*, const Shape&, const Shape&);
#define TG_X(type, e, name, st) TG_CUDA_COPY_TARGETS(TG_COPY_PAIR, type)
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
#undef TG_COPY_PAIR

}  // namespace tg::backend::cuda

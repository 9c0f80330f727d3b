// Elementwise kernels, declared once for every device (Note [kernels declared once]): binary ops with
// broadcasting (backends/cpu/elementwise.cpp), unary ops and their gradients, dropout, masked_fill
// (backends/cpu/unary.cpp); all in backends/cuda/elementwise.cu. Inputs are strided (strides in elements, one per dim of the
// output shape, 0 on broadcast dims); outputs are contiguous row-major.
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/declare.hpp"
#include "typegrad/detail/math.hpp"

// binary:          out = a op b over out_shape; sa / sb are a's and b's strides in out's index space.
// unary_forward:   y = f(x) (math::apply).
// unary_backward:  dx = dy · f'(saved), saved being x or y as math::uses_output(op) says.
// dropout_forward: y_i = keep_i ? x_i / (1 - p) : 0, keep_i = uniform(philox(seed, offset + i)[0]) >= p, i the
//                  row-major index of `shape` (so the mask does not depend on layout); also the backward
//                  (x = dy, y = dx): the mask is recomputed from (seed, offset), never stored
//                  (Note [dropout replays its mask]). With `base` not null the position is offset + *base,
//                  *base read from memory on the kernel's device (Note [the Philox base in memory]).
// masked_fill:     y = mask ? value : x; sm are the mask's strides in `shape` (0 on broadcast dims); also the
//                  backward (x = dy, value = 0).
#define TG_KERNELS_BINARY(K, ...)                                                                                   \
  K(void, binary, (math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out,                \
                   const Shape& out_shape), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_BINARY)

#define TG_KERNELS_UNARY(K, ...)                                                                                    \
  K(void, unary_forward, (math::Unary op, const T* x, const Shape& sx, T* y, const Shape& shape), __VA_ARGS__)       \
  K(void, unary_backward, (math::Unary op, const T* saved, const Shape& ss, const T* dy, const Shape& sdy, T* dx,     \
                           const Shape& shape), __VA_ARGS__)                                                         \
  K(void, dropout_forward, (const T* x, const Shape& sx, T* y, const Shape& shape, std::uint64_t seed,               \
                            std::uint64_t offset, const std::uint64_t* base, double p), __VA_ARGS__)                 \
  K(void, masked_fill, (const T* x, const Shape& sx, const std::uint8_t* mask, const Shape& sm, T value, T* y,       \
                        const Shape& shape), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_UNARY)

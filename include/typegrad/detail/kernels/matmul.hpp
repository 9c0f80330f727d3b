// GEMM-based kernels, declared once for every device (Note [kernels declared once]): batched strided
// matmul, linear, linear + GELU. Defined in backends/cpu/matmul.cpp and backends/cuda/gemm.cu.
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// matmul_strided:           C[i] = A[i]·B[i] for every index i of `batch` (A [M,K], B [K,N], C [M,N]). sa / sb / sc
//                           hold the batch strides (in batch's index space; 0 = broadcast) followed by the
//                           matrix's (row, col) strides; A and B must be GEMM operands without a copy (unit
//                           stride on one dim), C needs col stride 1. A batch stride of 0 in sc reduces over that
//                           dim (C accumulates in order).
// linear_forward:           y[M,N] = x[M,K]·w[N,K]ᵀ (+ bias[N]); x and w given by their (row, col) strides.
// linear_gelu_tanh_forward: pre[M,N] = x·wᵀ (+ bias) and y = gelu_tanh(pre), both contiguous (Note [fused
//                           linear + GELU], ops/linear_gelu.hpp): the CPU runs the composite's kernels, the GPU
//                           one cuBLASLt GEMM with the GELU epilogue where it can.
#define TG_KERNELS_MATMUL(K, ...)                                                                                   \
  K(void, matmul_strided, (const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,         \
                           const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K), __VA_ARGS__)        \
  K(void, linear_forward, (const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,            \
                           std::int64_t wcs, const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K),  \
    __VA_ARGS__)                                                                                                    \
  K(void, linear_gelu_tanh_forward, (const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, \
                                     std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N, \
                                     std::int64_t K), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_MATMUL)

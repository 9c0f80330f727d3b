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
// linear_weight_grad:       dw[N,K] = dy[M,N]ᵀ·x[M,K] (dy contiguous, x given by its strides) and, when db is not
//                           null, db[N] = Σ_rows dy: linear's weight and bias gradients. The CPU runs the GEMM
//                           and reduce_sum; the GPU one cuBLASLt GEMM with the BGRADB epilogue where it can
//                           (Note [bias gradients in the weight GEMM], backends/cuda/gemm.cu).
// linear_gelu_input_grad:   dpre[M,N] = (dy[M,K]·w[K,N]) · gelu_tanh'(pre[M,N]) and, when db is not null,
//                           db[N] = Σ_rows dpre, in one fused call; returns false (having written nothing) where
//                           there is no such call: always on the CPU, and on the GPU when cuBLASLt's
//                           DGELU(_BGRAD) epilogue cannot take it. The caller then runs the composite (Note
//                           [the fused GELU MLP], ops/linear_gelu.hpp).
#define TG_KERNELS_MATMUL(K, ...)                                                                                   \
  K(void, matmul_strided, (const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,         \
                           const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K), __VA_ARGS__)        \
  K(void, linear_forward, (const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,            \
                           std::int64_t wcs, const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K),  \
    __VA_ARGS__)                                                                                                    \
  K(void, linear_gelu_tanh_forward, (const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, \
                                     std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N, \
                                     std::int64_t K), __VA_ARGS__)                                      \
  K(void, linear_weight_grad, (const T* dy, const T* x, std::int64_t xrs, std::int64_t xcs, T* dw, T* db,          \
                               std::int64_t M, std::int64_t N, std::int64_t K), __VA_ARGS__)                  \
  K(bool, linear_gelu_input_grad, (const T* dy, const T* w, std::int64_t wrs, std::int64_t wcs, const T* pre,      \
                                   T* dpre, T* db, std::int64_t M, std::int64_t N, std::int64_t K), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_MATMUL)

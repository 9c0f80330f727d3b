// Causal attention kernels, declared once for every device (Note [kernels declared once]). Defined in
// backends/cpu/attention.cpp (fused, flash-attention style) and backends/cuda/gemm.cu (a composite of
// batched GEMMs and a masked softmax).
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// attention_forward:  over BH contiguous heads of [Tn, hs]: out = softmax(scale·QKᵀ + mask)·V, causal mask when
//                     `causal`; saves the per-row logsumexp of the scaled scores, not P.
// attention_backward: recomputes P = exp(scale·QKᵀ − lse); Dᵢ = Σ dOᵢ∘Oᵢ, dS = P∘(dO·Vᵀ − D):
//                     dQ = scale·dS·K, dK = scale·dSᵀ·Q, dV = Pᵀ·dO.
#define TG_KERNELS_ATTENTION(K, ...)                                                                               \
  K(void, attention_forward, (const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH,       \
                              std::int64_t Tn, std::int64_t hs, double scale, bool causal), __VA_ARGS__)           \
  K(void, attention_backward, (const T* q, const T* k, const T* v, const T* out, const T* dout,                    \
                               const accum_t<T>* lse, T* dq, T* dk, T* dv, std::int64_t BH, std::int64_t Tn,       \
                               std::int64_t hs, double scale, bool causal), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_ATTENTION)

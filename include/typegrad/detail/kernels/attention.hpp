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
// attention_qkv_forward:  the same causal attention of the H heads packed in a fused QKV projection's output:
//                         qkv [B, Tn, 3, H, hs] contiguous (q, k, v thirds of each row), out [B, Tn, H, hs]
//                         contiguous, lse [B, H, Tn]. No head-layout copy is needed around it.
// attention_qkv_backward: its gradient: dqkv [B, Tn, 3, H, hs] (every element written) from dout [B, Tn, H, hs].
#define TG_KERNELS_ATTENTION(K, ...)                                                                               \
  K(void, attention_forward, (const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH,       \
                              std::int64_t Tn, std::int64_t hs, double scale, bool causal), __VA_ARGS__)           \
  K(void, attention_backward, (const T* q, const T* k, const T* v, const T* out, const T* dout,                    \
                               const accum_t<T>* lse, T* dq, T* dk, T* dv, std::int64_t BH, std::int64_t Tn,       \
                               std::int64_t hs, double scale, bool causal), __VA_ARGS__)                       \
  K(void, attention_qkv_forward, (const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H,          \
                                  std::int64_t Tn, std::int64_t hs, double scale), __VA_ARGS__)                    \
  K(void, attention_qkv_backward, (const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv,     \
                                   std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale), \
    __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_ATTENTION)

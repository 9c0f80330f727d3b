// The fused (flash) attention kernels for 16-bit storage (flash_attention.cu, Note [flash attention on the
// GPU]), called by gemm.cu's attention_forward / attention_backward before their composite.
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"

namespace tg::backend::cuda {

/// Runs the fused forward and returns true when it applies (bf16 or fp16, hs 64 or 128, 16-byte aligned
/// operands, TG_CUDA_ATTENTION not "composite"); returns false, having done nothing, otherwise.
template <class T>
bool flash_attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH,
                             std::int64_t Tn, std::int64_t hs, double scale, bool causal);
/// The fused backward under the same conditions (dq, dk, dv overwritten).
template <class T>
bool flash_attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse,
                              T* dq, T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale,
                              bool causal);
/// The same over the heads packed in a fused QKV projection's output (qkv [B, Tn, 3, H, hs], out and dout
/// [B, Tn, H, hs], lse [B, H, Tn]), causal, with no head-layout copy; also 16-byte aligned strides.
template <class T>
bool flash_attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H,
                                 std::int64_t Tn, std::int64_t hs, double scale);
template <class T>
bool flash_attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv,
                                  std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale);

}  // namespace tg::backend::cuda

// The CUDA backend's own entry points: copies, fills, the GEMM settings and counters, the loss scaler's
// multi-tensor unscale. The op and optimizer kernels both devices have are declared once in detail/kernels/
// (Note [kernels declared once]) and included here. Declared always; defined by backends/cuda when
// TG_HAVE_CUDA, otherwise each call throws a tg::Error saying the build has no CUDA backend.
//
// Note [CUDA entry points]
// * Tensor data pointers are device pointers; Shapes and scalars are host values passed by value to
//   the kernels. Index pointers (embedding indices, cross-entropy targets) are HOST pointers: the ops
//   keep their integer inputs on the CPU (range checks happen there), and the launcher uploads them.
// * Every call is asynchronous on the current stream (stream order is the only ordering the backend
//   relies on); the cross-entropy writes its loss on the device (Note [the loss stays on the device]).
// * Floating kernels are instantiated for fp64, fp32, fp16 and bf16 (math in accum_t<T>: fp32 for the
//   16-bit types); copy_strided for every pair of the dtype master list.
// * GEMMs run through cuBLASLt (cuBLAS when Lt has no algorithm for a layout): fp16/bf16 operands with
//   fp32 compute and fp32 scale; fp32 with plain fp32 compute unless set_allow_tf32(true).
#pragma once

#include <cstdint>
#include <type_traits>

#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/kernels/attention.hpp"
#include "typegrad/detail/kernels/core.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/detail/kernels/matmul.hpp"
#include "typegrad/detail/kernels/nn.hpp"
#include "typegrad/detail/kernels/optim.hpp"
#include "typegrad/detail/kernels/reduce.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cuda {

// ---- copies and elementwise (backends/cuda/elementwise.cu) -------------------------------------------
// copy_strided<S, T> is declared once for both devices (detail/kernels/core.hpp).

// ---- GEMMs and attention (backends/cuda/gemm.cu) ----------------------------------------------------------
/// Whether fp32 GEMMs may use TF32 tensor cores (a precision policy's choice; off by default).
void set_allow_tf32(bool allow);
bool allow_tf32();
/// How many linear_gelu_tanh_forward calls in this process took cuBLASLt's GELU epilogue (one fused GEMM)
/// rather than the fallback (GEMM, then the gelu_tanh kernel). 0 without the CUDA backend.
std::int64_t gelu_epilogue_calls();
/// How many linear_weight_grad calls in this process computed the bias gradient in the weight GEMM's
/// cuBLASLt BGRADB epilogue (Note [bias gradients in the weight GEMM]) rather than a separate reduction.
std::int64_t bgrad_epilogue_calls();
/// How many mlp_gelu_tanh backwards in this process computed the GELU gradient (and the c_fc bias gradient) in
/// the dH GEMM's cuBLASLt DGELU(_BGRAD) epilogue (Note [the fused GELU MLP]) rather than the composite.
std::int64_t dgelu_epilogue_calls();
/// How many 16-bit GEMMs in this process ran on zero-padded, 16-byte aligned copies of their operands
/// (Note [16-byte aligned GEMM operands] in backends/cuda/gemm.cu: large GEMMs with an odd row width, such
/// as GPT-2's LM head with its 50257-token vocabulary). 0 without the CUDA backend.
std::int64_t padded_gemm_calls();
/// How many attention forwards and backwards in this process ran the fused tensor-core kernels (Note [flash
/// attention on the GPU] in backends/cuda/flash_attention.cu) instead of the composite. 0 without the CUDA backend.
std::int64_t flash_attention_calls();
/// How many device-to-host reads (each waits for the stream's queue) this process made: a training step with
/// its boundary on the device makes one (Note [the step boundary on the device]). 0 without the CUDA backend.
std::int64_t device_to_host_reads();
/// Turns the fused attention kernels on or off for the process (on unless TG_CUDA_ATTENTION=composite at
/// start): off, every attention runs the composite. Without the CUDA backend, enabling is an error.
void set_flash_attention(bool enabled);
bool flash_attention_enabled();
// ---- loss-scaler kernel (backends/cuda/optim.cu) ------------------------------------------------------
// The optimizer kernels, per-tensor and multi-tensor, are declared once for both devices in
// detail/kernels/optim.hpp (fp32 here: parameters and optimizer state are fp32 masters).
/// The loss scaler's unscale: grads[i][j] *= inv_scale over every tensor in one launch; returns whether
/// any element was inf or NaN (one 4-byte read back, so it synchronizes).
bool unscale_and_check(float* const* grads, const std::int64_t* sizes, int count, float inv_scale);
/// Σ x² over every element of `count` contiguous fp32 tensors in one launch: per-chunk fp64 partials read
/// back and added in chunk order (deterministic; the read-back synchronizes). The global norm of clipping.
double sum_squares_multi(const float* const* xs, const std::int64_t* sizes, int count);
/// xs[i][j] *= s over every tensor in one launch (clipping's rescale).
void scale_multi(float* const* xs, const std::int64_t* sizes, int count, float s);

}  // namespace tg::backend::cuda

/// PAIR(S, T) for every destination T of the dtype master list (copy_strided's instantiations).
#define TG_CUDA_COPY_TARGETS(PAIR, S)                                                                \
  PAIR(S, ::tg::fp64) PAIR(S, ::tg::fp32) PAIR(S, ::tg::fp16) PAIR(S, ::tg::bf16) PAIR(S, std::int64_t) \
  PAIR(S, std::int32_t) PAIR(S, std::uint8_t) PAIR(S, std::int8_t)

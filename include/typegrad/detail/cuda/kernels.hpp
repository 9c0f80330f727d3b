// The CUDA backend's own entry points: copies, fills, the GEMM settings and counters, the multi-tensor
// optimizer and loss-scaler launches. The op kernels both devices have are declared once in detail/kernels/
// (Note [kernels declared once]) and included here. Declared always; defined by backends/cuda when
// TG_HAVE_CUDA, otherwise each call throws a tg::Error saying the build has no CUDA backend.
//
// Note [CUDA entry points]
// * Tensor data pointers are device pointers; Shapes and scalars are host values passed by value to
//   the kernels. Index pointers (embedding indices, cross-entropy targets) are HOST pointers: the ops
//   keep their integer inputs on the CPU (range checks happen there), and the launcher uploads them.
// * Every call is asynchronous on the default stream (stream order is the only ordering the backend
//   relies on) except cross_entropy_forward, which returns the summed loss and so synchronizes.
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
/// How many 16-bit GEMMs in this process ran on zero-padded, 16-byte aligned copies of their operands
/// (Note [16-byte aligned GEMM operands] in backends/cuda/gemm.cu: large GEMMs with an odd row width, such
/// as GPT-2's LM head with its 50257-token vocabulary). 0 without the CUDA backend.
std::int64_t padded_gemm_calls();
// ---- optimizer and loss-scaler kernels (backends/cuda/optim.cu) -------------------------------------------
/// One parameter of a multi-tensor launch: contiguous fp32 device buffers of n elements.
struct AdamTensor {
  float* p;
  const float* g;
  float* m;
  float* v;
  std::int64_t n;
};
/// Adam / AdamW (decoupled) over `count` tensors in one launch: blocks take fixed-size chunks from a
/// (tensor, start) table built on the host; each element runs math::adam_update, the CPU loop's body.
void adam_step_multi(const AdamTensor* tensors, int count, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, long long step);
// The per-tensor SGD, LAMB and Adafactor kernels (backends/cuda/optim_tensor.cu) are declared once for both
// devices in detail/kernels/optim.hpp (fp32 here: parameters and optimizer state are fp32 masters; LAMB and
// Adafactor read their fp64 sums back, so they synchronize; SGD is asynchronous).
// Multi-tensor SGD and LAMB (backends/cuda/optim.cu): one launch (LAMB: two, with one read-back between)
// for every tensor of a group sharing the scalars, chunked as adam_step_multi is.
/// One parameter of a multi-tensor SGD launch; `buf` (the momentum buffer) may be null without momentum.
struct SgdTensor {
  float* p;
  const float* g;
  float* buf;
  std::int64_t n;
};
/// torch.optim.SGD over `count` tensors in one launch: each element runs math::sgd_update, the CPU loop's body.
void sgd_step_multi(const SgdTensor* tensors, int count, const SgdScalars& s);
/// One parameter of a multi-tensor LAMB step (m, v: its moments).
using LambTensor = AdamTensor;
/// LAMB over `count` tensors: launch 1 updates the moments and writes per-chunk fp64 sums of p² and u²
/// (u = math::lamb_direction); the host adds them per tensor in chunk order (deterministic) and takes each
/// tensor's trust ratio with lamb_trust_ratio; launch 2 applies p -= lr·trust·u. Writes the ratios to
/// `trust_ratios` (count entries, host memory) when it is not null. Synchronizes (the read-back).
void lamb_step_multi(const LambTensor* tensors, int count, const LambScalars& s, double* trust_ratios);

/// One parameter of a multi-tensor Adafactor step, viewed as [rows, cols] (adafactor_rows / _cols). A
/// factored one has r (rows entries) and c (cols entries) and v == nullptr; a full one has v (rows·cols
/// entries) and r == c == nullptr. m (the first moment) may be null when beta1 == 0.
struct AdafactorTensor {
  float* p;
  const float* g;
  float* r;
  float* c;
  float* v;
  float* m;
  std::int64_t rows, cols;
};
/// Adafactor over `count` tensors sharing the scalars (one decay group and step count): a row-statistics
/// launch over every factored tensor's rows, a column launch, a full-moment launch, a launch that sums each
/// tensor's row statistics in row order (fp64, one thread per tensor), a chunked launch writing per-chunk
/// fp64 sums of U² and X², one read-back of those sums (added per tensor in chunk order), each tensor's step
/// size and clipping by adafactor_apply on the host, and a chunked apply launch: 6 launches and one
/// synchronization for the whole group, where the per-tensor kernels take 3-5 launches and 1-2 read-backs
/// per tensor. The element formulas are the per-tensor kernels' (and the CPU's).
void adafactor_step_multi(const AdafactorTensor* tensors, int count, const AdafactorScalars& s);

/// The loss scaler's unscale: grads[i][j] *= inv_scale over every tensor in one launch; returns whether
/// any element was inf or NaN (one 4-byte read back, so it synchronizes).
bool unscale_and_check(float* const* grads, const std::int64_t* sizes, int count, float inv_scale);

}  // namespace tg::backend::cuda

/// PAIR(S, T) for every destination T of the dtype master list (copy_strided's instantiations).
#define TG_CUDA_COPY_TARGETS(PAIR, S)                                                                \
  PAIR(S, ::tg::fp64) PAIR(S, ::tg::fp32) PAIR(S, ::tg::fp16) PAIR(S, ::tg::bf16) PAIR(S, std::int64_t) \
  PAIR(S, std::int32_t) PAIR(S, std::uint8_t)

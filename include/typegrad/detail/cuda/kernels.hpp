// The CUDA backend's op kernels: host entry points with the CPU backend's signatures (detail/cpu/kernels.hpp),
// so each op dispatches with one `if constexpr` branch. Declared always; defined by backends/cuda when
// TG_HAVE_CUDA, otherwise each call throws a tg::Error saying the build has no CUDA backend.
//   if constexpr (std::is_same_v<D, cuda>) backend::cuda::softmax_forward<T>(x, y, rows, n, log);
//   else backend::cpu::softmax_forward<T>(x, y, rows, n, log);
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
#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::backend::cuda {

// ---- copies and elementwise (backends/cuda/elementwise.cu) -------------------------------------------
/// dst[i] = S->T(src[i]) for every index i of `sizes`, both sides strided (strides in elements).
template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes);
/// out = a op b over out_shape; sa / sb are a's and b's strides in out's index space (0 = broadcast).
template <class T>
void binary(math::Binary op, const T* a, const Shape& sa, const T* b, const Shape& sb, T* out, const Shape& out_shape);
/// y = f(x) (math::apply), x strided, y contiguous.
template <class T>
void unary_forward(math::Unary op, const T* x, const Shape& sx, T* y, const Shape& shape);
/// dx = dy · f'(saved) (math::grad), saved being x or y as math::uses_output(op) says.
template <class T>
void unary_backward(math::Unary op, const T* saved, const Shape& ss, const T* dy, const Shape& sdy, T* dx,
                    const Shape& shape);
/// The CPU's dropout bit for bit: element i (row-major over `shape`) is kept iff
/// uniform(philox(seed, offset + i)[0]) >= p (Note [dropout replays its mask]).
template <class T>
void dropout_forward(const T* x, const Shape& sx, T* y, const Shape& shape, std::uint64_t seed, std::uint64_t offset,
                     double p);
/// y = mask ? value : x; sm are the (device) mask's strides in `shape` (0 on broadcast dims).
template <class T>
void masked_fill(const T* x, const Shape& sx, const std::uint8_t* mask, const Shape& sm, T value, T* y,
                 const Shape& shape);

// ---- reductions (backends/cuda/reduce.cu) --------------------------------------------------------------
/// out[o, i] = Σ_k in[o, k, i] over a contiguous [outer, n, inner] block, accumulated in accum_t<T> in a
/// fixed order (deterministic: no atomics).
template <class T>
void reduce_sum(const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner);
/// out[o, i] = max_k in[o, k, i]; the first maximum's k into `index` (device) when it is not null; NaN wins.
template <class T>
void reduce_max(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n, std::int64_t inner);
/// din (contiguous [outer, n, inner], overwritten) = 0 except din[o, index[o, i], i] = dout[o, i].
template <class T>
void max_backward(const T* dout, const std::int64_t* index, T* din, std::int64_t outer, std::int64_t n,
                  std::int64_t inner);

// ---- row ops: softmax, norms, embedding, cross-entropy (backends/cuda/nn.cu) ------------------------------
template <class T>
void softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t n, bool log);
template <class T>
void softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log);
template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* y, accum_t<T>* mean, accum_t<T>* rstd,
                       std::int64_t rows, std::int64_t n, double eps);
/// mean == nullptr means RMSNorm; any of dx, dw, db may be null. dw / db are column sums over rows in a
/// fixed order (two passes through an fp32 workspace; deterministic).
template <class T>
void layernorm_backward(const T* x, const T* w, const accum_t<T>* mean, const accum_t<T>* rstd, const T* dy, T* dx,
                        T* dw, T* db, std::int64_t rows, std::int64_t n);
template <class T>
void rmsnorm_forward(const T* x, const T* w, T* y, accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps);
/// idx: HOST pointer (see the Note).
template <class T>
void embedding_forward(const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C);
/// dw[v, :] = Σ_{i: idx[i] = v} dout[i, :] summed in position order (the host sorts positions by index
/// stably; one block per row of dw): deterministic, the CPU's order. idx: HOST pointer.
template <class T>
void embedding_backward(const T* dout, const std::int64_t* idx, T* dw, std::int64_t n, std::int64_t V, std::int64_t C);
/// targets: HOST pointer. Per-row losses come back to the host and are summed in row order in fp64 (the
/// CPU's order); synchronizes.
template <class T>
double cross_entropy_forward(const T* logits, const std::int64_t* targets, accum_t<T>* lse, std::int64_t rows,
                             std::int64_t V, std::int64_t ignore_index, std::int64_t* count);
/// targets: HOST pointer.
template <class T>
void cross_entropy_backward(const T* logits, const std::int64_t* targets, const accum_t<T>* lse, double scale,
                            T* dlogits, std::int64_t rows, std::int64_t V, std::int64_t ignore_index);

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
/// The CPU's matmul_strided contract (detail/cpu/kernels.hpp): C[i] = A[i]·B[i] over `batch`, sa / sb / sc
/// = batch strides then (row, col) strides; a 0 batch stride in sc reduces over that dim.
template <class T>
void matmul_strided(const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,
                    const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K);
/// y[M,N] = x[M,K]·w[N,K]ᵀ (+ bias[N], as cuBLASLt's bias epilogue).
template <class T>
void linear_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, std::int64_t wcs,
                    const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K);
/// pre = x·wᵀ (+ bias) and y = gelu_tanh(pre), [M,N] contiguous each (Note [fused linear + GELU],
/// ops/linear_gelu.hpp): one cuBLASLt GEMM with CUBLASLT_EPILOGUE_GELU_AUX(_BIAS) writing y and, as its aux
/// output, pre; when cuBLASLt has no algorithm for the call (or N % 8 != 0, the aux ld rule), linear_forward
/// then unary_forward(gelu_tanh), the composite's kernels.
template <class T>
void linear_gelu_tanh_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,
                              std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N,
                              std::int64_t K);
/// Causal attention over BH contiguous heads of [Tn, hs] as a composite: S = scale·QKᵀ (batched GEMM, fp32
/// out), a masked-softmax kernel (P in T, lse in fp32), O = P·V. Workspace: BH·Tn² fp32 + BH·Tn² T.
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH, std::int64_t Tn,
                       std::int64_t hs, double scale, bool causal);
/// Recomputes S and P from lse; dV = Pᵀ·dO, dP = dO·Vᵀ, dS = scale·P∘(dP − rowsum(dO∘O)), dQ = dS·K, dK = dSᵀ·Q.
template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse, T* dq,
                        T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal);

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
// Per-tensor optimizer kernels (backends/cuda/optim_tensor.cu): the CPU backend's signatures and scalar
// structs, fp32 only (parameters and optimizer state are fp32 masters). LAMB and Adafactor read their
// fp64 sums back (they synchronize); SGD is asynchronous.
using SgdScalars = cpu::SgdScalars;
using LambScalars = cpu::LambScalars;
using AdafactorScalars = cpu::AdafactorScalars;
template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars& s);
template <class T>
double lamb_step(T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s);
template <class T>
void adafactor_step_factored(T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,
                             const AdafactorScalars& s);
template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s);
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
/// tensor's trust ratio with cpu::lamb_trust_ratio; launch 2 applies p -= lr·trust·u. Writes the ratios to
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
/// size and clipping by cpu::adafactor_apply on the host, and a chunked apply launch: 6 launches and one
/// synchronization for the whole group, where the per-tensor kernels take 3-5 launches and 1-2 read-backs
/// per tensor. The element formulas are the per-tensor kernels' (and the CPU's).
void adafactor_step_multi(const AdafactorTensor* tensors, int count, const AdafactorScalars& s);

/// The loss scaler's unscale: grads[i][j] *= inv_scale over every tensor in one launch; returns whether
/// any element was inf or NaN (one 4-byte read back, so it synchronizes).
bool unscale_and_check(float* const* grads, const std::int64_t* sizes, int count, float inv_scale);

}  // namespace tg::backend::cuda

// One list for the definitions (backends/cuda) and the CUDA-less stubs (backends/cpu/no_cuda.cpp).
#define TG_CUDA_FLOAT_TYPES(X) X(::tg::fp64) X(::tg::fp32) X(::tg::fp16) X(::tg::bf16)
/// PAIR(S, T) for every destination T of the dtype master list (copy_strided's instantiations).
#define TG_CUDA_COPY_TARGETS(PAIR, S)                                                                \
  PAIR(S, ::tg::fp64) PAIR(S, ::tg::fp32) PAIR(S, ::tg::fp16) PAIR(S, ::tg::bf16) PAIR(S, std::int64_t) \
  PAIR(S, std::int32_t) PAIR(S, std::uint8_t)

// Note [backend dispatch]
// An op calls its kernel as TG_BACKEND(D, kernel<T>(args...)): an `if constexpr` on the device tag that
// calls backend::cuda::kernel for tg::cuda and backend::cpu::kernel otherwise, as an expression (the
// kernel's result, if any, is the macro's value). Both backends declare every kernel with one signature,
// so the op's code (checks, shapes, saved values) is shared.
#define TG_BACKEND(D, ...)                                                        \
  [&]() -> decltype(auto) {                                                       \
    if constexpr (std::is_same_v<D, ::tg::cuda>) return ::tg::backend::cuda::__VA_ARGS__; \
    else return ::tg::backend::cpu::__VA_ARGS__;                                  \
  }()

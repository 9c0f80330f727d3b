// Fused causal attention on tensor cores for 16-bit storage (Note [flash attention on the GPU]): the T×T
// scores and probabilities live in shared memory one tile at a time, never in global memory. gemm.cu's
// attention_forward / attention_backward call these first and keep the composite (batched GEMMs and a
// softmax kernel) for fp32 and fp64, for head sizes other than 64 and 128, and when TG_CUDA_ATTENTION is
// "composite". Two sets of kernels compute the same thing: the WMMA tiles staged in shared memory
// (flash_attention_tiles.cuh, "tiles", the default) and the register-resident mma.sync kernels
// (flash_attention_mma.cuh, "registers"); TG_CUDA_ATTENTION=tiles|registers or set_flash_attention_kernels
// chooses. This file holds the Note, the launchers and the entry points.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>

#include "common.cuh"
#include "flash_attention.cuh"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cuda/attention.hpp"
#include "typegrad/detail/cuda/mma_layout.hpp"

namespace tg::backend::cuda {

// Note [flash attention on the GPU]
// Inputs: heads of [Tn, hs] rows, T = bf16 or fp16, hs 64 or 128, placed by a Heads layout (row t of head
// (b, h) at b·batch + h·head + t·row): BH contiguous heads for causal_attention, or the heads packed in a fused
// QKV projection's [B, Tn, 3, H, hs] output (and out, dout in [B, Tn, H, hs]) for causal_attention_qkv, read and
// written in place with no layout copy. The lse and the row sums D are fp32, [B·H, Tn]. Scores are computed with WMMA 16x16x16 tiles (fp32 accumulators)
// from tiles staged in shared memory; each of a block's 4 warps owns 16 rows of the tile, so the softmax of a
// row and its output accumulator belong to one warp (no block barrier between the two GEMMs of a step).
//
// Forward (one block per (head, 64 query rows)): for each key tile of 64 up to the diagonal,
//   S = scale·Q·Kᵀ, masked (j > i under the causal mask, j >= Tn) to −inf; m' = max(m, rowmax S);
//   P = exp(S − m') rounded to T (the composite also multiplies P in T); l = l·exp(m − m') + rowsum(P);
//   O = O·exp(m − m') + P·V.
// Then out = O / l and lse = m + log l (the composite's lse: the log-sum-exp of the scaled, masked scores).
// Backward, deterministic (no atomics; FlashAttention-2's schedule split in two kernels so that each output
// tile has one writer): D_i = Σ_c dO[i,c]·O[i,c] per row; then
//   dK/dV kernel, one block per (head, 64 keys): over the query tiles at or after the keys, recompute
//     Sᵀ = scale·K·Qᵀ and Pᵀ = exp(Sᵀ − lse), dPᵀ = V·dOᵀ, dSᵀ = scale·Pᵀ∘(dPᵀ − D);
//     dV += Pᵀ·dO, dK += dSᵀ·Q;
//   dQ kernel, one block per (head, 64 queries): over the key tiles up to the diagonal, recompute P and dP
//     the same way and dQ += dS·K.
// Each kernel sums its tiles in a fixed order, so results are reproducible run to run. They equal the
// composite's up to rounding (the composite rounds P and dS to T for its GEMMs too; here the fp32 partial
// sums are grouped by tile). The op database's CUDA-vs-CPU entries for causal_attention check both paths.

namespace {

#include "flash_attention_tiles.cuh"

#include "flash_attention_mma.cuh"

/// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per device (`done`
/// holds a bit per device ordinal below 64; higher ordinals set it on every call).
template <class Kernel>
void allow_smem(Kernel kernel, std::size_t bytes, std::atomic<std::uint64_t>& done) {
  int dev = 0;
  TG_CUDA_CHECK(cudaGetDevice(&dev));
  const std::uint64_t bit = dev >= 0 && dev < 64 ? std::uint64_t{1} << dev : 0;
  if (bit && (done.load() & bit)) return;
  TG_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  done.fetch_or(bit);
}

/// TG_CUDA_ATTENTION as read at the first attention call: unset or "tiles" (the WMMA kernels), "registers"
/// (the mma.sync kernels) or "composite" (no fused kernel). Another value is kept in `bad`: the attention
/// calls report it (Error naming the values) until a setter chooses for the process.
struct AttentionEnv {
  bool composite = false;
  FlashKernels kernels = FlashKernels::tiles;
  std::string bad;
};
const AttentionEnv& attention_env() {
  static const AttentionEnv env = [] {
    AttentionEnv e;
    const char* v = std::getenv("TG_CUDA_ATTENTION");
    if (!v || !*v || std::strcmp(v, "tiles") == 0) return e;
    if (std::strcmp(v, "composite") == 0) e.composite = true;
    else if (std::strcmp(v, "registers") == 0) e.kernels = FlashKernels::registers;
    else e.bad = v;
    return e;
  }();
  return env;
}
std::atomic<bool> g_chosen_by_call{false};  // a setter ran: TG_CUDA_ATTENTION no longer decides

/// Whether the fused kernels may run (TG_CUDA_ATTENTION=composite turns them off at start,
/// set_flash_attention at any time) and which set runs (set_flash_attention_kernels).
std::atomic<bool>& flash_enabled() {
  static std::atomic<bool> on{!attention_env().composite};
  return on;
}
std::atomic<FlashKernels>& kernel_choice() {
  static std::atomic<FlashKernels> k{attention_env().kernels};
  return k;
}
void check_env() {
  if (!g_chosen_by_call.load() && !attention_env().bad.empty())
    throw Error("TG_CUDA_ATTENTION must be tiles, registers or composite, got '", attention_env().bad, "'");
}

std::atomic<std::int64_t> g_flash_calls{0};

template <class T, int HS>
void forward_hs(const T* q, const T* k, const T* v, Heads in, T* out, Heads io, float* lse, std::int64_t B,
                std::int64_t H, std::int64_t Tn, float scale, bool causal, FlashKernels kernels) {
  const auto grid = static_cast<unsigned>(B * H * ((Tn + kRows - 1) / kRows));  // Note [attention grid]
  if (kernels == FlashKernels::registers) {
    static std::atomic<std::uint64_t> ready{0};
    allow_smem(mmak::forward_kernel<T, HS>, mmak::FwdSmem<HS>::bytes, ready);
    mmak::forward_kernel<T, HS><<<grid, kBlockThreads, mmak::FwdSmem<HS>::bytes, detail::stream()>>>(
        q, k, v, in, out, io, lse, H, Tn, scale, causal);
  } else {
    static std::atomic<std::uint64_t> ready{0};
    allow_smem(flash_forward_kernel<T, HS>, FwdSmem<HS>::bytes, ready);
    flash_forward_kernel<T, HS><<<grid, kBlockThreads, FwdSmem<HS>::bytes, detail::stream()>>>(q, k, v, in, out, io, lse,
                                                                                              H, Tn, scale, causal);
  }
  TG_CUDA_LAUNCHED();
}

template <class T, int HS>
void backward_hs(const T* q, const T* k, const T* v, Heads in, const T* out, const T* dout, Heads io, const float* lse,
                 T* dq, T* dk, T* dv, std::int64_t B, std::int64_t H, std::int64_t Tn, float scale, bool causal,
                 FlashKernels kernels) {
  const bool regs = kernels == FlashKernels::registers;
  if (regs) {
    static std::atomic<std::uint64_t> ready_dkdv{0}, ready_dq{0};
    allow_smem(mmak::backward_dkdv_kernel<T, HS>, mmak::DkvSmem<HS>::bytes, ready_dkdv);
    allow_smem(mmak::backward_dq_kernel<T, HS>, mmak::DqSmem<HS>::bytes, ready_dq);
  } else {
    static std::atomic<std::uint64_t> ready_dkdv{0}, ready_dq{0};
    allow_smem(flash_backward_dkdv_kernel<T, HS>, DkvSmem<HS>::bytes, ready_dkdv);
    allow_smem(flash_backward_dq_kernel<T, HS>, DqSmem<HS>::bytes, ready_dq);
  }
  const std::int64_t rows = B * H * Tn;
  detail::Workspace wd(static_cast<std::size_t>(rows) * sizeof(float));
  float* d = wd.as<float>();
  row_dot_kernel<T><<<static_cast<unsigned>(std::min<std::int64_t>((rows + 7) / 8, 65535LL * 8)), 256, 0, detail::stream()>>>(
      dout, out, io, d, H, Tn, rows, static_cast<int>(HS));
  TG_CUDA_LAUNCHED();
  const auto grid = static_cast<unsigned>(B * H * ((Tn + kRows - 1) / kRows));  // Note [attention grid]
  if (regs) {
    mmak::backward_dkdv_kernel<T, HS><<<grid, kBlockThreads, mmak::DkvSmem<HS>::bytes, detail::stream()>>>(
        q, k, v, in, dout, io, lse, d, dk, dv, H, Tn, scale, causal);
    TG_CUDA_LAUNCHED();
    mmak::backward_dq_kernel<T, HS><<<grid, kBlockThreads, mmak::DqSmem<HS>::bytes, detail::stream()>>>(
        q, k, v, in, dout, io, lse, d, dq, H, Tn, scale, causal);
    TG_CUDA_LAUNCHED();
    return;
  }
  flash_backward_dkdv_kernel<T, HS><<<grid, kBlockThreads, DkvSmem<HS>::bytes, detail::stream()>>>(
      q, k, v, in, dout, io, lse, d, dk, dv, H, Tn, scale, causal);
  TG_CUDA_LAUNCHED();
  flash_backward_dq_kernel<T, HS><<<grid, kBlockThreads, DqSmem<HS>::bytes, detail::stream()>>>(
      q, k, v, in, dout, io, lse, d, dq, H, Tn, scale, causal);
  TG_CUDA_LAUNCHED();
}

template <class T>
constexpr bool kSixteenBit = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;

/// Whether every pointer allows the 16-byte vector loads (fresh allocations do; a view at an odd offset may not).
template <class... P>
bool aligned16(const P*... p) {
  return ((reinterpret_cast<std::uintptr_t>(p) % 16 == 0) && ...);
}

/// The dynamic shared memory a block may opt in to on the current device (cached per device ordinal below 64).
std::size_t smem_optin_limit() {
  static std::atomic<int> limits[64] = {};
  int dev = 0;
  TG_CUDA_CHECK(cudaGetDevice(&dev));
  const bool cached = dev >= 0 && dev < 64;
  if (cached)
    if (const int v = limits[dev].load(); v > 0) return static_cast<std::size_t>(v);
  int v = 0;
  TG_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  if (cached) limits[dev].store(v);
  return static_cast<std::size_t>(v);
}

/// The shared memory per block of a set of kernels for head size HS.
template <int HS>
std::size_t smem_need(bool backward, FlashKernels kernels) {
  if (kernels == FlashKernels::registers)
    return backward ? std::max(mmak::DkvSmem<HS>::bytes, mmak::DqSmem<HS>::bytes) : mmak::FwdSmem<HS>::bytes;
  return backward ? std::max(DkvSmem<HS>::bytes, DqSmem<HS>::bytes) : FwdSmem<HS>::bytes;
}

/// Whether the fused kernels may run. The WMMA tiles need up to 137 KiB of shared memory per block (hs 128's
/// backward; Note [flash attention on the GPU]), the register kernels up to 80 KiB (hs 128's forward): GPUs
/// that allow less (99 KiB on sm_86 / sm_89 / sm_120) run the composite for the kernels that do not fit,
/// forward and backward deciding separately (their lse agree).
/// `kernels` is the choice read once by the entry point, so the check and the launch agree.
bool usable(std::int64_t BH, std::int64_t Tn, std::int64_t hs, bool backward, FlashKernels kernels) {
  check_env();
  if (!(BH > 0 && Tn > 0 && (hs == 64 || hs == 128) && flash_enabled().load())) return false;
  if (BH > (std::int64_t{1} << 31) / ((Tn + kRows - 1) / kRows) - 1) return false;  // the 1-D grid (Note [attention grid])
  return (hs == 64 ? smem_need<64>(backward, kernels) : smem_need<128>(backward, kernels)) <= smem_optin_limit();
}

}  // namespace

std::int64_t flash_attention_calls() { return g_flash_calls.load(); }
void set_flash_attention(bool enabled) {
  flash_enabled().store(enabled);
  g_chosen_by_call.store(true);
}
bool flash_attention_enabled() { return flash_enabled().load(); }
void set_flash_attention_kernels(FlashKernels kernels) {
  kernel_choice().store(kernels);
  g_chosen_by_call.store(true);
}
FlashKernels flash_attention_kernels() { return kernel_choice().load(); }

namespace {
/// The fused kernels over heads at layouts `in` (q, k, v and their gradients) and `io` (out and dout).
template <class T>
bool forward_any(const T* q, const T* k, const T* v, Heads in, T* out, Heads io, float* lse, std::int64_t B,
                 std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale, bool causal, FlashKernels kernels) {
  const auto s = static_cast<float>(scale);
  if (hs == 64) forward_hs<T, 64>(q, k, v, in, out, io, lse, B, H, Tn, s, causal, kernels);
  else forward_hs<T, 128>(q, k, v, in, out, io, lse, B, H, Tn, s, causal, kernels);
  g_flash_calls.fetch_add(1);
  return true;
}
template <class T>
bool backward_any(const T* q, const T* k, const T* v, Heads in, const T* out, const T* dout, Heads io,
                  const float* lse, T* dq, T* dk, T* dv, std::int64_t B, std::int64_t H, std::int64_t Tn,
                  std::int64_t hs, double scale, bool causal, FlashKernels kernels) {
  const auto s = static_cast<float>(scale);
  if (hs == 64) backward_hs<T, 64>(q, k, v, in, out, dout, io, lse, dq, dk, dv, B, H, Tn, s, causal, kernels);
  else backward_hs<T, 128>(q, k, v, in, out, dout, io, lse, dq, dk, dv, B, H, Tn, s, causal, kernels);
  g_flash_calls.fetch_add(1);
  return true;
}
/// Row and head strides whose 16-bit elements keep 16-byte vectors aligned.
bool strides16(const Heads& l) { return l.batch % 8 == 0 && l.head % 8 == 0 && l.row % 8 == 0; }
}  // namespace

template <class T>
bool flash_attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH,
                             std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const FlashKernels kernels = kernel_choice().load();
    if (!usable(BH, Tn, hs, false, kernels) || !aligned16(q, k, v, out)) return false;
    const Heads l{Tn * hs, 0, hs};  // BH heads of [Tn, hs], one after another
    return forward_any<T>(q, k, v, l, out, l, lse, BH, 1, Tn, hs, scale, causal, kernels);
  }
}

template <class T>
bool flash_attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse,
                              T* dq, T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale,
                              bool causal) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const FlashKernels kernels = kernel_choice().load();
    if (!usable(BH, Tn, hs, true, kernels) || !aligned16(q, k, v, out, dout, dq, dk, dv)) return false;
    const Heads l{Tn * hs, 0, hs};
    return backward_any<T>(q, k, v, l, out, dout, l, lse, dq, dk, dv, BH, 1, Tn, hs, scale, causal, kernels);
  }
}

template <class T>
bool flash_attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H,
                                 std::int64_t Tn, std::int64_t hs, double scale) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const std::int64_t C = H * hs;
    const Heads in{Tn * 3 * C, hs, 3 * C}, io{Tn * C, hs, C};
    const FlashKernels kernels = kernel_choice().load();
    if (!usable(B * H, Tn, hs, false, kernels) || !aligned16(qkv, out) || !strides16(in) || !strides16(io)) return false;
    return forward_any<T>(qkv, qkv + C, qkv + 2 * C, in, out, io, lse, B, H, Tn, hs, scale, true, kernels);
  }
}

template <class T>
bool flash_attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv,
                                  std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale) {
  if constexpr (!kSixteenBit<T>) {
    return false;
  } else {
    const std::int64_t C = H * hs;
    const Heads in{Tn * 3 * C, hs, 3 * C}, io{Tn * C, hs, C};
    const FlashKernels kernels = kernel_choice().load();
    if (!usable(B * H, Tn, hs, true, kernels) || !aligned16(qkv, out, dout, dqkv) || !strides16(in) || !strides16(io))
      return false;
    return backward_any<T>(qkv, qkv + C, qkv + 2 * C, in, out, dout, io, lse, dqkv, dqkv + C, dqkv + 2 * C, B, H, Tn, hs,
                           scale, true, kernels);
  }
}

#define TG_FLASH_INSTANTIATE(T)                                                                                   \
  template bool flash_attention_forward<T>(const T*, const T*, const T*, T*, accum_t<T>*, std::int64_t,          \
                                           std::int64_t, std::int64_t, double, bool);                            \
  template bool flash_attention_backward<T>(const T*, const T*, const T*, const T*, const T*, const accum_t<T>*, \
                                            T*, T*, T*, std::int64_t, std::int64_t, std::int64_t, double, bool); \
  template bool flash_attention_qkv_forward<T>(const T*, T*, accum_t<T>*, std::int64_t, std::int64_t,           \
                                               std::int64_t, std::int64_t, double);                              \
  template bool flash_attention_qkv_backward<T>(const T*, const T*, const T*, const accum_t<T>*, T*,            \
                                                std::int64_t, std::int64_t, std::int64_t, std::int64_t, double);
TG_FLASH_INSTANTIATE(double)
TG_FLASH_INSTANTIATE(float)
TG_FLASH_INSTANTIATE(::tg::bf16)
TG_FLASH_INSTANTIATE(::tg::fp16)
#undef TG_FLASH_INSTANTIATE

}  // namespace tg::backend::cuda

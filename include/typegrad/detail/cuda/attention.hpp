// Which fused attention kernels the CUDA backend runs (backends/cuda/flash_attention.cu): the WMMA tiles staged
// in shared memory (Note [flash attention on the GPU]) or the register-resident mma.sync kernels (Note [flash
// attention in registers]). Both compute the same values up to rounding order; gpu-check times both.
//   tg::backend::cuda::set_flash_attention_kernels(tg::backend::cuda::FlashKernels::registers);
#pragma once

namespace tg::backend::cuda {

enum class FlashKernels {
  tiles,      ///< WMMA 16x16x16 on tiles staged in shared memory (FlashAttention-1's shape); the default
  registers,  ///< mma.sync m16n8k16 with register-resident scores and accumulators (FlashAttention-2's shape)
};

/// Chooses the fused kernels for the process (TG_CUDA_ATTENTION=tiles|registers at start; `composite` turns
/// the fused kernels off, see set_flash_attention). Without the CUDA backend, choosing is an error.
void set_flash_attention_kernels(FlashKernels kernels);
FlashKernels flash_attention_kernels();

}  // namespace tg::backend::cuda

// bf16 GEMM on Intel AMX tiles (tdpbf16ps: bf16 x bf16 -> fp32), for CPUs whose AVX-512 vdpbf16ps is no
// faster than fp32 FMA. Used by the matmul / linear launchers for bf16 when amx_bf16_usable().
//   if (tg::backend::cpu::amx_bf16_usable()) tg::backend::cpu::gemm_bf16_amx(Trans::N, Trans::T, M, N, K, 1.f, x, K, w, K, 0.f, y, N, nullptr);
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu {

/// Linux keeps the AMX tile data state off until a process asks (arch_prctl ARCH_REQ_XCOMP_PERM for
/// XFEATURE_XTILEDATA); the answer holds for every thread of the process. Asks once (thread-safe), then
/// returns the answer. Shared by the bf16 and int8 AMX GEMMs (amx_bf16.cpp, amx_int8.cpp).
bool amx_tile_permission();

/// The 64-byte tile configuration ldtilecfg reads (palette 1): bytes per row and rows of each of the 8 tiles.
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

/// Whether this CPU has AMX-BF16, the OS granted the tile state to this process, and TG_GEMM_KERNEL /
/// TG_AMX do not ask for another kernel (TG_AMX=0 turns AMX off; any TG_GEMM_KERNEL keeps the GEMM
/// dispatch's own choice, so kernel tests stay on the kernel they name). Read on every call (cheap).
bool amx_bf16_usable();

/// C[M,N] = alpha · op(A) · op(B) + beta · C (+ bias[N] per row), Note [GEMM conventions]: A, B, C bf16,
/// accumulation in fp32, C rounded once. Throws tg::Error when AMX is not usable.
void gemm_bf16_amx(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const bf16* A,
                   std::int64_t lda, const bf16* B, std::int64_t ldb, float beta, bf16* C, std::int64_t ldc,
                   const float* bias);

}  // namespace tg::backend::cpu

// bf16 GEMM on AMX tiles. Both operands are packed into tile-shaped panels (A: 16 rows x 32 k; B: 16
// k-pairs x 16 columns x 2, the "VNNI" layout tdpbf16ps reads), zero-padded to whole tiles; each task
// computes a 32x32 block of C in four fp32 accumulator tiles (2x2 register blocking: two A and two B
// tiles per 32-wide k step), then rounds it into C once with alpha, beta and the bias.
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/amx.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"

namespace tg::backend::cpu {

bool amx_tile_permission() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  static const bool granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

namespace {

constexpr std::int64_t kTileRows = 16;  // rows of every tile
constexpr std::int64_t kTileK = 32;     // bf16 values per A-tile row (64 bytes)
constexpr std::int64_t kBlock = 32;     // C block per task: 2x2 tiles of 16x16

bool amx_granted() {
  static const bool ok = cpu_features().amx_bf16 && cpu_features().avx512f && amx_tile_permission();
  return ok;
}

__attribute__((target("amx-tile"))) void load_config() {
  AmxTileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;  // 16 fp32 (C), 32 bf16 (A), 16 pairs of bf16 (B)
    cfg.rows[t] = kTileRows;
  }
  _tile_loadconfig(&cfg);
}

/// One 32x32 block of C over `kb` k-tiles: a0/a1 are the two A panels (kb tiles of 16x32 each), b0/b1 the
/// two B panels (kb tiles of 16 pairs x 16 each); the fp32 result goes to out (32x32, row stride 32).
/// A tiles are read at a_stride bytes per row and advance a_step elements per k tile: (64, 512) for packed
/// panels, (2·lda, 32) straight from a row-major A.
__attribute__((target("amx-tile,amx-bf16"))) void block_32x32(const std::uint16_t* a0, const std::uint16_t* a1,
                                                              std::int64_t a_stride, std::int64_t a_step,
                                                              const std::uint16_t* b0, const std::uint16_t* b1,
                                                              std::int64_t kb, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  constexpr std::int64_t kTileElems = kTileRows * kTileK;  // 512 bf16 = 1 KiB
  for (std::int64_t k = 0; k < kb; ++k) {
    _tile_loadd(4, a0 + k * a_step, a_stride);
    _tile_loadd(6, b0 + k * kTileElems, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b1 + k * kTileElems, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + k * a_step, a_stride);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, out, kBlock * 4);
  _tile_stored(1, out + 16, kBlock * 4);
  _tile_stored(2, out + 16 * kBlock, kBlock * 4);
  _tile_stored(3, out + 16 * kBlock + 16, kBlock * 4);
}

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

inline std::uint16_t bits_at(const bf16* p, std::int64_t i) { return p[i].bits; }

/// op(A)[m, k] for A stored row-major with leading dimension lda (Trans::T: stored [K, M]).
inline std::uint16_t a_at(const bf16* A, Trans ta, std::int64_t lda, std::int64_t m, std::int64_t k) {
  return ta == Trans::N ? bits_at(A, m * lda + k) : bits_at(A, k * lda + m);
}
/// op(B)[k, n] (Trans::T: B stored [N, K]).
inline std::uint16_t b_at(const bf16* B, Trans tb, std::int64_t ldb, std::int64_t k, std::int64_t n) {
  return tb == Trans::N ? bits_at(B, k * ldb + n) : bits_at(B, n * ldb + k);
}

/// One A tile [16 rows][32 k] of op(A) from (m0, k0), zero outside M x K. Whole tiles copy rows (Trans::N)
/// or gather 16 contiguous m per k (Trans::T) without bounds checks.
void pack_a_tile(std::uint16_t* t, const bf16* A, Trans ta, std::int64_t lda, std::int64_t m0, std::int64_t k0,
                 std::int64_t M, std::int64_t K) {
  const bool full = m0 + kTileRows <= M && k0 + kTileK <= K;
  if (full && ta == Trans::N) {
    for (std::int64_t r = 0; r < kTileRows; ++r) std::memcpy(t + r * kTileK, A + (m0 + r) * lda + k0, kTileK * 2);
    return;
  }
  if (full) {
    for (std::int64_t j = 0; j < kTileK; ++j) {
      const bf16* src = A + (k0 + j) * lda + m0;
      for (std::int64_t r = 0; r < kTileRows; ++r) t[r * kTileK + j] = src[r].bits;
    }
    return;
  }
  for (std::int64_t r = 0; r < kTileRows; ++r)
    for (std::int64_t j = 0; j < kTileK; ++j) {
      const std::int64_t m = m0 + r, k = k0 + j;
      t[r * kTileK + j] = (m < M && k < K) ? a_at(A, ta, lda, m, k) : std::uint16_t(0);
    }
}

/// dst[2c] = r0[c], dst[2c + 1] = r1[c] for c < 16, r1 = r0 + ld: one row of a B tile, 64 bytes.
__attribute__((target("avx512f,avx512bw"))) inline void interleave_rows(const bf16* r0, std::int64_t ld,
                                                                         std::uint16_t* dst) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + ld)));
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

/// One B tile [16 k-pairs][16 n][2] of op(B) from (k0, n0), zero outside K x N. Whole tiles move k-pairs
/// as 32-bit words (Trans::T: a row of B holds 16 pairs) or interleave two k rows (Trans::N).
void pack_b_tile(std::uint16_t* t, const bf16* B, Trans tb, std::int64_t ldb, std::int64_t k0, std::int64_t n0,
                 std::int64_t K, std::int64_t N) {
  const bool full = n0 + kTileRows <= N && k0 + kTileK <= K;
  if (full && tb == Trans::T) {
    for (std::int64_t c = 0; c < kTileRows; ++c) {
      std::uint32_t pairs[kTileK / 2];
      std::memcpy(pairs, B + (n0 + c) * ldb + k0, kTileK * 2);
      for (std::int64_t p = 0; p < kTileK / 2; ++p) std::memcpy(t + p * 32 + c * 2, &pairs[p], 4);
    }
    return;
  }
  if (full) {
    for (std::int64_t p = 0; p < kTileK / 2; ++p) interleave_rows(B + (k0 + 2 * p) * ldb + n0, ldb, t + p * 32);
    return;
  }
  for (std::int64_t c = 0; c < kTileRows; ++c)
    for (std::int64_t j = 0; j < kTileK; ++j) {
      const std::int64_t n = n0 + c, k = k0 + j;
      t[(j / 2) * 32 + c * 2 + (j & 1)] = (n < N && k < K) ? b_at(B, tb, ldb, k, n) : std::uint16_t(0);
    }
}

}  // namespace

bool amx_bf16_usable() {
  if (const char* e = std::getenv("TG_AMX"); e && std::strcmp(e, "0") == 0) return false;
  if (const char* e = std::getenv("TG_GEMM_KERNEL"); e && *e) return false;
  return amx_granted();
}

// Note [AMX bf16 GEMM]
// Packed A: Mp/16 panels, each Kp/32 tiles of [16 rows][32 k] (tile (mb, kb) at (mb·KB + kb)·512).
// Packed B: Np/16 panels, each Kp/32 tiles of [16 k-pairs][16 n][2] (element (k, n) of the tile at
// ((k/2)·16 + n)·2 + k%2), the layout tdpbf16ps multiplies against A's rows: C[m][n] += Σ_k A[m][k]·B[k][n]
// over each pair. Mp, Np are rounded up to 32 and Kp to 32 with zeros, so edge blocks need no special
// kernel; the epilogue writes only the M x N corner. Tasks are 32x32 blocks of C, the longer dimension outer, split over the
// OpenMP team; each thread loads the tile configuration once per call.
void gemm_bf16_amx(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const bf16* A,
                   std::int64_t lda, const bf16* B, std::int64_t ldb, float beta, bf16* C, std::int64_t ldc,
                   const float* bias) {
  TG_CHECK(amx_granted(), "gemm_bf16_amx: AMX-BF16 is not available on this CPU or not granted by the OS");
  if (M <= 0 || N <= 0) return;
  // A tile row is a run of 32 k: a copy when op(A) = A. The B tile pairs adjacent k per column: an
  // interleave of two rows when op(B) = B, a 32-bit transpose when op(B) = Bᵀ. For x·Wᵀ (the forward of
  // every linear) compute Cᵀ = W·xᵀ instead, so the transpose falls on the activations, not the weights.
  const bool swap = ta == Trans::N && tb == Trans::T;
  if (swap) {
    std::swap(A, B);
    std::swap(lda, ldb);
    std::swap(M, N);
    ta = Trans::N;  // op(A') = W as stored ([N, K] rows)
    tb = Trans::T;  // op(B') = xᵀ, x stored [M, K]
  }
  const std::int64_t Mp = (M + kBlock - 1) / kBlock * kBlock, Np = (N + kBlock - 1) / kBlock * kBlock;
  const std::int64_t KB = std::max<std::int64_t>(1, (K + kTileK - 1) / kTileK), Kp = KB * kTileK;
  const std::int64_t panel = KB * kTileRows * kTileK;  // elements per 16-row (or 16-column) panel
  // Packing buffers grow to the largest call and stay (resizing down and up again would zero-fill).
  thread_local std::vector<std::uint16_t> pa, pb;
  const auto need_a = static_cast<std::size_t>(Mp / kTileRows * panel), need_b = static_cast<std::size_t>(Np / kTileRows * panel);
  if (pa.size() < need_a) pa.resize(need_a);
  if (pb.size() < need_b) pb.resize(need_b);
  std::uint16_t* PA = pa.data();
  std::uint16_t* PB = pb.data();
  const std::int64_t nthreads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool par = nthreads > 1 && 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) > 4e6;

  // Pack A: one (16-row panel, k tile) per iteration. A row-major A with whole k tiles is read in place
  // (tile rows at stride lda) for every 32-row block it fills; only the last partial block is packed.
  const bool a_direct = ta == Trans::N && K % kTileK == 0 && K > 0;
  const std::int64_t a_first_packed = a_direct ? (M / kBlock) * (kBlock / kTileRows) : 0;  // first packed panel
#pragma omp parallel for schedule(static) collapse(2) if (par)
  for (std::int64_t mb = a_first_packed; mb < Mp / kTileRows; ++mb)
    for (std::int64_t kb = 0; kb < KB; ++kb)
      pack_a_tile(PA + mb * panel + kb * kTileRows * kTileK, A, ta, lda, mb * kTileRows, kb * kTileK, M, K);
  // Pack B: one (16-column panel, k tile) per iteration.
#pragma omp parallel for schedule(static) collapse(2) if (par)
  for (std::int64_t nb = 0; nb < Np / kTileRows; ++nb)
    for (std::int64_t kb = 0; kb < KB; ++kb)
      pack_b_tile(PB + nb * panel + kb * kTileRows * kTileK, B, tb, ldb, kb * kTileK, nb * kTileRows, K, N);
  (void)Kp;

  const std::int64_t mblocks = Mp / kBlock, nblocks = Np / kBlock;
  const bool m_outer = mblocks >= nblocks;
#pragma omp parallel if (par)
  {
    load_config();
    alignas(64) float out[kBlock * kBlock];
#pragma omp for schedule(static)
    for (std::int64_t task = 0; task < mblocks * nblocks; ++task) {
      // The dimension with more blocks is the outer one: its panel pair is loaded once, while the other
      // operand's packed panels (the smaller total) stay in cache across it.
      const std::int64_t nb = m_outer ? task % nblocks : task / mblocks;
      const std::int64_t mb = m_outer ? task / nblocks : task % mblocks;
      const std::uint16_t* b0 = PB + (2 * nb) * panel;
      if (2 * mb < a_first_packed) {
        const std::uint16_t* a0 = reinterpret_cast<const std::uint16_t*>(A + mb * kBlock * lda);
        block_32x32(a0, a0 + kTileRows * lda, 2 * lda, kTileK, b0, b0 + panel, KB, out);
      } else {
        const std::uint16_t* a0 = PA + (2 * mb) * panel;
        block_32x32(a0, a0 + panel, 64, kTileRows * kTileK, b0, b0 + panel, KB, out);
      }
      const std::int64_t m0 = mb * kBlock, n0 = nb * kBlock;
      const std::int64_t rows = std::min(kBlock, M - m0), cols = std::min(kBlock, N - n0);
      if (!swap) {
        for (std::int64_t r = 0; r < rows; ++r) {
          bf16* c = C + (m0 + r) * ldc + n0;
          const float* o = out + r * kBlock;
          for (std::int64_t j = 0; j < cols; ++j) {
            float v = alpha * o[j];
            if (beta != 0.f) v += beta * static_cast<float>(c[j]);
            if (bias) v += bias[n0 + j];
            c[j] = bf16(v);
          }
        }
      } else {  // out holds a block of Cᵀ: row r is C's column m0 + r
        for (std::int64_t j = 0; j < cols; ++j) {
          bf16* c = C + (n0 + j) * ldc + m0;
          for (std::int64_t r = 0; r < rows; ++r) {
            float v = alpha * out[r * kBlock + j];
            if (beta != 0.f) v += beta * static_cast<float>(c[r]);
            if (bias) v += bias[m0 + r];
            c[r] = bf16(v);
          }
        }
      }
    }
    release_tiles();
  }
}

}  // namespace tg::backend::cpu

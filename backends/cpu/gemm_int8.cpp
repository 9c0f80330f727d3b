// int8 GEMM driver: kernel choice (TG_INT8_KERNEL), argument checks, the reference loops, packing of both
// operands (Note [int8 packed layout]), cache blocking and threads; the tile kernels are in the ISA files.
//   tg::backend::cpu::gemm_s8s8s32(Trans::N, Trans::T, M, N, K, a, K, w, K, c, N);   // C = A·Wᵀ, exact int32
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "gemm_int8_kernels.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/cpu_features.hpp"
#include "typegrad/detail/cpu/gemm_int8.hpp"
#include "typegrad/detail/cpu/kernels.hpp"

namespace tg::backend::cpu {

using int8::i64;
using int8::TileIo;

namespace {

i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
i64 round_up(i64 a, i64 b) { return ceil_div(a, b) * b; }

/// op(X)(r, c) of an operand stored row-major with leading dimension ld (Trans::T: stored transposed).
std::int8_t at(const std::int8_t* X, Trans t, i64 ld, i64 r, i64 c) {
  return t == Trans::N ? X[r * ld + c] : X[c * ld + r];
}

/// Σ_k op(A)(i, k) · op(B)(k, j), exact: |partial sums| <= K · 128 · 128 <= 2^30 for K <= kInt8MaxK.
std::int32_t dot_reference(Trans ta, Trans tb, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* B, i64 ldb,
                           i64 i, i64 j) {
  std::int32_t s = 0;
  for (i64 k = 0; k < K; ++k)
    s += static_cast<std::int32_t>(at(A, ta, lda, i, k)) * static_cast<std::int32_t>(at(B, tb, ldb, k, j));
  return s;
}

/// a + b modulo 2^32 (the wrap of the vector adds, without signed overflow).
std::int32_t wrap_add(std::int32_t a, std::int32_t b) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(a) + static_cast<std::uint32_t>(b));
}
std::int32_t wrap_sub(std::int32_t a, std::int32_t b) {
  return static_cast<std::int32_t>(static_cast<std::uint32_t>(a) - static_cast<std::uint32_t>(b));
}

/// The dequant epilogue of Note [int8 GEMM]: one fp32 rounding per operation, in this order (this file is
/// compiled with -ffp-contract=off, so no multiply-add is fused).
float dequant(std::int32_t s, float a_scale, float w_scale, const float* bias) {
  float v = static_cast<float>(s);
  v = v * a_scale;
  v = v * w_scale;
  if (bias) v = v + *bias;
  return v;
}

// ---- kernels -------------------------------------------------------------------------------------------

/// What the driver needs to know about a tile kernel (Note [int8 packed layout]).
struct KernelDesc {
  Int8Kernel id = Int8Kernel::reference;
  int mr = 0;                // rows per packed A panel
  int kq_align = 1;          // kqp is a multiple of this; so is every K block but the last
  int a_elem = 1;            // bytes per packed A element
  bool unsigned_a = false;   // A packed as A + 128: C needs corr (Note [int8 packed layout])
  bool a_row_major = false;  // A panels row-major [mr][4·kqp] (amx) instead of k-quad major
  int8::TileFn tile = nullptr;
  void (*begin)() = nullptr;  // per thread, around its tile calls
  void (*end)() = nullptr;
  const char* desc = "";

  i64 a_panel_bytes(i64 kqp) const { return static_cast<i64>(mr) * kqp * 4 * a_elem; }
  /// Offset of k-quad q within an A panel, and the A leading dimension the tile gets.
  i64 a_kq_offset(i64 q) const { return a_row_major ? 4 * q : q * mr * 4 * a_elem; }
  i64 a_ld(i64 kqp) const { return a_row_major ? 4 * kqp : 0; }
};

KernelDesc kernel_desc(Int8Kernel k) {
  KernelDesc d;
  d.id = k;
  switch (k) {
    case Int8Kernel::reference: d.desc = "reference loops"; break;
    case Int8Kernel::avx2:
      d.mr = int8::kMR, d.a_elem = 2, d.tile = int8::tile_avx2, d.desc = "avx2 vpmaddwd packed 12x32";
      break;
    case Int8Kernel::vnni:
      d.mr = int8::kMR, d.unsigned_a = true, d.tile = int8::tile_vnni, d.desc = "avx512-vnni vpdpbusd packed 12x32";
      break;
    case Int8Kernel::amx:
      d.mr = int8::kAmxMR, d.kq_align = 16, d.a_row_major = true, d.tile = int8::tile_amx;
      d.begin = int8::amx_thread_begin, d.end = int8::amx_thread_end, d.desc = "amx-int8 tdpbssd 16x32";
      break;
  }
  return d;
}

constexpr Int8Kernel kAllKernels[] = {Int8Kernel::reference, Int8Kernel::avx2, Int8Kernel::vnni, Int8Kernel::amx};

Int8Kernel best_kernel() {
  for (Int8Kernel k : {Int8Kernel::amx, Int8Kernel::vnni, Int8Kernel::avx2})
    if (int8_kernel_supported(k)) return k;
  return Int8Kernel::reference;
}

void check_supported(Int8Kernel k, const char* who) {
  TG_CHECK(int8_kernel_supported(k), who, ": the int8 kernel '", int8_kernel_name(k),
           "' is not supported by this CPU (", cpu_features_string(), ")");
}

// ---- blocking and threads ------------------------------------------------------------------------------

struct Blocking {
  i64 kc = 0, mc = 0, nc = 0;  // k, rows, columns; 0 = derived
};

/// TG_INT8_BLOCKING="kc,mc,nc" (Note [int8 GEMM blocking]).
Blocking env_blocking() {
  Blocking b;
  const char* env = std::getenv("TG_INT8_BLOCKING");
  if (env == nullptr || *env == '\0') return b;
  i64* fields[3] = {&b.kc, &b.mc, &b.nc};
  const char* p = env;
  for (int i = 0; i < 3; ++i) {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    TG_CHECK(end != p && v >= 0 && v <= (1LL << 24) && *end == (i < 2 ? ',' : '\0'), "gemm_int8: TG_INT8_BLOCKING='",
             env, "' must be three non-negative counts 'kc,mc,nc' (k, rows, columns; 0 = derived)");
    *fields[i] = v;
    p = end + 1;
  }
  return b;
}

/// Threads for one product: 1 inside a parallel region or below ~8 M int ops, else about one per 4 M ops
/// (the fp32 GEMM's rule, gemm.cpp, at the int8 kernels' higher rate), at most the team.
int default_threads(i64 M, i64 N, i64 K) {
  if (omp_in_parallel()) return 1;
  adapt_threads();  // Note [threads under contention]
  const double ops = 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  const int max_threads = omp_get_max_threads();
  if (max_threads <= 1 || ops < 8.0e6) return 1;
  const double by_work = ops / 4.0e6;
  return by_work < max_threads ? static_cast<int>(by_work) : max_threads;
}

/// A grow-only 64-byte-aligned buffer, one set per calling thread.
struct AlignedBuffer {
  void* p = nullptr;
  std::size_t bytes = 0;
  AlignedBuffer() = default;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { std::free(p); }
  void* get(std::size_t n) {
    if (n > bytes) {
      std::free(p);
      p = nullptr;
      bytes = 0;
      const std::size_t b = static_cast<std::size_t>(round_up(static_cast<i64>(std::max<std::size_t>(n, 64)), 4096));
      p = std::aligned_alloc(64, b);
      if (!p) throw std::bad_alloc();
      bytes = b;
    }
    return p;
  }
};
enum BufferId { kBufA = 0, kBufB = 1, kBufCorr = 2, kBufWork = 3 };
AlignedBuffer& thread_buffer(int id) {
  thread_local AlignedBuffer buffers[4];
  return buffers[id];
}

// ---- packing (Note [int8 packed layout]) ---------------------------------------------------------------

/// A panel p (rows p·mr ..) of op(A) [M, K] in kernel d's format, kqp k-quads.
void pack_a_panel(const KernelDesc& d, Trans ta, const std::int8_t* A, i64 lda, i64 M, i64 K, i64 kqp, i64 p,
                  void* dst) {
  const i64 mr = d.mr, i0 = p * mr, rows = std::min(mr, M - i0), kfull = K / 4 * 4;
  if (d.a_row_major) {  // amx: [mr][4·kqp], zero padded
    auto* o = static_cast<std::int8_t*>(dst);
    const i64 ld = 4 * kqp;
    std::memset(o, 0, static_cast<std::size_t>(mr * ld));
    for (i64 r = 0; r < rows; ++r) {
      if (ta == Trans::N)
        std::memcpy(o + r * ld, A + (i0 + r) * lda, static_cast<std::size_t>(K));
      else
        for (i64 k = 0; k < K; ++k) o[r * ld + k] = A[k * lda + i0 + r];
    }
    return;
  }
  // k-quad major: element (r, k) at ((k / 4) · mr + r) · 4 + k % 4.
  if (d.a_elem == 1) {  // vnni: bytes a ^ 0x80 = a + 128 as uint8; padding 0x80 (a = 0)
    auto* o = static_cast<std::uint8_t*>(dst);
    if (ta == Trans::N) return int8::pack_a_rows_vnni(A + i0 * lda, lda, rows, K, kqp, o);
    std::memset(o, 0x80, static_cast<std::size_t>(mr * kqp * 4));
    if (ta == Trans::N) {
      for (i64 r = 0; r < rows; ++r) {
        const std::int8_t* s = A + (i0 + r) * lda;
        for (i64 k = 0; k < kfull; k += 4) {
          std::uint32_t w;
          std::memcpy(&w, s + k, 4);
          w ^= 0x80808080u;
          std::memcpy(o + ((k / 4) * mr + r) * 4, &w, 4);
        }
        for (i64 k = kfull; k < K; ++k) o[((k / 4) * mr + r) * 4 + k % 4] = static_cast<std::uint8_t>(s[k]) ^ 0x80u;
      }
    } else {
      for (i64 k = 0; k < K; ++k) {
        const std::int8_t* s = A + k * lda + i0;
        std::uint8_t* ok = o + (k / 4) * mr * 4 + k % 4;
        for (i64 r = 0; r < rows; ++r) ok[r * 4] = static_cast<std::uint8_t>(s[r]) ^ 0x80u;
      }
    }
    return;
  }
  auto* o = static_cast<std::int16_t*>(dst);  // avx2: int16, padding 0
  std::memset(o, 0, static_cast<std::size_t>(mr * kqp * 4 * 2));
  if (ta == Trans::N) {
    for (i64 r = 0; r < rows; ++r) {
      const std::int8_t* s = A + (i0 + r) * lda;
      for (i64 k = 0; k < kfull; k += 4) {
        std::int16_t* d = o + ((k / 4) * mr + r) * 4;
        d[0] = s[k], d[1] = s[k + 1], d[2] = s[k + 2], d[3] = s[k + 3];
      }
      for (i64 k = kfull; k < K; ++k) o[((k / 4) * mr + r) * 4 + k % 4] = s[k];
    }
  } else {
    for (i64 k = 0; k < K; ++k) {
      const std::int8_t* s = A + k * lda + i0;
      std::int16_t* d = o + (k / 4) * mr * 4 + k % 4;
      for (i64 r = 0; r < rows; ++r) d[r * 4] = s[r];
    }
  }
}

/// k-quads [kq0, kq0 + nq) of B panel p of op(B) [K, N] to rows 0 .. nq-1 of dst, and 128 · their column sums
/// to corr[0 .. 32) (added to it with add_corr).
void pack_b_slice(Int8Kernel kernel, Trans tb, const std::int8_t* B, i64 ldb, i64 N, i64 K, i64 p, i64 kq0, i64 nq,
                  std::int8_t* dst, std::int32_t* corr, bool add_corr) {
  constexpr i64 NR = int8::kNR;
  if (kernel == Int8Kernel::vnni && tb == Trans::T)
    return int8::pack_b_rows_vnni(B, ldb, N, K, p, kq0, nq, dst, corr, add_corr);
  const i64 j0 = p * NR, cols = std::min(NR, N - j0), k0 = 4 * kq0, k1 = std::min(K, 4 * (kq0 + nq));
  std::memset(dst, 0, static_cast<std::size_t>(nq * 128));
  std::int32_t sum[NR] = {};
  if (tb == Trans::N) {  // rows of op(B) are contiguous: walk them in order
    for (i64 k = k0; k < k1; ++k) {
      const std::int8_t* s = B + k * ldb + j0;
      std::int8_t* o = dst + ((k - k0) / 4) * 128 + k % 4;
      for (i64 c = 0; c < cols; ++c) {
        o[c * 4] = s[c];
        sum[c] += s[c];
      }
    }
  } else {  // a column of op(B) is a row of B: whole k-quads move as 32-bit words
    const i64 kfull = k0 + (k1 - k0) / 4 * 4;
    for (i64 c = 0; c < cols; ++c) {
      const std::int8_t* s = B + (j0 + c) * ldb;
      std::int32_t sc = 0;
      for (i64 k = k0; k < kfull; k += 4) {
        std::memcpy(dst + ((k - k0) / 4) * 128 + c * 4, s + k, 4);
        sc += s[k] + s[k + 1] + s[k + 2] + s[k + 3];
      }
      for (i64 k = kfull; k < k1; ++k) {
        dst[((k - k0) / 4) * 128 + c * 4 + k % 4] = s[k];
        sc += s[k];
      }
      sum[c] = sc;
    }
  }
  for (i64 c = 0; c < NR; ++c) corr[c] = (add_corr ? corr[c] : 0) + 128 * sum[c];  // |128 · colsum| <= 2^30
}

/// The 64-byte lines of the source of B panel p's k-quads [kq0, kq0 + nq), as a prefetch walk (Note [int8 B
/// prefetch]): runs along op(B)'s contiguous dimension.
void source_walk(Trans tb, const std::int8_t* B, i64 ldb, i64 N, i64 K, i64 p, i64 kq0, i64 nq, TileIo& io) {
  const i64 j0 = p * int8::kNR, cols = std::min<i64>(int8::kNR, N - j0), k0 = 4 * kq0, k1 = std::min(K, 4 * (kq0 + nq));
  if (cols <= 0 || k1 <= k0) return;
  const bool by_rows = tb == Trans::T;  // a run: one column of op(B), k contiguous
  const std::int8_t* first = by_rows ? B + j0 * ldb + k0 : B + k0 * ldb + j0;
  const i64 run = by_rows ? k1 - k0 : cols, runs = by_rows ? cols : k1 - k0;
  const auto start = reinterpret_cast<std::uintptr_t>(first);
  io.pf_row = reinterpret_cast<const char*>(start & ~std::uintptr_t{63});
  io.pf_stride = ldb;
  // Runs start at different offsets within their first line unless the stride is a multiple of 64.
  io.pf_per_row = ceil_div(static_cast<i64>(start & 63) + run, 64) + (ldb % 64 != 0 ? 1 : 0);
  io.pf_col = 0;
  io.pf_count = runs * io.pf_per_row;
}

/// Moves a prefetch walk `n` lines on (the share of the tiles before this one).
void advance_walk(TileIo& io, i64 n) {
  n = std::min(n, io.pf_count);
  if (n <= 0) return;
  const i64 at = io.pf_col + n;
  io.pf_row += (at / io.pf_per_row) * io.pf_stride;
  io.pf_col = at % io.pf_per_row;
  io.pf_count -= n;
}

// ---- the driver ----------------------------------------------------------------------------------------

/// One product for the driver: op(A) [M, K], op(B) [K, N] packed (bpack, corr) or its source (B), the output.
struct Problem {
  i64 M = 0, N = 0, K = 0;
  Trans ta = Trans::N;
  const std::int8_t* A = nullptr;
  i64 lda = 0;
  const std::int8_t* bpack = nullptr;  // all panels, kqp k-quads each (Note [int8 packed layout]); or null:
  const std::int32_t* corr = nullptr;
  Trans tb = Trans::N;  // op(B)'s source, packed here
  const std::int8_t* B = nullptr;
  i64 ldb = 0;
  TileIo out;  // mode int32 or dequant, pointers at (0, 0)
};

// Note [int8 GEMM blocking]
// Each thread owns a block of a tm x tn grid of A panels x B panels (the grid minimising the largest share;
// among those within 5% of it, the fewest row parts), and runs, outermost first:
//   column chunks (nc)  ->  A blocks (mc rows)  ->  K blocks (kc)  ->  B panels  ->  A panels  ->  tile
// so a B panel's K slice (kc x 32 bytes, at most an eighth of L2) is reused by every A panel of the block,
// and the A block (mc x kc bytes, 7/16 of L2) by every B panel of the chunk. kc: kqp k-quads split evenly
// into blocks of at most L2/8 / 128 k-quads (4096 k for 1 MiB): GPT-2's K <= 3072 is one block, summed in
// registers and written once. With several K blocks the sums of the earlier ones wait in a per-thread int32
// workspace [mc rows][nc columns] (nc then limited to L2/4 of it); integer sums are exact in any order, so
// the blocking never changes a result. TG_INT8_BLOCKING forces kc, mc, nc (tests cross every boundary).
// A is packed whole, by the team, before any tile (one barrier). B is packed once (PackedInt8Weights) or,
// per call, lazily: when every thread's rows make one A block (so each B slice is used by that block alone,
// right away), a thread packs each slice into one private slot just before its tiles; otherwise all of B is
// packed by the team with A, before the barrier.
// Note [int8 B prefetch]
// With lazy packing, the tiles on B panel q prefetch into L2 the source lines of panel q+1 (two per k-quad
// in the first iterations of the K loop, the lines shared out over the panel's A tiles), so that packing it
// reads L2, not L3 or memory. A/B on a Zen 4 VM (1 thread, 4 alternated runs, GOPS of gemm_s8s8s32): LM head
// 348-374 -> 371-387, qkv 347-383 -> 392-404. The same walk over the next *packed* panel (pre-packed
// weights, contiguous, which the hardware prefetchers already follow) measured 7% slower on the LM head
// (1 thread: 411-418 -> 382-390 GOPS) and is not done. The tiles also prefetch their output lines for
// writing (gemm_int8_vnni.cpp): the LM head's 51 MB of fp32 output, 4% on its product.
void drive(const KernelDesc& d, const Problem& p, i64 kqp, int threads, const Blocking& bk) {
  const i64 M = p.M, N = p.N, mr = d.mr, NR = int8::kNR;
  const i64 pm = ceil_div(M, mr), pn = ceil_div(N, NR);
  const i64 l2 = std::max<i64>(cpu_cache_sizes().l2, 256 * 1024);
  // K blocks, in k-quads (multiples of kq_align).
  const i64 kcq_cap = bk.kc > 0 ? round_up(ceil_div(bk.kc, 4), d.kq_align)
                                : std::max<i64>(d.kq_align, l2 / 8 / (NR * 4) / d.kq_align * d.kq_align);
  const i64 nkb = std::max<i64>(1, ceil_div(kqp, kcq_cap));
  const i64 kcq = round_up(ceil_div(kqp, nkb), d.kq_align);
  // A blocks, in panels.
  const i64 mcp_cap =
      bk.mc > 0 ? ceil_div(bk.mc, mr) : std::max<i64>(1, l2 * 7 / 16 / std::max<i64>(1, d.a_panel_bytes(kcq)));
  // Column chunks, in panels: all of a thread's panels unless the workspace needs bounding.
  const i64 ncq_cap = bk.nc > 0 ? ceil_div(bk.nc, NR)
                      : nkb > 1 ? std::max<i64>(1, l2 / 4 / (std::min(mcp_cap, pm) * mr * NR * 4))
                                : pn;

  // Thread grid (tm row parts x tn column parts).
  const int nt = std::max(1, threads);
  int tm = 1;
  {
    i64 best = -1;
    for (int r = 1; r <= nt; ++r)
      if (nt % r == 0) {
        const i64 cost = ceil_div(pm, r) * ceil_div(pn, nt / r);
        if (best < 0 || cost < best) best = cost;
      }
    for (int r = 1; r <= nt; ++r)
      if (nt % r == 0 && ceil_div(pm, r) * ceil_div(pn, nt / r) * 100 <= best * 105) {
        tm = r;
        break;
      }
  }
  const int tn = nt / tm;

  const i64 apb = d.a_panel_bytes(kqp);
  auto* apack =
      static_cast<std::int8_t*>(thread_buffer(kBufA).get(static_cast<std::size_t>(std::max<i64>(1, pm * apb))));
  const i64 ncq_max = std::min(ncq_cap, pn);
  const i64 ws_elems = nkb > 1 ? std::min(mcp_cap, pm) * mr * ncq_max * NR : 0;
  auto* ws_all =
      nkb > 1 ? static_cast<std::int32_t*>(thread_buffer(kBufWork).get(sizeof(std::int32_t) * ws_elems * nt)) : nullptr;
  // B: packed already, packed whole here (bpack), or lazily into per-thread slots (a K slice and the sums).
  const bool lazy = p.bpack == nullptr && ceil_div(pm, tm) <= mcp_cap;
  const std::int8_t* bpack = p.bpack;
  const std::int32_t* corr = p.corr;
  std::int8_t* bpack_here = nullptr;
  std::int32_t* corr_here = nullptr;
  const i64 slot_bytes = round_up(kcq * 128, 64), slot_corr = ncq_max * NR;
  std::int8_t* slots = nullptr;
  if (lazy) {
    slots = static_cast<std::int8_t*>(thread_buffer(kBufB).get(
        static_cast<std::size_t>(nt * (slot_bytes + static_cast<i64>(sizeof(std::int32_t)) * slot_corr))));
  } else if (bpack == nullptr) {
    bpack = bpack_here =
        static_cast<std::int8_t*>(thread_buffer(kBufB).get(static_cast<std::size_t>(std::max<i64>(1, pn * kqp * 128))));
    corr = corr_here = static_cast<std::int32_t*>(thread_buffer(kBufCorr).get(sizeof(std::int32_t) * pn * NR));
  }
  const bool want_corr = d.unsigned_a;

#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int team = omp_get_num_threads(), t = omp_get_thread_num();
#pragma omp for schedule(static) nowait
    for (i64 ip = 0; ip < pm; ++ip) pack_a_panel(d, p.ta, p.A, p.lda, M, p.K, kqp, ip, apack + ip * apb);
    if (bpack_here) {
#pragma omp for schedule(static) nowait
      for (i64 q = 0; q < pn; ++q)
        pack_b_slice(d.id, p.tb, p.B, p.ldb, N, p.K, q, 0, kqp, bpack_here + q * kqp * 128, corr_here + q * NR, false);
    }
#pragma omp barrier
    if (d.begin) d.begin();
    std::int8_t* const slot =
        lazy ? slots + t * (slot_bytes + static_cast<i64>(sizeof(std::int32_t)) * slot_corr) : nullptr;
    std::int32_t* const slot_sums = lazy ? reinterpret_cast<std::int32_t*>(slot + slot_bytes) : nullptr;
    // A team smaller than asked (thread limits) runs the grid's parts in turn.
    for (int part = t; part < nt; part += team) {
      const int tr = part / tn, ts = part % tn;
      const i64 pm0 = tr * pm / tm, pm1 = (tr + 1) * pm / tm, pn0 = ts * pn / tn, pn1 = (ts + 1) * pn / tn;
      if (pm0 >= pm1 || pn0 >= pn1) continue;
      const i64 nmb = ceil_div(pm1 - pm0, mcp_cap), mcp = ceil_div(pm1 - pm0, nmb);  // evened A blocks
      const i64 ncb = ceil_div(pn1 - pn0, ncq_cap), ncq = ceil_div(pn1 - pn0, ncb);  // evened column chunks
      std::int32_t* ws = ws_all ? ws_all + static_cast<i64>(t) * ws_elems : nullptr;
      const i64 ldw = ncq * NR;
      for (i64 qc = pn0; qc < pn1; qc += ncq) {
        const i64 qc1 = std::min(qc + ncq, pn1);
        for (i64 ic = pm0; ic < pm1; ic += mcp) {
          const i64 ic1 = std::min(ic + mcp, pm1);
          for (i64 kb = 0; kb < nkb; ++kb) {
            const i64 q0 = kb * kcq, nq = std::max<i64>(0, std::min(kcq, kqp - q0));
            const bool last = kb == nkb - 1;
            for (i64 q = qc; q < qc1; ++q) {
              const i64 j = q * NR;
              const int cols = static_cast<int>(std::min(NR, N - j));
              const std::int8_t* bq;
              const std::int32_t* corr_q = nullptr;
              TileIo walk;  // what the tiles on this panel prefetch (Note [int8 B prefetch])
              if (lazy) {
                pack_b_slice(d.id, p.tb, p.B, p.ldb, N, p.K, q, q0, nq, slot, slot_sums + (q - qc) * NR, kb > 0);
                bq = slot;
                corr_q = slot_sums + (q - qc) * NR;
                if (q + 1 < qc1) source_walk(p.tb, p.B, p.ldb, N, p.K, q + 1, q0, nq, walk);
              } else {
                bq = bpack + (q * kqp + q0) * 128;
                corr_q = corr ? corr + j : nullptr;
              }
              const i64 share = ceil_div(walk.pf_count, ic1 - ic);
              for (i64 ip = ic; ip < ic1; ++ip) {
                const i64 i = ip * mr;
                const int rows = static_cast<int>(std::min(mr, M - i));
                TileIo io;
                io.pf_row = walk.pf_row, io.pf_stride = walk.pf_stride, io.pf_per_row = walk.pf_per_row;
                io.pf_col = walk.pf_col, io.pf_count = std::min(share, walk.pf_count);
                advance_walk(walk, share);
                io.ldw = ldw;
                std::int32_t* w = ws ? ws + (ip - ic) * mr * ldw + (q - qc) * NR : nullptr;
                io.carry_in = kb > 0 ? w : nullptr;
                if (!last) {
                  io.mode = TileIo::Mode::carry;
                  io.carry_out = w;
                } else {
                  io.mode = p.out.mode;
                  io.corr = want_corr ? corr_q : nullptr;
                  if (p.out.mode == TileIo::Mode::int32) {
                    io.c = p.out.c + i * p.out.ldc + j;
                    io.ldc = p.out.ldc;
                    io.accumulate = p.out.accumulate;
                  } else {
                    io.y = p.out.y + i * p.out.ldy + j;
                    io.ldy = p.out.ldy;
                    io.a_scale = p.out.a_scale + i;
                    io.w_scale = p.out.w_scale + j;
                    io.bias = p.out.bias ? p.out.bias + j : nullptr;
                  }
                }
                d.tile(nq, apack + ip * apb + d.a_kq_offset(q0), d.a_ld(kqp), bq, rows, cols, io);
              }
            }
          }
        }
      }
    }
    if (d.end) d.end();
  }
}

void check_dims(const char* who, i64 M, i64 N, i64 K) {
  TG_CHECK(M >= 0 && N >= 0 && K >= 0, who, ": sizes must be non-negative, got M = ", M, ", N = ", N, ", K = ", K);
  TG_CHECK(K <= kInt8MaxK, who, ": K = ", K, " exceeds kInt8MaxK = ", kInt8MaxK,
           " (larger K could overflow the int32 sums; split K and add the partial products)");
}

void check_gemm_args(const char* who, Trans ta, Trans tb, i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda,
                     const std::int8_t* B, i64 ldb, const std::int32_t* C, i64 ldc) {
  check_dims(who, M, N, K);
  if (M > 0 && K > 0) {
    const i64 need = ta == Trans::N ? K : M;
    TG_CHECK(A != nullptr && lda >= need, who, ": A is null or lda = ", lda, " < ", need);
  }
  if (N > 0 && K > 0) {
    const i64 need = tb == Trans::N ? N : K;
    TG_CHECK(B != nullptr && ldb >= need, who, ": B is null or ldb = ", ldb, " < ", need);
  }
  if (M > 0 && N > 0) TG_CHECK(C != nullptr && ldc >= N, who, ": C is null or ldc = ", ldc, " < N = ", N);
}

}  // namespace

// ---- write-back shared by the avx2 and amx tiles (Note [int8 tile write-back]) ---------------------------
namespace int8 {
void write_tile_scalar(const std::int32_t* t, i64 ldt, int rows, int cols, const TileIo& io) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      std::int32_t s = t[r * ldt + c];
      if (io.carry_in) s = wrap_add(s, io.carry_in[r * io.ldw + c]);
      switch (io.mode) {
        case TileIo::Mode::carry: io.carry_out[r * io.ldw + c] = s; break;
        case TileIo::Mode::int32:
          if (io.corr) s = wrap_sub(s, io.corr[c]);
          if (io.accumulate) s = wrap_add(s, io.c[r * io.ldc + c]);
          io.c[r * io.ldc + c] = s;
          break;
        case TileIo::Mode::dequant:
          if (io.corr) s = wrap_sub(s, io.corr[c]);
          io.y[r * io.ldy + c] = dequant(s, io.a_scale[r], io.w_scale[c], io.bias ? io.bias + c : nullptr);
          break;
      }
    }
}
}  // namespace int8

// ---- kernel choice -------------------------------------------------------------------------------------

std::string int8_kernel_name(Int8Kernel k) {
  switch (k) {
    case Int8Kernel::reference: return "reference";
    case Int8Kernel::avx2: return "avx2";
    case Int8Kernel::vnni: return "vnni";
    case Int8Kernel::amx: return "amx";
  }
  return "?";
}

bool int8_kernel_supported(Int8Kernel k) {
  const CpuFeatures& f = cpu_features();
  switch (k) {
    case Int8Kernel::reference: return true;
    case Int8Kernel::avx2: return cpu_supports(CpuIsa::avx2);
    case Int8Kernel::vnni: return cpu_supports(CpuIsa::avx512) && f.avx512_vnni;
    case Int8Kernel::amx: return f.amx_int8 && int8::amx_int8_granted();
  }
  return false;
}

Int8Kernel int8_kernel() {
  const char* env = std::getenv("TG_INT8_KERNEL");
  if (env == nullptr || *env == '\0') {
    static const Int8Kernel best = best_kernel();
    return best;
  }
  for (Int8Kernel k : kAllKernels)
    if (int8_kernel_name(k) == env) {
      TG_CHECK(int8_kernel_supported(k), "gemm_int8: TG_INT8_KERNEL=", env, " is not supported by this CPU (",
               cpu_features_string(), ")");
      return k;
    }
  throw Error("gemm_int8: unknown TG_INT8_KERNEL='", env, "' (expected reference, avx2, vnni or amx)");
}

std::string gemm_int8_kernel_name() { return kernel_desc(int8_kernel()).desc; }

// ---- the reference -------------------------------------------------------------------------------------

void gemm_s8s8s32_reference(Trans ta, Trans tb, i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda,
                            const std::int8_t* B, i64 ldb, std::int32_t* C, i64 ldc, bool accumulate) {
  check_gemm_args("gemm_s8s8s32_reference", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  for (i64 i = 0; i < M; ++i)
    for (i64 j = 0; j < N; ++j) {
      const std::int32_t s = dot_reference(ta, tb, K, A, lda, B, ldb, i, j);
      C[i * ldc + j] = accumulate ? wrap_add(C[i * ldc + j], s) : s;
    }
}

// ---- gemm_s8s8s32 --------------------------------------------------------------------------------------

void gemm_s8s8s32_with(Int8Kernel k, int threads, Trans ta, Trans tb, i64 M, i64 N, i64 K, const std::int8_t* A,
                       i64 lda, const std::int8_t* B, i64 ldb, std::int32_t* C, i64 ldc, bool accumulate) {
  check_gemm_args("gemm_s8s8s32", ta, tb, M, N, K, A, lda, B, ldb, C, ldc);
  check_supported(k, "gemm_s8s8s32");
  if (M == 0 || N == 0) return;
  if (K == 0) {  // the empty sum
    if (!accumulate)
      for (i64 i = 0; i < M; ++i) std::memset(C + i * ldc, 0, sizeof(std::int32_t) * static_cast<std::size_t>(N));
    return;
  }
  if (k == Int8Kernel::reference) return gemm_s8s8s32_reference(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, accumulate);
  const KernelDesc d = kernel_desc(k);
  const Blocking bk = env_blocking();
  const int nt = threads > 0 ? (omp_in_parallel() ? 1 : threads) : default_threads(M, N, K);
  const i64 kqp = round_up(ceil_div(K, 4), d.kq_align);
  Problem p;
  p.M = M, p.N = N, p.K = K, p.ta = ta, p.A = A, p.lda = lda, p.tb = tb, p.B = B, p.ldb = ldb;
  p.out.mode = TileIo::Mode::int32, p.out.c = C, p.out.ldc = ldc, p.out.accumulate = accumulate;
  drive(d, p, kqp, nt, bk);
}

void gemm_s8s8s32(Trans ta, Trans tb, i64 M, i64 N, i64 K, const std::int8_t* A, i64 lda, const std::int8_t* B, i64 ldb,
                  std::int32_t* C, i64 ldc, bool accumulate) {
  gemm_s8s8s32_with(int8_kernel(), 0, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, accumulate);
}

// ---- packed weights ------------------------------------------------------------------------------------

struct PackedInt8Weights::Impl {
  Int8Kernel kernel = Int8Kernel::reference;
  i64 n = 0, k = 0, kqp = 0;
  std::int8_t* panels = nullptr;  // ceil(n / 32) panels of kqp · 128 bytes (64-byte aligned)
  i64 panel_bytes = 0;
  std::vector<std::int32_t> corr;  // 128 · Σ_k W[n, k], zero past n (vnni only)
  std::vector<std::int8_t> plain;  // the reference kernel: W copied [n][k]
  Impl() = default;
  Impl(const Impl&) = delete;
  Impl& operator=(const Impl&) = delete;
  ~Impl() { std::free(panels); }
};

PackedInt8Weights::PackedInt8Weights(const std::int8_t* W, i64 N, i64 K, i64 ldw)
    : PackedInt8Weights(W, N, K, ldw, int8_kernel()) {}

PackedInt8Weights::PackedInt8Weights(const std::int8_t* W, i64 N, i64 K, i64 ldw, Int8Kernel kernel)
    : impl_(std::make_unique<Impl>()) {
  check_dims("PackedInt8Weights", N, N, K);
  if (N > 0 && K > 0) TG_CHECK(W != nullptr && ldw >= K, "PackedInt8Weights: W is null or ldw = ", ldw, " < K = ", K);
  check_supported(kernel, "PackedInt8Weights");
  Impl& m = *impl_;
  m.kernel = kernel, m.n = N, m.k = K;
  if (kernel == Int8Kernel::reference) {
    m.plain.resize(static_cast<std::size_t>(N * K));
    for (i64 r = 0; r < N; ++r)
      if (K > 0) std::memcpy(m.plain.data() + r * K, W + r * ldw, static_cast<std::size_t>(K));
    return;
  }
  const KernelDesc d = kernel_desc(kernel);
  const i64 pn = ceil_div(N, int8::kNR);
  m.kqp = round_up(ceil_div(K, 4), d.kq_align);
  m.panel_bytes = pn * m.kqp * 128;
  m.panels = static_cast<std::int8_t*>(
      std::aligned_alloc(64, static_cast<std::size_t>(round_up(std::max<i64>(m.panel_bytes, 64), 64))));
  if (!m.panels) throw std::bad_alloc();
  m.corr.assign(static_cast<std::size_t>(pn * int8::kNR), 0);
  for (i64 q = 0; q < pn; ++q)
    pack_b_slice(kernel, Trans::T, W, ldw, N, K, q, 0, m.kqp, m.panels + q * m.kqp * 128, m.corr.data() + q * int8::kNR,
                 false);
  if (!d.unsigned_a) std::vector<std::int32_t>().swap(m.corr);
}

PackedInt8Weights::~PackedInt8Weights() = default;
PackedInt8Weights::PackedInt8Weights(PackedInt8Weights&&) noexcept = default;
PackedInt8Weights& PackedInt8Weights::operator=(PackedInt8Weights&&) noexcept = default;

i64 PackedInt8Weights::n() const { return impl_->n; }
i64 PackedInt8Weights::k() const { return impl_->k; }
Int8Kernel PackedInt8Weights::kernel() const { return impl_->kernel; }
i64 PackedInt8Weights::bytes() const {
  const Impl& m = *impl_;
  return m.panel_bytes + static_cast<i64>(m.corr.size() * sizeof(std::int32_t) + m.plain.size());
}

// ---- gemm_s8_packed_dequant ----------------------------------------------------------------------------

void gemm_s8_packed_dequant_with(int threads, i64 M, const std::int8_t* A, i64 lda, const float* a_scale,
                                 const PackedInt8Weights& W, const float* w_scale, const float* bias, float* y,
                                 i64 ldy) {
  const PackedInt8Weights::Impl& w = W.impl();
  const i64 N = w.n, K = w.k;
  TG_CHECK(M >= 0, "gemm_s8_packed_dequant: M must be non-negative, got ", M);
  if (M == 0 || N == 0) return;
  if (K > 0) TG_CHECK(A != nullptr && lda >= K, "gemm_s8_packed_dequant: A is null or lda = ", lda, " < K = ", K);
  TG_CHECK(a_scale != nullptr && w_scale != nullptr, "gemm_s8_packed_dequant: a_scale and w_scale must not be null");
  TG_CHECK(y != nullptr && ldy >= N, "gemm_s8_packed_dequant: y is null or ldy = ", ldy, " < N = ", N);
  if (w.kernel == Int8Kernel::reference) {
    for (i64 i = 0; i < M; ++i)
      for (i64 j = 0; j < N; ++j)
        y[i * ldy + j] = dequant(dot_reference(Trans::N, Trans::T, K, A, lda, w.plain.data(), K, i, j), a_scale[i],
                                 w_scale[j], bias ? bias + j : nullptr);
    return;
  }
  const KernelDesc d = kernel_desc(w.kernel);
  const int nt = threads > 0 ? (omp_in_parallel() ? 1 : threads) : default_threads(M, N, K);
  Problem p;
  p.M = M, p.N = N, p.K = K, p.ta = Trans::N, p.A = A, p.lda = lda, p.bpack = w.panels;
  p.corr = d.unsigned_a ? w.corr.data() : nullptr;
  p.out.mode = TileIo::Mode::dequant, p.out.y = y, p.out.ldy = ldy;
  p.out.a_scale = a_scale, p.out.w_scale = w_scale, p.out.bias = bias;
  drive(d, p, w.kqp, nt, env_blocking());
}

void gemm_s8_packed_dequant(i64 M, const std::int8_t* A, i64 lda, const float* a_scale, const PackedInt8Weights& W,
                            const float* w_scale, const float* bias, float* y, i64 ldy) {
  gemm_s8_packed_dequant_with(0, M, A, lda, a_scale, W, w_scale, bias, y, ldy);
}

}  // namespace tg::backend::cpu

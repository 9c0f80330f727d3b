// The fused attention kernels run on the CPU: both sets, the register-resident mma.sync kernels
// (backends/cuda/flash_attention_mma.cuh, Note [flash attention in registers]) and the WMMA tiles
// (flash_attention_tiles.cuh, Note [flash attention on the GPU], the default), their bodies compiled unchanged as
// host code (TG_MMA_EMULATED), each block as 128 threads with real barriers. The device primitives are emulated:
// ldmatrix (with and without .trans) and mma.sync m16n8k16 warp-wide from the PTX ISA's fragment tables,
// nvcuda::wmma through its API (each lane holding the whole tile: the real layout is opaque to the kernels),
// shuffles through a warp's slots, cp.async delivering its 16 bytes either when issued or only at the wait (both
// are legal; a kernel must be right under each). For the mma.sync kernels a shadow of shared memory flags every
// race at 16-byte granularity between two barriers (a read of a chunk another thread wrote, a cp.async into a
// chunk read in the same interval, a read of a chunk whose cp.async was not waited for), accesses outside shared
// memory or any buffer, and misaligned cp.async / ldmatrix addresses. out, lse, dq, dk and dv are checked
// against a double-precision attention (the GPU tests' tolerances), with guard elements past every output,
// every row below Tn written, and a NaN query making its own row NaN and no other. On a GPU, gpu-check runs
// the same kernels (CudaAttention.*); what this cannot show is their speed and the hardware's own rounding of
// __expf and of the tensor-core sums.
//   ctest -R FlashEmulated
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>
#include <vector>

#include <typegrad/core/dtype.hpp>
#include <typegrad/detail/cuda/mma_layout.hpp>

#define TG_MMA_EMULATED 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x)
#define __shared__
#define __expf(x) std::exp(x)  // the device intrinsic (a few ulp); glibc declares a __expf of its own

namespace {
struct U3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local U3 threadIdx, blockIdx;
U3 gridDim;
thread_local int tl_epoch = 0;
int g_mode = 0;  // 0: cp.async lands at issue, 1: at wait
std::atomic<int> g_races{0}, g_fails{0};

[[noreturn]] void emu_fail(const char* what) {
  std::fprintf(stderr, "EMU FAIL: %s (thread %u block %u,%u)\n", what, threadIdx.x, blockIdx.x, blockIdx.y);
  std::abort();
}
void emu_race(const char* what, std::size_t chunk, int tid, int other, int epoch) {
  if (g_races.fetch_add(1) < 10)
    std::fprintf(stderr, "RACE: %s: chunk %zu thread %d other %d epoch %d block %u,%u\n", what, chunk, tid, other, epoch,
                 blockIdx.x, blockIdx.y);
}
struct Range {
  const void* p;
  std::size_t n;
};
std::vector<Range> g_ranges;
void emu_check_global(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  for (const auto& r : g_ranges) {
    const auto* s = static_cast<const unsigned char*>(r.p);
    if (b >= s && b + n <= s + r.n) return;
  }
  emu_fail("global read outside any buffer");
}
struct Pending {
  void* dst;
  const void* src;
  bool valid;
};
thread_local std::vector<Pending> tl_pending;
inline void do_copy(const Pending& p) {
  if (p.valid) std::memcpy(p.dst, p.src, 16);
  else std::memset(p.dst, 0, 16);
}
std::barrier<>* g_warp_bar[4];
std::barrier<>* g_block_bar;
inline void warp_sync(int w) { g_warp_bar[w]->arrive_and_wait(); }
inline void __syncthreads() {
  g_block_bar->arrive_and_wait();
  ++tl_epoch;
}
struct XSlot {
  const void* p;
  unsigned u[8];
  float f;
};
// A warp-wide operation: each lane posts its operands in its slot, one warp barrier, then each lane reads the
// slots it needs. Slots alternate between two sets from one operation to the next, so one barrier per operation
// is enough: a lane rewrites a set only after the next operation's barrier, which every lane reaches after
// reading that set.
XSlot g_xs[2][4][32];
thread_local int tl_set = 0;
/// The slot set of this warp operation (advances the lane to the other set for the next one).
inline XSlot (&slots(int w))[32] {
  XSlot(&s)[32] = g_xs[tl_set][w];
  tl_set ^= 1;
  return s;
}
inline float __shfl_xor_sync(unsigned, float v, int m) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  XSlot(&x)[32] = slots(w);
  x[lane].f = v;
  warp_sync(w);
  return x[lane ^ m].f;
}


// ---- what the WMMA kernels use: nvcuda::wmma, 16-byte vectors, __syncwarp, the warp reductions ----------
// A fragment's layout across the lanes is opaque to the kernels (they touch fragments only through the API),
// so every lane holds the whole 16x16 tile; a store is made once per warp.
using __nv_bfloat16 = tg::bf16;
using __half = tg::fp16;
U3 blockDim{128, 1, 1};
inline void __syncwarp() { warp_sync(static_cast<int>(threadIdx.x >> 5)); }
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

namespace nvcuda::wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16);
  float v[16][16];
};
template <class F>
void fill_fragment(F& f, float x) {
  for (auto& row : f.v)
    for (float& e : row) e = x;
}
/// A (rows, k) and B (k, n) from 16-bit elements: row_major reads (i, j) at p[i·ldm + j], col_major at p[j·ldm + i].
template <class Use, class T, class L>
void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm) {
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j)
      f.v[i][j] = static_cast<float>(std::is_same_v<L, row_major> ? p[i * ldm + j] : p[j * ldm + i]);
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) f.v[i][j] = l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i];
}
template <class T, class LA, class LB>
void mma_sync(fragment<accumulator, 16, 16, 16, float>& d, const fragment<matrix_a, 16, 16, 16, T, LA>& a,
              const fragment<matrix_b, 16, 16, 16, T, LB>& b, const fragment<accumulator, 16, 16, 16, float>& c) {
  fragment<accumulator, 16, 16, 16, float> r;
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      double s = c.v[i][j];
      for (int k = 0; k < 16; ++k) s += static_cast<double>(a.v[i][k]) * b.v[k][j];
      r.v[i][j] = static_cast<float>(s);
    }
  d = r;
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  __syncwarp();  // every lane has read what it needed of p
  if ((threadIdx.x & 31) == 0)
    for (int i = 0; i < 16; ++i)
      for (int j = 0; j < 16; ++j) (l == mem_row_major ? p[i * ldm + j] : p[j * ldm + i]) = f.v[i][j];
  __syncwarp();
}
}  // namespace nvcuda::wmma

}  // namespace

namespace tg::backend::cuda {
namespace detail {
template <class A>
A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class A>
A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) {
    const A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = (w > v || w != w) ? w : v;
  }
  return v;
}
}  // namespace detail
namespace {
alignas(128) unsigned char smem[1 << 18];  // the WMMA kernels' shared memory
#include "flash_attention_tiles.cuh"  // (their #pragma unroll: -Wno-unknown-pragmas in tests/CMakeLists.txt)
namespace mmak {
alignas(128) unsigned char smem[1 << 18];  // a block's shared memory (the kernels' extern __shared__ array)

inline void shadow_read(const void* p, int bytes);
inline void shadow_async_write(void* p);
inline void shadow_wait_all();

inline void cp_async16(void* dst, const void* src, bool valid) {
  if (reinterpret_cast<std::uintptr_t>(dst) % 16 || (valid && reinterpret_cast<std::uintptr_t>(src) % 16)) emu_fail("cp.async misaligned");
  auto* d = static_cast<unsigned char*>(dst);
  if (d < smem || d + 16 > smem + sizeof(smem)) emu_fail("cp.async dst out of smem");
  if (valid) emu_check_global(src, 16);
  shadow_async_write(dst);
  Pending pnd{dst, src, valid};
  if (g_mode == 0) do_copy(pnd);
  else tl_pending.push_back(pnd);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {
  for (auto& pnd : tl_pending) do_copy(pnd);
  tl_pending.clear();
  shadow_wait_all();
}

inline void ldsm_generic(unsigned (&r)[4], const void* p, bool trans) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  const auto* b = static_cast<const unsigned char*>(p);
  if (reinterpret_cast<std::uintptr_t>(p) % 16) emu_fail("ldmatrix misaligned");
  if (b < smem || b + 16 > smem + sizeof(smem)) emu_fail("ldmatrix out of smem");
  shadow_read(p, 16);
  XSlot(&g_x)[32] = slots(w);
  g_x[lane].p = p;
  warp_sync(w);
  const int q = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) {
    auto at = [&](int row, int col) {
      const auto* rp = static_cast<const std::uint16_t*>(g_x[8 * i + row].p);
      return static_cast<unsigned>(rp[col]);
    };
    unsigned lo, hi;
    if (trans) { lo = at(2 * t, q); hi = at(2 * t + 1, q); }
    else { lo = at(q, 2 * t); hi = at(q, 2 * t + 1); }
    r[i] = lo | (hi << 16);
  }
}
inline void ldsm_x4(unsigned (&r)[4], const void* p) { ldsm_generic(r, p, false); }
inline void ldsm_x4_trans(unsigned (&r)[4], const void* p) { ldsm_generic(r, p, true); }

template <class T>
inline float h2f(unsigned h) {
  return static_cast<float>(T::from_bits(static_cast<std::uint16_t>(h)));
}

template <class T>
inline void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  XSlot(&g_x)[32] = slots(w);
  for (int i = 0; i < 4; ++i) g_x[lane].u[i] = a[i];
  g_x[lane].u[4] = b0;
  g_x[lane].u[5] = b1;
  warp_sync(w);
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + ((i & 1) ? 8 : 0), col = 2 * t + ((i & 2) ? 8 : 0);
      A[row][col] = h2f<T>(g_x[l].u[i] & 0xffffu);
      A[row][col + 1] = h2f<T>(g_x[l].u[i] >> 16);
    }
    for (int i = 0; i < 2; ++i) {
      const int k = 2 * t + (i ? 8 : 0);
      B[k][g] = h2f<T>(g_x[l].u[4 + i] & 0xffffu);
      B[k + 1][g] = h2f<T>(g_x[l].u[4 + i] >> 16);
    }
  }
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
    double s = d[e];
    for (int k = 0; k < 16; ++k) s += static_cast<double>(A[row][k]) * B[k][col];
    d[e] = static_cast<float>(s);
  }
}

/// x rounded to T (to nearest even) and back, as __float2bfloat16_rn / __float2half_rn do.
template <class T>
inline float rounded(float x) {
  return static_cast<float>(T(x));
}

template <class T>
inline unsigned pack2(float lo, float hi) {
  const T l(lo), h(hi);
  return static_cast<unsigned>(l.bits) | (static_cast<unsigned>(h.bits) << 16);
}

// ---- shadow memory: races at barrier-interval granularity, per 16-byte chunk -------------------------
struct Chunk {
  int wlo = -1, whi = -1, writer = -1;
  bool pending = false;
  int rep = -1, reader = -1;
  bool multi = false;
};
inline Chunk g_shadow[sizeof(smem) / 16];
inline std::mutex g_shadow_mu;
thread_local std::vector<int> tl_pending_chunks;

inline void shadow_reset() {
  for (auto& c : g_shadow) c = Chunk{};
}
inline void shadow_read(const void* p, int bytes) {
  std::lock_guard<std::mutex> lk(g_shadow_mu);
  const int tid = threadIdx.x, e = tl_epoch;
  const std::size_t first = (static_cast<const unsigned char*>(p) - smem) / 16;
  for (std::size_t c = first; c < first + (bytes + 15) / 16; ++c) {
    Chunk& s = g_shadow[c];
    if (s.pending && e >= s.wlo) emu_race("read of a chunk whose cp.async is not waited for", c, tid, s.writer, e);
    if (!s.pending && s.writer >= 0 && s.wlo <= e && e <= s.whi && s.writer != tid)
      emu_race("read of a chunk another thread wrote in the same barrier interval", c, tid, s.writer, e);
    if (s.rep == e) {
      if (s.reader != tid) s.multi = true;
    } else {
      s.rep = e;
      s.reader = tid;
      s.multi = false;
    }
  }
}
inline void shadow_async_write(void* p) {
  std::lock_guard<std::mutex> lk(g_shadow_mu);
  const int tid = threadIdx.x, e = tl_epoch;
  const std::size_t c = (static_cast<unsigned char*>(p) - smem) / 16;
  Chunk& s = g_shadow[c];
  if (s.rep == e && (s.reader != tid || s.multi)) emu_race("cp.async into a chunk read in the same barrier interval", c, tid, s.reader, e);
  if (s.pending || (s.writer >= 0 && s.whi >= e && s.writer != tid)) emu_race("write-write", c, tid, s.writer, e);
  s.wlo = e;
  s.whi = -1;
  s.writer = tid;
  s.pending = true;
  tl_pending_chunks.push_back(static_cast<int>(c));
}
inline void shadow_wait_all() {
  std::lock_guard<std::mutex> lk(g_shadow_mu);
  for (int c : tl_pending_chunks) {
    g_shadow[c].pending = false;
    g_shadow[c].whi = tl_epoch;
  }
  tl_pending_chunks.clear();
}
}  // namespace mmak
#include "flash_attention_mma.cuh"
}  // namespace
}  // namespace tg::backend::cuda

namespace {

namespace mk = tg::backend::cuda::mmak;
using tg::backend::cuda::Heads;

template <class F>
void launch(unsigned gx, unsigned gy, F kernel) {
  gridDim = {gx, gy, 1};
  for (unsigned by = 0; by < gy; ++by)
    for (unsigned bx = 0; bx < gx; ++bx) {
      std::memset(mk::smem, 0xff, sizeof(mk::smem));  // NaN garbage
      std::memset(tg::backend::cuda::smem, 0xff, sizeof(tg::backend::cuda::smem));
      mk::shadow_reset();
      std::barrier<> wb0(32), wb1(32), wb2(32), wb3(32), bb(128);
      g_warp_bar[0] = &wb0, g_warp_bar[1] = &wb1, g_warp_bar[2] = &wb2, g_warp_bar[3] = &wb3;
      g_block_bar = &bb;
      std::vector<std::thread> th;
      for (int t = 0; t < 128; ++t)
        th.emplace_back([&, t] {
          threadIdx = {static_cast<unsigned>(t), 0, 0};
          blockIdx = {bx, by, 0};
          tl_epoch = 0;
          tl_pending.clear();
          kernel();
          if (!tl_pending.empty()) emu_fail("cp.async pending at exit");
        });
      for (auto& x : th) x.join();
    }
}

template <class T>
T* alloc(std::vector<T>& v, std::size_t n, std::size_t guard, T fill) {
  v.assign(n + guard, fill);
  g_ranges.push_back({v.data(), n * sizeof(T)});
  return v.data();
}

template <class T, int HS>
int run_case(int B, int H, int Tn, bool causal, bool packed, bool nan_case, unsigned seed, bool tiles) {
  const int hs = HS, C = H * hs;
  const std::int64_t BH = static_cast<std::int64_t>(B) * H;
  g_ranges.clear();
  Heads in{}, io{};
  std::size_t nin, nio;
  if (packed) {
    in = {static_cast<std::int64_t>(Tn) * 3 * C, hs, 3 * C};
    io = {static_cast<std::int64_t>(Tn) * C, hs, C};
    nin = static_cast<std::size_t>(B) * Tn * 3 * C;
    nio = static_cast<std::size_t>(B) * Tn * C;
  } else {
    in = {static_cast<std::int64_t>(Tn) * hs, 0, hs};
    io = in;
    nin = static_cast<std::size_t>(BH) * Tn * hs;
    nio = nin;
  }
  const std::size_t G = 64;
  const T sentinel = T::from_bits(0x7e55);
  std::vector<T> qb, kb, vb, ob, dob, dqb, dkb, dvb;
  std::vector<float> lseb, db;
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  T *q, *k, *v, *dq, *dk, *dv;
  if (packed) {
    q = alloc(qb, nin, G, T(0.f));
    for (std::size_t i = 0; i < nin; ++i) qb[i] = T(nd(rng));
    k = q + C;
    v = q + 2 * C;
    dq = alloc(dqb, nin, G, sentinel);
    dk = dq + C;
    dv = dq + 2 * C;
  } else {
    q = alloc(qb, nin, G, T(0.f));
    k = alloc(kb, nin, G, T(0.f));
    v = alloc(vb, nin, G, T(0.f));
    for (std::size_t i = 0; i < nin; ++i) qb[i] = T(nd(rng)), kb[i] = T(nd(rng)), vb[i] = T(nd(rng));
    dq = alloc(dqb, nin, G, sentinel);
    dk = alloc(dkb, nin, G, sentinel);
    dv = alloc(dvb, nin, G, sentinel);
  }
  T* out = alloc(ob, nio, G, sentinel);
  T* dout = alloc(dob, nio, G, T(0.f));
  for (std::size_t i = 0; i < nio; ++i) dob[i] = T(nd(rng));
  float* lse = alloc(lseb, static_cast<std::size_t>(BH) * Tn, G, -12345.f);
  float* dvec = alloc(db, static_cast<std::size_t>(BH) * Tn, G, 0.f);
  auto at = [&](const T* base, const Heads& l, std::int64_t bh, std::int64_t t) {
    return base + (bh / H) * l.batch + (bh % H) * l.head + t * l.row;
  };
  auto f = [](T x) { return static_cast<double>(static_cast<float>(x)); };
  if (nan_case) *const_cast<T*>(at(q, in, 0, std::min(Tn - 1, 70))) = T(NAN);
  const float scale = 1.f / std::sqrt(static_cast<float>(hs));
  // Note [attention grid]: one dimension, B·H·tiles blocks, tile-fastest within a head
  const unsigned gx = static_cast<unsigned>(BH * ((Tn + 63) / 64)), gy = 1;
  namespace tk = tg::backend::cuda;
  if (tiles) launch(gx, gy, [&] { tk::flash_forward_kernel<T, HS>(q, k, v, in, out, io, lse, H, Tn, scale, causal); });
  else launch(gx, gy, [&] { mk::forward_kernel<T, HS>(q, k, v, in, out, io, lse, H, Tn, scale, causal); });
  // D = rowsum(dO * O)
  for (std::int64_t bh = 0; bh < BH; ++bh)
    for (int t = 0; t < Tn; ++t) {
      float s = 0;
      for (int c = 0; c < hs; ++c) s += static_cast<float>(at(dout, io, bh, t)[c]) * static_cast<float>(at(out, io, bh, t)[c]);
      dvec[bh * Tn + t] = s;
    }
  if (tiles) {
    launch(gx, gy, [&] { tk::flash_backward_dkdv_kernel<T, HS>(q, k, v, in, dout, io, lse, dvec, dk, dv, H, Tn, scale, causal); });
    launch(gx, gy, [&] { tk::flash_backward_dq_kernel<T, HS>(q, k, v, in, dout, io, lse, dvec, dq, H, Tn, scale, causal); });
  } else {
    launch(gx, gy, [&] { mk::backward_dkdv_kernel<T, HS>(q, k, v, in, dout, io, lse, dvec, dk, dv, H, Tn, scale, causal); });
    launch(gx, gy, [&] { mk::backward_dq_kernel<T, HS>(q, k, v, in, dout, io, lse, dvec, dq, H, Tn, scale, causal); });
  }

  // guards
  int bad = 0;
  auto guard_ok = [&](auto& vec, std::size_t n, auto fill, const char* name) {
    for (std::size_t i = n; i < n + G; ++i)
      if (std::memcmp(&vec[i], &fill, sizeof(fill)) != 0) {
        std::printf("  guard of %s overwritten at +%zu\n", name, i - n);
        ++bad;
        return;
      }
  };
  guard_ok(ob, nio, sentinel, "out");
  guard_ok(lseb, static_cast<std::size_t>(BH) * Tn, -12345.f, "lse");
  if (packed) guard_ok(dqb, nin, sentinel, "dqkv");
  else {
    guard_ok(dqb, nin, sentinel, "dq");
    guard_ok(dkb, nin, sentinel, "dk");
    guard_ok(dvb, nin, sentinel, "dv");
  }
  // reference in double
  double eo = 0, mo = 0, el = 0, eq = 0, mq = 0, ek = 0, mk_ = 0, ev = 0, mv = 0;
  int unwritten = 0, nan_rows_ok = 1, nan_leak = 0;
  for (std::int64_t bh = 0; bh < BH; ++bh) {
    std::vector<double> P(static_cast<std::size_t>(Tn) * Tn, 0.0), dS(static_cast<std::size_t>(Tn) * Tn, 0.0);
    for (int i = 0; i < Tn; ++i) {
      double m = -INFINITY;
      std::vector<double> s(Tn, -INFINITY);
      for (int j = 0; j < Tn; ++j) {
        if (causal && j > i) continue;
        double d = 0;
        for (int c = 0; c < hs; ++c) d += f(at(q, in, bh, i)[c]) * f(at(k, in, bh, j)[c]);
        s[j] = d * scale;
        m = std::max(m, s[j]);
      }
      double l = 0;
      for (int j = 0; j < Tn; ++j) l += (s[j] == -INFINITY) ? 0 : std::exp(s[j] - m);
      for (int j = 0; j < Tn; ++j) P[static_cast<std::size_t>(i) * Tn + j] = (s[j] == -INFINITY) ? 0 : std::exp(s[j] - m) / l;
      const double lse_ref = m + std::log(l);
      const bool row_nan = std::isnan(lse_ref);
      const float lk = lse[bh * Tn + i];
      if (row_nan) {
        if (!std::isnan(lk)) nan_rows_ok = 0;
      } else el = std::max(el, std::abs(lk - lse_ref));
      for (int c = 0; c < hs; ++c) {
        double o = 0;
        for (int j = 0; j < Tn; ++j) o += P[static_cast<std::size_t>(i) * Tn + j] * f(at(v, in, bh, j)[c]);
        const T got = at(out, io, bh, i)[c];
        if (std::memcmp(&got, &sentinel, 2) == 0) ++unwritten;
        if (row_nan) {
          if (!std::isnan(f(got))) nan_rows_ok = 0;
        } else {
          if (std::isnan(f(got))) ++nan_leak;
          eo = std::max(eo, std::abs(f(got) - o));
          mo = std::max(mo, std::abs(o));
        }
      }
    }
    if (nan_case) continue;
    // backward, with the kernel's own O for D
    for (int i = 0; i < Tn; ++i) {
      const double D = dvec[bh * Tn + i];
      for (int j = 0; j < Tn; ++j) {
        double dp = 0;
        for (int c = 0; c < hs; ++c) dp += f(at(dout, io, bh, i)[c]) * f(at(v, in, bh, j)[c]);
        dS[static_cast<std::size_t>(i) * Tn + j] = P[static_cast<std::size_t>(i) * Tn + j] * (dp - D) * scale;
      }
    }
    for (int i = 0; i < Tn; ++i)
      for (int c = 0; c < hs; ++c) {
        double gq = 0, gk = 0, gv = 0;
        for (int j = 0; j < Tn; ++j) {
          gq += dS[static_cast<std::size_t>(i) * Tn + j] * f(at(k, in, bh, j)[c]);
          gk += dS[static_cast<std::size_t>(j) * Tn + i] * f(at(q, in, bh, j)[c]);
          gv += P[static_cast<std::size_t>(j) * Tn + i] * f(at(dout, io, bh, j)[c]);
        }
        const T a = at(dq, in, bh, i)[c], b = at(dk, in, bh, i)[c], d = at(dv, in, bh, i)[c];
        if (!std::memcmp(&a, &sentinel, 2) || !std::memcmp(&b, &sentinel, 2) || !std::memcmp(&d, &sentinel, 2)) ++unwritten;
        eq = std::max(eq, std::abs(f(a) - gq)), mq = std::max(mq, std::abs(gq));
        ek = std::max(ek, std::abs(f(b) - gk)), mk_ = std::max(mk_, std::abs(gk));
        ev = std::max(ev, std::abs(f(d) - gv)), mv = std::max(mv, std::abs(gv));
        if (std::isnan(f(a)) || std::isnan(f(b)) || std::isnan(f(d))) ++nan_leak;
      }
  }
  const double tol = std::is_same_v<T, tg::bf16> ? 3e-2 : 6e-3;
  const double ro = eo / std::max(mo, 1e-30), rq = eq / std::max(mq, 5e-2), rk = ek / std::max(mk_, 5e-2),
               rv = ev / std::max(mv, 1e-30);
  const bool ok = !bad && !unwritten && nan_rows_ok && !nan_leak && ro <= tol && el < 1e-2 &&
                  (nan_case || (rq <= tol && rk <= tol && rv <= tol));
  std::printf("%s %s hs=%d B=%d H=%d T=%d causal=%d packed=%d nan=%d mode=%d: out %.2e lse %.2e dq %.2e dk %.2e dv %.2e "
              "unwritten %d nanrows %d nanleak %d races %d\n",
              ok ? "ok  " : "FAIL", std::is_same_v<T, tg::bf16> ? "bf16" : "fp16", hs, B, H, Tn, causal, packed, nan_case,
              g_mode, ro, el, rq, rk, rv, unwritten, nan_rows_ok, nan_leak, g_races.load());
  std::fflush(stdout);
  return ok ? 0 : 1;
}


struct Scope {
  bool causal = true, packed = false, nan = false;
};
enum class Kernels { registers, tiles };

/// One forward and backward of B x H heads of Tn rows on one set of kernels, cp.async delivering at issue
/// (mode 0) or at the wait (mode 1; the WMMA kernels use plain loads): no failure and no race.
template <class T, int HS>
void check(Kernels kernels, int B, int H, int Tn, Scope s, int mode, unsigned seed) {
  SCOPED_TRACE(::testing::Message() << (kernels == Kernels::tiles ? "tiles " : "registers ")
                                    << (std::is_same_v<T, tg::bf16> ? "bf16" : "fp16") << " hs=" << HS << " B=" << B
                                    << " H=" << H << " T=" << Tn << " causal=" << s.causal << " packed=" << s.packed
                                    << " nan=" << s.nan << " cp.async at " << (mode ? "the wait" : "issue"));
  g_mode = mode;
  g_races = 0;
  EXPECT_EQ((run_case<T, HS>(B, H, Tn, s.causal, s.packed, s.nan, seed, kernels == Kernels::tiles)), 0);
  EXPECT_EQ(g_races.load(), 0) << "shared-memory races (the first ones are on stderr)";
}

constexpr Kernels R = Kernels::registers, W = Kernels::tiles;

TEST(FlashEmulated, RegistersBf16HeadSize64) {
  for (const int Tn : {17, 130}) check<tg::bf16, 64>(R, 1, 1, Tn, {}, 1, 1u + Tn);
  check<tg::bf16, 64>(R, 1, 1, 65, {}, 0, 3u);
  check<tg::bf16, 64>(R, 1, 1, 100, {.causal = false}, 1, 5u);
}
TEST(FlashEmulated, RegistersFp16HeadSize128) {
  for (const int Tn : {1, 65}) check<tg::fp16, 128>(R, 1, 1, Tn, {}, 1, 2u + Tn);
  check<tg::fp16, 128>(R, 1, 1, 130, {}, 0, 4u);
  check<tg::fp16, 128>(R, 1, 1, 100, {.causal = false}, 1, 6u);
}
// causal_attention_qkv's layout: q, k, v read in place from (B, T, 3, H, hs), out written to (B, T, H, hs).
TEST(FlashEmulated, RegistersPackedQkvLayout) {
  check<tg::bf16, 64>(R, 2, 2, 70, {.packed = true}, 1, 7u);
  check<tg::fp16, 128>(R, 1, 2, 70, {.packed = true}, 0, 8u);
}
// A NaN query (row 70, in a key tile that is not masked) makes its own row NaN, and only that row (the
// second head stays finite).
TEST(FlashEmulated, RegistersNanQueryMakesOnlyItsRowNan) {
  check<tg::bf16, 128>(R, 1, 2, 130, {.nan = true}, 1, 9u);
  check<tg::fp16, 64>(R, 1, 1, 100, {.causal = false, .nan = true}, 1, 10u);
}
// The WMMA kernels (the default set) over the same cases: values, bounds, NaN rows (no race check: their
// shared memory is read and written by plain loads and stores).
TEST(FlashEmulated, TilesBf16HeadSize64) {
  for (const int Tn : {1, 17, 130}) check<tg::bf16, 64>(W, 1, 1, Tn, {}, 1, 11u + Tn);
  check<tg::bf16, 64>(W, 1, 1, 100, {.causal = false}, 1, 12u);
}
TEST(FlashEmulated, TilesFp16HeadSize128) {
  check<tg::fp16, 128>(W, 1, 1, 65, {}, 1, 13u);
  check<tg::fp16, 128>(W, 1, 1, 100, {.causal = false}, 1, 14u);
}
TEST(FlashEmulated, TilesPackedQkvAndNan) {
  check<tg::bf16, 64>(W, 2, 2, 70, {.packed = true}, 1, 15u);
  check<tg::bf16, 128>(W, 1, 2, 130, {.nan = true}, 1, 16u);
}

}  // namespace

// The optimizer's multi-tensor kernels of every GPU training step run on the CPU (backends/cuda/optim_multi.cuh and
// adafactor_multi.cuh):
// Adam / AdamW writing the bf16 / fp16 weight copies in the same pass (Note [the optimizer writes the weight
// copies]), with its constants from the host or from the device boundary's state (Note [the step boundary on the
// device]); SGD; LAMB's moments, per-tensor ratios and update; Adafactor's seven launches; the loss scaler's unscale; clipping's per-chunk sums of squares and its rescale; and the step
// boundary's one-thread kernels (begin, note_loss, the chunk-order total, decide). Their bodies are compiled unchanged
// as host code, each block as real threads (blocks one after another), over the chunk tables and grids the launchers
// in optim.cu build (chunk_table, blocks_for, 256 threads), and over a shorter grid too, so that a block takes several
// chunks. Emulated: threadIdx / blockIdx / blockDim / gridDim; __syncthreads and the warp's meetings as barriers;
// __shfl_xor_sync and __any_sync through a warp's slots; __shared__ variables as function-local statics (shared by
// the running block's threads); block_sum and kThreads as common.cuh defines them.
// References are the CPU backend's own kernels (tg::backend::cpu: adam_step_multi, sgd_step_multi, lamb_step,
// unscale_and_check, sum_squares, scale_inplace and the boundary kernels DeviceBoundary<cpu> calls), as
// tests/cuda/test_cuda_optim.cpp and test_cuda_boundary.cpp compare the GPU with them: Adam, SGD, LAMB within a few
// ulps (the CPU library is built with -march=native and may contract to FMA), the weight copies bit for bit from
// the updated p, unscale / rescale / the boundary's state bit for bit, the sum of squares within 1e-12 (another
// order of fp64 additions) and bit for bit between clip_grad_norm's host total and the boundary's device total.
// Buffers carry guard bytes that must stay untouched; a skipped step must leave every byte as it was.
// What this cannot show: speed, races the host's schedule does not hit, and nvcc's code for the device.
//   ctest -R OptimEmulated
#include <gtest/gtest.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include <typegrad/core/dtype.hpp>
#include <typegrad/detail/cpu/amp_kernels.hpp>
#include <typegrad/detail/cpu/kernels.hpp>
#include <typegrad/detail/cpu/optim_kernels.hpp>
#include <typegrad/detail/cuda/multi_tensor.hpp>
#include <typegrad/detail/kernels/optim.hpp>
#include <typegrad/detail/math.hpp>

#define __global__
#define __device__
#define __forceinline__ inline

#include "simt_emulation.hpp"

// common.cuh's block size and its warp and block sums (the same shuffles and barriers in the same order)
namespace tg::backend::cuda::detail {
constexpr int kThreads = 256;
template <class A>
A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class A>
A block_sum(A v, A* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : A(0);
  return warp_sum(v);
}
}  // namespace tg::backend::cuda::detail

#define __shared__ static  // one variable per kernel instantiation, shared by the threads of the running block
namespace tg::backend::cuda {
namespace {
using detail::Chunk;
using detail::chunk_table;
using detail::kChunk;
#include "optim_multi.cuh"
// common.cuh's grid-stride loop, for adafactor_multi.cuh
#define TG_GRID_STRIDE(i, n)                                                                        \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
#include "adafactor_multi.cuh"
#undef TG_GRID_STRIDE
}  // namespace
}  // namespace tg::backend::cuda
#undef __shared__

namespace {

namespace be = tg::backend;
namespace cu = tg::backend::cuda;
namespace cpu = tg::backend::cpu;
using be::AdamTensor;
using be::SgdTensor;
using be::WeightCopyType;
using cu::detail::Chunk;
using cu::detail::chunk_table;
using cu::detail::kChunk;
using tg::bf16;
using tg::fp16;
using i64 = std::int64_t;

// ---- launches ---------------------------------------------------------------------------------------------
/// Runs kernel() as `threads` threads per block over `grid` blocks (launch_threads).
template <class F>
void launch(i64 grid, int threads, F kernel) {
  if (threads > 1 && threads % 32 != 0) emu_fail("bad launch shape");
  launch_threads(grid, threads, kernel);
}

// optim.cu's launchers, with the same chunk tables, grids and block size; `grid` > 0 overrides the grid.
unsigned blocks_for(std::size_t chunks) { return static_cast<unsigned>(std::min<std::size_t>(chunks, 65535u * 4u)); }
i64 pick(std::size_t chunks, i64 grid) { return grid > 0 ? std::min<i64>(grid, static_cast<i64>(chunks)) : blocks_for(chunks); }

void emu_adam(const std::vector<AdamTensor<float>>& ts, const be::AdamScalars& s, i64 grid = 0) {
  std::vector<i64> sizes;
  for (const auto& t : ts) sizes.push_back(t.n);
  const std::vector<Chunk> chunks = chunk_table(static_cast<int>(ts.size()), sizes.data());
  if (chunks.empty()) return;
  const auto n = static_cast<i64>(chunks.size());
  if (s.boundary)
    launch(pick(chunks.size(), grid), cu::detail::kThreads,
           [&] { cu::adam_multi_kernel<true>(ts.data(), chunks.data(), n, tg::math::AdamConsts<float>{}, s); });
  else {
    const auto c = tg::math::adam_consts<float>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step);
    launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::adam_multi_kernel<false>(ts.data(), chunks.data(), n, c, s); });
  }
}

void emu_sgd(const std::vector<SgdTensor<float>>& ts, const be::SgdScalars& s, i64 grid = 0) {
  std::vector<i64> sizes;
  for (const auto& t : ts) sizes.push_back(t.n);
  const std::vector<Chunk> chunks = chunk_table(static_cast<int>(ts.size()), sizes.data());
  if (chunks.empty()) return;
  const auto c = tg::math::sgd_consts<float>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
  const auto n = static_cast<i64>(chunks.size());
  if (c.use_mom) launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::sgd_multi_kernel<true>(ts.data(), chunks.data(), n, c, s); });
  else launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::sgd_multi_kernel<false>(ts.data(), chunks.data(), n, c, s); });
}

/// unscale_and_check (state null) or boundary_unscale (state set); returns the flag unscale_and_check reads back.
bool emu_unscale(float* const* g, const i64* sizes, int count, float inv, double* state, i64 grid = 0) {
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  if (chunks.empty()) return false;
  int found = 0;
  const auto n = static_cast<i64>(chunks.size());
  launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::unscale_kernel(g, sizes, chunks.data(), n, inv, &found, state); });
  return found != 0;
}

/// The per-chunk partial sums of sum_squares_multi_kernel.
std::vector<double> emu_partials(const float* const* x, const i64* sizes, int count, i64 grid = 0) {
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  std::vector<double> partials(chunks.size(), std::numeric_limits<double>::quiet_NaN());
  if (chunks.empty()) return partials;
  const auto n = static_cast<i64>(chunks.size());
  launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::sum_squares_multi_kernel(x, sizes, chunks.data(), n, partials.data()); });
  return partials;
}
/// boundary_sum_squares: the partials added by boundary_total_kernel into the state.
void emu_boundary_sum_squares(const float* const* x, const i64* sizes, int count, double* state) {
  const std::vector<double> partials = count > 0 ? emu_partials(x, sizes, count) : std::vector<double>{};
  const i64 n = static_cast<i64>(partials.size());
  launch(1, 1, [&] { cu::boundary_total_kernel(n ? partials.data() : nullptr, n, state); });
}
/// scale_multi (state null) or boundary_clip (state set).
void emu_scale(float* const* x, const i64* sizes, int count, float s, const double* state, i64 grid = 0) {
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  if (chunks.empty()) return;
  const auto n = static_cast<i64>(chunks.size());
  launch(pick(chunks.size(), grid), cu::detail::kThreads, [&] { cu::scale_multi_kernel(x, sizes, chunks.data(), n, s, state); });
}

/// lamb_step_multi as optim.cu launches it: the moments pass, the per-tensor ratios (one thread each over its
/// chunks' sums), the apply pass; the constants from the host, or from the boundary state (s.boundary).
void emu_lamb(const std::vector<AdamTensor<float>>& ts, const be::LambScalars& s, double* trust_ratios, i64 grid = 0) {
  const int count = static_cast<int>(ts.size());
  std::vector<i64> sizes;
  for (const auto& t : ts) sizes.push_back(t.n);
  const std::vector<Chunk> chunks = chunk_table(count, sizes.data());
  const std::vector<i64> first = cu::detail::chunk_firsts(chunks, count);
  const auto n = static_cast<i64>(chunks.size());
  std::vector<double> partials(std::max<std::size_t>(chunks.size(), 1) * 2, std::numeric_limits<double>::quiet_NaN());
  std::vector<float> scales(static_cast<std::size_t>(count), std::numeric_limits<float>::quiet_NaN());
  const auto c = s.boundary ? tg::math::LambConsts<float>{} : tg::math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  const i64 blocks = pick(chunks.size(), grid);
  if (n > 0)
    launch(blocks, cu::detail::kThreads, [&] {
      if (s.boundary) cu::lamb_moments_multi_kernel<true>(ts.data(), chunks.data(), n, c, s, partials.data());
      else cu::lamb_moments_multi_kernel<false>(ts.data(), chunks.data(), n, c, s, partials.data());
    });
  launch((count + cu::detail::kThreads - 1) / cu::detail::kThreads, cu::detail::kThreads,
         [&] { cu::lamb_trust_kernel(first.data(), count, partials.data(), s, scales.data(), trust_ratios); });
  if (n == 0) return;
  launch(blocks, cu::detail::kThreads, [&] {
    if (s.boundary) cu::lamb_apply_multi_kernel<true>(ts.data(), chunks.data(), n, c, s, scales.data());
    else cu::lamb_apply_multi_kernel<false>(ts.data(), chunks.data(), n, c, s, scales.data());
  });
}

/// adafactor_step_multi as optim_tensor.cu launches it: row and column statistics of the factored tensors,
/// the full moments, the row totals, the per-chunk sums, the step sizes (one thread per tensor), the update.
void emu_adafactor(const std::vector<be::AdafactorTensor<float>>& ts, const be::AdafactorScalars& s) {
  const int count = static_cast<int>(ts.size());
  const auto n = static_cast<std::size_t>(count);
  std::vector<i64> rows(n, 0), cols(n, 0), full(n, 0), all(n, 0);
  i64 max_cols = 1;
  for (std::size_t t = 0; t < n; ++t) {
    all[t] = ts[t].rows * ts[t].cols;
    if (ts[t].v) full[t] = all[t];
    else if (all[t] > 0) {
      rows[t] = ts[t].rows;
      cols[t] = ts[t].cols;
      max_cols = std::max(max_cols, ts[t].cols);
    }
  }
  const std::vector<Chunk> chunks = chunk_table(count, all.data());
  if (chunks.empty()) return;
  const std::vector<Chunk> full_chunks = chunk_table(count, full.data());
  const std::vector<i64> row_starts = cu::detail::prefix_starts(count, rows.data()), col_starts = cu::detail::prefix_starts(count, cols.data());
  const auto n_chunks = static_cast<i64>(chunks.size()), n_full = static_cast<i64>(full_chunks.size());
  const i64 max_blocks = 65535 * 4;
  const double* state = s.boundary;
  // common.cuh's row_threads and grid_for
  const int row_threads = max_cols <= 64 ? 32 : max_cols <= 256 ? 64 : max_cols <= 1024 ? 128 : max_cols <= 4096 ? 256 : 512;
  const auto grid_for = [](i64 items) { return std::clamp<i64>((items + cu::detail::kThreads - 1) / cu::detail::kThreads, 1, 65535LL * 16); };
  if (row_starts.back() > 0) {
    launch(std::min(row_starts.back(), max_blocks), row_threads,
           [&] { cu::adafactor_rows_multi_kernel(ts.data(), count, row_starts.data(), s.beta2, s.eps1, state); });
    launch(grid_for(col_starts.back()), cu::detail::kThreads,
           [&] { cu::adafactor_cols_multi_kernel(ts.data(), count, col_starts.data(), s.beta2, s.eps1, state); });
  }
  if (n_full > 0)
    launch(std::min(n_full, max_blocks), cu::detail::kThreads, [&] {
      cu::adafactor_full_moment_multi_kernel(ts.data(), full_chunks.data(), n_full, static_cast<float>(s.beta2),
                                             static_cast<float>(1.0 - s.beta2), static_cast<float>(s.eps1), state);
    });
  std::vector<float> inv_total(n, std::numeric_limits<float>::quiet_NaN());
  launch((count + 127) / 128, 128, [&] { cu::adafactor_row_totals_kernel(ts.data(), count, inv_total.data()); });
  std::vector<double> partials(chunks.size() * 2, std::numeric_limits<double>::quiet_NaN());
  const i64 chunk_blocks = std::min(n_chunks, max_blocks);
  launch(chunk_blocks, cu::detail::kThreads,
         [&] { cu::adafactor_norms_multi_kernel(ts.data(), chunks.data(), n_chunks, inv_total.data(), partials.data(), state); });
  const std::vector<i64> first = cu::detail::chunk_firsts(chunks, count);
  std::vector<float> alpha(n, std::numeric_limits<float>::quiet_NaN()), inv_clip(n, std::numeric_limits<float>::quiet_NaN());
  launch((count + cu::detail::kThreads - 1) / cu::detail::kThreads, cu::detail::kThreads,
         [&] { cu::adafactor_scales_kernel(ts.data(), first.data(), count, partials.data(), s, alpha.data(), inv_clip.data()); });
  launch(chunk_blocks, cu::detail::kThreads, [&] {
    cu::adafactor_apply_multi_kernel(ts.data(), chunks.data(), n_chunks, inv_total.data(), alpha.data(), inv_clip.data(),
                                     tg::math::adafactor_consts<float>(0.0, 1.0, s.weight_decay, s.beta1), state);
  });
}

// ---- buffers ----------------------------------------------------------------------------------------------
constexpr i64 kGuard = 64;  // bytes each side
constexpr unsigned char kGuardByte = 0xA7;
/// n elements of T between guard bytes.
template <class T>
struct Buf {
  std::vector<unsigned char> bytes;
  i64 n = 0;
  explicit Buf(i64 count = 0) : bytes(static_cast<std::size_t>(2 * kGuard + count * static_cast<i64>(sizeof(T))), kGuardByte), n(count) {}
  T* data() { return n ? reinterpret_cast<T*>(bytes.data() + kGuard) : nullptr; }
  const T* data() const { return n ? reinterpret_cast<const T*>(bytes.data() + kGuard) : nullptr; }
  T& operator[](i64 i) { return data()[i]; }
  const T& operator[](i64 i) const { return data()[i]; }
  bool guards_intact() const {
    const std::size_t end = bytes.size() - kGuard;
    for (std::size_t i = 0; i < static_cast<std::size_t>(kGuard); ++i)
      if (bytes[i] != kGuardByte || bytes[end + i] != kGuardByte) return false;
    return true;
  }
};
/// Uniform values in [lo, hi) from a splitmix64 sequence (fast: the tests fill a few million elements).
template <class T>
Buf<T> random_buf(i64 n, std::uint64_t seed, float lo, float hi) {
  Buf<T> b(n);
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ull;
  for (i64 i = 0; i < n; ++i) {
    std::uint64_t z = (x += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = static_cast<float>(z >> 40) * 0x1p-24f;  // [0, 1)
    b[i] = static_cast<T>(lo + (hi - lo) * u);
  }
  return b;
}
template <class T>
bool same_bytes(const Buf<T>& a, const Buf<T>& b) {
  return a.bytes == b.bytes;
}

// Sizes across chunk edges (kChunk = 65536): one chunk and one element, whole chunks, a tensor with no elements
// (what a parameter without a gradient leaves: the launchers see n = 0 and make no chunk), several chunks.
const std::vector<i64> kSizes = {kChunk + 1, 7, 0, 2 * kChunk, kChunk - 1, 1, 2 * kChunk + 3};
constexpr i64 kShortGrid = 2;  // blocks that each take several chunks

/// |got - want| <= 5e-7 (floor + |want|): test_cuda_optim.cpp's comparison of the GPU's Adam and SGD with the CPU's.
::testing::AssertionResult close_all(const Buf<float>& got, const Buf<float>& want, float floor) {
  for (i64 i = 0; i < want.n; ++i) {
    const float g = got[i], w = want[i];
    if (!(std::abs(g - w) <= 5e-7f * (floor + std::abs(w))))
      return ::testing::AssertionFailure() << "element " << i << ": " << g << " vs " << w;
  }
  return ::testing::AssertionSuccess();
}
template <class T>
::testing::AssertionResult same_all(const Buf<T>& got, const Buf<T>& want) {
  if (got.n != want.n) return ::testing::AssertionFailure() << "sizes differ";
  for (i64 i = 0; i < want.n; ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) return ::testing::AssertionFailure() << "element " << i << " differs";
  return ::testing::AssertionSuccess();
}

// ---- Adam -------------------------------------------------------------------------------------------------
/// A group's Adam state: p, g, m, v per tensor, and a bf16 or fp16 copy where asked.
struct AdamGroup {
  std::vector<Buf<float>> p, g, m, v;
  std::vector<Buf<bf16>> b16;
  std::vector<Buf<fp16>> f16;
  std::vector<WeightCopyType> types;
  AdamGroup(const std::vector<i64>& sizes, std::uint64_t seed, bool copies) {
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      const i64 n = sizes[k];
      p.push_back(random_buf<float>(n, seed + 10 * k, -1.f, 1.f));
      g.push_back(random_buf<float>(n, seed + 10 * k + 1, -0.1f, 0.1f));
      m.push_back(random_buf<float>(n, seed + 10 * k + 2, -0.01f, 0.01f));
      v.push_back(random_buf<float>(n, seed + 10 * k + 3, 0.f, 1e-3f));
      const WeightCopyType t = !copies ? WeightCopyType::none
                               : k % 3 == 0 ? WeightCopyType::bf16
                               : k % 3 == 1 ? WeightCopyType::fp16
                                            : WeightCopyType::none;
      types.push_back(t);
      b16.emplace_back(t == WeightCopyType::bf16 ? n : 0);
      f16.emplace_back(t == WeightCopyType::fp16 ? n : 0);
      for (i64 i = 0; i < b16.back().n; ++i) b16.back()[i].bits = 0x7fc1;  // a NaN no conversion writes
      for (i64 i = 0; i < f16.back().n; ++i) f16.back()[i].bits = 0x7e01;
    }
  }
  std::vector<AdamTensor<float>> list() {
    std::vector<AdamTensor<float>> out;
    for (std::size_t k = 0; k < p.size(); ++k) {
      void* copy = types[k] == WeightCopyType::bf16 ? static_cast<void*>(b16[k].data())
                   : types[k] == WeightCopyType::fp16 ? static_cast<void*>(f16[k].data())
                                                      : nullptr;
      out.push_back({p[k].data(), g[k].data(), m[k].data(), v[k].data(), p[k].n, copy, types[k]});
    }
    return out;
  }
  bool guards_intact() const {
    for (std::size_t k = 0; k < p.size(); ++k)
      if (!p[k].guards_intact() || !g[k].guards_intact() || !m[k].guards_intact() || !v[k].guards_intact() ||
          !b16[k].guards_intact() || !f16[k].guards_intact())
        return false;
    return true;
  }
};

/// The emulated step (mine) against the CPU's adam_step_multi (ref) on copies of one state.
void expect_adam_matches(AdamGroup& mine, AdamGroup& ref) {
  ASSERT_TRUE(mine.guards_intact());
  for (std::size_t k = 0; k < ref.p.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p";
    EXPECT_TRUE(close_all(mine.m[k], ref.m[k], 1e-2f)) << "m";  // g + wd·p may cancel
    EXPECT_TRUE(close_all(mine.v[k], ref.v[k], 1e-4f)) << "v";
    EXPECT_TRUE(same_all(mine.g[k], ref.g[k])) << "g is read only";
    // Note [the optimizer writes the weight copies]: each copy is its own updated p rounded to nearest even
    for (i64 i = 0; i < mine.b16[k].n; ++i)
      ASSERT_EQ(mine.b16[k][i].bits, tg::scalar_cast<bf16>(mine.p[k][i]).bits) << "bf16 copy element " << i;
    for (i64 i = 0; i < mine.f16[k].n; ++i)
      ASSERT_EQ(mine.f16[k][i].bits, tg::scalar_cast<fp16>(mine.p[k][i]).bits) << "fp16 copy element " << i;
  }
}

be::AdamScalars adam_scalars(bool decoupled, double wd, i64 step) {
  be::AdamScalars s;
  s.lr = 3e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = wd;
  s.decoupled = decoupled;
  s.step = step;
  return s;
}

// AdamW with weight decay (and bf16 / fp16 copies), a no-decay group, and Adam's L2 form, on the launchers' grid
// and on a short one.
TEST(OptimEmulated, AdamMultiMatchesTheCpuAndWritesTheWeightCopies) {
  struct Group {
    bool decoupled;
    double wd;
    bool copies;
  };
  for (const Group grp : {Group{true, 0.1, true}, Group{true, 0.0, true}, Group{false, 0.01, false}})
    for (const i64 grid : {i64{0}, kShortGrid}) {
      SCOPED_TRACE(std::string(grp.decoupled ? "AdamW" : "Adam") + " wd " + std::to_string(grp.wd) + " grid " + std::to_string(grid));
      const auto s = adam_scalars(grp.decoupled, grp.wd, 3);
      AdamGroup mine(kSizes, 100, grp.copies), ref(kSizes, 100, grp.copies), plain(kSizes, 100, false);
      emu_adam(mine.list(), s, grid);
      const auto rl = ref.list();
      cpu::adam_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s);
      expect_adam_matches(mine, ref);
      // the copies change nothing else: p, m and v equal the step without copies bit for bit
      emu_adam(plain.list(), s, grid);
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        EXPECT_TRUE(same_all(mine.p[k], plain.p[k])) << "tensor " << k;
        EXPECT_TRUE(same_all(mine.m[k], plain.m[k])) << "tensor " << k;
        EXPECT_TRUE(same_all(mine.v[k], plain.v[k])) << "tensor " << k;
      }
    }
}

/// A state as begin and decide leave it on the CPU (DeviceBoundary<cpu>'s kernels).
std::vector<double> decided_state(double lr, i64 step, double beta1, double beta2, bool skip) {
  std::vector<double> st(be::kBoundarySize);
  float factor = 0;
  be::BoundaryStart b;
  b.lr = lr;
  b.step = static_cast<double>(step);
  b.bc1 = tg::math::adam_bias_correction(beta1, step + 1);
  b.bc2 = tg::math::adam_bias_correction(beta2, step + 1);
  cpu::boundary_begin<float>(st.data(), &factor, &b);
  cpu::boundary_decide<float>(st.data(), be::BoundaryRule{});
  if (skip) st[be::kSkip] = 1;
  return st;
}

// Note [the step boundary on the device]: skip, lr (times the group's lr scale) and the bias corrections read from
// the state; a skipped step writes nothing.
TEST(OptimEmulated, AdamMultiReadsTheStepFromTheBoundaryState) {
  auto s = adam_scalars(true, 0.1, 999);  // lr and step are the state's
  s.lr = 123;
  s.lr_scale = 0.5f;
  {
    std::vector<double> st = decided_state(2e-3, 4, s.beta1, s.beta2, false);
    s.boundary = st.data();
    AdamGroup mine(kSizes, 300, true), ref(kSizes, 300, true);
    emu_adam(mine.list(), s);
    const auto rl = ref.list();
    cpu::adam_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s);
    expect_adam_matches(mine, ref);
  }
  {
    std::vector<double> st = decided_state(2e-3, 4, s.beta1, s.beta2, true);
    s.boundary = st.data();
    AdamGroup mine(kSizes, 400, true), before(kSizes, 400, true);
    emu_adam(mine.list(), s);
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      EXPECT_TRUE(same_bytes(mine.p[k], before.p[k]) && same_bytes(mine.m[k], before.m[k]) && same_bytes(mine.v[k], before.v[k]) &&
                  same_bytes(mine.b16[k], before.b16[k]) && same_bytes(mine.f16[k], before.f16[k]))
          << "a skipped step wrote tensor " << k;
    }
  }
}

// ---- LAMB --------------------------------------------------------------------------------------------------
// Each tensor's trust ratio from its chunks' fp64 sums (within 1e-6, as test_cuda_optim.cpp), an all-zero tensor's
// ratio 1, and p, m, v as Adam's.
TEST(OptimEmulated, LambMultiMatchesTheCpuWithEachTrustRatio) {
  be::LambScalars s;
  s.lr = 1e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.eps = 1e-6;
  s.weight_decay = 0.01;
  s.step = 3;
  for (const i64 grid : {i64{0}, kShortGrid}) {
    AdamGroup mine(kSizes, 1200, false), ref(kSizes, 1200, false);
    for (i64 i = 0; i < kSizes[4]; ++i) mine.p[4][i] = ref.p[4][i] = 0.f;  // all-zero weights: the ratio falls back to 1
    std::vector<double> trust(kSizes.size(), -1.0);
    emu_lamb(mine.list(), s, trust.data(), grid);
    ASSERT_TRUE(mine.guards_intact());
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k) + " grid " + std::to_string(grid));
      const double want = cpu::lamb_step<float>(ref.p[k].data(), ref.g[k].data(), ref.m[k].data(), ref.v[k].data(), kSizes[k], s);
      EXPECT_NEAR(trust[k], want, 1e-6 * want);
      EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p";
      EXPECT_TRUE(close_all(mine.m[k], ref.m[k], 1e-2f)) << "m";
      EXPECT_TRUE(close_all(mine.v[k], ref.v[k], 1e-4f)) << "v";
    }
    EXPECT_EQ(trust[4], 1.0);
    EXPECT_NE(trust[0], 1.0);
  }
}

// Each tensor's chunk range, which the ratio kernel adds in order: the empty tensor (2) owns none.
TEST(OptimEmulated, ChunkFirstsGivesEachTensorItsChunks) {
  const auto chunks = chunk_table(static_cast<int>(kSizes.size()), kSizes.data());
  EXPECT_EQ(cu::detail::chunk_firsts(chunks, static_cast<int>(kSizes.size())), (std::vector<i64>{0, 2, 3, 3, 5, 6, 7, 10}));
  EXPECT_EQ(cu::detail::chunk_firsts({}, 2), (std::vector<i64>{0, 0, 0}));
}

// Note [the step boundary on the device], Note [LAMB on the device]: skip, lr (times the group's lr scale), t and
// the bias corrections from the state, bit for bit the step with the same values from the host; a skipped step
// writes nothing, its ratios included.
TEST(OptimEmulated, LambMultiReadsTheStepFromTheBoundaryState) {
  be::LambScalars s;
  s.lr = 123;  // lr and step are the state's
  s.step = 999;
  s.lr_scale = 0.5f;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-6;
  s.weight_decay = 0.1;
  be::LambScalars host = s;  // the same step from the host: lr = float(2e-3) · 0.5 in fp32, t = 5
  host.lr = static_cast<double>(static_cast<float>(2e-3) * 0.5f);
  host.step = 5;
  {
    std::vector<double> st = decided_state(2e-3, 4, s.beta1, s.beta2, false);
    s.boundary = st.data();
    AdamGroup mine(kSizes, 500, false), same(kSizes, 500, false), ref(kSizes, 500, false);
    std::vector<double> trust(kSizes.size(), -1.0), trust_host(kSizes.size(), -1.0), trust_cpu(kSizes.size(), -1.0);
    emu_lamb(mine.list(), s, trust.data(), kShortGrid);
    emu_lamb(same.list(), host, trust_host.data(), kShortGrid);
    const auto rl = ref.list();
    cpu::lamb_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s, trust_cpu.data());
    ASSERT_TRUE(mine.guards_intact());
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      EXPECT_EQ(trust[k], trust_host[k]);
      EXPECT_TRUE(same_all(mine.p[k], same.p[k]) && same_all(mine.m[k], same.m[k]) && same_all(mine.v[k], same.v[k]));
      EXPECT_NEAR(trust[k], trust_cpu[k], 1e-6 * trust_cpu[k]);
      EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p";
      EXPECT_TRUE(close_all(mine.m[k], ref.m[k], 1e-2f)) << "m";
      EXPECT_TRUE(close_all(mine.v[k], ref.v[k], 1e-4f)) << "v";
    }
  }
  {
    std::vector<double> st = decided_state(2e-3, 4, s.beta1, s.beta2, true);
    s.boundary = st.data();
    AdamGroup mine(kSizes, 600, false), before(kSizes, 600, false);
    std::vector<double> trust(kSizes.size(), -1.0);
    emu_lamb(mine.list(), s, trust.data());
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      EXPECT_TRUE(same_bytes(mine.p[k], before.p[k]) && same_bytes(mine.m[k], before.m[k]) && same_bytes(mine.v[k], before.v[k]))
          << "a skipped step wrote tensor " << k;
      EXPECT_EQ(trust[k], -1.0) << "a skipped step wrote the ratio of tensor " << k;
    }
    std::vector<double> cpu_trust(kSizes.size(), -1.0);
    AdamGroup cpu_mine(kSizes, 600, false);
    const auto rl = cpu_mine.list();
    cpu::lamb_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s, cpu_trust.data());
    for (std::size_t k = 0; k < kSizes.size(); ++k) {
      EXPECT_TRUE(same_bytes(cpu_mine.p[k], before.p[k])) << "the CPU's skipped step wrote tensor " << k;
      EXPECT_EQ(cpu_trust[k], -1.0);
    }
  }
}

// ---- SGD --------------------------------------------------------------------------------------------------
TEST(OptimEmulated, SgdMultiMatchesTheCpu) {
  struct Case {
    double momentum, wd;
    bool nesterov, first, boundary;
  };
  for (const Case c : {Case{0.0, 0.0, false, false, false}, Case{0.9, 0.01, true, false, false}, Case{0.9, 0.0, false, true, false},
                       Case{0.9, 0.01, false, false, true}}) {
    SCOPED_TRACE("momentum " + std::to_string(c.momentum) + (c.nesterov ? " nesterov" : "") + (c.first ? " first" : "") +
                 (c.boundary ? " boundary" : ""));
    be::SgdScalars s;
    s.lr = 1e-2;
    s.momentum = c.momentum;
    s.weight_decay = c.wd;
    s.nesterov = c.nesterov;
    s.first_step = c.first;
    std::vector<double> st = decided_state(5e-3, 2, 0.9, 0.999, false);
    if (c.boundary) {
      s.boundary = st.data();
      s.lr_scale = 0.25f;
    }
    AdamGroup mine(kSizes, 500, false), ref(kSizes, 500, false);  // p, g, and m as the momentum buffer
    auto list = [&](AdamGroup& a) {
      std::vector<SgdTensor<float>> out;
      for (std::size_t k = 0; k < kSizes.size(); ++k) out.push_back({a.p[k].data(), a.g[k].data(), c.momentum != 0 ? a.m[k].data() : nullptr, kSizes[k]});
      return out;
    };
    for (const i64 grid : {i64{0}, kShortGrid}) {
      emu_sgd(list(mine), s, grid);
      const auto rl = list(ref);
      cpu::sgd_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s);
      ASSERT_TRUE(mine.guards_intact());
      for (std::size_t k = 0; k < kSizes.size(); ++k) {
        EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p, tensor " << k << " grid " << grid;
        EXPECT_TRUE(close_all(mine.m[k], ref.m[k], 1e-2f)) << "momentum buffer, tensor " << k << " grid " << grid;
      }
    }
  }
}

// ---- unscale, the sum of squares, the rescale ------------------------------------------------------------
struct Grads {
  std::vector<Buf<float>> g;
  std::vector<float*> ptr;
  std::vector<i64> sizes;
  Grads(const std::vector<i64>& n, std::uint64_t seed, float scale) {
    for (std::size_t k = 0; k < n.size(); ++k) {
      g.push_back(random_buf<float>(n[k], seed + k, -2.f * scale, 2.f * scale));
      sizes.push_back(n[k]);
    }
    for (auto& b : g) ptr.push_back(b.data());
  }
  int count() const { return static_cast<int>(g.size()); }
  const float* const* cptr() const { return ptr.data(); }
  bool guards_intact() const {
    return std::all_of(g.begin(), g.end(), [](const Buf<float>& b) { return b.guards_intact(); });
  }
};

TEST(OptimEmulated, UnscaleMatchesTheCpuAndFindsInfAndNanAtChunkEdges) {
  for (const i64 grid : {i64{0}, kShortGrid}) {
    Grads mine(kSizes, 700, 1024.f), ref(kSizes, 700, 1024.f);
    const float inv = 1.f / 1000.f;  // not a power of 2: every product rounds
    EXPECT_FALSE(emu_unscale(mine.ptr.data(), mine.sizes.data(), mine.count(), inv, nullptr, grid));
    bool found = false;
    for (int k = 0; k < ref.count(); ++k) found = cpu::unscale_and_check<float>(ref.ptr[k], ref.sizes[k], inv) || found;
    EXPECT_FALSE(found);
    ASSERT_TRUE(mine.guards_intact());
    for (int k = 0; k < ref.count(); ++k) EXPECT_TRUE(same_all(mine.g[k], ref.g[k])) << "tensor " << k << " grid " << grid;
  }
  // one bad value at a time: the last element of a chunk, the first of the next, a tensor's last, a one-element tensor
  constexpr float kInf = std::numeric_limits<float>::infinity(), kNaN = std::numeric_limits<float>::quiet_NaN();
  struct Bad {
    int tensor;
    i64 at;
    float value;
  };
  for (const Bad b : {Bad{0, kChunk - 1, kInf}, Bad{0, kChunk, kNaN}, Bad{3, 2 * kChunk - 1, -kInf}, Bad{5, 0, kNaN},
                      Bad{6, 2 * kChunk + 2, kInf}}) {
    const float bad = b.value;
    Grads mine(kSizes, 800, 1.f);
    mine.g[static_cast<std::size_t>(b.tensor)][b.at] = bad;
    EXPECT_TRUE(emu_unscale(mine.ptr.data(), mine.sizes.data(), mine.count(), 1.f, nullptr)) << "tensor " << b.tensor << " at " << b.at;
    std::vector<double> st(be::kBoundarySize, 0.0);
    st[be::kScale] = 1;
    Grads again(kSizes, 800, 1.f);
    again.g[static_cast<std::size_t>(b.tensor)][b.at] = bad;
    emu_unscale(again.ptr.data(), again.sizes.data(), again.count(), 0.f, st.data(), kShortGrid);
    EXPECT_EQ(st[be::kFoundInf], 1.0) << "boundary_unscale, tensor " << b.tensor << " at " << b.at;
  }
}

TEST(OptimEmulated, SumOfSquaresAndRescaleMatchTheCpu) {
  Grads mine(kSizes, 900, 1.f), ref(kSizes, 900, 1.f);
  double want = 0;
  for (int k = 0; k < ref.count(); ++k) want += cpu::sum_squares<float>(ref.ptr[k], ref.sizes[k]);
  // sum_squares_multi: each chunk's partial in fp64, added on the host in chunk order
  const std::vector<double> partials = emu_partials(mine.cptr(), mine.sizes.data(), mine.count());
  double got = 0;
  for (double x : partials) got += x;
  EXPECT_NEAR(got, want, 1e-12 * want);  // the fp64 additions in another order
  // each chunk's partial is its own elements' sum: a chunk edge off by one moves an element to a neighbour
  const std::vector<Chunk> chunks = chunk_table(mine.count(), mine.sizes.data());
  for (std::size_t b = 0; b < chunks.size(); ++b) {
    const i64 n = mine.sizes[static_cast<std::size_t>(chunks[b].tensor)], len = std::min(kChunk, n - chunks[b].start);
    const double part = cpu::sum_squares<float>(mine.ptr[static_cast<std::size_t>(chunks[b].tensor)] + chunks[b].start, len);
    EXPECT_NEAR(partials[b], part, 1e-12 * part) << "chunk " << b;
  }
  // a block's partials do not depend on how many chunks it takes
  const std::vector<double> short_grid = emu_partials(mine.cptr(), mine.sizes.data(), mine.count(), kShortGrid);
  EXPECT_EQ(std::memcmp(short_grid.data(), partials.data(), partials.size() * sizeof(double)), 0);
  // the boundary's device total is clip_grad_norm's host total, bit for bit
  std::vector<double> st(be::kBoundarySize, 0.0);
  emu_boundary_sum_squares(mine.cptr(), mine.sizes.data(), mine.count(), st.data());
  EXPECT_EQ(std::memcmp(&st[be::kSumSquares], &got, sizeof got), 0);
  st[be::kSumSquares] = -1;
  emu_boundary_sum_squares(nullptr, nullptr, 0, st.data());
  EXPECT_EQ(st[be::kSumSquares], 0.0) << "no gradient: a sum of 0";

  // boundary_clip leaves a skipped step's gradients alone, whatever the factor says
  std::vector<double> skipped(be::kBoundarySize, 0.0);
  skipped[be::kSkip] = 1;
  skipped[be::kCoef] = 0.5;
  const std::vector<Buf<float>> kept = mine.g;
  emu_scale(mine.ptr.data(), mine.sizes.data(), mine.count(), 1.f, skipped.data());
  for (int k = 0; k < mine.count(); ++k) EXPECT_TRUE(same_bytes(mine.g[k], kept[static_cast<std::size_t>(k)])) << "tensor " << k;

  const float coef = static_cast<float>(0.7 / (std::sqrt(got) + 1e-6));
  for (const i64 grid : {i64{0}, kShortGrid}) {
    emu_scale(mine.ptr.data(), mine.sizes.data(), mine.count(), coef, nullptr, grid);
    for (int k = 0; k < ref.count(); ++k) cpu::scale_inplace<float>(ref.ptr[k], ref.sizes[k], coef);
    ASSERT_TRUE(mine.guards_intact());
    for (int k = 0; k < ref.count(); ++k) EXPECT_TRUE(same_all(mine.g[k], ref.g[k])) << "tensor " << k << " grid " << grid;
  }
}

// ---- the step boundary ------------------------------------------------------------------------------------
/// The state bit for bit (NaN included).
::testing::AssertionResult same_state(const std::vector<double>& got, const std::vector<double>& want) {
  for (int i = 0; i < be::kBoundarySize; ++i)
    if (std::memcmp(&got[static_cast<std::size_t>(i)], &want[static_cast<std::size_t>(i)], sizeof(double)) != 0)
      return ::testing::AssertionFailure() << "slot " << i << ": " << got[static_cast<std::size_t>(i)] << " vs " << want[static_cast<std::size_t>(i)];
  return ::testing::AssertionSuccess();
}

// A whole step decided on the emulated device against DeviceBoundary<cpu>'s kernels: begin, three micro-batch losses,
// unscale, Σ g², decide, clip, then AdamW (with copies) reading the state. Each kernel is compared from the same
// input state (bit for bit: the same fp64 operations), the sum of squares within 1e-12, the step as Adam is above.
TEST(OptimEmulated, DeviceBoundaryMatchesTheCpuBoundary) {
  constexpr double kInf = std::numeric_limits<double>::infinity(), kNaN = std::numeric_limits<double>::quiet_NaN();
  struct Case {
    const char* name;
    be::BoundaryRule rule;
    double scale;
    double bad_loss;   // 0: every loss finite
    double bad_grad;   // 0: every gradient finite
    bool skip;         // what the step must decide
    bool clipped;
  };
  const Case cases[] = {
      {"fp16 scaler, clipped", {true, false, true, 0.5}, 1024, 0, 0, false, true},
      {"fp16 scaler, an overflow", {true, false, true, 0.5}, 65536, 0, kInf, true, false},
      {"no scaler, a NaN loss", {false, true, true, 0.5}, 1, kNaN, 0, true, false},
      {"no scaler, a NaN gradient", {false, true, false, 0}, 1, 0, kNaN, true, false},
      {"no scaler, +inf and -inf gradients", {false, true, true, 1.0}, 1, 0, kInf, true, false},
      {"clipping below the limit", {false, false, true, 1e9}, 1, 0, 0, false, false},
  };
  const std::vector<i64> sizes = {kChunk + 1, 7, 0, kChunk - 1, 2 * kChunk + 3};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::vector<double> emu(be::kBoundarySize, 7.0), ref(be::kBoundarySize, 7.0);
    float emu_factor = 0, ref_factor = 0;
    be::BoundaryStart b;
    b.lr = 2e-3;
    b.step = 6;
    b.bc1 = tg::math::adam_bias_correction(0.9, 7);
    b.bc2 = tg::math::adam_bias_correction(0.95, 7);
    b.scale = c.scale;
    b.inv_n = 1.0 / 3.0;
    launch(1, 1, [&] { cu::boundary_begin_kernel(emu.data(), &emu_factor, &b); });
    cpu::boundary_begin<float>(ref.data(), &ref_factor, &b);
    ASSERT_TRUE(same_state(emu, ref)) << "begin";
    ASSERT_EQ(emu_factor, ref_factor);

    for (int mb = 0; mb < 3; ++mb) {
      const float loss = mb == 1 && c.bad_loss != 0 ? static_cast<float>(c.bad_loss) : 2.5f + 0.37f * static_cast<float>(mb);
      launch(1, 1, [&] { cu::boundary_note_loss_kernel(emu.data(), &loss, 3.0); });
      cpu::boundary_note_loss<float>(ref.data(), &loss, 3.0);
    }
    ASSERT_TRUE(same_state(emu, ref)) << "note_loss";

    Grads ge(sizes, 1000, static_cast<float>(c.scale) * 1e-2f), gr(sizes, 1000, static_cast<float>(c.scale) * 1e-2f);
    if (c.bad_grad != 0) {
      ge.g[3][kChunk - 2] = gr.g[3][kChunk - 2] = static_cast<float>(c.bad_grad);
      if (std::string(c.name).find("-inf") != std::string::npos) ge.g[0][kChunk] = gr.g[0][kChunk] = -static_cast<float>(c.bad_grad);
    }
    if (c.rule.scaler_checks) {
      emu_unscale(ge.ptr.data(), ge.sizes.data(), ge.count(), 0.f, emu.data());
      cpu::boundary_unscale<float>(gr.ptr.data(), gr.sizes.data(), gr.count(), ref.data());
      ASSERT_TRUE(same_state(emu, ref)) << "unscale";
      for (int k = 0; k < ge.count(); ++k) ASSERT_TRUE(same_all(ge.g[k], gr.g[k])) << "unscaled tensor " << k;
    }
    if (c.rule.clip || (c.rule.check_non_finite && !c.rule.scaler_checks)) {
      emu_boundary_sum_squares(ge.cptr(), ge.sizes.data(), ge.count(), emu.data());
      cpu::boundary_sum_squares<float>(gr.cptr(), gr.sizes.data(), gr.count(), ref.data());
      const double e = emu[be::kSumSquares], r = ref[be::kSumSquares];
      if (std::isfinite(r)) {
        EXPECT_NEAR(e, r, 1e-12 * r) << "sum of squares";
      } else {
        EXPECT_EQ(std::isnan(e), std::isnan(r)) << "sum of squares " << e << " vs " << r;
      }
      ref[be::kSumSquares] = e;  // from here on the same input state on both sides
    }

    launch(1, 1, [&] { cu::boundary_decide_kernel(emu.data(), c.rule); });
    cpu::boundary_decide<float>(ref.data(), c.rule);
    ASSERT_TRUE(same_state(emu, ref)) << "decide";
    EXPECT_EQ(emu[be::kSkip] != 0, c.skip);
    EXPECT_EQ(emu[be::kCoef] < 1.0, c.clipped);

    if (c.rule.clip) {
      const std::vector<Buf<float>> before = ge.g;
      emu_scale(ge.ptr.data(), ge.sizes.data(), ge.count(), 1.f, emu.data());
      cpu::boundary_clip<float>(gr.ptr.data(), gr.sizes.data(), gr.count(), ref.data());
      ASSERT_TRUE(ge.guards_intact());
      for (int k = 0; k < ge.count(); ++k) {
        ASSERT_TRUE(same_all(ge.g[k], gr.g[k])) << "clipped tensor " << k;
        if (!c.clipped) {
          ASSERT_TRUE(same_bytes(ge.g[k], before[static_cast<std::size_t>(k)])) << "tensor " << k << " rescaled";
        }
      }
    }

    // the optimizer's step from the state, over the decided gradients
    AdamGroup mine(sizes, 1100, true), want(sizes, 1100, true), before(sizes, 1100, true);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      std::memcpy(mine.g[k].data(), ge.g[k].data(), static_cast<std::size_t>(sizes[k]) * sizeof(float));
      std::memcpy(want.g[k].data(), ge.g[k].data(), static_cast<std::size_t>(sizes[k]) * sizeof(float));
      before.g[k] = mine.g[k];
    }
    auto s = adam_scalars(true, 0.1, 1);
    s.beta2 = 0.95;
    s.lr_scale = 0.5f;
    s.boundary = emu.data();
    emu_adam(mine.list(), s);
    const auto wl = want.list();
    s.boundary = ref.data();
    cpu::adam_step_multi<float>(wl.data(), static_cast<int>(wl.size()), s);
    if (c.skip) {
      for (std::size_t k = 0; k < sizes.size(); ++k)
        EXPECT_TRUE(same_bytes(mine.p[k], before.p[k]) && same_bytes(mine.m[k], before.m[k]) && same_bytes(mine.v[k], before.v[k]) &&
                    same_bytes(mine.b16[k], before.b16[k]) && same_bytes(mine.f16[k], before.f16[k]))
            << "a skipped step wrote tensor " << k;
    } else {
      expect_adam_matches(mine, want);
    }
  }
}

// ---- Adafactor ---------------------------------------------------------------------------------------------
/// Adafactor state for factored [rows, cols] matrices (rows > 0) and full vectors (rows == 0: cols elements).
struct AdafactorGroup {
  struct Shape2 {
    i64 rows, cols;
  };
  std::vector<Shape2> shapes;
  std::vector<Buf<float>> p, g, r, c, v, m;
  AdafactorGroup(std::vector<Shape2> sh, std::uint64_t seed) : shapes(std::move(sh)) {
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      const bool factored = shapes[k].rows > 0;
      const i64 n = (factored ? shapes[k].rows : 1) * shapes[k].cols;
      p.push_back(random_buf<float>(n, seed + 10 * k, -1.f, 1.f));
      g.push_back(random_buf<float>(n, seed + 10 * k + 1, -0.1f, 0.1f));
      m.push_back(random_buf<float>(n, seed + 10 * k + 2, -0.01f, 0.01f));
      r.push_back(random_buf<float>(factored ? shapes[k].rows : 0, seed + 10 * k + 3, 0.5f, 2.f));
      c.push_back(random_buf<float>(factored ? shapes[k].cols : 0, seed + 10 * k + 4, 0.5f, 2.f));
      v.push_back(random_buf<float>(factored ? 0 : n, seed + 10 * k + 5, 0.f, 1e-3f));
    }
  }
  std::vector<be::AdafactorTensor<float>> list(bool first_moment) {
    std::vector<be::AdafactorTensor<float>> out;
    for (std::size_t k = 0; k < shapes.size(); ++k) {
      float* mk = first_moment ? m[k].data() : nullptr;
      if (shapes[k].rows > 0) out.push_back({p[k].data(), g[k].data(), r[k].data(), c[k].data(), nullptr, mk, shapes[k].rows, shapes[k].cols});
      else out.push_back({p[k].data(), g[k].data(), nullptr, nullptr, v[k].data(), mk, 1, shapes[k].cols});
    }
    return out;
  }
};
// Factored matrices (a wide one: 512-thread rows), full vectors across a chunk edge, one element, an empty one.
const std::vector<AdafactorGroup::Shape2> kAdafactorShapes = {{37, 70}, {3, 5000}, {0, kChunk + 5}, {0, 1}, {0, 0}, {64, 1}};

be::AdafactorScalars adafactor_test_scalars(double beta1) {
  be::AdafactorScalars s;
  s.rho = 1e-2;
  s.scale_parameter = true;
  s.beta2 = 1.0 - std::pow(3.0, -0.8);
  s.beta1 = beta1;
  s.weight_decay = 0.01;
  return s;
}

// The seven launches against the CPU's adafactor_step_multi: moments within the fp64 sums' order, p as the GPU
// comparison (test_cuda_optim.cpp), with and without a first moment.
TEST(OptimEmulated, AdafactorMultiMatchesTheCpu) {
  for (const double beta1 : {0.0, 0.9}) {
    SCOPED_TRACE("beta1 " + std::to_string(beta1));
    const auto s = adafactor_test_scalars(beta1);
    AdafactorGroup mine(kAdafactorShapes, 900), ref(kAdafactorShapes, 900);
    emu_adafactor(mine.list(beta1 > 0), s);
    const auto rl = ref.list(beta1 > 0);
    cpu::adafactor_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s);
    for (std::size_t k = 0; k < kAdafactorShapes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      ASSERT_TRUE(mine.p[k].guards_intact() && mine.r[k].guards_intact() && mine.c[k].guards_intact() && mine.v[k].guards_intact());
      EXPECT_TRUE(close_all(mine.r[k], ref.r[k], 1e-3f)) << "r";
      EXPECT_TRUE(close_all(mine.c[k], ref.c[k], 1e-3f)) << "c";
      EXPECT_TRUE(close_all(mine.v[k], ref.v[k], 1e-4f)) << "v";
      EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p";
      if (beta1 > 0) EXPECT_TRUE(close_all(mine.m[k], ref.m[k], 1e-2f)) << "m";
      EXPECT_TRUE(same_all(mine.g[k], ref.g[k])) << "g is read only";
    }
  }
}

// Note [the step boundary on the device]: skip, lr (times the group's scale), β̂2_t and 1/sqrt(t) read from the
// state, bit for bit the step with the same scalars from the host; a skipped step writes nothing.
TEST(OptimEmulated, AdafactorMultiReadsTheStepFromTheBoundaryState) {
  const std::int64_t t = 5;
  auto s = adafactor_test_scalars(0.9);
  s.relative_step = true;
  s.lr_scale = 0.5f;
  s.rho = 123;  // the state's
  s.beta2 = 0.5;
  auto host = adafactor_test_scalars(0.9);
  host.rho = std::min(static_cast<double>(static_cast<float>(2e-3) * 0.5f), 1.0 / std::sqrt(static_cast<double>(t)));
  host.beta2 = 1.0 - std::pow(static_cast<double>(t), -0.8);
  for (const bool skip : {false, true}) {
    SCOPED_TRACE(skip ? "skipped" : "taken");
    std::vector<double> st(be::kBoundarySize);
    float factor = 0;
    be::BoundaryStart b;
    b.lr = 2e-3;
    b.step = static_cast<double>(t - 1);
    b.bc1 = host.beta2;
    b.bc2 = 1.0 / std::sqrt(static_cast<double>(t));
    cpu::boundary_begin<float>(st.data(), &factor, &b);
    cpu::boundary_decide<float>(st.data(), be::BoundaryRule{});
    if (skip) st[be::kSkip] = 1;
    s.boundary = st.data();
    AdafactorGroup mine(kAdafactorShapes, 950), same(kAdafactorShapes, 950), before(kAdafactorShapes, 950), ref(kAdafactorShapes, 950);
    emu_adafactor(mine.list(true), s);
    const auto rl = ref.list(true);
    cpu::adafactor_step_multi<float>(rl.data(), static_cast<int>(rl.size()), s);
    if (!skip) emu_adafactor(same.list(true), host);
    for (std::size_t k = 0; k < kAdafactorShapes.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      if (skip) {
        EXPECT_TRUE(same_bytes(mine.p[k], before.p[k]) && same_bytes(mine.r[k], before.r[k]) && same_bytes(mine.c[k], before.c[k]) &&
                    same_bytes(mine.v[k], before.v[k]) && same_bytes(mine.m[k], before.m[k]))
            << "a skipped step wrote";
        EXPECT_TRUE(same_bytes(ref.p[k], before.p[k]) && same_bytes(ref.v[k], before.v[k])) << "the CPU's skipped step wrote";
        continue;
      }
      EXPECT_TRUE(same_all(mine.p[k], same.p[k]) && same_all(mine.r[k], same.r[k]) && same_all(mine.c[k], same.c[k]) &&
                  same_all(mine.v[k], same.v[k]) && same_all(mine.m[k], same.m[k]))
          << "the state's step differs from the host's";
      EXPECT_TRUE(close_all(mine.p[k], ref.p[k], 1.f)) << "p against the CPU";
    }
  }
}

}  // namespace

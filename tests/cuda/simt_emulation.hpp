// The CUDA built-ins that the emulation tests' kernels use, for kernel bodies compiled unchanged as host code
// (test_rows_emulated, test_softmax_emulated, test_optim_emulated): threadIdx / blockIdx / blockDim / gridDim, a
// block's threads as real threads (launch_threads: blocks one after another), __syncthreads and __syncwarp as
// barriers, __shfl_xor_sync and __any_sync through a warp's slots, a warp's xor butterfly replayed in the
// shuffles' order of operations (warp_butterfly), the correctly rounded intrinsics, and a late-warp schedule that
// makes a missing barrier show. Include it once, in the test's one translation unit, before the kernels.
// What it cannot show: speed, races the host's schedule does not hit, and nvcc's code for the device.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace {
struct U3 {
  unsigned x = 0, y = 0, z = 0;
};
thread_local U3 threadIdx, blockIdx;
U3 gridDim, blockDim;

[[noreturn, maybe_unused]] void emu_fail(const char* what) {
  std::fprintf(stderr, "EMU FAIL: %s (thread %u block %u)\n", what, threadIdx.x, blockIdx.x);
  std::abort();
}

constexpr int kMaxWarps = 32;
std::barrier<>* g_block_bar;
std::barrier<>* g_warp_bar[kMaxWarps];
double g_shfl[kMaxWarps][32];     // __shfl_xor_sync's slots (float and double values both fit exactly)
double g_lane[kMaxWarps][2][32];  // warp_butterfly's slots, two sets used in turn
thread_local unsigned tl_shuffles = 0;  // butterflies this thread has made: which set it writes next

// The late-warp schedule (g_late_warp >= 0): after every block barrier, that warp waits until each thread of the
// other warps has arrived at the next block barrier (or the block's end): the others run as far ahead as the
// barriers allow. A barrier missing between a read of shared memory by the late warp and the others' next writes
// to it (or between the others' reads and the late warp's writes) then shows as a wrong result, every run.
int g_late_warp = -1;  // the schedule a case asks for: -1 none, else a warp (past the block's last: the last one)
int g_late = -1;       // the late warp of the running launch
std::atomic<int> g_arrived[4];  // by barrier phase mod 4: threads outside the late warp that arrived
thread_local int tl_phase = 0;  // block barriers this thread has passed in the launch
/// A block barrier (__syncthreads, and the launch's own between blocks; `last`: the launch's final one).
inline void block_barrier(bool last = false) {
  const int phase = tl_phase++;
  const bool late = static_cast<int>(threadIdx.x >> 5) == g_late;
  if (!late) g_arrived[phase % 4].fetch_add(1);
  g_block_bar->arrive_and_wait();
  if (!late || last) return;
  // nobody can arrive at phase + 2 before this warp arrives at phase + 1: its counter can be reset now
  if ((threadIdx.x & 31u) == 0) g_arrived[(phase + 2) % 4].store(0);
  const int others = static_cast<int>(blockDim.x) - 32;
  while (g_arrived[(phase + 1) % 4].load() < others) std::this_thread::yield();
}
inline void __syncthreads() { block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) emu_fail("__syncwarp with a partial mask");
  g_warp_bar[threadIdx.x >> 5]->arrive_and_wait();
}
/// Every lane publishes v, the warp meets, each lane reads lane ^ m's, the warp meets again (the slots are reused).
template <class A>
A __shfl_xor_sync(unsigned mask, A v, int m) {
  static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>);
  if (mask != 0xffffffffu || m < 1 || m > 16 || blockDim.x % 32 != 0) emu_fail("__shfl_xor_sync outside a full warp's butterfly");
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
  g_shfl[w][lane] = static_cast<double>(v);
  g_warp_bar[w]->arrive_and_wait();
  const A r = static_cast<A>(g_shfl[w][lane ^ static_cast<unsigned>(m)]);
  g_warp_bar[w]->arrive_and_wait();
  return r;
}
/// True on every lane when any lane's predicate is (a full warp only).
inline bool __any_sync(unsigned mask, bool pred) {
  if (mask != 0xffffffffu || blockDim.x % 32 != 0) emu_fail("__any_sync outside a full warp");
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5;
  g_shfl[w][lane] = pred ? 1.0 : 0.0;
  g_warp_bar[w]->arrive_and_wait();
  bool any = false;
  for (unsigned l = 0; l < 32; ++l) any = any || g_shfl[w][l] != 0.0;
  g_warp_bar[w]->arrive_and_wait();
  return any;
}
/// A warp's xor butterfly (for o = 16, 8, 4, 2, 1: v = f(v, the value of lane ^ o), where a shuffle would fetch
/// it): every lane publishes v, the warp meets once, and each lane replays the butterfly over the 32 published values,
/// the same operations in the same order as the shuffles would give it. The next butterfly writes the other set of
/// slots; the one after can only start once every lane has passed the next meeting, after its reads of this set.
template <class A, class F>
A warp_butterfly(A v, F f) {
  static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>);
  const unsigned lane = threadIdx.x & 31u, w = threadIdx.x >> 5, set = tl_shuffles++ & 1u;
  g_lane[w][set][lane] = static_cast<double>(v);
  g_warp_bar[w]->arrive_and_wait();
  A x[32], y[32];
  for (unsigned l = 0; l < 32; ++l) x[l] = static_cast<A>(g_lane[w][set][l]);
  for (unsigned o = 16; o > 0; o >>= 1) {
    for (unsigned l = 0; l < 32; ++l) y[l] = f(x[l], x[l ^ o]);
    std::copy(y, y + 32, x);
  }
  return x[lane];
}
// One correctly rounded operation each; the host compiler neither contracts nor reassociates them.
inline float __fmul_rn(float a, float b) { return a * b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fmaf(a, b, c); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

struct NoBlockStart {
  void operator()() const {}
};
/// Runs kernel() as `threads` threads per block (real threads, concurrent, a warp's 32 meeting at its barrier) over
/// `grid` blocks, one block after another with a block barrier between them (one block's shared variables are the
/// next one's). block_start() runs on thread 0 before each block, before the barrier that starts it (e.g. to fill
/// shared memory with garbage). A launch of less than a warp has one partial warp.
template <class F, class BlockStart = NoBlockStart>
void launch_threads(std::int64_t grid, int threads, F kernel, BlockStart block_start = {}) {
  if (grid < 1 || threads < 1 || threads > 1024 || (threads > 32 && threads % 32 != 0)) emu_fail("bad launch shape");
  gridDim = {static_cast<unsigned>(grid), 1, 1};
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  std::barrier<> block(threads);
  const int nwarps = (threads + 31) / 32;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  for (int w = 0; w < nwarps; ++w) {
    warps.push_back(std::make_unique<std::barrier<>>(std::min(threads, 32)));
    g_warp_bar[w] = warps.back().get();
  }
  g_block_bar = &block;
  g_late = g_late_warp < 0 ? -1 : std::min(g_late_warp, nwarps - 1);
  for (auto& a : g_arrived) a.store(0);
  std::vector<std::thread> th;
  th.reserve(static_cast<std::size_t>(threads));
  for (int t = 0; t < threads; ++t)
    th.emplace_back([&, t] {
      threadIdx = {static_cast<unsigned>(t), 0, 0};
      tl_phase = 0;
      tl_shuffles = 0;
      for (std::int64_t b = 0; b < grid; ++b) {
        if (t == 0) block_start();
        block_barrier();
        blockIdx = {static_cast<unsigned>(b), 0, 0};
        kernel();
        block_barrier(b == grid - 1);
      }
    });
  for (auto& x : th) x.join();
}
/// Runs kernel() as every thread of every block in turn on the calling thread, for kernels whose threads share
/// nothing (elementwise, grid-stride): in order, or with blocks and threads reversed.
template <class F>
void launch_sequential(std::int64_t grid, int threads, F kernel, bool reverse = false) {
  gridDim = {static_cast<unsigned>(grid), 1, 1};
  blockDim = {static_cast<unsigned>(threads), 1, 1};
  for (std::int64_t bb = 0; bb < grid; ++bb) {
    blockIdx = {static_cast<unsigned>(reverse ? grid - 1 - bb : bb), 0, 0};
    for (int tt = 0; tt < threads; ++tt) {
      threadIdx = {static_cast<unsigned>(reverse ? threads - 1 - tt : tt), 0, 0};
      kernel();
    }
  }
}
}  // namespace

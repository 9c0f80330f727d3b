// Tests of the CPU caching allocator (core/allocator.hpp, backends/cpu/allocator.cpp): statistics, block
// reuse, size classes, alignment, empty_cache, and that steady-state loops make no system allocation.
//   ./build/cpu/tests/test_tensor --gtest_filter='CachingHostAllocator*'
#include <gtest/gtest.h>
#include <typegrad/config.hpp>

#include <omp.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "typegrad/typegrad.hpp"

namespace test_allocator_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::CachingHostAllocator;
using F = tg::Tensor<tg::fp32>;

std::int64_t rs(std::size_t bytes) { return static_cast<std::int64_t>(CachingHostAllocator::round_size(bytes)); }

TEST(CachingHostAllocator, RoundSizeClasses) {
  // 512-byte granules up to 1 MiB.
  EXPECT_EQ(CachingHostAllocator::round_size(0), 512u);
  EXPECT_EQ(CachingHostAllocator::round_size(1), 512u);
  EXPECT_EQ(CachingHostAllocator::round_size(512), 512u);
  EXPECT_EQ(CachingHostAllocator::round_size(513), 1024u);
  EXPECT_EQ(CachingHostAllocator::round_size(100000), 100352u);  // 196 * 512
  EXPECT_EQ(CachingHostAllocator::round_size(1u << 20), 1u << 20);
  // Above 1 MiB: multiples of 1/8 of the next power of two.
  EXPECT_EQ(CachingHostAllocator::round_size((1u << 20) + 1), (1u << 20) + (1u << 18));
  EXPECT_EQ(CachingHostAllocator::round_size(3u << 20), 3u << 20);
  EXPECT_EQ(CachingHostAllocator::round_size((3u << 20) + 1), (3u << 20) + (1u << 19));
  EXPECT_EQ(CachingHostAllocator::round_size((8u << 20) + 1), (8u << 20) + (2u << 20));
  // Always >= the request, and less than a quarter (1/8 of the next power of two) + 512 B over it.
  for (std::size_t b = 1; b < (64u << 20); b = b * 3 / 2 + 7) {
    const std::size_t r = CachingHostAllocator::round_size(b);
    ASSERT_GE(r, b);
    ASSERT_LE(r, b + b / 4 + 512) << b;
    ASSERT_EQ(r % 512, 0u) << b;
    ASSERT_EQ(CachingHostAllocator::round_size(r), r) << b;  // size classes are fixed points
  }
}

TEST(CachingHostAllocator, StatsTrackInUsePeakReserved) {
  CachingHostAllocator a;
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_EQ(a.stats().bytes_reserved, 0);
  void* p = a.allocate(10000);
  void* q = a.allocate(20000);
  EXPECT_EQ(a.stats().bytes_in_use, rs(10000) + rs(20000));
  EXPECT_EQ(a.stats().peak_bytes, rs(10000) + rs(20000));
  EXPECT_EQ(a.stats().bytes_reserved, rs(10000) + rs(20000));
  EXPECT_EQ(a.stats().system_allocations, 2);
  EXPECT_EQ(a.stats().allocations, 2);
  a.deallocate(q, 20000);
  EXPECT_EQ(a.stats().bytes_in_use, rs(10000));
  EXPECT_EQ(a.stats().peak_bytes, rs(10000) + rs(20000));      // peak remembers
  EXPECT_EQ(a.stats().bytes_reserved, rs(10000) + rs(20000));  // cached, not returned
  a.reset_peak();
  EXPECT_EQ(a.stats().peak_bytes, rs(10000));
  void* r = a.allocate(1000);
  EXPECT_EQ(a.stats().peak_bytes, rs(10000) + rs(1000));
  a.deallocate(r, 1000);
  a.deallocate(p, 10000);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_EQ(a.stats().peak_bytes, rs(10000) + rs(1000));
  a.deallocate(nullptr, 123);  // no-op
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_EQ(a.name(), "cpu caching allocator");
}

TEST(CachingHostAllocator, FreedBlocksAreReused) {
  CachingHostAllocator a;
  void* p = a.allocate(4000);
  a.deallocate(p, 4000);
  void* q = a.allocate(4000);
  EXPECT_EQ(q, p);
  EXPECT_EQ(a.stats().system_allocations, 1);
  a.deallocate(q, 4000);
  // Same size class, different request: still the same block.
  void* r = a.allocate(3585);  // rounds to 4096 as 4000 did
  EXPECT_EQ(r, p);
  EXPECT_EQ(a.stats().system_allocations, 1);
  EXPECT_EQ(a.stats().allocations, 3);
  a.deallocate(r, 3585);
}

TEST(CachingHostAllocator, LargerCachedBlockServesUpToTwiceItsSize) {
  CachingHostAllocator a;
  void* big = a.allocate(4096);
  a.deallocate(big, 4096);
  // 1024 B: the cached 4 KiB block is more than twice the class, so the system is asked.
  void* small = a.allocate(1024);
  EXPECT_NE(small, big);
  EXPECT_EQ(a.stats().system_allocations, 2);
  // 2048 B: the 4 KiB block fits (<= 2x) and is handed out whole; in-use counts its true size.
  void* mid = a.allocate(2048);
  EXPECT_EQ(mid, big);
  EXPECT_EQ(a.stats().system_allocations, 2);
  EXPECT_EQ(a.stats().bytes_in_use, 1024 + 4096);
  a.deallocate(mid, 2048);  // the caller passes its own size; the block's true size is remembered
  EXPECT_EQ(a.stats().bytes_in_use, 1024);
  void* again = a.allocate(4096);  // the 4 KiB block went back to the 4 KiB bin
  EXPECT_EQ(again, big);
  EXPECT_EQ(a.stats().system_allocations, 2);
  a.deallocate(again, 4096);
  a.deallocate(small, 1024);
  EXPECT_EQ(a.stats().bytes_in_use, 0);
  EXPECT_EQ(a.stats().bytes_reserved, 4096 + 1024);
}

// allocate_exact (tg::compile's arenas): only a cached block of the request's own size class serves it.
TEST(CachingHostAllocator, AllocateExactTakesNoLargerCachedBlock) {
  CachingHostAllocator a;
  void* big = a.allocate(4096);
  a.deallocate(big, 4096);
  void* exact = a.allocate_exact(2048);  // allocate() would hand out the 4 KiB block
  EXPECT_NE(exact, big);
  EXPECT_EQ(a.stats().system_allocations, 2);
  EXPECT_EQ(a.stats().bytes_in_use, 2048);
  a.deallocate(exact, 2048);
  void* same = a.allocate_exact(2000);  // the 2 KiB class: its own cached block
  EXPECT_EQ(same, exact);
  EXPECT_EQ(a.stats().system_allocations, 2);
  a.deallocate(same, 2000);
}

TEST(CachingHostAllocator, EmptyCacheReturnsMemory) {
  CachingHostAllocator a;
  std::vector<void*> blocks;
  for (int i = 1; i <= 8; ++i) blocks.push_back(a.allocate(static_cast<std::size_t>(i) * 10000));
  void* keep = a.allocate(50000);
  const auto reserved = a.stats().bytes_reserved;
  for (int i = 1; i <= 8; ++i) a.deallocate(blocks[static_cast<std::size_t>(i - 1)], static_cast<std::size_t>(i) * 10000);
  EXPECT_EQ(a.stats().bytes_reserved, reserved);
  EXPECT_EQ(a.stats().system_frees, 0);
  a.empty_cache();
  EXPECT_EQ(a.stats().bytes_reserved, rs(50000));  // only the block still in use
  EXPECT_EQ(a.stats().bytes_in_use, rs(50000));
  EXPECT_EQ(a.stats().system_frees, 8);
  // After empty_cache a new request goes to the system again.
  const auto sys = a.stats().system_allocations;
  void* p = a.allocate(10000);
  EXPECT_EQ(a.stats().system_allocations, sys + 1);
  a.deallocate(p, 10000);
  a.deallocate(keep, 50000);
}

TEST(CachingHostAllocator, BlocksAre64ByteAligned) {
  CachingHostAllocator a;
  std::vector<std::pair<void*, std::size_t>> blocks;
  for (std::size_t b : {1u, 3u, 64u, 100u, 511u, 513u, 4097u, 65537u, (1u << 20) + 3u, 5u << 20}) {
    void* p = a.allocate(b);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 64, 0u) << b;
    blocks.emplace_back(p, b);
  }
  for (auto [p, b] : blocks) a.deallocate(p, b);
  for (int i = 0; i < 5; ++i) {
    const F t = F::empty({static_cast<std::int64_t>(17 + 31 * i)});
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  }
}

TEST(CachingHostAllocator, GlobalAllocatorBacksTensors) {
  auto& a = tg::allocator<tg::cpu>();
  const auto before = a.stats();
  {
    const F t = F::zeros({1000});
    EXPECT_EQ(a.stats().bytes_in_use, before.bytes_in_use + rs(4000));
    EXPECT_EQ(a.stats().allocations, before.allocations + 1);
    EXPECT_EQ(t.storage()->bytes(), 4000u);
  }
  EXPECT_EQ(a.stats().bytes_in_use, before.bytes_in_use);
  EXPECT_EQ(&a, &tg::allocator<tg::cpu>());
#if !TG_HAVE_CUDA
  EXPECT_THROW(tg::allocator<tg::cuda>(), tg::Error);  // no CUDA backend in this build: a clear error
#else
  EXPECT_EQ(tg::allocator<tg::cuda>().name(), "cuda caching allocator");
#endif
}

TEST(CachingHostAllocator, SteadyStateTensorLoopMakesNoSystemAllocation) {
  auto& a = tg::allocator<tg::cpu>();
  std::int64_t after_first = 0;
  for (int it = 0; it < 100; ++it) {
    {
      const F x = F::zeros({64, 33});
      const F y = F::ones({7});
      const F z = F::full({1 << 16}, 2.0);  // 256 KiB
      const F w = x.transpose(0, 1).contiguous();
      const auto h = z.to<tg::bf16>();
      ASSERT_EQ(w.shape(), (tg::Shape{33, 64}));
      (void)y;
      (void)h;
    }
    if (it == 0) after_first = a.stats().system_allocations;
  }
  EXPECT_EQ(a.stats().system_allocations, after_first);
}

TEST(CachingHostAllocator, SteadyStateAutodiffLoopMakesNoSystemAllocation) {
  auto& a = tg::allocator<tg::cpu>();
  F w = F::normal({32, 16});
  F b = F::zeros({16});
  w.requires_grad_();
  b.requires_grad_();
  const F x = F::normal({8, 32, 16});
  std::int64_t after_first = 0, in_use_first = 0;
  for (int it = 0; it < 100; ++it) {
    {
      const F loss = tg::sum((x * w + b) * (x * w + b)) / 1000.0;
      loss.backward();
      ASSERT_TRUE(w.grad().defined());
    }
    w.zero_grad();
    b.zero_grad();
    if (it == 0) {
      after_first = a.stats().system_allocations;
      in_use_first = a.stats().bytes_in_use;
    }
    ASSERT_EQ(a.stats().bytes_in_use, in_use_first) << "iteration " << it;  // nothing leaks
  }
  EXPECT_EQ(a.stats().system_allocations, after_first);
}

TEST(CachingHostAllocator, PeakMeasuresAGraph) {
  auto& a = tg::allocator<tg::cpu>();
  const F x = F::ones({1024});  // 4 KiB
  a.reset_peak();
  const auto base = a.stats().bytes_in_use;
  EXPECT_EQ(a.stats().peak_bytes, base);
  {
    const F y = x * 2.0;   // +4 KiB, +512 (the scalar)
    const F z = y + x;     // +4 KiB, while y is alive
  }
  EXPECT_EQ(a.stats().bytes_in_use, base);
  EXPECT_GE(a.stats().peak_bytes, base + 2 * rs(4096));
  EXPECT_LE(a.stats().peak_bytes, base + 2 * rs(4096) + rs(4));
}

}  // namespace

// Note [OpenMP on a shared machine] (backends/cpu/kernels.cpp): the library bounds libgomp's spinning
// before libgomp reads its settings, unless the environment the program started with chose a policy.
namespace {
std::string initial_env(const std::string& key) {  // the environment at exec, before any setenv
  std::ifstream f("/proc/self/environ", std::ios::binary);
  std::string entry;
  while (std::getline(f, entry, '\0'))
    if (entry.starts_with(key + "=")) return entry.substr(key.size() + 1);
  return "(unset)";
}
}  // namespace

TEST(CpuThreads, OpenmpSpinningIsBoundedUnlessTheUserChoseAndTheEnvironmentIsKept) {
  const std::string at_exec = initial_env("GOMP_SPINCOUNT"), policy = initial_env("OMP_WAIT_POLICY");
  EXPECT_EQ(tg::backend::cpu::omp_spin_bounded(), at_exec == "(unset)" && policy == "(unset)");
  // The program sees the environment it was given: the library's entry was for libgomp alone.
  const char* now = std::getenv("GOMP_SPINCOUNT");
  EXPECT_EQ(now ? std::string(now) : std::string("(unset)"), at_exec);
  std::ifstream f("/proc/self/environ", std::ios::binary);
  std::string entry;
  int checked = 0;
  while (std::getline(f, entry, '\0')) {  // every variable given at exec is there, with its value
    const std::string key = entry.substr(0, entry.find('='));
    const char* v = std::getenv(key.c_str());
    ASSERT_NE(v, nullptr) << "the variable " << key << " was not put back";
    EXPECT_EQ(key + "=" + v, entry);
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

TEST(CpuThreads, TeamForLoadLeavesOtherProgramsTheirCpus) {
  using tg::backend::cpu::team_for_load;
  EXPECT_EQ(team_for_load(2, 0.0), 2);   // alone
  EXPECT_EQ(team_for_load(2, 0.5), 2);   // one sample of a passing kernel thread, smoothed
  EXPECT_EQ(team_for_load(2, 0.75), 1);  // two samples: another busy program
  EXPECT_EQ(team_for_load(2, 1.0), 1);
  EXPECT_EQ(team_for_load(2, 3.0), 1);   // three: never below one
  EXPECT_EQ(team_for_load(16, 5.0), 11);
  EXPECT_EQ(team_for_load(1, 0.0), 1);
}

TEST(CpuThreads, PinnedTeamIsNotAdapted) {
  const int before = tg::backend::cpu::num_threads();
  tg::backend::cpu::set_num_threads(3);
  tg::backend::cpu::adapt_threads();
  EXPECT_EQ(tg::backend::cpu::num_threads(), 3);
  tg::backend::cpu::set_num_threads(before);
}

TEST(CpuThreads, DefaultThreadCountIsWithinTheAffinityMask) {
  const int before = tg::backend::cpu::num_threads();
  tg::backend::cpu::set_num_threads(0);
  const int def = tg::backend::cpu::num_threads();
  EXPECT_GE(def, 1);
  EXPECT_LE(def, omp_get_num_procs());
  tg::backend::cpu::set_num_threads(before);
  EXPECT_EQ(tg::backend::cpu::num_threads(), before);
}

// An allocation that cannot be met is a tg::Error naming the tensor and the bytes, never an abort.
TEST(CpuAllocator, FailedAllocationIsAnErrorNamingTheTensorAndBytes) {
  const std::int64_t in_use = tg::allocator<tg::cpu>().stats().bytes_in_use;
  try {
    (void)tg::Tensor<tg::fp32>::empty({std::int64_t{1} << 28, std::int64_t{1} << 30});  // 2^60 bytes
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("Tensor<fp32>::empty([268435456,1073741824]), 1152921504606846976 bytes: cpu allocator: out of memory"),
              std::string::npos) << m;
  }
  EXPECT_THROW((void)tg::Tensor<tg::fp32>::empty({std::int64_t{1} << 40, std::int64_t{1} << 40}), tg::Error);  // overflows
  try {
    (void)tg::Tensor<tg::fp64>::empty({std::int64_t{1} << 31, std::int64_t{1} << 31, 4});
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("needs more than 2^62 bytes"), std::string::npos) << e.what();
  }
  EXPECT_EQ(tg::allocator<tg::cpu>().stats().bytes_in_use, in_use);  // nothing leaked or counted
}

}  // namespace test_allocator_cpp

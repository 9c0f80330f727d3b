// CPU kernels: strided copy/convert, fill, counter-based random draws, arange, accumulation.
// One OpenMP pool for everything (PEERS.md: two spinning pools cost PyTorch a third of its step).
#include <omp.h>

#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <cstring>
#include <fstream>
#include <string>

#include "typegrad/core/random.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/row_pieces.hpp"

namespace tg {
Generator& default_generator() {
  static Generator gen(0x5eed);
  return gen;
}
}  // namespace tg

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kParallelGrain = 1 << 15;  // elements below which a loop stays on one thread
constexpr const char* kSpinCount = "10000";        // Note [OpenMP on a shared machine]

// Merges adjacent dims that are contiguous with each other on both sides, and drops size-1 dims.
struct Coalesced {
  int rank = 0;
  std::int64_t size[kMaxDims], a[kMaxDims], b[kMaxDims];
};
Coalesced coalesce(const Shape& sizes, const Shape& sa, const Shape& sb) {
  Coalesced c;
  for (int i = 0; i < sizes.size(); ++i) {
    if (sizes[i] == 1) continue;
    if (c.rank > 0 && c.a[c.rank - 1] == sa[i] * sizes[i] && c.b[c.rank - 1] == sb[i] * sizes[i]) {
      c.size[c.rank - 1] *= sizes[i];
      c.a[c.rank - 1] = sa[i];
      c.b[c.rank - 1] = sb[i];
    } else {
      c.size[c.rank] = sizes[i];
      c.a[c.rank] = sa[i];
      c.b[c.rank] = sb[i];
      ++c.rank;
    }
  }
  return c;
}
}  // namespace

template <class S, class T>
void copy_strided(const S* src, const Shape& src_strides, T* dst, const Shape& dst_strides, const Shape& sizes) {
  const std::int64_t n = sizes.numel();
  if (n == 0) return;
  const Coalesced c = coalesce(sizes, src_strides, dst_strides);
  if (c.rank == 0) {
    dst[0] = scalar_cast<T>(src[0]);
    return;
  }
  const int last = c.rank - 1;
  const std::int64_t inner = c.size[last], outer = n / inner;
  const std::int64_t sa = c.a[last], sb = c.b[last];
  // A contiguous copy coalesces to one row (a parameter's gradient converted to fp32, a weight copy):
  // for_row_pieces cuts it so that every thread takes a share.
  for_row_pieces(outer, inner, kParallelGrain, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    const auto [ao, bo] = row_offsets(o, last, c.size, c.a, c.b);
    const S* s = src + ao;
    T* t = dst + bo;
    if (sa == 1 && sb == 1) {
      for (std::int64_t i = i0; i < i1; ++i) t[i] = scalar_cast<T>(s[i]);
    } else {
      for (std::int64_t i = i0; i < i1; ++i) t[i * sb] = scalar_cast<T>(s[i * sa]);
    }
  });
}

template <class T>
void fill(T* dst, std::int64_t n, T value) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (std::int64_t i = 0; i < n; ++i) dst[i] = value;
}

namespace {
/// The largest 16-bit value strictly below v (v finite).
template <class T>
T next_below(T v) {
  if ((v.bits & 0x7fffu) == 0) return T::from_bits(0x8001u);  // ±0 -> the smallest negative subnormal
  return T::from_bits(static_cast<std::uint16_t>((v.bits & 0x8000u) ? v.bits + 1 : v.bits - 1));
}
}  // namespace

template <class T>
void random_uniform(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float lo, float hi) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    const auto w = detail::philox_words(seed, offset + static_cast<std::uint64_t>(i));
    T v = scalar_cast<T>(lo + (hi - lo) * detail::uniform_from_bits(w[0]));
    // Rounding to a narrower type can land on hi itself; keep the half-open interval [lo, hi).
    if constexpr (std::is_same_v<T, fp16> || std::is_same_v<T, bf16>) {
      if (hi > lo && static_cast<float>(v) >= hi) v = next_below(v);
    } else {
      if (hi > lo && !(static_cast<double>(v) < static_cast<double>(hi))) v = std::nextafter(v, static_cast<T>(lo));
    }
    dst[i] = v;
  }
}

template <class T>
void random_normal(T* dst, std::int64_t n, std::uint64_t seed, std::uint64_t offset, float mean, float stddev) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    const auto w = detail::philox_words(seed, offset + static_cast<std::uint64_t>(i));
    dst[i] = scalar_cast<T>(mean + stddev * detail::normal_from_bits(w[0], w[1]));
  }
}

template <class T>
void arange(T* dst, std::int64_t n, double start, double step) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = scalar_cast<T>(start + step * static_cast<double>(i));
}

template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n) {
#pragma omp parallel for schedule(static) if (n > kParallelGrain)
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, fp16> || std::is_same_v<T, bf16>)
      dst[i] = T(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
    else
      dst[i] = dst[i] + src[i];
  }
}

// Note [OpenMP on a shared machine]
// libgomp's idle workers spin before they sleep: GOMP_SPINCOUNT iterations of `pause`, 300,000 by default
// when OMP_WAIT_POLICY is unset. Alone on a machine that hides the futex wake-up (about 60 us here); with
// two programs on the same cores each spinning worker burns the time slice that the other program's
// worker needs to reach its barrier, at every one of the thousands of parallel regions of a step, and both
// collapse (two tiny-GPT trainers with --threads 2 on 2 cores: 4.7x slower each, where sharing the cores
// costs 2x). So the library bounds the spin of its own pool to kSpinCount iterations unless the user
// chose a policy (OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment; GOMP_SPINCOUNT=300000 restores
// libgomp's default). libgomp reads the setting once, in its constructor, which runs before any
// constructor of ours, and setenv() before it does not help: the executable's .preinit_array runs first,
// but libc's own initialization then resets `environ` to the array the kernel passed. So the preinit
// entry lends one slot of that array to "GOMP_SPINCOUNT=<kSpinCount>" (a slot of a variable no runtime
// reads at start-up, such as the shell's "_"), where libc and then libgomp find it, and a constructor of
// priority 101 puts the original entry back, so the program and its children see the environment they
// were given (the shared libraries' constructors in between miss only the lent variable). omp_spin_bounded() tells whether it happened. Only an executable's
// .preinit_array runs, so a program that loads typegrad as a shared library sets GOMP_SPINCOUNT itself.
// The default thread count is what libgomp counts (the CPUs of the affinity mask), lowered to a cgroup's
// CPU quota (cpu.max, rounded up) when that is smaller: a container limited to 2 CPUs on a 64-core host
// runs 2 threads, not 64 that take turns.
namespace {
constexpr std::size_t kSpinEntryLength = 32;
char g_spin_entry[kSpinEntryLength] = "GOMP_SPINCOUNT=";
char** g_env_slot = nullptr;
char* g_env_saved = nullptr;
bool g_spin_bounded = false;

bool starts_with(const char* s, const char* prefix) { return std::strncmp(s, prefix, std::strlen(prefix)) == 0; }

void bound_openmp_spinning(int, char**, char** envp) {
  if (envp == nullptr) return;
  for (char** e = envp; *e != nullptr; ++e)
    if (starts_with(*e, "OMP_WAIT_POLICY=") || starts_with(*e, "GOMP_SPINCOUNT=")) return;
  // The slot to lend: a variable no runtime reads at start-up (a shell's bookkeeping first), never one of
  // the OpenMP, loader, allocator, locale or GPU runtimes' own.
  char** slot = nullptr;
  for (char** e = envp; *e != nullptr && slot == nullptr; ++e)
    for (const char* name : {"_=", "OLDPWD=", "SHLVL=", "PWD=", "HOSTNAME=", "TERM=", "SHELL=", "LOGNAME=", "USER="})
      if (starts_with(*e, name)) slot = e;
  for (char** e = envp; *e != nullptr && slot == nullptr; ++e) {
    bool risky = false;
    for (const char* p : {"OMP_", "GOMP_", "KMP_", "LD_", "MALLOC_", "GLIBC_", "CUDA", "NCCL", "NVIDIA", "LC_", "LANG", "TZ"})
      risky = risky || starts_with(*e, p);
    if (!risky) slot = e;
  }
  if (slot == nullptr) return;
  std::strncat(g_spin_entry, kSpinCount, kSpinEntryLength - std::strlen(g_spin_entry) - 1);
  g_env_slot = slot;
  g_env_saved = *slot;
  *slot = g_spin_entry;
  g_spin_bounded = true;
}

// Among the executable's first constructors (priority 101): the environment as it was given.
[[gnu::constructor(101)]] void restore_environment() {
  if (g_env_slot != nullptr) *g_env_slot = g_env_saved;
}
}  // namespace

bool omp_spin_bounded() { return g_spin_bounded; }
}  // namespace tg::backend::cpu

// The preinit entry (Note [OpenMP on a shared machine]).
extern "C" {
[[gnu::section(".preinit_array"), gnu::used]] void (*const tg_preinit_bound_openmp_spinning)(int, char**, char**) =
    &tg::backend::cpu::bound_openmp_spinning;
}

namespace tg::backend::cpu {
namespace {
/// CPUs of the cgroup (v2 cpu.max, v1 cfs quota) quota, rounded up; 0 when there is none.
int cgroup_cpu_quota() {
  long long quota = -1, period = 0;
  if (std::ifstream f("/sys/fs/cgroup/cpu.max"); f) {
    std::string q;
    if (f >> q >> period && q != "max") quota = std::atoll(q.c_str());
  } else if (std::ifstream fq("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"), fp("/sys/fs/cgroup/cpu/cpu.cfs_period_us"); fq && fp) {
    fq >> quota;
    fp >> period;
  }
  if (quota <= 0 || period <= 0) return 0;
  return static_cast<int>((quota + period - 1) / period);
}

int default_threads() {
  static const int n = [] {
    const int procs = omp_get_num_procs();  // the affinity mask's CPUs
    const int quota = cgroup_cpu_quota();
    return quota > 0 && quota < procs ? quota : procs;
  }();
  return n;
}

// Note [threads under contention]
// Bounded spinning (Note [OpenMP on a shared machine]) stops a waiting worker from stealing the core, but
// a team of 2 on 2 cores that shares them with another busy program still pays a futex wake-up (~60 us)
// at nearly every one of a step's thousands of short parallel regions, because its two threads are rarely
// on the cores together: two tiny-GPT trainers measured 4.8x slower each. A team no larger than the cores
// left free degrades as it should (each program gets its share). So when the team size is the library's
// default (no OMP_NUM_THREADS, no set_num_threads(n > 0): those pin it), adapt_threads(), called at each
// GEMM's start outside parallel regions, re-counts at most every 100 ms the runnable threads of other
// programs: /proc/loadavg's running count less this process's own running threads (/proc/self/task/*/stat),
// smoothed, and sets the team to the default less that count, at least 1. It only runs where that count
// describes our CPUs: the affinity mask holds every online CPU and no cgroup quota applies (in a container
// pinned to some of a host's CPUs /proc/loadavg counts the whole host). GEMM results do not depend on the
// team size except where K is split between the threads (Note [GEMM K split]), and a few fp64 reductions (the
// global gradient norm) round differently with another team, so a run that must repeat bit for bit on a busy
// machine pins its thread count.
std::atomic<bool> g_auto_threads{std::getenv("OMP_NUM_THREADS") == nullptr};

// The default team size, once, unless the user chose one (OMP_NUM_THREADS).
[[maybe_unused]] const bool kDefaultThreadsSet = [] {
  if (std::getenv("OMP_NUM_THREADS") == nullptr && default_threads() < omp_get_max_threads())
    omp_set_num_threads(default_threads());
  return true;
}();

/// Threads of this process in state R (running or runnable).
int own_running_threads() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (const dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      char path[64];
      std::snprintf(path, sizeof path, "/proc/self/task/%s/stat", e->d_name);
      if (FILE* f = std::fopen(path, "r")) {
        char buf[256];
        const std::size_t got = std::fread(buf, 1, sizeof buf - 1, f);
        std::fclose(f);
        buf[got] = '\0';
        const char* close = std::strrchr(buf, ')');  // "tid (comm) S ..."
        if (close != nullptr && close[1] == ' ' && close[2] == 'R') ++n;
      }
    }
    ::closedir(d);
  }
  return n;
}

/// Runnable threads system-wide (the numerator of /proc/loadavg's fourth field), or -1.
int system_running_threads() {
  FILE* f = std::fopen("/proc/loadavg", "r");
  if (f == nullptr) return -1;
  double a, b, c;
  int running = -1, total = 0;
  if (std::fscanf(f, "%lf %lf %lf %d/%d", &a, &b, &c, &running, &total) != 5) running = -1;
  std::fclose(f);
  return running;
}
}  // namespace

int team_for_load(int default_team, double other_running) {
  // A CPU counts as taken once the smoothed count is within a quarter of it: a lone runnable kernel thread
  // (one sample of 1, smoothed to 0.5) does not halve the team; a busy program (two samples) does.
  const int busy = static_cast<int>(std::floor(std::max(0.0, other_running) + 0.25));
  return std::clamp(default_team - busy, 1, std::max(1, default_team));
}

void adapt_threads() {
  if (!g_auto_threads.load(std::memory_order_relaxed) || omp_in_parallel()) return;
  static const bool whole_machine = [] {
    return omp_get_num_procs() == static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)) && cgroup_cpu_quota() == 0;
  }();
  if (!whole_machine) return;
  static std::mutex mu;
  static std::chrono::steady_clock::time_point last{};
  static double others_ema = 0;
  std::unique_lock lock(mu, std::try_to_lock);
  if (!lock.owns_lock()) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - last < std::chrono::milliseconds(100)) return;
  last = now;
  const int system = system_running_threads();
  if (system < 0) return;
  const int others = std::max(0, system - own_running_threads());
  others_ema = 0.5 * others_ema + 0.5 * others;
  const int team = team_for_load(default_threads(), others_ema);
  if (team != omp_get_max_threads()) omp_set_num_threads(team);
}

void set_num_threads(int n) {
  // Note [threads under contention]: n <= 0 hands the team back to the default: OMP_NUM_THREADS's first
  // number when it is set (a pinned team), else every usable CPU, adapted to other programs' load.
  const char* env = std::getenv("OMP_NUM_THREADS");
  const int pinned = env ? std::atoi(env) : 0;
  g_auto_threads.store(n <= 0 && env == nullptr, std::memory_order_relaxed);
  omp_set_num_threads(n > 0 ? n : pinned > 0 ? pinned : default_threads());
}
int num_threads() { return omp_get_max_threads(); }

#define TG_COPY_FROM(S)                                                                               \
  template void copy_strided<S, fp64>(const S*, const Shape&, fp64*, const Shape&, const Shape&);   \
  template void copy_strided<S, fp32>(const S*, const Shape&, fp32*, const Shape&, const Shape&);   \
  template void copy_strided<S, fp16>(const S*, const Shape&, fp16*, const Shape&, const Shape&);   \
  template void copy_strided<S, bf16>(const S*, const Shape&, bf16*, const Shape&, const Shape&);   \
  template void copy_strided<S, std::int64_t>(const S*, const Shape&, std::int64_t*, const Shape&, const Shape&); \
  template void copy_strided<S, std::int32_t>(const S*, const Shape&, std::int32_t*, const Shape&, const Shape&); \
  template void copy_strided<S, std::uint8_t>(const S*, const Shape&, std::uint8_t*, const Shape&, const Shape&); \
  template void copy_strided<S, std::int8_t>(const S*, const Shape&, std::int8_t*, const Shape&, const Shape&);
#define TG_ALL(T)  \
  TG_COPY_FROM(T) \
  template void arange<T>(T*, std::int64_t, double, double);
#define TG_X(type, e, name, st) TG_ALL(type)
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
TG_INSTANTIATE_KERNELS(TG_KERNELS_FILL, TG_ALL_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_ADD_INPLACE, TG_ALL_TYPES)
#define TG_COUNT_(...) +1
static_assert(0 TG_ALL_TYPES(TG_COUNT_, _) == 0 TG_FOR_EACH_DTYPE(TG_COUNT_),
              "TG_ALL_TYPES (detail/kernels/declare.hpp) must list every type of the dtype master list");
#undef TG_COUNT_
#define TG_RANDOM(T)                                                                                     \
  template void random_uniform<T>(T*, std::int64_t, std::uint64_t, std::uint64_t, float, float);        \
  template void random_normal<T>(T*, std::int64_t, std::uint64_t, std::uint64_t, float, float);
TG_RANDOM(fp64)
TG_RANDOM(fp32)
TG_RANDOM(fp16)
TG_RANDOM(bf16)

}  // namespace tg::backend::cpu

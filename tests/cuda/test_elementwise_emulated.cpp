// The elementwise kernels of every GPU training step run on the CPU: the 16-byte vector maps (vector_map.cuh, Note
// [vector elementwise maps]) with the element functions the launchers pass them (elementwise.cu's casts, binary
// ops, unary forward and backward; runtime.cu's gradient accumulation, whose AddFn is restated below because
// runtime.cu is not split), the scalar kernels the launchers fall back to when an operand is not aligned to its
// vector, and the two dropout kernels (elementwise.cu's dropout_kernel, dropout_add.cu's dropout_add_kernel). Their
// bodies are compiled unchanged as host code (elementwise_kernels.cuh and dropout_add_kernel.cuh; TG_ELEM_EMULATED
// leaves out vector_map.cuh's CUDA side), on the grids the launchers choose (grid_for over the packs, or over the
// elements, kThreads per block) and on short grids, so that the grid-stride loops go round more than once.
// These kernels share nothing between threads (no shared memory, no barrier, no shuffle), so a block's threads
// run one after another; each case runs three times: the launcher's grid with blocks and threads in order, the
// same reversed (an in-place map, out = a, then shows an element read after another thread wrote it), and a grid
// of two blocks. runtime.cu's scalar add_inplace_kernel (misaligned operands) is not covered: it is not split out.
// References are the library's CPU backend (tg::backend::cpu::copy_strided / binary / unary_forward /
// unary_backward / add_inplace) and CPU ops (tg::dropout, tg::dropout_add, tg::add), which the GPU promises to equal:
// casts, binary ops, relu, sqrt, rsqrt, gradient accumulation and both dropouts bit for bit (a NaN only has to be a
// NaN: the GPU's NaN payloads are its own); the other unary ops within close()'s tolerances (one rounding of the
// storage type, and a hundred fp32 ulps of the terms: the device's expf, tanhf, erfcf are not the host's, and both
// compilers fuse multiplies and adds). Outputs start as a pattern (all-zero bytes in one run, all-one
// bytes in the other), and the bytes around every buffer must stay untouched.
// Cases: n below, at and above multiples of the pack size N and of a block's packs; operands 16-byte aligned, aligned
// only to their own vector (N·sizeof, under 16 bytes for the narrower side of a mixed cast) and off by one element
// (the scalar kernels); all 56 casts between the eight element types the launcher instantiates; fp64 / fp32 / fp16 /
// bf16 for the rest; inputs with NaN, ±inf, ±0, subnormals and rounding ties. Dropout: several seeds and offsets
// (one that crosses 2^32 inside the tensor, one above it), p = 0, 0.1, 0.5, 0.999, contiguous, transposed and
// permuted inputs, and dropout_add equal to add(x, dropout(r)).
// What this cannot show: speed; the device's own math functions; a compiler's code for the device. gpu-check runs
// the same kernels on a GPU (the op database's CUDA-vs-CPU entries).
//   ctest -R ElementwiseEmulated
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <typegrad/core/dtype.hpp>
#include <typegrad/core/random.hpp>
#include <typegrad/core/shape.hpp>
#include <typegrad/detail/cuda/geometry.hpp>
#include <typegrad/detail/kernels/core.hpp>
#include <typegrad/detail/kernels/elementwise.hpp>
#include <typegrad/detail/math.hpp>
#include <typegrad/typegrad.hpp>

#include "simt_emulation.hpp"  // the CUDA built-ins on the host

#define __global__
#define __device__
#define __forceinline__ inline
// common.cuh's grid-stride loop
#define TG_GRID_STRIDE(i, n)                                                                       \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

// common.cuh's accumulation type
namespace tg::backend::cuda::detail {
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
}  // namespace tg::backend::cuda::detail

#define TG_ELEM_EMULATED 1
#include "vector_map.cuh"  // (its #pragma unroll: -Wno-unknown-pragmas)

namespace tg::backend::cuda {
using detail::acc_t;
using detail::Geo;
namespace {
#include "dropout_add_kernel.cuh"
#include "elementwise_kernels.cuh"

// runtime.cu's element function of add_inplace (gradient accumulation), the same expression.
template <class T>
struct AddFn {
  __device__ T operator()(T a, T b) const {
    using A = std::conditional_t<std::is_same_v<T, double>, double, float>;
    return scalar_cast<T>(scalar_cast<A>(a) + scalar_cast<A>(b));
  }
};
}  // namespace
}  // namespace tg::backend::cuda

namespace {

namespace cu = tg::backend::cuda;
namespace cpu = tg::backend::cpu;
using tg::bf16;
using tg::fp16;
using tg::scalar_cast;
using tg::Shape;
using i64 = std::int64_t;
using cu::Geo;

template <class... T>
struct TypeList {};

/// The element type's name, for messages.
template <class T>
const char* type_name() {
  if constexpr (std::is_same_v<T, double>) return "fp64";
  else if constexpr (std::is_same_v<T, float>) return "fp32";
  else if constexpr (std::is_same_v<T, fp16>) return "fp16";
  else if constexpr (std::is_same_v<T, bf16>) return "bf16";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "int64";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "int32";
  else if constexpr (std::is_same_v<T, std::uint8_t>) return "uint8";
  else return "int8";
}

// ---- launches -----------------------------------------------------------------------------------------------
constexpr int kThreads = 256;  // common.cuh's kThreads
/// common.cuh's grid_for.
i64 grid_for(i64 n) { return std::clamp<i64>((n + kThreads - 1) / kThreads, 1, 65535LL * 16); }

/// Runs kernel() as every thread of every block, one after another: in order, or blocks and threads reversed.
template <class F>
void launch(i64 grid, bool reverse, F kernel) {
  launch_sequential(grid, kThreads, kernel, reverse);
}

/// A launch: the launcher's grid (cap 0) or at most `cap` blocks, in order or reversed.
struct Run {
  i64 cap;
  bool reverse;
  unsigned char fill;  // the output's bytes before the launch
};
constexpr Run kRuns[] = {{0, false, 0x00}, {0, true, 0xff}, {2, false, 0xff}};
i64 capped(i64 grid, const Run& r) { return r.cap > 0 ? std::min(grid, r.cap) : grid; }

// ---- buffers ------------------------------------------------------------------------------------------------
constexpr int kGuard = 64;
constexpr unsigned char kGuardByte = 0xe7;

/// n elements of T at `shift` elements past a 64-byte boundary, with guard bytes either side.
template <class T>
struct Buf {
  std::vector<unsigned char> raw;
  T* p;
  i64 n;
  std::size_t lo, hi;  // the elements' byte range in raw
  Buf(i64 n_, int shift) : raw(static_cast<std::size_t>(n_ + shift) * sizeof(T) + 3 * kGuard + 64, kGuardByte), n(n_) {
    const auto base = reinterpret_cast<std::uintptr_t>(raw.data());
    const std::size_t start = (64 - base % 64) % 64 + kGuard + static_cast<std::size_t>(shift) * sizeof(T);
    p = reinterpret_cast<T*>(raw.data() + start);
    lo = start;
    hi = start + static_cast<std::size_t>(n) * sizeof(T);
  }
  void fill(unsigned char b) { std::memset(raw.data() + lo, b, hi - lo); }
  void set(const std::vector<T>& v) { std::memcpy(p, v.data(), v.size() * sizeof(T)); }
  std::vector<T> get() const { return std::vector<T>(p, p + n); }
  bool guards_intact() const {
    for (std::size_t i = 0; i < raw.size(); ++i)
      if ((i < lo || i >= hi) && raw[i] != kGuardByte) return false;
    return true;
  }
};

// ---- values -------------------------------------------------------------------------------------------------
/// A fixed pseudo-random stream (splitmix64): the same inputs on every platform.
struct Rng {
  std::uint64_t s;
  std::uint64_t next() {
    std::uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double unit() { return static_cast<double>(next() >> 11) * 0x1p-53; }  // [0, 1)
  double in(double lo, double hi) { return lo + (hi - lo) * unit(); }
};

template <class T>
constexpr bool is_float_v = std::is_floating_point_v<T> || std::is_same_v<T, fp16> || std::is_same_v<T, bf16>;

template <class T>
T from_bits(std::uint64_t b) {
  T v;
  std::memcpy(static_cast<void*>(&v), &b, sizeof(T));  // the low bytes (little-endian)
  return v;
}
template <class T>
std::uint64_t bits_of(T v) {
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

/// Inputs of a floating type: ordinary values, random bit patterns (every class: NaN, ±inf, subnormals), the
/// specials, and values whose rounding to a narrower type is a tie.
template <class T>
std::vector<T> float_values(i64 n, Rng& g) {
  std::vector<T> v(static_cast<std::size_t>(n));
  const double specials[] = {0.0, -0.0, std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN(), 1e-40, -3e-39, 65504.0, 65520.0, 70000.0, 1.0, -1.0};
  for (auto& x : v) {
    const std::uint64_t k = g.next() % 16;
    if (k < 9) {
      x = scalar_cast<T>(g.in(-4, 4));
    } else if (k < 11) {
      x = from_bits<T>(g.next());
    } else if (k < 13) {
      x = scalar_cast<T>(specials[g.next() % std::size(specials)]);
    } else if (k == 13) {  // an fp32 half-way between two bf16 values
      const auto b = static_cast<std::uint32_t>(g.next() & 0x3fff0000u) | 0x8000u;
      x = scalar_cast<T>(std::bit_cast<float>(b));
    } else if (k == 14) {  // an fp32 half-way between two fp16 values (near 1)
      x = scalar_cast<T>(1.0f + static_cast<float>(g.next() % 1024) * 0x1p-10f + 0x1p-11f);
    } else {  // an fp64 half-way between two fp32 values
      x = scalar_cast<T>(1.0 + static_cast<double>(g.next() % (1u << 23)) * 0x1p-23 + 0x1p-24);
    }
  }
  return v;
}
/// Inputs of a floating type that every integer type holds after truncation (a float-to-int cast out of range
/// is undefined on the host and saturates on the GPU: the launcher's callers never ask for one).
template <class T>
std::vector<T> int_safe_values(i64 n, Rng& g, bool unsigned_target) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = scalar_cast<T>(unsigned_target ? g.in(0, 250) : g.in(-120, 120));
  return v;
}
/// Inputs of an integer type: the whole range of its bits, and small values.
template <class T>
std::vector<T> int_values(i64 n, Rng& g) {
  std::vector<T> v(static_cast<std::size_t>(n));
  for (auto& x : v) x = (g.next() % 2) ? static_cast<T>(g.next()) : static_cast<T>(static_cast<std::int64_t>(g.next() % 400) - 200);
  return v;
}

/// Bit-exact (a NaN only has to be a NaN).
template <class T>
bool same(T a, T b) {
  if constexpr (is_float_v<T>)
    if (std::isnan(scalar_cast<double>(a)) && std::isnan(scalar_cast<double>(b))) return true;
  return bits_of(a) == bits_of(b);
}
/// Within the rounding of T of the reference, for ops whose GPU results the CPU's equal only that far: the
/// device's math functions differ from the host's by a few ulps, and both compilers fuse multiplies and adds
/// (nvcc by default, the CPU backend built with -mfma). `terms` bounds the magnitude of the terms of the formula
/// (a cancellation leaves their error in a small result). A NaN or an infinity must be matched exactly.
template <class T>
bool close(T a, T b, double terms) {
  if (same(a, b)) return true;
  const double x = scalar_cast<double>(a), y = scalar_cast<double>(b);
  if (!std::isfinite(x) || !std::isfinite(y)) return false;
  double rel_t = 0x1p-16, rel_a = 0x1p-16, abs = 1e-37;  // fp32: about a hundred ulps of float math
  if constexpr (std::is_same_v<T, double>) rel_t = rel_a = 0x1p-44, abs = 1e-300;
  if constexpr (std::is_same_v<T, bf16>) rel_t = 0x1p-7;  // one bf16 ulp: the float result may round either way
  if constexpr (std::is_same_v<T, fp16>) rel_t = 0x1p-10, abs = 0x1p-24;
  return std::abs(x - y) <= rel_t * std::abs(y) + rel_a * terms + abs;
}

template <class T>
std::string show(T v) {
  char s[64];
  std::snprintf(s, sizeof s, "%.9g (0x%llx)", scalar_cast<double>(v), static_cast<unsigned long long>(bits_of(v)));
  return s;
}

/// Every element against the reference (bit for bit unless `terms`: then close, with terms[i] for element i);
/// the first few mismatches reported.
template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& want, bool exact, const std::string& what,
                  const std::vector<double>* terms = nullptr) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (exact ? same(got[i], want[i]) : close(got[i], want[i], terms ? (*terms)[i] : 0.0)) continue;
    if (++bad <= 3) ADD_FAILURE() << what << " element " << i << ": " << show(got[i]) << ", want " << show(want[i]);
  }
  EXPECT_EQ(bad, 0) << what;
}

std::string tname(const char* name, i64 n, int s0, int s1 = 0, int s2 = 0) {
  return std::string(name) + " n=" + std::to_string(n) + " shifts=" + std::to_string(s0) + "," + std::to_string(s1) +
         "," + std::to_string(s2);
}

/// Lengths around the pack size N and a block's packs.
std::vector<i64> lengths(int N) {
  return {1, N - 1, N, N + 1, 2 * N - 1, 3 * N, i64{kThreads} * N - 1, i64{kThreads} * N, i64{kThreads} * N + N - 1,
          i64{kThreads} * N + N + 1, 3 * i64{kThreads} * N + 5};
}

/// Element shifts of the operands: all 16-byte aligned; the narrower ones aligned only to their vector (where that
/// is under 16 bytes); one off by an element (the launcher's scalar fallback).
template <int N, class... T>
std::vector<std::vector<int>> shifts() {
  constexpr int k = sizeof...(T);
  std::vector<std::vector<int>> s{std::vector<int>(k, 0)};
  std::vector<int> own{(static_cast<int>(N * sizeof(T)) % 16 != 0 ? N : 0)...};
  if (std::any_of(own.begin(), own.end(), [](int x) { return x != 0; })) s.push_back(own);
  for (int j = 0; j < k; ++j) {
    std::vector<int> one(k, 0);
    one[static_cast<std::size_t>(j)] = 1;
    s.push_back(one);
  }
  return s;
}

// ---- the vector maps and their launchers ----------------------------------------------------------------------
/// What copy_strided does with contiguous operands of different types (the vector map, or the scalar kernel).
template <class S, class T>
void check_cast() {
  constexpr int N = cu::detail::vector_width<T, S>();
  Rng g{0x5a17 + sizeof(S) * 131 + sizeof(T) * 7 + std::is_signed_v<S> + 2 * std::is_signed_v<T>};
  for (const i64 n : lengths(N)) {
    for (const auto& sh : shifts<N, T, S>()) {
      std::vector<S> src_v;
      if constexpr (!is_float_v<S>) src_v = int_values<S>(n, g);
      else if constexpr (!is_float_v<T>) src_v = int_safe_values<S>(n, g, std::is_unsigned_v<T>);
      else src_v = float_values<S>(n, g);
      Buf<S> src(n, sh[1]);
      src.set(src_v);
      std::vector<T> want(static_cast<std::size_t>(n));
      cpu::copy_strided<S, T>(src.p, Shape{1}, want.data(), Shape{1}, Shape{n});
      for (const Run& r : kRuns) {
        Buf<T> dst(n, sh[0]);
        dst.fill(r.fill);
        // shifts in elements from a 64-byte boundary: aligned to the vector iff a multiple of N
        const bool fits = cu::detail::vector_map_fits(dst.p, src.p);
        EXPECT_EQ(fits, N > 1 && sh[0] % N == 0 && sh[1] % N == 0);
        if (fits) {
          const i64 packs = n / N;
          launch(capped(grid_for(packs > 0 ? packs : 1), r), r.reverse,
                 [&] { cu::detail::vector_map_kernel<N>(cu::CastTo<T>{}, dst.p, n, src.p); });
        } else {
          launch(capped(grid_for(n), r), r.reverse, [&] { cu::copy_contiguous_kernel<S, T>(src.p, dst.p, n); });
        }
        const std::string what = tname("cast", n, sh[0], sh[1]) + " " + type_name<S>() + "->" + type_name<T>();
        expect_equal(dst.get(), want, true, what);
        EXPECT_TRUE(dst.guards_intact() && src.guards_intact()) << what;
        EXPECT_TRUE(std::memcmp(src.p, src_v.data(), src_v.size() * sizeof(S)) == 0) << what << ": the source changed";
      }
    }
  }
}

template <class S, class... T>
void check_casts_from(TypeList<T...>) {
  (..., [] {
    if constexpr (!std::is_same_v<S, T>) check_cast<S, T>();
  }());
}

using AllTypes = TypeList<double, float, fp16, bf16, std::int64_t, std::int32_t, std::uint8_t, std::int8_t>;

TEST(ElementwiseEmulated, CastsAllPairs) {
  check_casts_from<double>(AllTypes{});
  check_casts_from<float>(AllTypes{});
  check_casts_from<fp16>(AllTypes{});
  check_casts_from<bf16>(AllTypes{});
  check_casts_from<std::int64_t>(AllTypes{});
  check_casts_from<std::int32_t>(AllTypes{});
  check_casts_from<std::uint8_t>(AllTypes{});
  check_casts_from<std::int8_t>(AllTypes{});
}

/// binary's contiguous path: the vector map over (a, b), or binary_kernel with dense geometry.
template <class T>
void check_binary() {
  constexpr int N = cu::detail::vector_width<T, T, T>();
  Rng g{0xb1 + sizeof(T)};
  for (const auto op : {tg::math::Binary::add, tg::math::Binary::sub, tg::math::Binary::mul, tg::math::Binary::div}) {
    for (const i64 n : lengths(N)) {
      for (const auto& sh : shifts<N, T, T, T>()) {
        Buf<T> a(n, sh[1]), b(n, sh[2]);
        a.set(float_values<T>(n, g));
        b.set(float_values<T>(n, g));
        const Shape shape{n}, dense{1};
        std::vector<T> want(static_cast<std::size_t>(n));
        cpu::binary<T>(op, a.p, dense, b.p, dense, want.data(), shape);
        for (const Run& r : kRuns) {
          Buf<T> out(n, sh[0]);
          out.fill(r.fill);
          if (cu::detail::vector_map_fits(out.p, a.p, b.p)) {
            launch(capped(grid_for(std::max<i64>(n / N, 1)), r), r.reverse,
                   [&] { cu::detail::vector_map_kernel<N>(cu::BinaryFn<T>{op}, out.p, n, a.p, b.p); });
          } else {
            const Geo geo = cu::detail::make_geo(shape, dense, dense);
            launch(capped(grid_for(n), r), r.reverse, [&] { cu::binary_kernel<T>(op, a.p, b.p, out.p, n, geo); });
          }
          const std::string what = tname("binary", n, sh[0], sh[1], sh[2]) + " op " + std::to_string(int(op)) + " " + type_name<T>();
          expect_equal(out.get(), want, true, what);
          EXPECT_TRUE(out.guards_intact() && a.guards_intact() && b.guards_intact()) << what;
        }
      }
    }
  }
}
TEST(ElementwiseEmulated, BinaryOps) {
  check_binary<double>();
  check_binary<float>();
  check_binary<fp16>();
  check_binary<bf16>();
}

constexpr tg::math::Unary kUnary[] = {tg::math::Unary::exp,     tg::math::Unary::log,  tg::math::Unary::sqrt,
                                      tg::math::Unary::rsqrt,   tg::math::Unary::tanh, tg::math::Unary::sigmoid,
                                      tg::math::Unary::relu,    tg::math::Unary::gelu_tanh,
                                      tg::math::Unary::gelu_erf, tg::math::Unary::silu};
/// The ops whose GPU results the CPU's equal bit for bit (IEEE-rounded square root and division, a comparison).
bool exact_unary(tg::math::Unary op) {
  return op == tg::math::Unary::sqrt || op == tg::math::Unary::rsqrt || op == tg::math::Unary::relu;
}

/// unary_forward and unary_backward's contiguous paths.
template <class T>
void check_unary() {
  constexpr int N = cu::detail::vector_width<T, T>();
  Rng g{0x0a + sizeof(T)};
  for (const auto op : kUnary) {
    for (const i64 n : lengths(N)) {
      for (const auto& sh : shifts<N, T, T, T>()) {
        const Shape shape{n}, dense{1};
        Buf<T> x(n, sh[1]), dy(n, sh[2]);
        x.set(float_values<T>(n, g));
        dy.set(float_values<T>(n, g));
        const std::string what = tname("unary", n, sh[0], sh[1], sh[2]) + " op " + std::to_string(int(op)) + " " + type_name<T>();
        std::vector<T> want(static_cast<std::size_t>(n)), dwant(static_cast<std::size_t>(n));
        cpu::unary_forward<T>(op, x.p, dense, want.data(), shape);
        cpu::unary_backward<T>(op, x.p, dense, dy.p, dense, dwant.data(), shape);  // x as the saved value
        // the backward's terms: dy times at most 1 + x^2 (gelu's x s (1 - s) 2k (1 + 3c x^2), tanh's 1 - y^2)
        std::vector<double> dterms(static_cast<std::size_t>(n));
        for (i64 i = 0; i < n; ++i) {
          const double xi = scalar_cast<double>(x.p[i]), di = scalar_cast<double>(dy.p[i]);
          dterms[static_cast<std::size_t>(i)] = std::abs(di) * (1 + xi * xi);
        }
        for (const Run& r : kRuns) {
          Buf<T> y(n, sh[0]), dx(n, sh[0]);
          y.fill(r.fill);
          dx.fill(r.fill);
          if (cu::detail::vector_map_fits(y.p, x.p)) {
            launch(capped(grid_for(std::max<i64>(n / N, 1)), r), r.reverse,
                   [&] { cu::detail::vector_map_kernel<N>(cu::UnaryFn<T>{op}, y.p, n, x.p); });
          } else {
            const Geo geo = cu::detail::make_geo(shape, dense);
            launch(capped(grid_for(n), r), r.reverse, [&] { cu::unary_forward_kernel<T>(op, x.p, y.p, n, geo); });
          }
          if (cu::detail::vector_map_fits(dx.p, x.p, dy.p)) {
            launch(capped(grid_for(std::max<i64>(n / N, 1)), r), r.reverse, [&] {
              cu::detail::vector_map_kernel<N>(cu::UnaryGradFn<T>{op, tg::math::uses_output(op)}, dx.p, n, x.p, dy.p);
            });
          } else {
            const Geo geo = cu::detail::make_geo(shape, dense, dense);
            launch(capped(grid_for(n), r), r.reverse, [&] { cu::unary_backward_kernel<T>(op, x.p, dy.p, dx.p, n, geo); });
          }
          expect_equal(y.get(), want, exact_unary(op), what + " forward");
          expect_equal(dx.get(), dwant, exact_unary(op), what + " backward", &dterms);
          EXPECT_TRUE(y.guards_intact() && dx.guards_intact() && x.guards_intact() && dy.guards_intact()) << what;
        }
      }
    }
  }
}

TEST(ElementwiseEmulated, UnaryForwardAndBackward) {
  check_unary<double>();
  check_unary<float>();
  check_unary<fp16>();
  check_unary<bf16>();
}

/// add_inplace's vector path (runtime.cu): dst += src with dst both an input and the output.
template <class T>
void check_add_inplace() {
  constexpr int N = cu::detail::vector_width<T, T, T>();
  Rng g{0xadd + sizeof(T)};
  for (const i64 n : lengths(N)) {
    const std::vector<T> d0 = float_values<T>(n, g);
    Buf<T> src(n, 0);
    src.set(float_values<T>(n, g));
    std::vector<T> want = d0;
    cpu::add_inplace<T>(want.data(), src.p, n);
    for (const Run& r : kRuns) {
      Buf<T> dst(n, 0);
      dst.set(d0);
      ASSERT_TRUE(cu::detail::vector_map_fits(dst.p, dst.p, src.p));
      launch(capped(grid_for(std::max<i64>(n / N, 1)), r), r.reverse, [&] {
        cu::detail::vector_map_kernel<N>(cu::AddFn<T>{}, dst.p, n, static_cast<const T*>(dst.p), src.p);
      });
      const std::string what = tname("add_inplace", n, 0) + " " + type_name<T>();
      expect_equal(dst.get(), want, true, what);
      EXPECT_TRUE(dst.guards_intact() && src.guards_intact()) << what;
    }
  }
}

TEST(ElementwiseEmulated, GradientAccumulation) {
  check_add_inplace<double>();
  check_add_inplace<float>();
  check_add_inplace<fp16>();
  check_add_inplace<bf16>();
}

// ---- dropout ------------------------------------------------------------------------------------------------
struct Stream {
  std::uint64_t seed, offset;
};
// Word positions (4 per Philox counter; the ops draw at 4 x their generator's counter): 17 and the last two start
// inside a counter; the last one's counters cross 2^32 inside the larger tensors; the one before starts above it.
constexpr Stream kStreams[] = {{0, 0}, {42, 17}, {0x0123456789abcdefull, (1ull << 35) + 5}, {7, 4 * ((1ull << 32) - 100) + 2}};
constexpr double kP[] = {0.0, 0.1, 0.5, 0.999};

/// A CPU tensor of `shape` from fixed values, and views of it: contiguous, transposed, permuted.
template <class T>
tg::Tensor<T> make_input(const Shape& shape, Rng& g) {
  std::vector<T> v(static_cast<std::size_t>(shape.numel()));
  for (auto& x : v) x = scalar_cast<T>(g.in(-3, 3));
  if (!v.empty()) v[0] = scalar_cast<T>(std::numeric_limits<double>::quiet_NaN());  // NaN stays NaN when kept, 0 when dropped
  if (v.size() > 1) v[1] = scalar_cast<T>(-std::numeric_limits<double>::infinity());
  return tg::Tensor<T>::from_vector(shape, v);
}

template <class T>
std::vector<T> values_of(const tg::Tensor<T>& t) {
  const tg::Tensor<T> c = t.contiguous();
  return std::vector<T>(c.data(), c.data() + c.numel());
}

template <class T>
void check_dropout() {
  using A = cu::acc_t<T>;
  Rng g{0xd0 + sizeof(T)};
  struct View {
    const char* name;
    Shape base;
    int kind;  // 0 contiguous, 1 transposed, 2 permuted
  };
  const View views[] = {{"n=1", {1}, 0},         {"n=7", {7}, 0},          {"n=255", {255}, 0},
                        {"n=257", {257}, 0},     {"3x1000", {3, 1000}, 0}, {"40x33^T", {40, 33}, 1},
                        {"5x6x7 perm", {5, 6, 7}, 2}};
  for (const View& v : views) {
    const tg::Tensor<T> base = make_input<T>(v.base, g);
    const tg::Tensor<T> x = v.kind == 0 ? base : v.kind == 1 ? base.transpose(0, 1) : base.permute({2, 0, 1});
    const i64 n = x.numel();
    for (const Stream& s : kStreams) {
      for (const double p : kP) {
        const std::string what = std::string("dropout ") + v.name + " seed " + std::to_string(s.seed) + " offset " +
                                 std::to_string(s.offset) + " p " + std::to_string(p) + " " + type_name<T>();
        // the CPU op (p = 0 returns x: the backend kernel then, which the op would run)
        std::vector<T> want(static_cast<std::size_t>(n));
        cpu::dropout_forward<T>(x.data(), x.strides(), want.data(), x.shape(), s.seed, s.offset, nullptr, p);
        // Note [the Philox base in memory]: the position split into a base in memory (a word position, a
        // multiple of 4) and the rest: the same mask on both devices
        const std::uint64_t cell = s.offset / 8 * 4, rel = s.offset - cell;
        {
          std::vector<T> got(static_cast<std::size_t>(n));
          cpu::dropout_forward<T>(x.data(), x.strides(), got.data(), x.shape(), s.seed, rel, &cell, p);
          expect_equal(got, want, true, what + " (CPU, base in memory)");
        }
        if (p > 0) {  // the op draws its mask at the word position of its generator's counter (Note [dropout replays its mask])
          tg::Generator gen;
          gen.set_state(s.seed, s.offset);
          std::vector<T> want_op(static_cast<std::size_t>(n));
          cpu::dropout_forward<T>(x.data(), x.strides(), want_op.data(), x.shape(), s.seed, tg::detail::dropout_position(s.offset), nullptr, p);
          expect_equal(values_of(tg::dropout(x, p, gen)), want_op, true, what + " (op vs backend)");
          EXPECT_EQ(gen.offset(), s.offset + tg::detail::dropout_counters(static_cast<std::uint64_t>(n))) << what;
        } else {
          expect_equal(values_of(x), want, true, what + " (p = 0 is x)");
        }
        // dropout_forward's launch
        const auto scale = static_cast<A>(1.0 / (1.0 - p));
        const Geo geo = cu::detail::make_geo(x.shape(), x.strides());
        for (const Run& r : kRuns) {
          Buf<T> y(n, 0);
          y.fill(r.fill);
          launch(capped(grid_for(n), r), r.reverse,
                 [&] { cu::dropout_kernel<T>(x.data(), y.p, n, geo, s.seed, s.offset, nullptr, static_cast<float>(p), scale); });
          expect_equal(y.get(), want, true, what);
          EXPECT_TRUE(y.guards_intact()) << what;
          Buf<T> yb(n, 0);
          yb.fill(r.fill);
          launch(capped(grid_for(n), r), r.reverse,
                 [&] { cu::dropout_kernel<T>(x.data(), yb.p, n, geo, s.seed, rel, &cell, static_cast<float>(p), scale); });
          expect_equal(yb.get(), want, true, what + " (base in memory)");
          EXPECT_TRUE(yb.guards_intact()) << what;
        }
      }
    }
  }
}

TEST(ElementwiseEmulated, DropoutMatchesCpu) {
  check_dropout<float>();
  check_dropout<double>();
  check_dropout<fp16>();
  check_dropout<bf16>();
}

template <class T>
void check_dropout_add() {
  using A = cu::acc_t<T>;
  Rng g{0xda + sizeof(T)};
  for (const i64 n : {i64{1}, i64{9}, i64{256}, i64{1000}, i64{3 * 1024 + 5}}) {
    const Shape shape{n};
    const tg::Tensor<T> x = make_input<T>(shape, g), r = make_input<T>(shape, g);
    for (const Stream& s : kStreams) {
      for (const double p : kP) {
        const std::string what = "dropout_add n=" + std::to_string(n) + " seed " + std::to_string(s.seed) + " offset " +
                                 std::to_string(s.offset) + " p " + std::to_string(p) + " " + type_name<T>();
        std::vector<T> want(static_cast<std::size_t>(n));
        cpu::dropout_add_forward<T>(x.data(), r.data(), want.data(), n, s.seed, s.offset, nullptr, p);
        const std::uint64_t cell = s.offset / 8 * 4, rel = s.offset - cell;  // Note [the Philox base in memory]
        {
          std::vector<T> got(static_cast<std::size_t>(n));
          cpu::dropout_add_forward<T>(x.data(), r.data(), got.data(), n, s.seed, rel, &cell, p);
          expect_equal(got, want, true, what + " (CPU, base in memory)");
        }
        // the promise: add(x, dropout(r)) bit for bit, and the op runs the backend kernel
        tg::Generator g1, g2;
        g1.set_state(s.seed, s.offset);
        g2.set_state(s.seed, s.offset);
        std::vector<T> want_op(static_cast<std::size_t>(n));  // the op's mask: at its counter's word position
        cpu::dropout_add_forward<T>(x.data(), r.data(), want_op.data(), n, s.seed, tg::detail::dropout_position(s.offset), nullptr, p);
        if (p > 0) expect_equal(values_of(tg::dropout_add(x, r, p, g1)), want_op, true, what + " (op vs backend)");
        expect_equal(values_of(tg::add(x, tg::dropout(r, p, g2))), want_op, true, what + " (add of dropout)");
        const auto scale = static_cast<A>(1.0 / (1.0 - p));
        for (const int shift : {0, 1}) {  // the kernel reads element by element: any alignment
          Buf<T> xb(n, shift), rb(n, 0);
          xb.set(values_of(x));
          rb.set(values_of(r));
          for (const Run& run : kRuns) {
            Buf<T> out(n, shift);
            out.fill(run.fill);
            launch(capped(grid_for(n), run), run.reverse, [&] {
              cu::dropout_add_kernel<T>(xb.p, rb.p, out.p, n, s.seed, s.offset, nullptr, static_cast<float>(p), scale);
            });
            expect_equal(out.get(), want, true, what + " shift " + std::to_string(shift));
            EXPECT_TRUE(out.guards_intact() && xb.guards_intact() && rb.guards_intact()) << what;
            Buf<T> outb(n, shift);
            outb.fill(run.fill);
            launch(capped(grid_for(n), run), run.reverse, [&] {
              cu::dropout_add_kernel<T>(xb.p, rb.p, outb.p, n, s.seed, rel, &cell, static_cast<float>(p), scale);
            });
            expect_equal(outb.get(), want, true, what + " shift " + std::to_string(shift) + " (base in memory)");
            EXPECT_TRUE(outb.guards_intact()) << what;
          }
        }
      }
    }
  }
}

TEST(ElementwiseEmulated, DropoutAddEqualsAddOfDropout) {
  check_dropout_add<float>();
  check_dropout_add<double>();
  check_dropout_add<fp16>();
  check_dropout_add<bf16>();
}

}  // namespace

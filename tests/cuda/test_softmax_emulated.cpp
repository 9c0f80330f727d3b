// The GPU's softmax row kernels and the two fused row kernels that promise to equal unfused ones bit for bit run on
// the CPU: softmax_forward_kernel / softmax_backward_kernel and scale_masked_softmax_forward_kernel / _backward_kernel
// (backends/cuda/softmax_kernels.cuh, Note [fused scale, mask and softmax]), and norm_forward_kernel with
// add_layernorm_kernel (add_layernorm_rows.cuh, Note [fused residual add and LayerNorm]). Their bodies are compiled
// unchanged as host code, each block as real threads (blocks one after another), on the grids and block sizes the
// launchers in nn.cu and add_layernorm.cu choose (row_blocks, row_threads) and on shorter grids, so that a block
// takes several rows. Emulated: threadIdx / blockIdx / blockDim / gridDim; __syncthreads as a barrier; a warp's
// shuffle butterfly through its slots (one meeting, then each lane replays the shuffles); the static __shared__ arrays
// as function-local statics (one per kernel instantiation, shared by the running block's threads); warp_sum /
// warp_max / block_sum / block_max / acc_t as common.cuh defines them, in the same order of operations; the _rn
// intrinsics as the host's correctly rounded operations (g++ under -std=c++20 contracts nothing); exp / log / sqrt as
// the host's float and double functions.
// The unfused side runs the elementwise kernels (elementwise_kernels.cuh: binary_kernel for mul / div / add,
// masked_fill_kernel), which test_elementwise_emulated shows equal to the CPU backend's.
// Checked, in fp64, fp32, bf16 and fp16:
// - scale_masked_softmax forward and backward equal mul (div) by a one-element scale, masked_fill, softmax and their
//   backward bit for bit, in each form (0 mul, mask; 1 div, mask; 2 mul; 3 mask), with an inexact scale (1/3), a
//   causal mask, a random mask broadcast over the rows, and a mask broadcast along each row (stride 0: whole rows
//   masked, a fill of -inf making them NaN);
// - add_layernorm's h, y, mean and rstd equal the elementwise add then norm_forward_kernel bit for bit;
// - every output against a double-precision computation from the same stored inputs (and the stored intermediate
//   the separate ops round to T), within rounding; softmax and log_softmax, LayerNorm and RMSNorm on their own too;
// - rows of width 1, 7, 40, 100, 771, 1000, 4097 (not whole 16-byte packs, or misaligned: the block path), rows
//   fewer and more than the grid, NaN and infinite inputs (their own rows only), a late-warp schedule;
// - outputs start as a pattern no kernel writes, the bytes around every buffer stay untouched, and inputs are
//   followed by NaN, so a read past a row's end shows.
// What this cannot show: speed; the device's expf / logf (within 2 ulps of the host's; the tolerances allow for it);
// nvcc's code: bit-for-bit agreement on the device also needs nvcc to contract (fuse multiplies and adds) the
// kernels' shared expressions alike outside the _rn intrinsics, which only the device (or its PTX) shows. gpu-check
// runs the same comparisons on a GPU (CudaAttention.ScaleMaskedSoftmaxEqualsTheSeparateOpsBitForBit, CudaNorm.*).
//   ctest -R SoftmaxEmulated
#include <gtest/gtest.h>
#include <math.h>  // the global float overloads of exp, log and sqrt, which the kernels call as CUDA's

#include <algorithm>
#include <array>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <typegrad/core/dtype.hpp>
#include <typegrad/core/random.hpp>
#include <typegrad/core/shape.hpp>
#include <typegrad/detail/cuda/geometry.hpp>
#include <typegrad/detail/math.hpp>

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static  // one array per kernel instantiation, shared by the threads of the running block

#include "simt_emulation.hpp"  // the CUDA built-ins on the host

// common.cuh's accumulation type and reductions, in its order of operations
namespace tg::backend::cuda::detail {
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class A>
A warp_sum(A v) {  // v += __shfl_xor_sync(full, v, o)
  return warp_butterfly(v, [](A mine, A other) { return mine + other; });
}
template <class A>
A warp_max(A v) {  // w = __shfl_xor_sync(full, v, o); v = (w > v || w != w) ? w : v: NaN wins
  return warp_butterfly(v, [](A mine, A other) { return (other > mine || other != other) ? other : mine; });
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
template <class A>
A block_max(A v, A* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : -INFINITY;
  return warp_max(v);
}
}  // namespace tg::backend::cuda::detail

// common.cuh's grid-stride loop
#define TG_GRID_STRIDE(i, n)                                                                       \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

namespace tg::backend::cuda {
using detail::acc_t;
using detail::Geo;
namespace {
#include "add_layernorm_rows.cuh"
#include "elementwise_kernels.cuh"
#include "softmax_kernels.cuh"
}  // namespace
}  // namespace tg::backend::cuda
#undef __shared__

namespace {

namespace cu = tg::backend::cuda;
using cu::acc_t;
using tg::bf16;
using tg::fp16;
using tg::scalar_cast;
using tg::Shape;
using i64 = std::int64_t;

// ---- launches ---------------------------------------------------------------------------------------------
/// Runs kernel() as `threads` threads per block over `grid` blocks (launch_threads).
template <class F>
void launch(i64 grid, int threads, F kernel) {
  if (threads < 32 || threads % 32 != 0) emu_fail("bad launch shape");
  launch_threads(grid, threads, kernel);
}
/// The elementwise kernels share nothing between threads: every thread of every block in turn, on this thread.
template <class F>
void launch_elementwise(i64 n, F kernel) {
  constexpr int kThreads = 256;  // common.cuh's kThreads and grid_for
  launch_sequential(std::clamp<i64>((n + kThreads - 1) / kThreads, 1, 65535LL * 16), kThreads, kernel);
}

// The launchers' shapes: common.cuh's row_threads, nn.cu's row_blocks.
int row_threads(i64 n) {
  if (n <= 64) return 32;
  if (n <= 256) return 64;
  if (n <= 1024) return 128;
  if (n <= 4096) return 256;
  return 512;
}
i64 row_blocks(i64 rows) { return std::min<i64>(rows, 65535LL * 8); }

// ---- buffers ----------------------------------------------------------------------------------------------
constexpr std::size_t kGuardBytes = 64;
constexpr unsigned char kInputFill = 0xff;   // NaN in every floating type: what a read past the data finds
constexpr unsigned char kOutputFill = 0x5a;  // 1.5e16 (fp32), 219 (bf16 0x5a5a)...: never a right answer

/// n elements one element past a 16-byte aligned address (so never the packed kernels' layout), with guard bytes.
template <class X>
class Buf {
 public:
  Buf(std::size_t n, unsigned char fill) : n_(n), fill_(fill), store_(kGuardBytes * 2 + (n + 1) * sizeof(X)) {
    std::memset(store_.data(), fill, store_.size());
    p_ = reinterpret_cast<X*>(store_.data() + kGuardBytes) + 1;
  }
  X* data() { return p_; }
  const X* data() const { return p_; }
  X& operator[](std::size_t i) { return p_[i]; }
  const X& operator[](std::size_t i) const { return p_[i]; }
  std::size_t size() const { return n_; }
  bool guards_intact() const {
    const auto* b = reinterpret_cast<const unsigned char*>(p_);
    const auto* e = b + n_ * sizeof(X);
    for (const auto* q = store_.data(); q < store_.data() + store_.size(); ++q)
      if ((q < b || q >= e) && *q != fill_) return false;
    return true;
  }

 private:
  std::size_t n_;
  unsigned char fill_;
  std::vector<unsigned char> store_;
  X* p_;
};

/// Whether two buffers hold the same bytes; on a difference, where.
template <class X>
::testing::AssertionResult same_bits(const Buf<X>& a, const Buf<X>& b, const std::string& what) {
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(X)) != 0)
      return ::testing::AssertionFailure() << what << ": differs at " << i << ": " << scalar_cast<double>(a[i]) << " vs "
                                           << scalar_cast<double>(b[i]);
  return ::testing::AssertionSuccess();
}

// ---- tolerances -------------------------------------------------------------------------------------------
// |got − ref| <= k·round·|ref| + acc·scale + k·tiny: `round` the storage type's unit roundoff (k roundings to T),
// `acc` the relative error of the float (double) arithmetic before it, of `scale` (the size of the terms, stated
// with each check), `tiny` half T's smallest subnormal step.
template <class T>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double round = 0x1p-53, acc = 1e-14, tiny = 0;
  static constexpr const char* name = "fp64";
};
template <>
struct Tol<float> {
  static constexpr double round = 0x1p-24, acc = 2e-6, tiny = 0x1p-150;
  static constexpr const char* name = "fp32";
};
template <>
struct Tol<fp16> {
  static constexpr double round = 0x1p-11, acc = 2e-6, tiny = 0x1p-25;
  static constexpr const char* name = "fp16";
};
template <>
struct Tol<bf16> {
  static constexpr double round = 0x1p-8, acc = 2e-6, tiny = 0x1p-134;
  static constexpr const char* name = "bf16";
};

/// A NaN reference must be matched by a NaN, an infinite one by the same infinity, a finite one within `allowed`.
class Compare {
 public:
  explicit Compare(std::string what) : what_(std::move(what)) {}
  void operator()(i64 i, double got, double ref, double allowed) {
    bool ok;
    if (std::isnan(ref)) ok = std::isnan(got);
    else if (std::isinf(ref) || got == ref) ok = got == ref;  // (an exact zero next to infinite terms: a NaN allowance)
    else ok = std::isfinite(got) && std::abs(got - ref) <= allowed;
    if (!ok && bad_++ == 0) {
      first_ = i;
      got_ = got;
      ref_ = ref;
      allowed_ = allowed;
    }
  }
  ::testing::AssertionResult result() const {
    if (bad_ == 0) return ::testing::AssertionSuccess();
    char s[256];
    std::snprintf(s, sizeof s, ": %ld bad, first at %lld: got %.9g want %.9g (allowed %.3g)", bad_,
                  static_cast<long long>(first_), got_, ref_, allowed_);
    return ::testing::AssertionFailure() << what_ << s;
  }

 private:
  std::string what_;
  long bad_ = 0;
  i64 first_ = 0;
  double got_ = 0, ref_ = 0, allowed_ = 0;
};

template <class X>
double dbl(X v) {
  return scalar_cast<double>(v);
}
template <class T>
std::string label(const char* what, i64 rows, i64 n, i64 grid) {
  return std::string(Tol<T>::name) + " " + what + " rows " + std::to_string(rows) + " n " + std::to_string(n) +
         " grid " + std::to_string(grid);
}

// ---- softmax and scale_masked_softmax ---------------------------------------------------------------------
enum class MaskKind { none, causal, random, rows };

/// A [B, L, n] softmax case: x, dy, the mask (by the kind) and its strides over the shape, the fill.
template <class T>
struct SoftmaxCase {
  i64 B, L, n;
  MaskKind kind;
  double fill;
  std::vector<std::uint8_t> mask;  // the mask's own elements (nullptr-free even when unused)
  Shape sm;                        // its strides over [B, L, n]
  Buf<T> x, dy;

  SoftmaxCase(i64 b, i64 l, i64 cols, MaskKind k, double f, std::mt19937& gen)
      : B(b), L(l), n(cols), kind(k), fill(f), x(b * l * cols, kInputFill), dy(b * l * cols, kInputFill) {
    std::normal_distribution<float> nd(0.f, 2.f), nu(0.f, 1.f);
    for (std::size_t i = 0; i < x.size(); ++i) {
      x[i] = scalar_cast<T>(nd(gen));
      dy[i] = scalar_cast<T>(nu(gen));
    }
    std::bernoulli_distribution coin(0.5);
    switch (k) {
      case MaskKind::none: break;
      case MaskKind::causal:  // [L, n]: a row sees the columns up to its own place from the end
        for (i64 i = 0; i < L; ++i)
          for (i64 j = 0; j < n; ++j) mask.push_back(j > i + (n - L) ? 1 : 0);
        sm = Shape({0, n, 1});
        break;
      case MaskKind::random:  // [1, 1, n]: the same columns masked in every row
        for (i64 j = 0; j < n; ++j) mask.push_back(coin(gen) ? 1 : 0);
        sm = Shape({0, 0, 1});
        break;
      case MaskKind::rows:  // [L, 1]: whole rows masked (stride 0 along the row)
        for (i64 i = 0; i < L; ++i) mask.push_back(i % 3 == 1 ? 1 : 0);
        sm = Shape({0, 1, 0});
        break;
    }
  }
  i64 rows() const { return B * L; }
  Shape shape() const { return Shape({B, L, n}); }
  const std::uint8_t* mask_data() const { return kind == MaskKind::none ? nullptr : mask.data(); }
  /// Whether element (r, j) is masked, from the mask's strides.
  bool masked(i64 r, i64 j) const {
    if (kind == MaskKind::none) return false;
    const i64 b = r / L, i = r % L;
    return mask[static_cast<std::size_t>(b * sm[0] + i * sm[1] + j * sm[2])] != 0;
  }
};

/// Puts NaN, +inf and −inf into rows of x (each row one kind; others untouched), where the row has room for them.
template <class T>
void poison(Buf<T>& x, i64 rows, i64 n) {
  if (rows >= 3) x[static_cast<std::size_t>(0 * n + n / 2)] = scalar_cast<T>(NAN);
  if (rows >= 4) x[static_cast<std::size_t>(2 * n + n / 3)] = scalar_cast<T>(INFINITY);
  if (rows >= 5) x[static_cast<std::size_t>(4 * n + n - 1)] = scalar_cast<T>(-INFINITY);
}

/// Forward and backward of the fused kernel against the separate kernels, bit for bit, and both against fp64.
template <class T>
void check_scale_masked_softmax(i64 B, i64 L, i64 n, MaskKind kind, double fill, int form, i64 grid_rows = 0) {
  using A = acc_t<T>;
  if (form == 2) kind = MaskKind::none;  // form 2 has no mask
  std::mt19937 gen(static_cast<unsigned>(n * 131 + L * 7 + form));
  SoftmaxCase<T> c(B, L, n, kind, fill, gen);
  const i64 rows = c.rows(), N = rows * n;
  poison(c.x, rows, n);
  const bool scaled = form != 3, divide = form == 1;
  const int how = scaled ? (divide ? 2 : 1) : 0;
  Buf<T> scale(1, kInputFill);
  scale[0] = scalar_cast<T>(1.0 / 3.0);
  const T fill_t = scalar_cast<T>(fill);
  const T* sp = scaled ? scale.data() : nullptr;
  const std::uint8_t* mp = c.mask_data();
  const Shape shape = c.shape();
  // nn.cu's row_geometry
  const i64 ms = mp ? c.sm[2] : 0;
  const cu::Geo g = mp ? cu::detail::make_geo(shape, c.sm) : cu::Geo{};
  const i64 grid = grid_rows ? grid_rows : row_blocks(rows);
  const int threads = row_threads(n);
  const std::string what = label<T>("scale_masked_softmax", rows, n, grid) + " form " + std::to_string(form) +
                           " mask " + std::to_string(static_cast<int>(kind));

  // fused
  Buf<T> yf(N, kOutputFill), dxf(N, kOutputFill);
  launch(grid, threads, [&] {
    cu::scale_masked_softmax_forward_kernel<T>(c.x.data(), sp, how, mp, g, ms, fill_t, yf.data(), rows, n);
  });
  launch(grid, threads, [&] {
    cu::scale_masked_softmax_backward_kernel<T>(yf.data(), c.dy.data(), sp, how, mp, g, ms, dxf.data(), rows, n);
  });

  // separate: v = x·s (x / s), masked_fill, softmax; backward: softmax's, masked_fill's (0), mul's (div's) by s
  const Shape contiguous({L * n, n, 1}), one({0, 0, 0});
  const cu::Geo g_xs = cu::detail::make_geo(shape, contiguous, one);
  Buf<T> v(N, kOutputFill), ys(N, kOutputFill), dv(N, kOutputFill), dxs(N, kOutputFill);
  std::memcpy(v.data(), c.x.data(), static_cast<std::size_t>(N) * sizeof(T));
  if (scaled) {
    const auto op = divide ? tg::math::Binary::div : tg::math::Binary::mul;
    launch_elementwise(N, [&] { cu::binary_kernel<T>(op, c.x.data(), scale.data(), v.data(), N, g_xs); });
  }
  if (mp) {
    Buf<T> vm(N, kOutputFill);
    const cu::Geo g_m = cu::detail::make_geo(shape, contiguous, c.sm);
    launch_elementwise(N, [&] { cu::masked_fill_kernel<T>(v.data(), mp, fill_t, vm.data(), N, g_m); });
    std::memcpy(v.data(), vm.data(), static_cast<std::size_t>(N) * sizeof(T));
  }
  launch(grid, threads, [&] { cu::softmax_forward_kernel<T>(v.data(), ys.data(), rows, n, false); });
  launch(grid, threads, [&] { cu::softmax_backward_kernel<T>(ys.data(), c.dy.data(), dv.data(), rows, n, false); });
  if (mp) {
    Buf<T> dm(N, kOutputFill);
    const cu::Geo g_m = cu::detail::make_geo(shape, contiguous, c.sm);
    launch_elementwise(N, [&] { cu::masked_fill_kernel<T>(dv.data(), mp, scalar_cast<T>(0.0), dm.data(), N, g_m); });
    std::memcpy(dv.data(), dm.data(), static_cast<std::size_t>(N) * sizeof(T));
  }
  if (scaled) {
    const auto op = divide ? tg::math::Binary::div : tg::math::Binary::mul;
    launch_elementwise(N, [&] { cu::binary_kernel<T>(op, dv.data(), scale.data(), dxs.data(), N, g_xs); });
  } else {
    std::memcpy(dxs.data(), dv.data(), static_cast<std::size_t>(N) * sizeof(T));
  }

  EXPECT_TRUE(same_bits(yf, ys, what + " y (fused vs separate)"));
  EXPECT_TRUE(same_bits(dxf, dxs, what + " dx (fused vs separate)"));
  for (const Buf<T>* b : {&yf, &dxf, &ys, &dv, &dxs, &c.x, &c.dy, &scale})
    EXPECT_TRUE(b->guards_intact()) << what << ": a write outside a buffer";

  // fp64: v_j the stored intermediate (x·s rounded to T, or the fill), then the softmax and its backward
  const double s = dbl(scale[0]);
  Compare cy(what + " y vs fp64"), cdx(what + " dx vs fp64");
  std::vector<double> vr(static_cast<std::size_t>(n)), yr(static_cast<std::size_t>(n));
  for (i64 r = 0; r < rows; ++r) {
    double m = -INFINITY;
    bool nan = false;
    for (i64 j = 0; j < n; ++j) {
      const T xv = c.x[static_cast<std::size_t>(r * n + j)];
      const T vt = c.masked(r, j) ? fill_t
                   : !scaled      ? xv
                                  : scalar_cast<T>(divide ? scalar_cast<A>(xv) / scalar_cast<A>(scale[0])
                                                          : scalar_cast<A>(xv) * scalar_cast<A>(scale[0]));
      vr[static_cast<std::size_t>(j)] = dbl(vt);
      nan = nan || std::isnan(dbl(vt));
      m = std::max(m, dbl(vt));
    }
    if (nan) m = NAN;
    long double sum = 0;  // (long double: the reference's own rounding stays far below fp64's allowance)
    for (i64 j = 0; j < n; ++j) sum += std::exp(static_cast<long double>(vr[static_cast<std::size_t>(j)]) - m);
    for (i64 j = 0; j < n; ++j) {
      const double vj = vr[static_cast<std::size_t>(j)];
      const double ref = static_cast<double>(std::exp(static_cast<long double>(vj) - m) / sum);
      const i64 i = r * n + j;
      cy(i, dbl(yf[static_cast<std::size_t>(i)]), ref,
         Tol<T>::round * std::abs(ref) + Tol<T>::acc * (1 + std::abs(vj) + std::abs(m)) * std::abs(ref) + Tol<T>::tiny);
    }
    // backward from the stored y and dy
    long double gy = 0;
    double gya = 0;
    for (i64 j = 0; j < n; ++j) {
      const double yv = dbl(yf[static_cast<std::size_t>(r * n + j)]), gv = dbl(c.dy[static_cast<std::size_t>(r * n + j)]);
      gy += static_cast<long double>(gv) * yv;
      gya += std::abs(gv * yv);
    }
    for (i64 j = 0; j < n; ++j) {
      const i64 i = r * n + j;
      const double yv = dbl(yf[static_cast<std::size_t>(i)]), gv = dbl(c.dy[static_cast<std::size_t>(i)]);
      const double f = !scaled ? 1.0 : divide ? 1.0 / s : s;
      const double ref = c.masked(r, j) ? 0.0 : static_cast<double>(yv * (gv - gy) * f);
      // softmax's gradient rounded to T, then (scaled) rounded again: the first rounding's error grows by f
      const double first = Tol<T>::round * std::abs(ref) + Tol<T>::tiny * f;
      const double second = scaled ? Tol<T>::round * std::abs(ref) + Tol<T>::tiny : 0;
      cdx(i, dbl(dxf[static_cast<std::size_t>(i)]), ref,
          first + second + Tol<T>::acc * std::abs(yv) * (std::abs(gv) + gya) * f);
    }
  }
  EXPECT_TRUE(cy.result());
  EXPECT_TRUE(cdx.result());
}

/// softmax and log_softmax on their own, forward and backward, against fp64.
template <class T>
void check_softmax(i64 rows, i64 n, bool log, i64 grid_rows = 0) {
  std::mt19937 gen(static_cast<unsigned>(n * 17 + rows + log));
  SoftmaxCase<T> c(1, rows, n, MaskKind::none, 0, gen);
  poison(c.x, rows, n);
  const i64 N = rows * n, grid = grid_rows ? grid_rows : row_blocks(rows);
  const int threads = row_threads(n);
  const std::string what = label<T>(log ? "log_softmax" : "softmax", rows, n, grid);
  Buf<T> y(N, kOutputFill), dx(N, kOutputFill);
  launch(grid, threads, [&] { cu::softmax_forward_kernel<T>(c.x.data(), y.data(), rows, n, log); });
  launch(grid, threads, [&] { cu::softmax_backward_kernel<T>(y.data(), c.dy.data(), dx.data(), rows, n, log); });
  for (const Buf<T>* b : {&y, &dx, &c.x, &c.dy}) EXPECT_TRUE(b->guards_intact()) << what << ": a write outside a buffer";
  Compare cy(what + " y vs fp64"), cdx(what + " dx vs fp64");
  for (i64 r = 0; r < rows; ++r) {
    double m = -INFINITY;
    long double sum = 0;
    bool nan = false;
    for (i64 j = 0; j < n; ++j) {
      const double xv = dbl(c.x[static_cast<std::size_t>(r * n + j)]);
      nan = nan || std::isnan(xv);
      m = std::max(m, xv);
    }
    if (nan) m = NAN;
    for (i64 j = 0; j < n; ++j) sum += std::exp(static_cast<long double>(dbl(c.x[static_cast<std::size_t>(r * n + j)])) - m);
    for (i64 j = 0; j < n; ++j) {
      const i64 i = r * n + j;
      const double xv = dbl(c.x[static_cast<std::size_t>(i)]);
      const long double lx = xv;
      const double ref = static_cast<double>(log ? lx - m - std::log(sum) : std::exp(lx - m) / sum);
      const double scale = log ? std::abs(xv) + std::abs(m) + std::abs(static_cast<double>(std::log(sum)))
                               : (1 + std::abs(xv) + std::abs(m)) * std::abs(ref);
      cy(i, dbl(y[static_cast<std::size_t>(i)]), ref, Tol<T>::round * std::abs(ref) + Tol<T>::acc * scale + Tol<T>::tiny);
    }
    long double s = 0;
    double sa = 0;
    for (i64 j = 0; j < n; ++j) {
      const double gv = dbl(c.dy[static_cast<std::size_t>(r * n + j)]), yv = dbl(y[static_cast<std::size_t>(r * n + j)]);
      s += log ? static_cast<long double>(gv) : static_cast<long double>(gv) * yv;
      sa += std::abs(log ? gv : gv * yv);
    }
    for (i64 j = 0; j < n; ++j) {
      const i64 i = r * n + j;
      const double gv = dbl(c.dy[static_cast<std::size_t>(i)]), yv = dbl(y[static_cast<std::size_t>(i)]);
      const double ref = static_cast<double>(log ? gv - std::exp(static_cast<long double>(yv)) * s : yv * (gv - s));
      const double scale = log ? std::abs(gv) + std::exp(yv) * sa * (1 + std::abs(yv)) : std::abs(yv) * (std::abs(gv) + sa);
      cdx(i, dbl(dx[static_cast<std::size_t>(i)]), ref, Tol<T>::round * std::abs(ref) + Tol<T>::acc * scale + Tol<T>::tiny);
    }
  }
  EXPECT_TRUE(cy.result());
  EXPECT_TRUE(cdx.result());
}

// ---- add + LayerNorm -------------------------------------------------------------------------------------
/// add_layernorm_kernel against binary_kernel's add then norm_forward_kernel, bit for bit; both, and RMSNorm, vs fp64.
template <class T>
void check_add_layernorm(i64 rows, i64 n, i64 grid_rows = 0) {
  using A = acc_t<T>;
  std::mt19937 gen(static_cast<unsigned>(n * 29 + rows));
  std::normal_distribution<float> nd(0.f, 1.f);
  const i64 N = rows * n, grid = grid_rows ? grid_rows : row_blocks(rows);
  const int threads = row_threads(n);
  const std::string what = label<T>("add_layernorm", rows, n, grid);
  Buf<T> x(N, kInputFill), r(N, kInputFill), w(n, kInputFill), b(n, kInputFill);
  for (i64 i = 0; i < N; ++i) {
    x[static_cast<std::size_t>(i)] = scalar_cast<T>(nd(gen) * 2.f + 1.f);  // an offset: the centring matters
    r[static_cast<std::size_t>(i)] = scalar_cast<T>(nd(gen));
  }
  for (i64 j = 0; j < n; ++j) {
    w[static_cast<std::size_t>(j)] = scalar_cast<T>(1.f + 0.5f * nd(gen));
    b[static_cast<std::size_t>(j)] = scalar_cast<T>(0.5f * nd(gen));
  }
  if (rows >= 3) x[static_cast<std::size_t>(1 * n + n / 2)] = scalar_cast<T>(NAN);
  if (rows >= 4) r[static_cast<std::size_t>(3 * n)] = scalar_cast<T>(INFINITY);
  const A eps = static_cast<A>(1e-5);

  Buf<T> h(N, kOutputFill), y(N, kOutputFill), h2(N, kOutputFill), y2(N, kOutputFill), y3(N, kOutputFill);
  Buf<A> mean(rows, kOutputFill), rstd(rows, kOutputFill), mean2(rows, kOutputFill), rstd2(rows, kOutputFill),
      rstd3(rows, kOutputFill);
  launch(grid, threads, [&] {
    cu::add_layernorm_kernel<T>(x.data(), r.data(), w.data(), b.data(), h.data(), y.data(), mean.data(), rstd.data(),
                                rows, n, eps);
  });
  const cu::Geo g = cu::detail::make_geo(Shape({rows, n}), Shape({n, 1}), Shape({n, 1}));
  launch_elementwise(N, [&] { cu::binary_kernel<T>(tg::math::Binary::add, x.data(), r.data(), h2.data(), N, g); });
  launch(grid, threads, [&] {
    cu::norm_forward_kernel<T>(h2.data(), w.data(), b.data(), y2.data(), mean2.data(), rstd2.data(), rows, n, eps);
  });
  launch(grid, threads, [&] {
    cu::norm_forward_kernel<T>(h2.data(), w.data(), nullptr, y3.data(), nullptr, rstd3.data(), rows, n, eps);
  });
  EXPECT_TRUE(same_bits(h, h2, what + " h (fused vs add)"));
  EXPECT_TRUE(same_bits(y, y2, what + " y (fused vs add + layernorm)"));
  EXPECT_TRUE(same_bits(mean, mean2, what + " mean"));
  EXPECT_TRUE(same_bits(rstd, rstd2, what + " rstd"));
  for (const Buf<T>* p : {&x, &r, &w, &b, &h, &y, &h2, &y2, &y3})
    EXPECT_TRUE(p->guards_intact()) << what << ": a write outside a buffer";
  for (const Buf<A>* p : {&mean, &rstd, &mean2, &rstd2, &rstd3})
    EXPECT_TRUE(p->guards_intact()) << what << ": a write outside a statistics buffer";

  Compare ch(what + " h vs fp64"), cy(what + " y vs fp64"), cm(what + " mean vs fp64"), cr(what + " rstd vs fp64"),
      cq(what + " rmsnorm y vs fp64"), cq2(what + " rmsnorm rstd vs fp64");
  for (i64 i = 0; i < rows; ++i) {
    long double mu = 0, var = 0, ms = 0;
    double ma = 0;
    for (i64 j = 0; j < n; ++j) {
      const std::size_t k = static_cast<std::size_t>(i * n + j);
      const double ref = dbl(x[k]) + dbl(r[k]);
      ch(i * n + j, dbl(h[k]), ref, Tol<T>::round * std::abs(ref) + Tol<T>::tiny);
      const long double hv = dbl(h[k]);
      mu += hv;
      ma += std::abs(dbl(h[k]));
      ms += hv * hv;
    }
    mu /= n;
    ma /= static_cast<double>(n);
    for (i64 j = 0; j < n; ++j) {
      const long double d = dbl(h[static_cast<std::size_t>(i * n + j)]) - mu;
      var += d * d;
    }
    const double rs = static_cast<double>(1 / std::sqrt(var / n + static_cast<long double>(eps)));
    const double rq = static_cast<double>(1 / std::sqrt(ms / n + static_cast<long double>(eps)));
    cm(i, dbl(mean[static_cast<std::size_t>(i)]), static_cast<double>(mu), Tol<T>::acc * ma);
    cr(i, dbl(rstd[static_cast<std::size_t>(i)]), rs, Tol<T>::acc * rs * (1 + ma * rs));
    cq2(i, dbl(rstd3[static_cast<std::size_t>(i)]), rq, Tol<T>::acc * rq);
    for (i64 j = 0; j < n; ++j) {
      const std::size_t k = static_cast<std::size_t>(i * n + j);
      const double hv = dbl(h[k]), wv = dbl(w[static_cast<std::size_t>(j)]), bv = dbl(b[static_cast<std::size_t>(j)]);
      const double ref = static_cast<double>((hv - mu) * rs * wv + bv);
      const double scale = ((std::abs(hv) + ma) * rs * (1 + ma * rs)) * std::abs(wv) + std::abs(bv);
      cy(i * n + j, dbl(y[k]), ref, Tol<T>::round * std::abs(ref) + Tol<T>::acc * scale + Tol<T>::tiny);
      const double q = hv * rq * wv;
      cq(i * n + j, dbl(y3[k]), q, Tol<T>::round * std::abs(q) + Tol<T>::acc * std::abs(q) + Tol<T>::tiny);
    }
  }
  for (const Compare* c : {&ch, &cy, &cm, &cr, &cq, &cq2}) EXPECT_TRUE(c->result());
}

// ---- cases ------------------------------------------------------------------------------------------------
// Rows not whole 16-byte packs (1, 7, 771, 1100, 4097) and, misaligned, rows that would be (40, 100, 1000); the
// launcher's grid (one block per row) and shorter ones (each block takes several rows). Every block barrier and
// warp reduction is a meeting of real threads, so every form with every mask runs in fp32 (each form once in the
// other types) and the widest rows (512 threads) in one type per kernel.
struct Cover {
  bool every_form_and_mask;  // each form with each mask kind, or each form once
  bool widest;               // rows of 4097 (512 threads)
};

template <class T>
void scale_masked_softmax_cases(Cover c) {
  constexpr double ninf = -INFINITY;
  if (c.every_form_and_mask) {
    for (const int form : {0, 1, 3}) {
      check_scale_masked_softmax<T>(1, 3, 40, MaskKind::causal, ninf, form);
      check_scale_masked_softmax<T>(1, 3, 40, MaskKind::random, -30.0, form, 2);
      check_scale_masked_softmax<T>(1, 3, 40, MaskKind::rows, ninf, form);
    }
  } else {
    check_scale_masked_softmax<T>(1, 3, 40, MaskKind::causal, ninf, 0);
    check_scale_masked_softmax<T>(1, 3, 40, MaskKind::random, -30.0, 1, 2);
    check_scale_masked_softmax<T>(1, 3, 40, MaskKind::rows, ninf, 3);
  }
  check_scale_masked_softmax<T>(1, 3, 40, MaskKind::none, 0, 2, 1);
  check_scale_masked_softmax<T>(1, 5, 1, MaskKind::rows, -30.0, 1);
  check_scale_masked_softmax<T>(2, 3, 7, MaskKind::rows, ninf, 0, 4);
  check_scale_masked_softmax<T>(1, 3, 100, MaskKind::causal, ninf, 1);
  check_scale_masked_softmax<T>(1, 2, 771, MaskKind::random, -30.0, 0, 1);
  check_scale_masked_softmax<T>(1, 1, 1000, MaskKind::none, 0, 2);
  check_scale_masked_softmax<T>(1, 1, 1100, MaskKind::causal, ninf, 3);  // the last row of a square causal mask
  if (c.widest) check_scale_masked_softmax<T>(1, 2, 4097, MaskKind::random, -30.0, 1, 1);
}
template <class T>
void softmax_cases(Cover c) {
  for (const bool log : {false, true}) {
    check_softmax<T>(5, 1, log);
    check_softmax<T>(5, 7, log, 2);
    check_softmax<T>(3, 100, log);
    check_softmax<T>(1, 771, log);
    if (c.widest) check_softmax<T>(log ? 1 : 2, 4097, log, 1);
  }
}
template <class T>
void add_layernorm_cases(Cover c) {
  check_add_layernorm<T>(3, 1);
  check_add_layernorm<T>(4, 7, 2);
  check_add_layernorm<T>(3, 100);
  check_add_layernorm<T>(3, 771, 2);
  check_add_layernorm<T>(1, 1000);
  if (c.widest) check_add_layernorm<T>(2, 4097, 1);
}

TEST(SoftmaxEmulated, ScaleMaskedSoftmaxEqualsTheSeparateOpsBitForBit) {
  scale_masked_softmax_cases<double>({false, false});
  scale_masked_softmax_cases<float>({true, true});
  scale_masked_softmax_cases<bf16>({false, false});
  scale_masked_softmax_cases<fp16>({false, false});
}

TEST(SoftmaxEmulated, SoftmaxAndLogSoftmaxMatchDouble) {
  softmax_cases<double>({false, false});
  softmax_cases<float>({false, true});
  softmax_cases<bf16>({false, false});
  softmax_cases<fp16>({false, false});
}

TEST(SoftmaxEmulated, AddLayerNormEqualsAddThenLayerNormBitForBit) {
  add_layernorm_cases<double>({false, true});
  add_layernorm_cases<float>({false, false});
  add_layernorm_cases<bf16>({false, false});
  add_layernorm_cases<fp16>({false, false});
}

// A warp running behind the others at every barrier (the first, the last): the block reductions' shared slots must
// be fenced on both sides.
TEST(SoftmaxEmulated, LateWarpSchedule) {
  for (const int late : {0, 31}) {
    g_late_warp = late;
    check_scale_masked_softmax<float>(1, 3, 200, MaskKind::causal, -INFINITY, 1);
    check_softmax<float>(3, 200, false, 1);
    check_add_layernorm<float>(3, 200, 2);
    g_late_warp = -1;
  }
}

}  // namespace

// The row kernels of every GPU training step run on the CPU: the LayerNorm / RMSNorm forward and the fused residual
// add + LayerNorm over 16-byte packs (backends/cuda/norm_forward.cuh, Note [norm forward in packs]), the one-pass
// norm backward and the dweight / dbias column sums (norm_backward.cuh, Note [one-pass norm backward]; the
// two-kernel path's column sums too), and the packed cross-entropy forward and backward (cross_entropy_packed.cuh,
// Note [cross-entropy in one pass over 16-byte packs]), and the embedding backward's sort of the positions by id
// and its row sums (embedding_order.cuh, Note [embedding rows sorted on the device]). Their bodies are compiled
// unchanged as host code (TG_ROWS_EMULATED leaves out norm_forward.cuh's CUDA side), each block as real threads
// (blocks one after another), on the grids and block sizes the launchers in nn.cu and add_layernorm.cu would choose
// (4 blocks per SM of an H100's 132 for the one-pass backward), and on shorter grids, so that each warp or block
// takes several rows.
// Emulated: threadIdx / blockIdx / blockDim / gridDim; __syncthreads and __syncwarp as barriers; __shfl_xor_sync
// through a warp's slots; the dynamic shared array as a buffer filled with NaN before each block, and the static
// __shared__ arrays as function-local statics (one per kernel instantiation, which the running block's threads
// share); warp_sum, acc_t and TG_GRID_STRIDE as common.cuh defines them; exp / log / sqrt as the host's float and
// double functions. Every output element is compared with a double-precision computation from the same stored
// inputs (tolerances below); outputs start as a pattern no kernel would write, the bytes around every buffer must
// stay untouched, and what lies past the inputs' rows (padding columns, guards) is NaN, so a read past the end
// shows. Also checked: a NaN or infinite input makes its own row (its dweight / dbias column) non-finite and
// nothing else; ignored targets give a zero loss and zero gradient rows whatever their logits; rows fewer than a
// block's warps; the fused add + LayerNorm equals the add then the LayerNorm bit for bit, and with x and r off 16
// bytes too; and a late-warp schedule (block_barrier) that shows a missing barrier around shared memory.
// What this cannot show: speed; shared-memory races in general (loads and stores are plain and not observed: the
// threads interleave as the host schedules them, plus the one forced schedule); the device's own rounding of expf
// and logf (within 2 ulps: the tolerances allow for it); and a compiler's code for the device (nvcc's, not g++'s).
// gpu-check runs the same kernels on a GPU (CudaNorm.*, the op database's CUDA-vs-CPU entries).
//   ctest -R RowsEmulated
#include <gtest/gtest.h>
#include <math.h>  // the global float overloads of exp, log and sqrt, which the kernels call as CUDA's

#include <algorithm>
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

#define TG_ROWS_EMULATED 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x)
#define __shared__

#include "simt_emulation.hpp"

// GCC 12 at -O2 merges load_norm_pack's two arms (a 16-byte pack load, and an element-by-element copy of the same
// bytes) into one load that keeps the pack's 16-byte alignment, then vectorizes it into aligned SSE accesses: the
// kernel's misaligned x and r (add_layernorm's element-by-element path) then fault on the host. nvcc keeps the arms
// apart (the PTX of norm_forward_packed_kernel<T, true> has both the vector and the scalar loads), so the kernels
// are compiled here without the host's vectorizers.
#pragma GCC push_options
#pragma GCC optimize("no-tree-vectorize")

// common.cuh's accumulation type and warp reduction
namespace tg::backend::cuda::detail {
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
template <class A>
A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
}  // namespace tg::backend::cuda::detail

#include "norm_forward.cuh"  // (its #pragma unroll: -Wno-unknown-pragmas)

// common.cuh's grid-stride loop
#define TG_GRID_STRIDE(i, n)                                                                       \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)

namespace tg::backend::cuda {
using detail::acc_t;
namespace {
constexpr std::size_t kSmemBytes = 48 * 1024;     // the one-pass backward's limit (layernorm_backward)
alignas(16) unsigned char norm_smem[kSmemBytes];  // the fused backward's extern __shared__ array
#include "norm_backward.cuh"
#undef __shared__
#define __shared__ static  // one array per kernel instantiation, shared by the threads of the running block
#include "cross_entropy_packed.cuh"
#include "embedding_order.cuh"
#undef __shared__
}  // namespace
}  // namespace tg::backend::cuda
#pragma GCC pop_options

namespace {

namespace cu = tg::backend::cuda;
using cu::acc_t;
using cu::kSmemBytes;
using tg::bf16;
using tg::fp16;
using tg::scalar_cast;
using i64 = std::int64_t;

// ---- launches ---------------------------------------------------------------------------------------------
/// Runs kernel() as `threads` threads per block over `grid` blocks (launch_threads); dynamic shared memory is NaN
/// when each block starts, as uninitialised memory may be.
template <class F>
void launch(i64 grid, int threads, F kernel) {
  if (threads < 32 || threads % 32 != 0) emu_fail("bad launch shape");
  launch_threads(grid, threads, kernel, [] { std::memset(cu::norm_smem, 0xff, sizeof cu::norm_smem); });
}

// The launchers' shapes (common.cuh's row_threads and grid_for, nn.cu's row_blocks and the one-pass backward's
// grid, which is at most 4 blocks per SM: an H100 SXM's 132 unless a case says otherwise).
int row_threads(i64 n) {
  if (n <= 64) return 32;
  if (n <= 256) return 64;
  if (n <= 1024) return 128;
  if (n <= 4096) return 256;
  return 512;
}
i64 grid_for(i64 n, int threads = 256) { return std::clamp<i64>((n + threads - 1) / threads, 1, 65535LL * 16); }
i64 row_blocks(i64 rows) { return std::min<i64>(rows, 65535LL * 8); }
constexpr int kSmCount = 132;

// ---- buffers ----------------------------------------------------------------------------------------------
constexpr std::size_t kGuardBytes = 256;
constexpr unsigned char kInputFill = 0xff;   // NaN in every floating type: what a read past the data finds
constexpr unsigned char kOutputFill = 0x5a;  // 1.5e16 (fp32), 219 (bf16 0x5a5a)...: never a right answer

/// n elements 16-byte aligned (or `shift` elements past an aligned address), with guard bytes before and after.
template <class X>
class Buf {
 public:
  explicit Buf(std::size_t n, unsigned char fill, std::size_t shift = 0)
      : n_(n), fill_(fill), store_((kGuardBytes * 2 + (n + shift) * sizeof(X)) / 16 + 1) {
    std::memset(store_.data(), fill, store_.size() * 16);
    p_ = reinterpret_cast<X*>(reinterpret_cast<unsigned char*>(store_.data()) + kGuardBytes) + shift;
  }
  X* data() { return p_; }
  const X* data() const { return p_; }
  X& operator[](std::size_t i) { return p_[i]; }
  const X& operator[](std::size_t i) const { return p_[i]; }
  /// Whether every byte outside [data(), data() + n) still holds the fill.
  bool guards_intact() const {
    const auto* all = reinterpret_cast<const unsigned char*>(store_.data());
    const auto* b = reinterpret_cast<const unsigned char*>(p_);
    const auto* e = b + n_ * sizeof(X);
    for (const auto* q = all; q < all + store_.size() * 16; ++q)
      if ((q < b || q >= e) && *q != fill_) return false;
    return true;
  }

 private:
  struct alignas(16) Chunk {
    unsigned char b[16];
  };
  std::size_t n_;
  unsigned char fill_;
  std::vector<Chunk> store_;
  X* p_;
};

template <class X>
bool same_bits(const X& a, const X& b) {
  return std::memcmp(&a, &b, sizeof(X)) == 0;
}
/// What an output element holds before a kernel writes it.
template <class X>
X unwritten() {
  unsigned char b[sizeof(X)];
  std::memset(b, kOutputFill, sizeof b);
  X v{};
  std::memcpy(&v, b, sizeof v);
  return v;
}
template <class X>
double dbl(X v) {
  return scalar_cast<double>(v);
}

// ---- tolerances -------------------------------------------------------------------------------------------
// An element must satisfy |got − ref| <= round·|ref| + acc·scale: `round` is the storage type's unit roundoff (the
// final rounding to T), `acc` the relative error allowed for the float (double) arithmetic before it, `scale` the
// size of the terms that produced the element (stated with each check), `tiny` half T's smallest subnormal step
// (fp16 gradients of a 50257-way softmax are subnormal). acc is 1e-6 for fp32 arithmetic (8 ulps) and 1e-14 for
// fp64 (90 ulps): the sums here add a few dozen terms in sequence per thread, then a tree, and the device's expf /
// logf are within 2 ulps. The emulated errors stay under 0.15 of these allowances. For 16-bit storage the final
// rounding dominates (its errors reach 0.99 of round·|ref|, as a correctly rounded result does); for fp32 storage
// the arithmetic does.
template <class T>
struct Tol;
template <>
struct Tol<double> {
  static constexpr double round = 0x1p-53, acc = 1e-14, tiny = 0;  // (2^-1075: not a double)
  static constexpr const char* name = "fp64";
};
template <>
struct Tol<float> {
  static constexpr double round = 0x1p-24, acc = 1e-6, tiny = 0x1p-150;
  static constexpr const char* name = "fp32";
};
template <>
struct Tol<fp16> {
  static constexpr double round = 0x1p-11, acc = 1e-6, tiny = 0x1p-25;
  static constexpr const char* name = "fp16";
};
template <>
struct Tol<bf16> {
  static constexpr double round = 0x1p-8, acc = 1e-6, tiny = 0x1p-134;
  static constexpr const char* name = "bf16";
};

/// The worst error of one output over a case, as a fraction of what is allowed; a NaN or infinite reference must be
/// matched exactly (NaN by NaN, an infinity by the same infinity), a finite one by a finite value within tolerance.
class Compare {
 public:
  explicit Compare(const char* what) : what_(what) {}
  void operator()(i64 i, double got, double ref, double allowed) {
    bool ok;
    if (std::isnan(ref)) {
      ok = std::isnan(got);
    } else if (std::isinf(ref)) {
      ok = got == ref;
    } else {
      const double e = std::abs(got - ref);
      ok = std::isfinite(got) && e <= allowed;
      worst_ = std::max(worst_, std::isfinite(got) ? (allowed > 0 ? e / allowed : (e > 0 ? INFINITY : 0.0)) : INFINITY);
    }
    if (!ok && bad_++ == 0) {
      first_ = i;
      got_ = got;
      ref_ = ref;
      allowed_ = allowed;
    }
  }
  bool ok() const { return bad_ == 0; }
  std::string report() const {
    char s[256];
    if (bad_ == 0)
      std::snprintf(s, sizeof s, "%s %.2f", what_, worst_);
    else
      std::snprintf(s, sizeof s, "%s: %ld bad, first at %lld: got %.9g want %.9g (allowed %.3g)", what_, bad_,
                    static_cast<long long>(first_), got_, ref_, allowed_);
    return s;
  }

 private:
  const char* what_;
  double worst_ = 0, got_ = 0, ref_ = 0, allowed_ = 0;
  long bad_ = 0;
  i64 first_ = -1;
};

/// Prints one line per case (the worst error of each output over its allowance) and fails the test on any bad one.
void conclude(const std::string& label, std::initializer_list<const Compare*> outputs,
              std::initializer_list<std::pair<const char*, bool>> conditions) {
  bool ok = true;
  std::string line;
  for (const Compare* c : outputs) {
    ok = ok && c->ok();
    line += ' ';
    line += c->report();
  }
  if (g_late_warp >= 0) line += g_late_warp == 0 ? " (warp 0 late)" : " (the last warp late)";
  for (const auto& [what, holds] : conditions)
    if (!holds) {
      ok = false;
      line += " NOT ";
      line += what;
    }
  std::printf("%s %s:%s\n", ok ? "ok  " : "FAIL", label.c_str(), line.c_str());
  std::fflush(stdout);
  EXPECT_TRUE(ok) << label << ":" << line;
}

template <class T>
T sample(std::mt19937& rng, double mean, double sd) {
  std::normal_distribution<double> nd(mean, sd);
  return scalar_cast<T>(nd(rng));
}

// ---- LayerNorm / RMSNorm forward (norm_forward.cuh) --------------------------------------------------------
enum class Norm { layer, layer_no_bias, rms };
const char* norm_name(Norm k) {
  return k == Norm::layer ? "layernorm" : k == Norm::rms ? "rmsnorm" : "layernorm-nobias";
}
constexpr double kEps = 1e-5;

/// The LayerNorm (RMSNorm) of rows x n values in double, as the CPU kernels define it: mean, rstd and y.
struct NormRef {
  std::vector<double> mean, rstd, y, scale;  // scale: |x − mean|·rstd·|w| + |b| + max|x|·rstd·|w| per element
};
template <class T>
NormRef norm_reference(const T* x, const T* w, const T* b, bool centre, i64 rows, i64 n) {
  NormRef r;
  r.mean.resize(rows), r.rstd.resize(rows), r.y.resize(rows * n), r.scale.resize(rows * n);
  for (i64 i = 0; i < rows; ++i) {
    double s = 0, mx = 0;
    for (i64 j = 0; j < n; ++j) s += dbl(x[i * n + j]), mx = std::max(mx, std::abs(dbl(x[i * n + j])));
    const double mu = centre ? s / n : 0.0;
    double v = 0;
    for (i64 j = 0; j < n; ++j) v += (dbl(x[i * n + j]) - mu) * (dbl(x[i * n + j]) - mu);
    const double rs = 1.0 / std::sqrt(v / n + kEps);
    r.mean[i] = mu, r.rstd[i] = rs;
    const double spread = std::isfinite(mx * rs) ? mx * rs : 0.0;  // the mean's rounding, scaled as x̂ is
    for (i64 j = 0; j < n; ++j) {
      const double xh = (dbl(x[i * n + j]) - mu) * rs, bj = b ? dbl(b[j]) : 0.0;
      r.y[i * n + j] = xh * dbl(w[j]) + bj;
      r.scale[i * n + j] = (std::abs(xh) + spread) * std::abs(dbl(w[j])) + std::abs(bj);
    }
  }
  return r;
}

/// One launch of norm_forward_packed_kernel<T, false> as layernorm_forward / rmsnorm_forward make it (or on a
/// grid of `grid` blocks); rows 2 and 4 get a NaN and an infinity when `nonfinite`.
template <class T>
void norm_forward_case(Norm kind, i64 rows, i64 n, bool nonfinite = false, i64 grid = 0, unsigned seed = 1) {
  using A = acc_t<T>;
  using P = Tol<T>;
  std::mt19937 rng(seed + static_cast<unsigned>(n * 7 + rows));
  const std::size_t N = static_cast<std::size_t>(rows * n);
  Buf<T> x(N, kInputFill), w(n, kInputFill), b(n, kInputFill), y(N, kOutputFill);
  Buf<A> mean(rows, kOutputFill), rstd(rows, kOutputFill);
  for (std::size_t i = 0; i < N; ++i) x[i] = sample<T>(rng, 3.0, 2.0);  // a mean far from 0: centring matters
  for (i64 j = 0; j < n; ++j) w[j] = sample<T>(rng, 1.0, 0.3), b[j] = sample<T>(rng, 0.0, 0.5);
  if (nonfinite && rows > 4) {
    x[2 * n + 5] = scalar_cast<T>(NAN);
    x[4 * n + n - 1] = scalar_cast<T>(INFINITY);
  }
  const bool centre = kind != Norm::rms, bias = kind == Norm::layer;
  T* bp = bias ? b.data() : nullptr;
  A* mp = centre ? mean.data() : nullptr;
  // the launchers' test: these rows take the packed kernel
  const bool packed = centre ? cu::detail::norm_rows_in_packs<T>(n, {x.data(), w.data(), bp, y.data()})
                             : cu::detail::norm_rows_in_packs<T>(n, {x.data(), w.data(), y.data()});
  const i64 blocks = grid ? grid
                          : std::clamp<i64>((rows + cu::detail::kNormRowWarps - 1) / cu::detail::kNormRowWarps, 1,
                                            cu::detail::kMaxNormRowBlocks);
  launch(blocks, 32 * cu::detail::kNormRowWarps, [&] {
    cu::detail::norm_forward_packed_kernel<T, false>(x.data(), nullptr, true, w.data(), bp, nullptr, y.data(), mp,
                                                     rstd.data(), rows, n, static_cast<A>(kEps));
  });
  const NormRef ref = norm_reference(x.data(), w.data(), bp, centre, rows, n);
  Compare cy("y"), cm("mean"), cr("rstd");
  for (i64 i = 0; i < rows; ++i) {
    double mx = 0;
    for (i64 j = 0; j < n; ++j) mx = std::max(mx, std::abs(dbl(x[i * n + j])));
    if (centre) cm(i, dbl(mean[i]), ref.mean[i], P::acc * mx);
    cr(i, dbl(rstd[i]), ref.rstd[i], P::acc * ref.rstd[i]);
    for (i64 j = 0; j < n; ++j) {
      const i64 e = i * n + j;
      cy(e, dbl(y[e]), ref.y[e], P::round * std::abs(ref.y[e]) + P::acc * ref.scale[e]);
    }
  }
  char label[160];
  std::snprintf(label, sizeof label, "%s %s forward rows=%lld n=%lld grid=%lld%s", P::name, norm_name(kind),
                static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(blocks),
                nonfinite ? " nan/inf rows" : "");
  bool mean_untouched = true;  // RMSNorm: no mean written
  for (i64 i = 0; i < rows && !centre; ++i) mean_untouched = mean_untouched && same_bits(mean[i], unwritten<A>());
  conclude(label, {&cy, &cm, &cr},
           {{"the launcher's packed path", packed},
            {"no mean written for RMSNorm", mean_untouched},
            {"guards intact", y.guards_intact() && mean.guards_intact() && rstd.guards_intact() && x.guards_intact()}});
}

/// add_layernorm's packed path: h = x + r rounded to T, then the LayerNorm of h. The same launch with x and r one
/// element off 16 bytes (read element by element), and `layernorm` of the h it wrote (the unfused pair), must
/// produce the same bits; y is also checked against the double LayerNorm of h.
template <class T>
void add_layernorm_case(i64 rows, i64 n, unsigned seed = 2) {
  using A = acc_t<T>;
  using E = std::conditional_t<std::is_same_v<T, double>, double, float>;
  using P = Tol<T>;
  std::mt19937 rng(seed + static_cast<unsigned>(n));
  const std::size_t N = static_cast<std::size_t>(rows * n);
  Buf<T> x(N, kInputFill), r(N, kInputFill), xs(N, kInputFill, 1), rs(N, kInputFill, 1), w(n, kInputFill),
      b(n, kInputFill);
  for (std::size_t i = 0; i < N; ++i) {
    x[i] = xs[i] = sample<T>(rng, 0.0, 1.0);
    r[i] = rs[i] = sample<T>(rng, 2.0, 3.0);  // the residual stream
  }
  for (i64 j = 0; j < n; ++j) w[j] = sample<T>(rng, 1.0, 0.3), b[j] = sample<T>(rng, 0.0, 0.5);
  struct Out {
    Buf<T> h, y;
    Buf<A> mean, rstd;
    explicit Out(std::size_t N, i64 rows)
        : h(N, kOutputFill), y(N, kOutputFill), mean(rows, kOutputFill), rstd(rows, kOutputFill) {}
  } fused(N, rows), shifted(N, rows), unfused(N, rows);
  const i64 blocks = std::clamp<i64>((rows + cu::detail::kNormRowWarps - 1) / cu::detail::kNormRowWarps, 1,
                                     cu::detail::kMaxNormRowBlocks);
  const int threads = 32 * cu::detail::kNormRowWarps;
  // add_layernorm_forward's tests: the path by h, y, w, b; x and r read in packs only when aligned
  const bool packed = cu::detail::norm_rows_in_packs<T>(n, {fused.h.data(), w.data(), b.data(), fused.y.data()});
  const bool xr_aligned = cu::detail::norm_rows_in_packs<T>(n, {x.data(), r.data()});
  const bool xr_shifted = cu::detail::norm_rows_in_packs<T>(n, {xs.data(), rs.data()});
  launch(blocks, threads, [&] {
    cu::detail::norm_forward_packed_kernel<T, true>(x.data(), r.data(), xr_aligned, w.data(), b.data(), fused.h.data(),
                                                    fused.y.data(), fused.mean.data(), fused.rstd.data(), rows, n,
                                                    static_cast<A>(kEps));
  });
  launch(blocks, threads, [&] {
    cu::detail::norm_forward_packed_kernel<T, true>(xs.data(), rs.data(), xr_shifted, w.data(), b.data(),
                                                    shifted.h.data(), shifted.y.data(), shifted.mean.data(),
                                                    shifted.rstd.data(), rows, n, static_cast<A>(kEps));
  });
  launch(blocks, threads, [&] {
    cu::detail::norm_forward_packed_kernel<T, false>(fused.h.data(), nullptr, true, w.data(), b.data(), nullptr,
                                                     unfused.y.data(), unfused.mean.data(), unfused.rstd.data(), rows,
                                                     n, static_cast<A>(kEps));
  });
  bool h_exact = true, same = true;
  for (std::size_t i = 0; i < N; ++i) {
    h_exact = h_exact && same_bits(fused.h[i], scalar_cast<T>(scalar_cast<E>(x[i]) + scalar_cast<E>(r[i])));
    same = same && same_bits(shifted.h[i], fused.h[i]) && same_bits(shifted.y[i], fused.y[i]) &&
           same_bits(unfused.y[i], fused.y[i]);
  }
  for (i64 i = 0; i < rows; ++i)
    same = same && same_bits(shifted.mean[i], fused.mean[i]) && same_bits(shifted.rstd[i], fused.rstd[i]) &&
           same_bits(unfused.mean[i], fused.mean[i]) && same_bits(unfused.rstd[i], fused.rstd[i]);
  const NormRef ref = norm_reference(fused.h.data(), w.data(), b.data(), true, rows, n);
  Compare cy("y");
  for (std::size_t e = 0; e < N; ++e)
    cy(static_cast<i64>(e), dbl(fused.y[e]), ref.y[e], P::round * std::abs(ref.y[e]) + P::acc * ref.scale[e]);
  bool guards = true;
  for (Out* o : {&fused, &shifted, &unfused})
    guards =
        guards && o->h.guards_intact() && o->y.guards_intact() && o->mean.guards_intact() && o->rstd.guards_intact();
  char label[160];
  std::snprintf(label, sizeof label, "%s add+layernorm forward rows=%lld n=%lld grid=%lld", P::name,
                static_cast<long long>(rows), static_cast<long long>(n), static_cast<long long>(blocks));
  conclude(label, {&cy},
           {{"the launcher's packed path", packed && xr_aligned && !xr_shifted},
            {"h = x + r rounded to T", h_exact},
            {"shifted x, r and the unfused pair give the same bits", same},
            {"guards intact", guards && unfused.h.guards_intact()}});
}

// ---- LayerNorm / RMSNorm backward (norm_backward.cuh) ------------------------------------------------------
struct Grads {
  bool dx = true, dw = true, db = true;
};

/// dx, dw, db in double from the stored x, w, dy and the mean / rstd the forward saved, with the scale of each
/// element's terms (dx: rstd·(|g| + mean|g| + |x̂|·mean|g∘x̂|); dw, db: Σ over rows of |dy∘x̂|, |dy|).
struct BackRef {
  std::vector<double> dx, dx_scale, dw, dw_scale, db, db_scale;
};
template <class T, class A>
BackRef norm_backward_reference(const T* x, const T* w, const A* mean, const A* rstd, const T* dy, i64 rows, i64 n) {
  BackRef r;
  r.dx.resize(rows * n), r.dx_scale.resize(rows * n);
  r.dw.assign(n, 0), r.dw_scale.assign(n, 0), r.db.assign(n, 0), r.db_scale.assign(n, 0);
  for (i64 i = 0; i < rows; ++i) {
    const double mu = mean ? dbl(mean[i]) : 0.0, rs = dbl(rstd[i]);
    double mg = 0, mgx = 0, ag = 0, agx = 0;
    for (i64 j = 0; j < n; ++j) {
      const double xh = (dbl(x[i * n + j]) - mu) * rs, g = dbl(dy[i * n + j]) * dbl(w[j]);
      mg += g, mgx += g * xh, ag += std::abs(g), agx += std::abs(g * xh);
      r.dw[j] += dbl(dy[i * n + j]) * xh, r.dw_scale[j] += std::abs(dbl(dy[i * n + j]) * xh);
      r.db[j] += dbl(dy[i * n + j]), r.db_scale[j] += std::abs(dbl(dy[i * n + j]));
    }
    mg = mean ? mg / n : 0.0, mgx /= n, ag /= n, agx /= n;
    for (i64 j = 0; j < n; ++j) {
      const double xh = (dbl(x[i * n + j]) - mu) * rs, g = dbl(dy[i * n + j]) * dbl(w[j]);
      r.dx[i * n + j] = rs * (g - mg - xh * mgx);
      r.dx_scale[i * n + j] = rs * (std::abs(g) + ag + std::abs(xh) * agx);
    }
  }
  return r;
}

template <class T>
struct BackInputs {
  using A = acc_t<T>;
  Buf<T> x, w, dy;
  Buf<A> mean, rstd;
  BackInputs(i64 rows, i64 n, bool centre, bool nonfinite, unsigned seed)
      : x(rows * n, kInputFill),
        w(n, kInputFill),
        dy(rows * n, kInputFill),
        mean(rows, kInputFill),
        rstd(rows, kInputFill) {
    std::mt19937 rng(seed);
    for (i64 e = 0; e < rows * n; ++e) x[e] = sample<T>(rng, 1.0, 2.0), dy[e] = sample<T>(rng, 0.0, 1.0);
    for (i64 j = 0; j < n; ++j) w[j] = sample<T>(rng, 1.0, 0.3);
    // the forward's saved statistics, as it would store them
    const NormRef f = norm_reference(x.data(), w.data(), static_cast<const T*>(nullptr), centre, rows, n);
    for (i64 i = 0; i < rows; ++i) mean[i] = static_cast<A>(f.mean[i]), rstd[i] = static_cast<A>(f.rstd[i]);
    if (nonfinite && rows > 2) dy[2 * n + n / 2] = scalar_cast<T>(NAN);  // row 2 and column n / 2
  }
};

/// layernorm_backward's one-pass path: norm_backward_fused_kernel on its grid (at most 4 blocks per SM of
/// `sms`), then norm_backward_dwdb_final_kernel over the blocks' partial sums.
template <class T>
void norm_backward_case(bool centre, i64 rows, i64 n, Grads out = {}, int sms = kSmCount, bool nonfinite = false,
                        unsigned seed = 3) {
  using A = acc_t<T>;
  using P = Tol<T>;
  constexpr int V = 16 / sizeof(T);
  BackInputs<T> in(rows, n, centre, nonfinite, seed + static_cast<unsigned>(n + rows));
  Buf<T> dx(rows * n, kOutputFill), dw(n, kOutputFill), db(n, kOutputFill);
  const A* mp = centre ? in.mean.data() : nullptr;
  T* dxp = out.dx ? dx.data() : nullptr;
  T* dwp = out.dw ? dw.data() : nullptr;
  T* dbp = out.db ? db.data() : nullptr;
  // layernorm_backward's test and grid
  const std::size_t smem = static_cast<std::size_t>(cu::kNormWarps) * 2 * static_cast<std::size_t>(n) * sizeof(A);
  const bool one_pass = (dwp || dbp) && rows > 0 && n % V == 0 && smem <= kSmemBytes;
  const i64 blocks = std::clamp<i64>((rows + cu::kNormWarps - 1) / cu::kNormWarps, 1, 4 * sms);
  Buf<A> pw(blocks * n, kInputFill), pb(blocks * n, kInputFill);  // the workspace: garbage until written
  launch(blocks, 32 * cu::kNormWarps, [&] {
    cu::norm_backward_fused_kernel<T>(in.x.data(), in.w.data(), mp, in.rstd.data(), in.dy.data(), dxp, pw.data(),
                                      pb.data(), rows, n);
  });
  launch(grid_for(n), 256, [&] { cu::norm_backward_dwdb_final_kernel<T>(pw.data(), pb.data(), dwp, dbp, n, blocks); });
  const BackRef ref = norm_backward_reference(in.x.data(), in.w.data(), mp, in.rstd.data(), in.dy.data(), rows, n);
  Compare cx("dx"), cw("dw"), cb("db");
  bool untouched = true;  // outputs not asked for stay as they were
  for (i64 e = 0; e < rows * n; ++e) {
    if (out.dx)
      cx(e, dbl(dx[e]), ref.dx[e], P::round * std::abs(ref.dx[e]) + P::acc * ref.dx_scale[e]);
    else
      untouched = untouched && same_bits(dx[e], unwritten<T>());
  }
  for (i64 j = 0; j < n; ++j) {
    if (out.dw)
      cw(j, dbl(dw[j]), ref.dw[j], P::round * std::abs(ref.dw[j]) + P::acc * ref.dw_scale[j]);
    else
      untouched = untouched && same_bits(dw[j], unwritten<T>());
    if (out.db)
      cb(j, dbl(db[j]), ref.db[j], P::round * std::abs(ref.db[j]) + P::acc * ref.db_scale[j]);
    else
      untouched = untouched && same_bits(db[j], unwritten<T>());
  }
  char label[200];
  std::snprintf(label, sizeof label, "%s %s backward one-pass rows=%lld n=%lld grid=%lld%s%s%s%s", P::name,
                centre ? "layernorm" : "rmsnorm", static_cast<long long>(rows), static_cast<long long>(n),
                static_cast<long long>(blocks), out.dx ? " dx" : "", out.dw ? " dw" : "", out.db ? " db" : "",
                nonfinite ? " nan dy" : "");
  conclude(label, {&cx, &cw, &cb},
           {{"the launcher's one-pass path", one_pass},
            {"outputs not asked for untouched", untouched},
            {"guards intact", dx.guards_intact() && dw.guards_intact() && db.guards_intact() && pw.guards_intact() &&
                                  pb.guards_intact() && in.x.guards_intact() && in.dy.guards_intact()}});
}

/// layernorm_backward's two-kernel dw / db (rows that are not whole packs, or too wide for the one-pass shared
/// memory): norm_backward_dwdb_partial_kernel over the launcher's chunks of rows, then the final kernel.
template <class T>
void norm_columns_case(bool centre, i64 rows, i64 n, unsigned seed = 4) {
  using A = acc_t<T>;
  using P = Tol<T>;
  BackInputs<T> in(rows, n, centre, false, seed + static_cast<unsigned>(n));
  Buf<T> dw(n, kOutputFill), db(n, kOutputFill);
  const A* mp = centre ? in.mean.data() : nullptr;
  const i64 want = std::max<i64>(1, (i64{1} << 17) / n);
  i64 chunks = std::clamp<i64>(want, 1, std::max<i64>(1, rows / 16));
  const i64 chunk_len = (rows + chunks - 1) / chunks;
  chunks = (rows + chunk_len - 1) / chunk_len;
  Buf<A> pw(chunks * n, kInputFill), pb(chunks * n, kInputFill);
  launch(grid_for(chunks * n), 256, [&] {
    cu::norm_backward_dwdb_partial_kernel<T>(in.x.data(), mp, in.rstd.data(), in.dy.data(), pw.data(), pb.data(), rows,
                                             n, chunks, chunk_len);
  });
  launch(grid_for(n), 256,
         [&] { cu::norm_backward_dwdb_final_kernel<T>(pw.data(), pb.data(), dw.data(), db.data(), n, chunks); });
  const BackRef ref = norm_backward_reference(in.x.data(), in.w.data(), mp, in.rstd.data(), in.dy.data(), rows, n);
  Compare cw("dw"), cb("db");
  for (i64 j = 0; j < n; ++j) {
    cw(j, dbl(dw[j]), ref.dw[j], P::round * std::abs(ref.dw[j]) + P::acc * ref.dw_scale[j]);
    cb(j, dbl(db[j]), ref.db[j], P::round * std::abs(ref.db[j]) + P::acc * ref.db_scale[j]);
  }
  char label[160];
  std::snprintf(label, sizeof label, "%s %s backward two-kernel dw/db rows=%lld n=%lld chunks=%lld", P::name,
                centre ? "layernorm" : "rmsnorm", static_cast<long long>(rows), static_cast<long long>(n),
                static_cast<long long>(chunks));
  conclude(label, {&cw, &cb}, {{"guards intact", dw.guards_intact() && db.guards_intact() && pw.guards_intact()}});
}

// ---- cross-entropy (cross_entropy_packed.cuh) --------------------------------------------------------------
constexpr i64 kIgnore = -100;

/// Logits of rows x V in rows ld apart (padding columns and guards NaN), targets (row 0: class 0, row 1: the
/// last class, row 2: ignored, others random) and, with `edge`, the rows the kernels must get right: row 3 a
/// NaN logit, row 4 a +inf, row 5 all −inf, row 6 every other logit −inf, row 7 NaN but ignored, row 8 all large.
template <class T>
struct Logits {
  Buf<T> x;
  std::vector<i64> t;
  Logits(i64 rows, i64 V, i64 ld, bool edge, unsigned seed) : x(rows * ld, kInputFill), t(rows) {
    std::mt19937 rng(seed);
    for (i64 i = 0; i < rows; ++i)
      for (i64 j = 0; j < V; ++j) x[i * ld + j] = sample<T>(rng, 0.0, 2.0);
    std::uniform_int_distribution<i64> cls(0, V - 1);
    for (i64 i = 0; i < rows; ++i) t[i] = i == 0 ? 0 : i == 1 ? V - 1 : i == 2 ? kIgnore : cls(rng);
    if (rows > 1) x[ld + V - 1] = scalar_cast<T>(8.0);  // row 1's last logit (its target) carries its loss
    if (!edge) return;
    if (rows < 9) emu_fail("the edge rows need 9 rows");
    const T inf = scalar_cast<T>(INFINITY), nan = scalar_cast<T>(NAN);
    x[3 * ld + V / 3] = nan;
    x[4 * ld + V / 2] = inf;
    for (i64 j = 0; j < V; ++j) x[5 * ld + j] = scalar_cast<T>(-INFINITY);
    for (i64 j = 0; j < V; j += 2) x[6 * ld + j] = scalar_cast<T>(-INFINITY);
    t[6] = V > 1 ? 1 : kIgnore;  // a finite logit
    x[7 * ld + V - 1] = nan;
    t[7] = kIgnore;
    for (i64 j = 0; j < V; ++j) x[8 * ld + j] = scalar_cast<T>(1000.0 + 4.0 * std::sin(static_cast<double>(j)));
  }
};

/// The CPU's log-sum-exp over a row's V logits in double: m = max (NaN wins), lse = m + log Σ exp(x − m), so an
/// infinite maximum gives NaN.
template <class T>
double lse_reference(const T* xr, i64 V) {
  double m = -INFINITY;
  for (i64 j = 0; j < V; ++j) {
    const double v = dbl(xr[j]);
    m = (v > m || v != v) ? v : m;
  }
  double s = 0;
  for (i64 j = 0; j < V; ++j) s += std::exp(dbl(xr[j]) - m);
  return m + std::log(s);
}

/// cross_entropy_forward's packed launch (one block per row, row_threads(V / N + 1) threads), or `grid` blocks.
template <class T>
void cross_entropy_forward_case(i64 rows, i64 V, i64 ld, bool edge = false, i64 grid = 0, unsigned seed = 5) {
  using A = acc_t<T>;
  using P = Tol<T>;
  constexpr i64 N = 16 / sizeof(T);
  Logits<T> lg(rows, V, ld, edge, seed + static_cast<unsigned>(V));
  Buf<i64> t(rows, kInputFill);
  for (i64 i = 0; i < rows; ++i) t[i] = lg.t[i];
  Buf<A> lse(rows, kOutputFill), loss(rows, kOutputFill);
  const bool packed = ld % N == 0 && reinterpret_cast<std::uintptr_t>(lg.x.data()) % 16 == 0;  // packed_rows
  const i64 blocks = grid ? grid : row_blocks(rows);
  const int threads = row_threads(V / N + 1);
  launch(blocks, threads, [&] {
    cu::cross_entropy_forward_packed_kernel<T>(lg.x.data(), t.data(), lse.data(), loss.data(), rows, V, ld, kIgnore);
  });
  Compare cl("lse"), cs("loss");
  for (i64 i = 0; i < rows; ++i) {
    const double l = lse_reference(lg.x.data() + i * ld, V);
    cl(i, dbl(lse[i]), l, P::acc * (1 + std::abs(l)));
    if (lg.t[i] == kIgnore) {
      cs(i, dbl(loss[i]), 0.0, 0.0);  // 0 exactly, whatever the row holds
    } else {
      const double xt = dbl(lg.x[i * ld + lg.t[i]]);
      cs(i, dbl(loss[i]), l - xt, P::acc * (1 + std::abs(l) + std::abs(xt)));
    }
  }
  char label[160];
  std::snprintf(label, sizeof label, "%s cross-entropy forward rows=%lld V=%lld ld=%lld grid=%lld threads=%d%s",
                P::name, static_cast<long long>(rows), static_cast<long long>(V), static_cast<long long>(ld),
                static_cast<long long>(blocks), threads, edge ? " edge rows" : "");
  conclude(label, {&cl, &cs},
           {{"the launcher's packed path", packed},
            {"guards intact", lse.guards_intact() && loss.guards_intact() && lg.x.guards_intact()}});
}

/// cross_entropy_backward's packed launch (one block per row, row_threads(ld_out / N) threads), or `grid` blocks,
/// with the forward's lse (in double, stored as A), dloss 0.7 and count the rows not ignored (or every row ignored).
template <class T>
void cross_entropy_backward_case(i64 rows, i64 V, i64 ld, i64 ld_out, bool edge = false, i64 grid = 0,
                                 bool all_ignored = false, unsigned seed = 6) {
  using A = acc_t<T>;
  using P = Tol<T>;
  constexpr i64 N = 16 / sizeof(T);
  Logits<T> lg(rows, V, ld, edge, seed + static_cast<unsigned>(V));
  if (all_ignored) std::fill(lg.t.begin(), lg.t.end(), kIgnore);
  Buf<i64> t(rows, kInputFill);
  Buf<A> lse(rows, kInputFill), dloss(1, kInputFill);
  i64 count = 0;
  for (i64 i = 0; i < rows; ++i) {
    t[i] = lg.t[i];
    lse[i] = static_cast<A>(lse_reference(lg.x.data() + i * ld, V));
    count += lg.t[i] != kIgnore;
  }
  dloss[0] = static_cast<A>(0.7);
  Buf<T> d(rows * ld_out, kOutputFill);
  const bool packed = ld % N == 0 && ld_out % N == 0 && reinterpret_cast<std::uintptr_t>(lg.x.data()) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(d.data()) % 16 == 0;  // packed_rows of both
  const i64 blocks = grid ? grid : row_blocks(rows);
  const int threads = row_threads(ld_out / N);
  launch(blocks, threads, [&] {
    cu::cross_entropy_backward_packed_kernel<T>(lg.x.data(), t.data(), lse.data(), dloss.data(), count, d.data(), rows,
                                                V, ld, ld_out, kIgnore);
  });
  const double scale = count ? dbl(dloss[0]) / static_cast<double>(count) : 0.0;
  Compare cd("dlogits");
  bool zeros = true;  // columns past V and ignored rows: +0 exactly
  const T zero = scalar_cast<T>(0.0);
  for (i64 i = 0; i < rows; ++i)
    for (i64 j = 0; j < ld_out; ++j) {
      const T got = d[i * ld_out + j];
      if (j >= V || lg.t[i] == kIgnore) {
        zeros = zeros && same_bits(got, zero);
        continue;
      }
      // the kernel rounds x − lse before its exp: a relative error of p up to ulp(|x − lse|)
      const double arg = dbl(lg.x[i * ld + j]) - dbl(lse[i]), p = std::exp(arg), hot = j == lg.t[i] ? 1.0 : 0.0;
      const double ref = scale * (p - hot);
      cd(i * ld_out + j, dbl(got), ref,
         P::round * std::abs(ref) + P::tiny +
             P::acc * std::abs(scale) * ((p > 0 ? p * (1 + std::abs(arg)) : 0.0) + hot));
    }
  char label[200];
  std::snprintf(label, sizeof label,
                "%s cross-entropy backward rows=%lld V=%lld ld=%lld ld_out=%lld grid=%lld threads=%d%s%s", P::name,
                static_cast<long long>(rows), static_cast<long long>(V), static_cast<long long>(ld),
                static_cast<long long>(ld_out), static_cast<long long>(blocks), threads, edge ? " edge rows" : "",
                all_ignored ? " all ignored" : "");
  conclude(label, {&cd},
           {{"the launcher's packed path", packed},
            {"zeros past V and in ignored rows", zeros},
            {"guards intact", d.guards_intact() && lg.x.guards_intact()}});
}

// ---- the cases ----------------------------------------------------------------------------------------------
// Widths: the smallest row the packed forward takes (32 packs, one per lane), 33 packs (one lane takes two), GPT-2's
// 768 and GPT-2 XL's 1600; the one-pass backward from one pack up to its shared-memory limit (1536 in fp32
// accumulators, 768 in fp64). Rows: 1 (one of a block's four warps busy), 7, 37 (a last block part full).

template <class T>
void norm_forward_widths() {
  constexpr i64 V = 16 / sizeof(T);
  for (const i64 n : {32 * V, 33 * V, i64{768}, i64{1600}}) norm_forward_case<T>(Norm::layer, 37, n);
  norm_forward_case<T>(Norm::rms, 7, 768);
  norm_forward_case<T>(Norm::rms, 1, 33 * V);
  norm_forward_case<T>(Norm::layer_no_bias, 1, 768);
}

TEST(RowsEmulated, NormForwardFp32) { norm_forward_widths<float>(); }
TEST(RowsEmulated, NormForwardBf16) { norm_forward_widths<bf16>(); }
TEST(RowsEmulated, NormForwardFp16) { norm_forward_widths<fp16>(); }
TEST(RowsEmulated, NormForwardFp64) {
  norm_forward_case<double>(Norm::layer, 7, 64);
  norm_forward_case<double>(Norm::rms, 7, 66);
  norm_forward_case<double>(Norm::layer, 5, 768);
}
// A grid shorter than the rows (each warp takes several, the rows' stride loop), and rows with a NaN and an
// infinity: those rows are NaN (an infinite input's own RMSNorm element too), the others right.
TEST(RowsEmulated, NormForwardShortGridAndNonFiniteRows) {
  norm_forward_case<bf16>(Norm::layer, 37, 264, false, 2);
  norm_forward_case<float>(Norm::rms, 37, 768, false, 3);
  norm_forward_case<bf16>(Norm::layer, 9, 768, true);
  norm_forward_case<fp16>(Norm::rms, 9, 256, true);
  norm_forward_case<float>(Norm::layer, 6, 132, true, 1);
}
TEST(RowsEmulated, AddLayerNormMatchesUnfusedBitForBit) {
  add_layernorm_case<bf16>(7, 768);
  add_layernorm_case<fp16>(5, 264);
  add_layernorm_case<float>(37, 132);
  add_layernorm_case<double>(3, 66);
}

template <class T>
void norm_backward_widths() {
  constexpr i64 V = 16 / sizeof(T);
  for (const i64 n : {V, 33 * V, i64{768}, i64{1536}}) norm_backward_case<T>(true, 37, n);
  norm_backward_case<T>(true, 37, 768, {}, 1);  // 4 blocks: each warp takes two or three rows
  norm_backward_case<T>(false, 7, 264, {.db = false});
  norm_backward_case<T>(true, 1, 768);
  norm_backward_case<T>(true, 6, 33 * V, {.dx = false});
}
TEST(RowsEmulated, NormBackwardOnePassFp32) { norm_backward_widths<float>(); }
TEST(RowsEmulated, NormBackwardOnePassBf16) { norm_backward_widths<bf16>(); }
TEST(RowsEmulated, NormBackwardOnePassFp16) { norm_backward_widths<fp16>(); }
TEST(RowsEmulated, NormBackwardOnePassFp64) {
  norm_backward_case<double>(true, 37, 2);
  norm_backward_case<double>(true, 13, 768, {}, 1);
  norm_backward_case<double>(false, 7, 66, {.db = false});
}
// A NaN in dy makes its row of dx and its column of dw and db NaN, nothing else; only dw or only db asked for.
TEST(RowsEmulated, NormBackwardNanAndPartialOutputs) {
  norm_backward_case<bf16>(true, 9, 768, {}, kSmCount, true);
  norm_backward_case<float>(true, 13, 132, {}, 1, true);
  norm_backward_case<fp16>(true, 5, 264, {.dx = false, .dw = false});
  norm_backward_case<bf16>(true, 5, 264, {.dx = false, .db = false});
}
TEST(RowsEmulated, NormBackwardTwoKernelColumnSums) {
  norm_columns_case<bf16>(true, 100, 771);
  norm_columns_case<float>(false, 40, 1000);
  norm_columns_case<fp16>(true, 33, 4000);
}

// Cross-entropy: GPT-2's vocabulary of 50257 in rows padded to 50304 (a partial last pack), the padded width itself,
// rows narrower than one pack, and small vocabularies.
template <class T>
void cross_entropy_widths() {
  constexpr i64 N = 16 / sizeof(T);
  cross_entropy_forward_case<T>(4, 50257, 50304);
  cross_entropy_forward_case<T>(3, 50304, 50304);
  cross_entropy_forward_case<T>(9, 1000, 1000, true);
  cross_entropy_forward_case<T>(9, 3 * N + 1, 4 * N, true);
  cross_entropy_forward_case<T>(3, N - 1, N);
  cross_entropy_backward_case<T>(4, 50257, 50304, 50304);
  cross_entropy_backward_case<T>(3, 50257, 50304, 50264);  // a narrower gradient row than the logits'
  cross_entropy_backward_case<T>(9, 1000, 1000, 1000, true);
  cross_entropy_backward_case<T>(9, 3 * N + 1, 4 * N, 5 * N, true);
  cross_entropy_backward_case<T>(3, N - 1, N, N);
}
TEST(RowsEmulated, CrossEntropyPackedFp32) { cross_entropy_widths<float>(); }
TEST(RowsEmulated, CrossEntropyPackedBf16) { cross_entropy_widths<bf16>(); }
TEST(RowsEmulated, CrossEntropyPackedFp16) { cross_entropy_widths<fp16>(); }
TEST(RowsEmulated, CrossEntropyPackedFp64) {
  cross_entropy_forward_case<double>(9, 1001, 1002, true);
  cross_entropy_backward_case<double>(9, 1001, 1002, 1004, true);
}
// A grid shorter than the rows (a block takes several: its shared pairs are reused), and every row ignored.
TEST(RowsEmulated, CrossEntropyShortGridAndAllIgnored) {
  cross_entropy_forward_case<bf16>(9, 50257, 50304, true, 2);
  cross_entropy_forward_case<float>(9, 700, 704, true, 4);
  cross_entropy_backward_case<bf16>(9, 50257, 50304, 50304, true, 2);
  cross_entropy_backward_case<fp16>(4, 100, 104, 104, false, 0, true);
}

// ---- the embedding backward: the positions sorted by id on the device ---------------------------------------------
// Note [embedding rows sorted on the device]: the launcher's sequence (nn.cu's embedding_backward) with its shapes:
// per pass order_count and order_scatter on one block of kOrderChunk threads per chunk, order_scan on one block of
// kOrderScanThreads; then order_start on grid_for(V + 1) blocks and the row sums on row_blocks(V) blocks of
// row_threads(C). The result must be the CPU's counting sort exactly (start and order) and the rows of dw the
// ascending-position sums rounded once, bit for bit.
struct SortedRows {
  std::vector<i64> start, order;
};
/// The CPU kernel's stable counting sort (backends/cpu/nn.cpp).
SortedRows counting_sort(const std::vector<i64>& idx, i64 V) {
  SortedRows r{std::vector<i64>(static_cast<std::size_t>(V + 1), 0), std::vector<i64>(idx.size())};
  for (const i64 v : idx) ++r.start[static_cast<std::size_t>(v + 1)];
  for (i64 v = 0; v < V; ++v) r.start[static_cast<std::size_t>(v + 1)] += r.start[static_cast<std::size_t>(v)];
  std::vector<i64> pos(r.start.begin(), r.start.end() - 1);
  for (std::size_t i = 0; i < idx.size(); ++i) r.order[static_cast<std::size_t>(pos[static_cast<std::size_t>(idx[i])]++)] = static_cast<i64>(i);
  return r;
}
/// The device sort of `idx` as the launcher runs it; every scratch buffer with guards, checked after.
SortedRows device_sort(const std::vector<i64>& idx, i64 V) {
  const i64 n = static_cast<i64>(idx.size());
  const i64 chunks = (n + cu::kOrderChunk - 1) / cu::kOrderChunk;
  const std::size_t un = static_cast<std::size_t>(n);
  Buf<i64> keys_in(un, kOutputFill), k0(un, kOutputFill), v0(un, kOutputFill), k1(un, kOutputFill), v1(un, kOutputFill);
  Buf<int> counts(static_cast<std::size_t>(cu::kOrderBuckets * chunks), kOutputFill);
  Buf<i64> start(static_cast<std::size_t>(V + 1), kOutputFill);
  std::copy(idx.begin(), idx.end(), keys_in.data());
  const i64* keys = keys_in.data();
  const i64* vals = nullptr;
  i64* const kout[2] = {k0.data(), k1.data()};
  i64* const vout[2] = {v0.data(), v1.data()};
  const int passes = n > 0 ? cu::order_passes(V) : 0;
  for (int p = 0; p < passes; ++p) {
    const int shift = p * cu::kOrderBits;
    launch_threads(chunks, cu::kOrderChunk, [&] { cu::order_count_kernel(keys, n, shift, counts.data(), chunks); });
    launch_threads(1, cu::kOrderScanThreads, [&] { cu::order_scan_kernel(counts.data(), cu::kOrderBuckets * chunks); });
    launch_threads(chunks, cu::kOrderChunk, [&] {
      cu::order_scatter_kernel(keys, vals, n, shift, counts.data(), chunks, kout[p % 2], vout[p % 2]);
    });
    keys = kout[p % 2];
    vals = vout[p % 2];
  }
  launch_sequential(grid_for(V + 1), 256, [&] { cu::order_start_kernel(keys, n, start.data(), V); });
  EXPECT_TRUE(keys_in.guards_intact() && k0.guards_intact() && v0.guards_intact() && k1.guards_intact() &&
              v1.guards_intact() && counts.guards_intact() && start.guards_intact())
      << "a sort kernel wrote outside its buffers (n " << n << ", V " << V << ")";
  SortedRows r{std::vector<i64>(start.data(), start.data() + V + 1), {}};
  if (n > 0) r.order.assign(vals, vals + n);
  return r;
}
enum class Ids { uniform, one, skewed, ends };
std::vector<i64> make_ids(i64 n, i64 V, Ids kind, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::vector<i64> idx(static_cast<std::size_t>(n));
  for (auto& v : idx) {
    const i64 u = static_cast<i64>(rng() % static_cast<std::uint64_t>(V));
    switch (kind) {
      case Ids::uniform: v = u; break;
      case Ids::one: v = V / 2; break;
      case Ids::skewed: v = u % 3 == 0 ? u : (u % 7) * (V / 7); break;  // a few ids hold two thirds of the positions
      case Ids::ends: v = u % 2 == 0 ? 0 : V - 1; break;
    }
  }
  return idx;
}
void embedding_sort_case(i64 n, i64 V, Ids kind, unsigned seed = 7) {
  const std::vector<i64> idx = make_ids(n, V, kind, seed);
  const SortedRows want = counting_sort(idx, V), got = device_sort(idx, V);
  EXPECT_EQ(got.start, want.start) << "row starts, n " << n << ", V " << V << ", ids " << static_cast<int>(kind);
  EXPECT_EQ(got.order, want.order) << "positions, n " << n << ", V " << V << ", ids " << static_cast<int>(kind);
}

TEST(RowsEmulated, EmbeddingOrderIsTheCountingSort) {
  EXPECT_EQ(cu::order_passes(1), 1);
  EXPECT_EQ(cu::order_passes(256), 1);
  EXPECT_EQ(cu::order_passes(257), 2);
  EXPECT_EQ(cu::order_passes(50304), 2);
  EXPECT_EQ(cu::order_passes(65536), 2);
  EXPECT_EQ(cu::order_passes(65537), 3);
  for (const i64 n : {0, 1, 255, 256, 257, 1000}) {
    embedding_sort_case(n, 1, Ids::uniform);
    embedding_sort_case(n, 256, Ids::uniform);
    embedding_sort_case(n, 257, Ids::ends);
  }
  embedding_sort_case(4097, 50304, Ids::uniform);  // GPT-2's padded vocabulary: two passes, 17 chunks
  embedding_sort_case(4097, 50304, Ids::skewed);
  embedding_sort_case(3000, 50304, Ids::one);       // every position one id: a chunk's ranks run to 255
  embedding_sort_case(1500, 70000, Ids::uniform);   // three passes
  embedding_sort_case(1500, 70000, Ids::ends);
}

/// dw of the row-sum kernel over the device order against the ascending-position sums in acc_t<T>, bit for bit.
template <class T>
void embedding_backward_case(i64 n, i64 V, i64 C, Ids kind, unsigned seed = 9) {
  using A = acc_t<T>;
  const std::vector<i64> idx = make_ids(n, V, kind, seed);
  const SortedRows s = device_sort(idx, V);
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-2.0, 2.0);
  Buf<T> dout(static_cast<std::size_t>(n * C), kInputFill), dw(static_cast<std::size_t>(V * C), kOutputFill);
  for (i64 i = 0; i < n * C; ++i) dout[static_cast<std::size_t>(i)] = scalar_cast<T>(u(rng));
  const i64* order = s.order.empty() ? nullptr : s.order.data();
  launch_sequential(row_blocks(V), row_threads(C),
                    [&] { cu::embedding_backward_kernel<T>(dout.data(), s.start.data(), order, dw.data(), V, C); });
  std::vector<A> acc(static_cast<std::size_t>(V * C), A(0));
  for (i64 i = 0; i < n; ++i)  // ascending positions: each row's own order
    for (i64 j = 0; j < C; ++j)
      acc[static_cast<std::size_t>(idx[static_cast<std::size_t>(i)] * C + j)] += scalar_cast<A>(dout[static_cast<std::size_t>(i * C + j)]);
  i64 bad = 0;
  for (i64 e = 0; e < V * C; ++e)
    if (!same_bits(dw[static_cast<std::size_t>(e)], scalar_cast<T>(acc[static_cast<std::size_t>(e)])) && bad++ < 5)
      ADD_FAILURE() << "dw[" << e / C << ", " << e % C << "] = " << dbl(dw[static_cast<std::size_t>(e)]) << ", want "
                    << dbl(scalar_cast<T>(acc[static_cast<std::size_t>(e)]));
  EXPECT_EQ(bad, 0) << "n " << n << ", V " << V << ", C " << C;
  EXPECT_TRUE(dw.guards_intact() && dout.guards_intact());
}
TEST(RowsEmulated, EmbeddingBackwardSumsInPositionOrder) {
  embedding_backward_case<float>(1000, 300, 768, Ids::skewed);
  embedding_backward_case<bf16>(1000, 300, 768, Ids::skewed);
  embedding_backward_case<fp16>(777, 257, 100, Ids::ends);
  embedding_backward_case<double>(300, 1, 33, Ids::uniform);
  embedding_backward_case<bf16>(2048, 50304, 8, Ids::uniform);  // most rows have no position: written zero
  embedding_backward_case<float>(0, 40, 16, Ids::uniform);      // no position at all: dw zero
}

// Shared memory under the late-warp schedule (see block_barrier): the fused backward's gather of the warps' column
// slices, and the cross-entropy forward's shared (max, sum) pairs reused by a block's next row.
class LateWarp {
 public:
  explicit LateWarp(int w) { g_late_warp = w; }
  ~LateWarp() { g_late_warp = -1; }
};
TEST(RowsEmulated, LateWarpSchedules) {
  for (const int w : {0, kMaxWarps}) {
    LateWarp late(w);
    norm_backward_case<bf16>(true, 37, 768, {}, 1);
    norm_backward_case<float>(true, 13, 132, {}, 1);
    cross_entropy_forward_case<bf16>(9, 50257, 50304, true, 2);
    cross_entropy_forward_case<float>(9, 700, 704, true, 4);
    embedding_sort_case(600, 50304, Ids::skewed);  // the digits in shared memory; order_scan's partial sums
  }
}

}  // namespace

// CPU kernels: strided copy/convert, fill, counter-based random draws, arange, accumulation.
// One OpenMP pool for everything (PEERS.md: two spinning pools cost PyTorch a third of its step).
#include <omp.h>

#include <cmath>

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

void set_num_threads(int n) { omp_set_num_threads(n > 0 ? n : omp_get_num_procs()); }
int num_threads() { return omp_get_max_threads(); }

#define TG_COPY_FROM(S)                                                                               \
  template void copy_strided<S, fp64>(const S*, const Shape&, fp64*, const Shape&, const Shape&);   \
  template void copy_strided<S, fp32>(const S*, const Shape&, fp32*, const Shape&, const Shape&);   \
  template void copy_strided<S, fp16>(const S*, const Shape&, fp16*, const Shape&, const Shape&);   \
  template void copy_strided<S, bf16>(const S*, const Shape&, bf16*, const Shape&, const Shape&);   \
  template void copy_strided<S, std::int64_t>(const S*, const Shape&, std::int64_t*, const Shape&, const Shape&); \
  template void copy_strided<S, std::int32_t>(const S*, const Shape&, std::int32_t*, const Shape&, const Shape&); \
  template void copy_strided<S, std::uint8_t>(const S*, const Shape&, std::uint8_t*, const Shape&, const Shape&);
#define TG_ALL(T)                                                                   \
  TG_COPY_FROM(T)                                                                   \
  template void fill<T>(T*, std::int64_t, T);                                       \
  template void arange<T>(T*, std::int64_t, double, double);                        \
  template void add_inplace<T>(T*, const T*, std::int64_t);
#define TG_X(type, e, name, st) TG_ALL(type)
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X
#define TG_RANDOM(T)                                                                                     \
  template void random_uniform<T>(T*, std::int64_t, std::uint64_t, std::uint64_t, float, float);        \
  template void random_normal<T>(T*, std::int64_t, std::uint64_t, std::uint64_t, float, float);
TG_RANDOM(fp64)
TG_RANDOM(fp32)
TG_RANDOM(fp16)
TG_RANDOM(bf16)

}  // namespace tg::backend::cpu

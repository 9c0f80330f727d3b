// Index geometry of the CUDA kernels, in plain C++ (no CUDA headers) so the CPU tests check it: the strided
// offsets an elementwise kernel computes per element (Geo), and how a batched matmul is cut into
// strided-batched GEMM calls (BatchPlan). Private to the backend; tests/cuda/test_cuda_geometry.cpp.
//   const Geo g = make_geo(shape, a_strides, b_strides);   // kernel: a[g.offset(i, 0)], b[g.offset(i, 1)]
//   plan_batches(batch, sa, sb, sc).for_each([&](std::int64_t oa, std::int64_t ob, std::int64_t oc, bool first) {...});
#pragma once

#include <cstdint>
#include <vector>

#include "typegrad/core/shape.hpp"
#include "typegrad/detail/macros.hpp"

namespace tg::backend::cuda::detail {

/// Sizes and up to three stride sets of one index space, by value (a kernel parameter).
struct Geo {
  int nd = 0;
  bool narrow = false;  // under 2^32 elements: indices are split with 32-bit division
  std::int64_t size[kMaxDims] = {};
  std::int64_t st[3][kMaxDims] = {};
  /// Offset in stride set s of row-major linear index i.
  TG_HOST_DEVICE TG_INLINE std::int64_t offset(std::int64_t i, int s) const {
    if (nd == 1) return i * st[s][0];  // i < size[0]: no division (contiguous and merged operands)
    std::int64_t off[1] = {0};
    if (narrow) walk<std::uint32_t>(i, s, off);
    else walk<std::int64_t>(i, s, off);
    return off[0];
  }
  /// Offsets in stride sets 0 … N-1 of row-major linear index i, splitting i once for all of them (a
  /// kernel with two strided operands pays one division per dim, not two).
  template <int N>
  TG_HOST_DEVICE TG_INLINE void offsets(std::int64_t i, std::int64_t (&off)[N]) const {
    static_assert(N >= 1 && N <= 3);
    for (int s = 0; s < N; ++s) off[s] = 0;
    if (nd == 1) {
      for (int s = 0; s < N; ++s) off[s] = i * st[s][0];
    } else if (narrow) {
      walk<std::uint32_t>(i, 0, off);
    } else {
      walk<std::int64_t>(i, 0, off);
    }
  }

 private:
  // Adds to off[k] the offset of index i in stride set first + k. 64-bit integer division is emulated on
  // GPUs (several times the instructions of 32-bit), hence the index type I.
  template <class I, int N>
  TG_HOST_DEVICE TG_INLINE void walk(std::int64_t i, int first, std::int64_t (&off)[N]) const {
    I j = static_cast<I>(i);
    for (int d = nd - 1; d >= 0; --d) {
      const I n = static_cast<I>(size[d]);
      const I q = j / n;
      const auto coord = static_cast<std::int64_t>(j - q * n);
      for (int k = 0; k < N; ++k) off[k] += coord * st[first + k][d];
      j = q;
    }
  }
};

/// Geometry of `sizes` with up to three stride sets. Size-1 dims are dropped and neighbours that are one
/// uniform stride in every set are merged (row-major linear indices are unchanged), so a contiguous or
/// simply broadcast operand costs one or two divisions per element, not one per dim.
/// Whether `strides` lay `sizes` out densely in row-major order, so an elementwise kernel may read the operand as
/// one flat array (the 16-byte vector maps, a memcpy). A dimension of size 1 is never stepped along, so its stride
/// does not count (a broadcast operand's is 0, a view's may be anything).
inline bool dense_layout(const Shape& sizes, const Shape& strides) {
  if (strides.size() != sizes.size()) return false;
  std::int64_t expected = 1;
  for (std::size_t i = sizes.size(); i-- > 0;) {
    if (sizes[i] == 1) continue;
    if (strides[i] != expected) return false;
    expected *= sizes[i];
  }
  return true;
}

inline Geo make_geo(const Shape& sizes, const Shape& s0, const Shape& s1 = Shape(), const Shape& s2 = Shape()) {
  Geo g;
  const Shape* sets[3] = {&s0, &s1, &s2};
  auto stride = [&](int s, int d) { return sets[s]->size() > d ? (*sets[s])[d] : std::int64_t{0}; };
  for (int d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 1) continue;
    if (g.nd > 0) {
      const int p = g.nd - 1;
      bool merge = true;
      for (int s = 0; s < 3; ++s) merge = merge && g.st[s][p] == stride(s, d) * sizes[d];
      if (merge) {
        g.size[p] *= sizes[d];
        for (int s = 0; s < 3; ++s) g.st[s][p] = stride(s, d);
        continue;
      }
    }
    g.size[g.nd] = sizes[d];
    for (int s = 0; s < 3; ++s) g.st[s][g.nd] = stride(s, d);
    ++g.nd;
  }
  g.narrow = sizes.numel() <= std::int64_t{0xFFFFFFFF};
  return g;
}

/// How matmul_strided covers its batch: size-1 dims dropped, neighbours of one uniform stride (in a, b and
/// c) merged. Without a reduced dim (c stride 0) the innermost dim is one strided-batched call (`inner`)
/// and the `outer` dims loop on the host; with one, every product is its own call (inner.n == 1) and C
/// accumulates (beta = 1) after the first product that writes it.
struct BatchPlan {
  struct Dim {
    std::int64_t n, a, b, c;  // size and the batch strides of a, b, c
  };
  std::vector<Dim> outer;
  Dim inner{1, 0, 0, 0};
  bool reduces = false;

  /// f(offset of a, of b, of c, whether this is the first product into that c block), one call per GEMM
  /// launch, in row-major order of the outer dims.
  template <class F>
  void for_each(F f) const {
    std::int64_t count = 1;
    for (const Dim& d : outer) count *= d.n;
    std::vector<std::int64_t> idx(outer.size(), 0);
    for (std::int64_t it = 0; it < count; ++it) {
      std::int64_t oa = 0, ob = 0, oc = 0;
      bool first = true;
      for (std::size_t d = 0; d < outer.size(); ++d) {
        oa += idx[d] * outer[d].a;
        ob += idx[d] * outer[d].b;
        oc += idx[d] * outer[d].c;
        if (outer[d].c == 0 && idx[d] != 0) first = false;
      }
      f(oa, ob, oc, first);
      for (std::size_t d = outer.size(); d-- > 0;) {  // row-major increment
        if (++idx[d] < outer[d].n) break;
        idx[d] = 0;
      }
    }
  }
};

/// batch: the batch sizes; sa / sb / sc: at least batch.size() strides (the batch strides come first).
inline BatchPlan plan_batches(const Shape& batch, const Shape& sa, const Shape& sb, const Shape& sc) {
  BatchPlan p;
  for (int d = 0; d < batch.size(); ++d) {
    if (batch[d] == 1) continue;
    const BatchPlan::Dim cur{batch[d], sa[d], sb[d], sc[d]};
    if (!p.outer.empty()) {
      BatchPlan::Dim& q = p.outer.back();
      if (q.a == cur.a * cur.n && q.b == cur.b * cur.n && q.c == cur.c * cur.n) {
        q = {q.n * cur.n, cur.a, cur.b, cur.c};
        continue;
      }
    }
    p.outer.push_back(cur);
  }
  for (const BatchPlan::Dim& d : p.outer) p.reduces = p.reduces || d.c == 0;
  if (!p.reduces && !p.outer.empty()) {
    p.inner = p.outer.back();
    p.outer.pop_back();
  }
  return p;
}

}  // namespace tg::backend::cuda::detail

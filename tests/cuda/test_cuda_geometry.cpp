// The CUDA backend's index geometry, checked on the CPU (it is plain C++ shared with the kernels): the
// merged strided offsets of the elementwise kernels, and how matmul_strided cuts a batch into GEMM calls.
#include <gtest/gtest.h>

#include <map>
#include <vector>

#include <typegrad/detail/cuda/geometry.hpp>
#include <typegrad/typegrad.hpp>

namespace test_cuda_geometry_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::Shape;
using tg::backend::cuda::detail::BatchPlan;
using tg::backend::cuda::detail::make_geo;
using tg::backend::cuda::detail::plan_batches;

std::int64_t naive_offset(std::int64_t i, const Shape& sizes, const Shape& strides) {
  std::int64_t off = 0;
  for (int d = sizes.size() - 1; d >= 0; --d) {
    off += (i % sizes[d]) * strides[d];
    i /= sizes[d];
  }
  return off;
}

struct GeoCase {
  const char* name;
  Shape sizes, s0, s1, s2;
};

TEST(CudaGeometry, MergedOffsetsEqualThePerDimOffsets) {
  const std::vector<GeoCase> cases = {
      {"contiguous", {4, 5, 6}, {30, 6, 1}, {30, 6, 1}, {30, 6, 1}},
      {"row broadcast", {4, 5, 6}, {30, 6, 1}, {0, 0, 1}, {30, 6, 1}},
      {"column broadcast", {3, 7, 2}, {14, 2, 1}, {0, 1, 0}, {14, 2, 1}},
      {"transposed", {5, 7}, {1, 5}, {7, 1}, {7, 1}},
      {"size-one dims", {1, 4, 1, 3, 1}, {12, 3, 3, 1, 1}, {99, 3, 77, 1, 55}, {0, 0, 0, 0, 0}},
      {"strided slice", {3, 4}, {16, 2}, {4, 1}, {4, 1}},
      {"scalar", {}, {}, {}, {}},
      {"all broadcast", {2, 3}, {0, 0}, {3, 1}, {0, 0}},
      {"permuted", {2, 3, 4}, {1, 8, 2}, {12, 4, 1}, {4, 1, 12}},
  };
  for (const auto& c : cases) {
    const auto g = make_geo(c.sizes, c.s0, c.s1, c.s2);
    EXPECT_LE(g.nd, c.sizes.size()) << c.name;
    const Shape* sets[3] = {&c.s0, &c.s1, &c.s2};
    EXPECT_TRUE(g.narrow) << c.name;
    for (std::int64_t i = 0; i < c.sizes.numel(); ++i) {
      std::int64_t two[2], three[3];
      g.offsets(i, two);
      g.offsets(i, three);
      for (int s = 0; s < 3; ++s) {
        const std::int64_t want = naive_offset(i, c.sizes, *sets[s]);
        ASSERT_EQ(g.offset(i, s), want) << c.name << ": index " << i << ", set " << s;
        ASSERT_EQ(three[s], want) << c.name << ": offsets<3>, index " << i << ", set " << s;
        if (s < 2) ASSERT_EQ(two[s], want) << c.name << ": offsets<2>, index " << i << ", set " << s;
      }
    }
  }
  // merging works: a contiguous tensor is one dim, a (B,T,C) + (C) broadcast two
  EXPECT_EQ(make_geo({4, 5, 6}, {30, 6, 1}, {30, 6, 1}).nd, 1);
  EXPECT_EQ(make_geo({4, 5, 6}, {30, 6, 1}, {0, 0, 1}).nd, 2);
}

// Index spaces of 2^32 elements or more split indices with 64-bit division; below that with 32-bit. Both
// are checked at the indices where a 32-bit split would go wrong (past 2^32) or is at its limit.
TEST(CudaGeometry, WideAndNarrowIndexSpacesGiveThePerDimOffsets) {
  struct Case {
    const char* name;
    Shape sizes, s0, s1;
    bool narrow;
  };
  const std::int64_t big = std::int64_t{1} << 20;
  const std::vector<Case> cases = {
      // a (2^20, 2^13) tensor read transposed: 2^33 elements
      {"wide transpose", {big, 8192}, {1, big}, {8192, 1}, false},
      // (65535, 65537) = 2^32 - 1 elements: the largest narrow space
      {"narrow limit", {65535, 65537}, {1, 65535}, {65537, 1}, true},
      {"wide permute", {2, big, 4096}, {4096, 8192, 1}, {std::int64_t{4096} * big, 1, big}, false},
  };
  for (const auto& c : cases) {
    const auto g = make_geo(c.sizes, c.s0, c.s1);
    EXPECT_EQ(g.narrow, c.narrow) << c.name;
    const std::int64_t n = c.sizes.numel();
    for (const std::int64_t i : {std::int64_t{0}, std::int64_t{1}, n / 3, (std::int64_t{1} << 32) - 1,
                                 std::int64_t{1} << 32, (std::int64_t{1} << 32) + 12345, n - 2, n - 1}) {
      if (i >= n) continue;
      std::int64_t off[2];
      g.offsets(i, off);
      EXPECT_EQ(off[0], naive_offset(i, c.sizes, c.s0)) << c.name << ": index " << i;
      EXPECT_EQ(off[1], naive_offset(i, c.sizes, c.s1)) << c.name << ": index " << i;
      EXPECT_EQ(g.offset(i, 1), off[1]) << c.name << ": index " << i;
    }
  }
}

/// Host emulation of matmul_strided through a plan: each for_each call is one strided-batched GEMM of
/// plan.inner.n products, C = A·B (beta 0) or C += A·B (beta 1). Row-major contiguous matrices.
std::vector<double> run_plan(const BatchPlan& p, const std::vector<double>& a, const std::vector<double>& b,
                             std::size_t c_size, std::int64_t M, std::int64_t N, std::int64_t K, int& calls) {
  std::vector<double> c(c_size, -7.0);  // garbage: beta 0 must overwrite it
  calls = 0;
  p.for_each([&](std::int64_t oa, std::int64_t ob, std::int64_t oc, bool first) {
    ++calls;
    for (std::int64_t i = 0; i < p.inner.n; ++i)
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t n = 0; n < N; ++n) {
          double acc = 0;
          for (std::int64_t k = 0; k < K; ++k)
            acc += a[static_cast<std::size_t>(oa + i * p.inner.a + m * K + k)] *
                   b[static_cast<std::size_t>(ob + i * p.inner.b + k * N + n)];
          double& dst = c[static_cast<std::size_t>(oc + i * p.inner.c + m * N + n)];
          dst = first ? acc : dst + acc;
        }
  });
  return c;
}

/// The contract: C[c(idx)] = Σ over batch indices idx mapping there of A[a(idx)]·B[b(idx)].
std::vector<double> naive(const Shape& batch, const Shape& sa, const Shape& sb, const Shape& sc, const std::vector<double>& a,
                          const std::vector<double>& b, std::size_t c_size, std::int64_t M, std::int64_t N, std::int64_t K) {
  std::vector<double> c(c_size, 0.0);
  for (std::int64_t it = 0; it < batch.numel(); ++it) {
    const std::int64_t oa = naive_offset(it, batch, sa), ob = naive_offset(it, batch, sb), oc = naive_offset(it, batch, sc);
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n)
        for (std::int64_t k = 0; k < K; ++k)
          c[static_cast<std::size_t>(oc + m * N + n)] +=
              a[static_cast<std::size_t>(oa + m * K + k)] * b[static_cast<std::size_t>(ob + k * N + n)];
  }
  return c;
}

struct PlanCase {
  const char* name;
  Shape batch, a_own, b_own, c_own;  // each operand's own batch shape (1 = broadcast / reduced)
  int max_calls;
};

Shape batch_strides(const Shape& own, std::int64_t matrix) {  // contiguous [own..., matrix], 0 on size-1 dims
  Shape st = Shape::filled(own.size(), 0);
  std::int64_t s = matrix;
  for (int d = own.size() - 1; d >= 0; --d) {
    st[d] = own[d] == 1 ? 0 : s;
    s *= own[d];
  }
  return st;
}

TEST(CudaGeometry, MatmulBatchPlansComputeTheBatchedProduct) {
  const std::int64_t M = 3, N = 2, K = 4;
  const std::vector<PlanCase> cases = {
      {"no batch", {}, {}, {}, {}, 1},
      {"contiguous batch folds into one call", {2, 3}, {2, 3}, {2, 3}, {2, 3}, 1},
      {"shared b: one call, b stride 0", {2, 3}, {2, 3}, {1, 1}, {2, 3}, 1},
      {"broadcast a on the inner dim", {2, 3}, {2, 1}, {2, 3}, {2, 3}, 2},
      {"size-1 batch dims are dropped", {2, 1, 3}, {2, 1, 3}, {2, 1, 3}, {2, 1, 3}, 1},
      {"dB of a shared weight: reduce over everything", {2, 3}, {2, 3}, {2, 3}, {1, 1}, 6},
      {"reduce over the outer dim only", {2, 3}, {2, 3}, {2, 3}, {1, 3}, 6},
      {"reduce over the inner dim only", {2, 3}, {2, 3}, {1, 3}, {2, 1}, 6},
  };
  for (const auto& c : cases) {
    const Shape sa = batch_strides(c.a_own, M * K), sb = batch_strides(c.b_own, K * N), sc = batch_strides(c.c_own, M * N);
    const std::size_t na = static_cast<std::size_t>(c.a_own.numel() * M * K), nb = static_cast<std::size_t>(c.b_own.numel() * K * N),
                      nc = static_cast<std::size_t>(c.c_own.numel() * M * N);
    std::vector<double> a(na), b(nb);
    for (std::size_t i = 0; i < na; ++i) a[i] = static_cast<double>((i * 7) % 11) - 5;
    for (std::size_t i = 0; i < nb; ++i) b[i] = static_cast<double>((i * 5) % 13) - 6;
    const BatchPlan plan = plan_batches(c.batch, sa, sb, sc);
    int calls = 0;
    const auto got = run_plan(plan, a, b, nc, M, N, K, calls);
    EXPECT_EQ(got, naive(c.batch, sa, sb, sc, a, b, nc, M, N, K)) << c.name;
    EXPECT_EQ(calls, c.max_calls) << c.name;
  }
}

// The elementwise launchers' test for a flat operand (the 16-byte vector maps, a memcpy): size-1 dimensions do not
// count, whatever their stride (a batch of 1 broadcast to stride 0 is still dense).
TEST(CudaGeometry, DenseLayoutIgnoresSizeOneDimensions) {
  using tg::backend::cuda::detail::dense_layout;
  EXPECT_TRUE(dense_layout({2, 3, 4}, {12, 4, 1}));
  EXPECT_TRUE(dense_layout({1, 1024, 768}, {0, 768, 1}));       // a [1, T, C] operand as binary's broadcast gives it
  EXPECT_TRUE(dense_layout({1, 1024, 768}, {786432, 768, 1}));
  EXPECT_TRUE(dense_layout({4, 1, 8}, {8, 77, 1}));              // a view's size-1 stride is never used
  EXPECT_TRUE(dense_layout({1}, {0}));
  EXPECT_TRUE(dense_layout({}, {}));
  EXPECT_FALSE(dense_layout({2, 3, 4}, {12, 1, 3}));             // transposed
  EXPECT_FALSE(dense_layout({2, 3, 4}, {0, 4, 1}));              // broadcast along a real dimension
  EXPECT_FALSE(dense_layout({2, 3, 4}, {24, 4, 1}));             // rows with a gap
  EXPECT_FALSE(dense_layout({2, 3}, {3, 1, 1}));                 // a stride set of another rank
  // every operand that the per-element offsets walk as 0, 1, 2, ... is dense
  const tg::Shape sizes = {1, 3, 1, 5};
  for (const tg::Shape& st : {tg::Shape{0, 5, 0, 1}, tg::Shape{15, 5, 5, 1}, tg::Shape{9, 5, 3, 1}}) {
    const auto g = tg::backend::cuda::detail::make_geo(sizes, st);
    for (std::int64_t i = 0; i < sizes.numel(); ++i) EXPECT_EQ(g.offset(i, 0), i) << st;
    EXPECT_TRUE(dense_layout(sizes, st)) << st;
  }
}

}  // namespace

}  // namespace test_cuda_geometry_cpp

// The index arithmetic of the register-resident attention kernels (Note [flash attention in registers],
// include/typegrad/detail/cuda/mma_layout.hpp) on the CPU: tiles stored swizzled, fragments gathered by an
// emulation of ldmatrix.x4 (with and without .trans) from the rows each lane names, products by an emulation
// of mma.sync m16n8k16, both written from the PTX ISA's fragment tables; the products the kernels' loops make
// (S = Q·Kᵀ from Q's A fragments and a K tile, then O += P·V with P taken from the accumulators) must equal
// the plain matrix products. Runs without a GPU.
#include <gtest/gtest.h>

#include <array>
#include <cstdint>
#include <set>
#include <vector>

#include <typegrad/detail/cuda/mma_layout.hpp>

namespace test_cuda_mma_layout_cpp {  // the file's own names (Note [unity test sources])

namespace {

namespace lay = tg::backend::cuda::detail::mma;

/// A 32-bit register holding two 16-bit elements (emulated as floats holding small integers, exact).
struct Reg {
  float lo = 0, hi = 0;
};
using Warp4 = std::array<std::array<Reg, 4>, 32>;  // four registers per lane

/// ldmatrix.x4: lanes 8i .. 8i + 7 name the eight rows of matrix i (each the start of 8 consecutive elements);
/// register i of lane L receives row L / 4 of matrix i, elements 2(L % 4) and 2(L % 4) + 1; with .trans it
/// receives column L / 4, rows 2(L % 4) and 2(L % 4) + 1.
Warp4 ldmatrix_x4(const std::vector<float>& smem, const std::array<int, 32>& row_start, bool trans) {
  Warp4 r{};
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      auto at = [&](int row, int col) { return smem.at(static_cast<std::size_t>(row_start[8 * i + row] + col)); };
      const int q = lane / 4, t = lane % 4;
      r[lane][i] = trans ? Reg{at(2 * t, q), at(2 * t + 1, q)} : Reg{at(q, 2 * t), at(q, 2 * t + 1)};
    }
  return r;
}

/// mma.sync.m16n8k16 (row.col), fp32 accumulators: d[lane][e] += Σ_k A[row][k]·B[k][col], with A's registers
/// a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..), B's b0 (k 2t.., n g), b1 (k 2t + 8.., n g),
/// C's c0, c1 (g, 2t + {0, 1}) and c2, c3 (g + 8, 2t + {0, 1}); g = lane / 4, t = lane % 4.
void mma16816(std::array<std::array<float, 4>, 32>& d, const std::array<std::array<Reg, 4>, 32>& a,
              const std::array<std::array<Reg, 2>, 32>& b) {
  float A[16][16] = {}, B[16][8] = {};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = g + ((i & 1) ? 8 : 0), col = 2 * t + ((i & 2) ? 8 : 0);
      A[row][col] = a[lane][i].lo;
      A[row][col + 1] = a[lane][i].hi;
    }
    for (int i = 0; i < 2; ++i) {
      const int k = 2 * t + (i ? 8 : 0);
      B[k][g] = b[lane][i].lo;
      B[k + 1][g] = b[lane][i].hi;
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int e = 0; e < 4; ++e) {
      const int row = g + (e >= 2 ? 8 : 0), col = 2 * t + (e & 1);
      for (int k = 0; k < 16; ++k) d[lane][e] += A[row][k] * B[k][col];
    }
  }
}

using Acc = std::vector<std::array<std::array<float, 4>, 32>>;  // [n-tile][lane][register]

std::array<std::array<Reg, 2>, 32> half(const Warp4& r, int first) {
  std::array<std::array<Reg, 2>, 32> b{};
  for (int lane = 0; lane < 32; ++lane) b[lane] = {r[lane][first], r[lane][first + 1]};
  return b;
}

/// A [rows, HS] matrix of small integers stored swizzled.
template <int HS>
std::vector<float> store_swizzled(const std::vector<float>& m, int rows) {
  std::vector<float> s(static_cast<std::size_t>(rows) * HS, -1.f);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < HS; ++c) s.at(static_cast<std::size_t>(lay::swizzled<HS>(r, c))) = m[static_cast<std::size_t>(r * HS + c)];
  return s;
}

std::vector<float> small_ints(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    seed = seed * 1103515245u + 12345u;
    v[i] = static_cast<float>(static_cast<int>((seed >> 16) % 7) - 3);
  }
  return v;
}

template <int HS, int N>
void check_products(int w0) {
  SCOPED_TRACE(::testing::Message() << "HS=" << HS << " N=" << N << " w0=" << w0);
  constexpr int kRowsInTile = 64;
  const auto q = small_ints(kRowsInTile * HS, 1u + w0), k = small_ints(N * HS, 7u), v = small_ints(N * HS, 11u);
  const auto qs = store_swizzled<HS>(q, kRowsInTile), ks = store_swizzled<HS>(k, N), vs = store_swizzled<HS>(v, N);

  // the kernels' load_a_rows: Q's fragments for rows w0 .. w0 + 15
  std::vector<Warp4> qf(HS / 16);
  for (int kc = 0; kc < HS / 16; ++kc) {
    std::array<int, 32> starts{};
    for (int lane = 0; lane < 32; ++lane) {
      const lay::RowCol at = lay::a_source(lane, w0, kc * 16);
      starts[lane] = lay::swizzled<HS>(at.row, at.col);
    }
    qf[kc] = ldmatrix_x4(qs, starts, false);
  }
  // rows_times_tile_t: S = Q·Kᵀ
  Acc s(N / 8);
  for (auto& t : s)
    for (auto& l : t) l.fill(0.f);
  for (int kc = 0; kc < HS / 16; ++kc)
    for (int np = 0; np < N / 16; ++np) {
      std::array<int, 32> starts{};
      for (int lane = 0; lane < 32; ++lane) {
        const lay::RowCol at = lay::bt_source(lane, np * 16, kc * 16);
        starts[lane] = lay::swizzled<HS>(at.row, at.col);
      }
      const Warp4 b = ldmatrix_x4(ks, starts, false);
      mma16816(s[2 * np], qf[kc], half(b, 0));
      mma16816(s[2 * np + 1], qf[kc], half(b, 2));
    }
  std::vector<float> p(16 * N);  // the accumulators as a matrix, through c_element
  for (int n = 0; n < N / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const lay::RowCol c = lay::c_element(lane, e);
        float want = 0;
        for (int d = 0; d < HS; ++d) want += q[static_cast<std::size_t>((w0 + c.row) * HS + d)] * k[static_cast<std::size_t>((n * 8 + c.col) * HS + d)];
        ASSERT_EQ(s[n][lane][e], want) << "S at row " << c.row << " key " << n * 8 + c.col;
        p[static_cast<std::size_t>(c.row * N + n * 8 + c.col)] = s[n][lane][e];
      }
  // acc_times_tile: O = P·V with P's A fragments built from the accumulators
  Acc o(HS / 8);
  for (auto& t : o)
    for (auto& l : t) l.fill(0.f);
  for (int kk = 0; kk < N / 16; ++kk) {
    Warp4 a{};
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) {
        const lay::ASourceOfC src = lay::a_from_c(kk, i);
        a[lane][i] = {s[src.tile][lane][src.lo], s[src.tile][lane][src.lo + 1]};
      }
    for (int dp = 0; dp < HS / 16; ++dp) {
      std::array<int, 32> starts{};
      for (int lane = 0; lane < 32; ++lane) {
        const lay::RowCol at = lay::b_source_trans(lane, kk * 16, dp * 16);
        starts[lane] = lay::swizzled<HS>(at.row, at.col);
      }
      const Warp4 b = ldmatrix_x4(vs, starts, true);
      mma16816(o[2 * dp], a, half(b, 0));
      mma16816(o[2 * dp + 1], a, half(b, 2));
    }
  }
  for (int n = 0; n < HS / 8; ++n)
    for (int lane = 0; lane < 32; ++lane)
      for (int e = 0; e < 4; ++e) {
        const lay::RowCol c = lay::c_element(lane, e);
        float want = 0;
        for (int j = 0; j < N; ++j) want += p[static_cast<std::size_t>(c.row * N + j)] * v[static_cast<std::size_t>(j * HS + n * 8 + c.col)];
        ASSERT_EQ(o[n][lane][e], want) << "O at row " << c.row << " column " << n * 8 + c.col;
      }
}

TEST(MmaLayout, KernelLoopsGiveThePlainProducts) {
  for (int w0 : {0, 16, 48}) {
    check_products<64, 64>(w0);
    check_products<64, 32>(w0);
    check_products<128, 64>(w0);
    check_products<128, 32>(w0);
  }
}

// The swizzle is a permutation of each row's 16-byte chunks, and ldmatrix's eight rows (consecutive rows at
// one column) land in eight different 16-byte bank groups of a 128-byte line: no bank conflict.
TEST(MmaLayout, SwizzleIsAPermutationWithoutBankConflicts) {
  auto check = [](auto hs_tag) {
    constexpr int HS = decltype(hs_tag)::value;
    std::set<int> seen;
    for (int r = 0; r < 64; ++r)
      for (int c = 0; c < HS; ++c) {
        const int off = lay::swizzled<HS>(r, c);
        EXPECT_EQ(off / HS, r);
        seen.insert(off);
      }
    EXPECT_EQ(seen.size(), static_cast<std::size_t>(64 * HS));
    for (int r0 = 0; r0 < 64; r0 += 8)
      for (int c = 0; c < HS; c += 8) {
        std::set<int> groups;
        for (int r = r0; r < r0 + 8; ++r) groups.insert((lay::swizzled<HS>(r, c) * 2 / 16) % 8);
        EXPECT_EQ(groups.size(), 8u) << "HS " << HS << " rows " << r0 << " column " << c;
      }
  };
  check(std::integral_constant<int, 64>{});
  check(std::integral_constant<int, 128>{});
}

}  // namespace

}  // namespace test_cuda_mma_layout_cpp

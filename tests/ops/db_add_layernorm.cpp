// Op database entry for add_layernorm (ops/add_layernorm.hpp, Note [fused residual add and LayerNorm]):
// y = layernorm(x + branch). The entry's function returns y, so its gradients pass through both recorded
// nodes ("add" for the sum, "add_layernorm" for y) to x, branch, weight and bias. The behaviour tests check
// what the note promises: the sum and y equal `add` then `layernorm` bit for bit in fp64, fp32 and bf16,
// and so do the four gradients when the sum also feeds the residual stream.
//
// Tolerances: the defaults (a LayerNorm of a sum: the layernorm entry's).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <typegrad/ops/add_layernorm.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

// args = {eps}
OpEntry add_layernorm_entry() {
  OpEntry e = make_entry("add_layernorm", [](const auto& x, const I&, const Sample& s) {
    return tg::add_layernorm(x[0], x[1], x[2], x[3], s.args[0]).out;
  });
  e.sample("rows", {{{4, 7}}, {{4, 7}}, {{7}, 0.5, 1.5}, {{7}}}, {}, {1e-5})
      .sample("rank3_strided", {{{2, 3, 5}, L::strided}, {{2, 3, 5}}, {{5}, 0.5, 1.5}, {{5}, -1.0, 1.0, L::strided}}, {}, {1e-5})
      .sample("transposed_branch", {{{6, 5}}, {{6, 5}, L::transposed}, {{5}, 0.5, 1.5}, {{5}}}, {}, {1e-3})
      .sample("one_row_offset", {{{1, 9}, 3.0, 5.0}, {{1, 9}, 1.0, 2.0}, {{9}, 0.5, 1.5}, {{9}}}, {}, {1e-5})
      .sample("parallel", {{{40, 520}}, {{40, 520}}, {{520}, 0.5, 1.5}, {{520}}}, {}, {1e-5})  // > 2^14: OpenMP rows
      // rows of at least one 16-byte pack per lane: the GPU's warp-per-row kernel (Note [norm forward in packs])
      .sample("packed_rows", {{{3, 256}}, {{3, 256}}, {{256}, 0.5, 1.5}, {{256}}}, {}, {1e-5});
  e.reference([](const X& x, const I&, const Sample& s) {
    const std::int64_t n = x[0].shape()[x[0].dim() - 1], rows = x[0].numel() / n;
    const std::vector<double> a = values(x[0]), b = values(x[1]), w = values(x[2]), c = values(x[3]);
    Tensor<double> out = Tensor<double>::empty(x[0].shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      std::vector<double> h(static_cast<std::size_t>(n));
      double mu = 0, v = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        const auto k = static_cast<std::size_t>(r * n + j);
        h[static_cast<std::size_t>(j)] = a[k] + b[k];
        mu += h[static_cast<std::size_t>(j)];
      }
      mu /= static_cast<double>(n);
      for (double hv : h) v += (hv - mu) * (hv - mu);
      const double rs = 1.0 / std::sqrt(v / static_cast<double>(n) + s.args[0]);
      for (std::int64_t j = 0; j < n; ++j) {
        const auto jj = static_cast<std::size_t>(j);
        out.data()[r * n + j] = (h[jj] - mu) * rs * w[jj] + c[jj];
      }
    }
    return out;
  });
  e.error("shapes", [] { tg::add_layernorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8}), Tensor<float>::zeros({8}), Tensor<float>::zeros({8})); },
          "add_layernorm: x [4,8] and branch [8] must have the same shape");
  e.error("weight", [] { tg::add_layernorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({7}), Tensor<float>::zeros({8})); },
          "add_layernorm: weight must be [8] (the last dim of x [4,8]), got [7]");
  e.error("bias", [] { tg::add_layernorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8}), Tensor<float>::zeros({2, 4})); },
          "add_layernorm: bias must be [8] (the last dim of x [4,8]), got [2,4]");
  return e;
}
TG_REGISTER_OP(add_layernorm_entry());

// The fused pair against `add` then `layernorm`, forward and every gradient, with the sum also feeding a
// residual add downstream (a pre-LN block's shape): equal bit for bit (Note [fused residual add and LayerNorm]).
template <class T>
void check_against_unfused(std::int64_t rows, std::int64_t n) {
  Generator gen(7);
  const Tensor<float> x0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, gen), r0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, gen);
  const Tensor<float> w0 = Tensor<float>::normal({n}, 1.f, 0.2f, gen), b0 = Tensor<float>::normal({n}, 0.f, 0.2f, gen);
  const Tensor<float> u0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, gen);
  Tensor<T> xf = leaf_as<T>(x0), rf = leaf_as<T>(r0), wf = leaf_as<T>(w0), bf = leaf_as<T>(b0);
  Tensor<T> xu = leaf_as<T>(x0), ru = leaf_as<T>(r0), wu = leaf_as<T>(w0), bu = leaf_as<T>(b0);
  const Tensor<T> u = u0.to<T>();
  const AddLayerNorm<T, cpu> f = tg::add_layernorm(xf, rf, wf, bf);
  const Tensor<T> hu = tg::add(xu, ru), yu = tg::layernorm(hu, wu, bu);
  EXPECT_TRUE(same_bits(f.sum, hu)) << "the sum";
  EXPECT_TRUE(same_bits(f.out, yu)) << "the LayerNorm";
  // the block's next residual add reads the sum and a function of y
  tg::add(f.sum, f.out * u).backward(u);
  tg::add(hu, yu * u).backward(u);
  EXPECT_TRUE(same_bits(xf.grad(), xu.grad())) << "dx";
  EXPECT_TRUE(same_bits(rf.grad(), ru.grad())) << "dbranch";
  EXPECT_TRUE(same_bits(wf.grad(), wu.grad())) << "dweight";
  EXPECT_TRUE(same_bits(bf.grad(), bu.grad())) << "dbias";
}

TEST(OpDb_add_layernorm_behaviour, EqualsAddThenLayerNormBitForBit) {
  check_against_unfused<fp32>(6, 37);
  check_against_unfused<fp32>(64, 768);  // the OpenMP path of both kernels
  check_against_unfused<bf16>(6, 37);
  check_against_unfused<bf16>(64, 768);
  check_against_unfused<fp64>(5, 16);
}

// Two nodes: "add" for the sum, "add_layernorm" for y (whose input is the sum).
TEST(OpDb_add_layernorm_behaviour, RecordsAnAddAndALayerNormNode) {
  Tensor<float> x = Tensor<float>::ones({2, 4}), r = Tensor<float>::ones({2, 4}), w = Tensor<float>::ones({4}),
                b = Tensor<float>::zeros({4});
  x.requires_grad_();
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const AddLayerNorm<fp32, cpu> f = tg::add_layernorm(x, r, w, b);
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 2);
  ASSERT_TRUE(f.sum.requires_grad());
  ASSERT_TRUE(f.out.requires_grad());
  for (float v : f.sum.to_vector()) EXPECT_EQ(v, 2.f);
  for (float v : f.out.to_vector()) EXPECT_EQ(v, 0.f);  // a constant row normalizes to the bias
}

}  // namespace
}  // namespace tg::testing

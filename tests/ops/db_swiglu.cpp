// Op database entry for swiglu (ops/swiglu.hpp, Note [swiglu halves]): out = silu(a) · b with a the first
// and b the second half of x's last dim. Samples with odd half sizes, rank 3, non-contiguous layouts, one
// pair per row and saturating gates; its PyTorch golden (Note [goldens from the op database]); and
// behaviour the generic tests cannot express (the fused op matches its composite, one tape node, the
// autocast rule).
//
// Tolerances: the defaults. Math in fp32 for 16-bit storage, each output and gradient rounded once.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

OpEntry swiglu_entry() {
  OpEntry e = make_entry("swiglu", [](const auto& x, const I&, const Sample&) { return tg::swiglu(x[0]); });
  e.sample("rows", {{{4, 10}}})                          // N = 5
      .sample("rank3", {{{2, 3, 8}}})
      .sample("transposed", {{{6, 4}, L::transposed}})
      .sample("strided", {{{3, 6}, L::strided}})
      .sample("one_pair", {{{5, 2}}})                      // N = 1
      .sample("saturating", {{{3, 8}, -12.0, 12.0}})       // sigmoid near 0 and 1
      .golden();
  e.reference([](const X& x, const I&, const Sample&) {
    const std::int64_t two_n = x[0].shape()[x[0].dim() - 1], n = two_n / 2, rows = x[0].numel() / two_n;
    Shape os = x[0].shape();
    os[os.size() - 1] = n;
    Tensor<double> out = Tensor<double>::empty(os);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t j = 0; j < n; ++j) {
        const double a = x[0].data()[r * two_n + j], b = x[0].data()[r * two_n + n + j];
        out.data()[r * n + j] = a / (1.0 + std::exp(-a)) * b;
      }
    return out;
  });
  e.error("odd", [] { tg::swiglu(Tensor<float>::zeros({3, 5})); },
          "swiglu: the last dim of x must be even (the gate half, then the up half), got 5 (x is [3,5])");
  e.error("scalar", [] { tg::swiglu(Tensor<float>::full(Shape(), 1.0)); },
          "swiglu: x must have at least one dim (..., 2N), got []");
  return e;
}
TG_REGISTER_OP(swiglu_entry());

// The fused op against its composite silu(x[..., :N]) · x[..., N:] (fp32: the same formulas up to the
// vectorized sigmoid's last ulp), forward and gradient.
TEST(OpDb_swiglu_behaviour, MatchesCompositeFp32) {
  Generator gen(11);
  const Tensor<float> x0 = Tensor<float>::normal({3, 4, 14}, 0.f, 2.f, gen), u = Tensor<float>::normal({3, 4, 7}, 0.f, 1.f, gen);
  Tensor<float> xf = x0.clone().detach(), xc = x0.clone().detach();
  xf.requires_grad_();
  xc.requires_grad_();
  const Tensor<float> yf = tg::swiglu(xf), yc = tg::silu(xc.narrow(-1, 0, 7)) * xc.narrow(-1, 7, 7);
  yf.backward(u);
  yc.backward(u);
  const auto f = yf.to_vector(), c = yc.to_vector(), gf = xf.grad().to_vector(), gc = xc.grad().to_vector();
  ASSERT_EQ(f.size(), c.size());
  for (std::size_t i = 0; i < f.size(); ++i) EXPECT_NEAR(f[i], c[i], 1e-6 * (1 + std::abs(c[i]))) << "output " << i;
  ASSERT_EQ(gf.size(), gc.size());
  for (std::size_t i = 0; i < gf.size(); ++i) EXPECT_NEAR(gf[i], gc[i], 1e-6 * (1 + std::abs(gc[i]))) << "gradient " << i;
}

// One op, one node; elementwise (its declared autocast rule), fp32 registers for 16-bit storage.
TEST(OpDb_swiglu_behaviour, RecordsOneNodeAndDeclaresItsRule) {
  static_assert(amp::rule_of<amp::op::swiglu>::value == amp::Rule::elementwise);
  static_assert(std::is_same_v<amp::kernel_math_t<amp::op::swiglu, fp16>, float>);
  Tensor<float> x = Tensor<float>::ones({2, 6});
  x.requires_grad_();
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const Tensor<float> y = tg::swiglu(x);
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 1);
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
  for (float v : y.to_vector()) EXPECT_NEAR(v, 1.0 / (1.0 + std::exp(-1.0)), 1e-6);  // silu(1) · 1
}

}  // namespace
}  // namespace tg::testing

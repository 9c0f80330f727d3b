// Op database entry for rope (ops/rope.hpp, Note [rope: rotate half]): samples over (B,H,T,Dh) and
// (T,Dh), non-contiguous layouts, a position offset far into a long context, partial rotary; its PyTorch
// golden (Note [goldens from the op database]); and behaviour the generic tests cannot express (decoding
// with an offset equals the same positions of the full sequence, one tape node, the autocast rule).
// args = {theta, offset, rotary_dim (−1: all of Dh)}.
//
// Tolerances: the defaults. The cos / sin are computed in fp64 and rounded once to the math type (fp32
// for 16-bit storage), and each output is two products and a sum rounded once to the storage type.
#include <gtest/gtest.h>

#include <cmath>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

/// Note [rope: rotate half] as plain fp64 loops over a contiguous x (…, T, Dh).
Tensor<double> ref_rope(const Tensor<double>& x, double theta, std::int64_t offset, std::int64_t rotary_dim) {
  const std::int64_t dh = x.shape()[x.dim() - 1], t = x.shape()[x.dim() - 2], rows = x.numel() / (t * dh);
  const std::int64_t r = rotary_dim < 0 ? dh : rotary_dim, half = r / 2;
  Tensor<double> out = x.clone().detach();  // features [r, dh) pass through
  for (std::int64_t row = 0; row < rows; ++row)
    for (std::int64_t p = 0; p < t; ++p) {
      const double* xv = x.data() + (row * t + p) * dh;
      double* o = out.data() + (row * t + p) * dh;
      for (std::int64_t i = 0; i < half; ++i) {
        const double a = static_cast<double>(offset + p) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(r));
        o[i] = xv[i] * std::cos(a) - xv[i + half] * std::sin(a);
        o[i + half] = xv[i + half] * std::cos(a) + xv[i] * std::sin(a);
      }
    }
  return out;
}

OpEntry rope_entry() {
  OpEntry e = make_entry("rope", [](const auto& x, const I&, const Sample& s) {
    return tg::rope(x[0], s.args[0], static_cast<std::int64_t>(s.args[1]), static_cast<std::int64_t>(s.args[2]));
  });
  e.sample("bhtd", {{{2, 3, 5, 8}}}, {}, {10000, 0, -1})
      .sample("offset_theta", {{{1, 2, 4, 6}}}, {}, {500, 7, -1})
      .sample("partial_rotary", {{{2, 1, 5, 10}}}, {}, {10000, 3, 4})  // features 4..9 pass through
      .sample("transposed", {{{2, 2, 6, 4}, L::transposed}}, {}, {10000, 0, -1})
      .sample("strided", {{{1, 3, 3, 6}, L::strided}}, {}, {10000, 2, -1})
      .sample("rank2", {{{7, 2}}}, {}, {10000, 0, -1})                     // (T, Dh), one pair
      .sample("long_context", {{{1, 1, 3, 8}}}, {}, {10000, 100000, -1})  // angles of 10^5 radians
      .golden();
  e.reference([](const X& x, const I&, const Sample& s) {
    return ref_rope(x[0], s.args[0], static_cast<std::int64_t>(s.args[1]), static_cast<std::int64_t>(s.args[2]));
  });
  e.error("rank", [] { tg::rope(Tensor<float>::zeros({8})); }, "rope: x must be (..., T, Dh), e.g. (B,H,T,Dh), got [8]");
  e.error("odd_dh", [] { tg::rope(Tensor<float>::zeros({1, 2, 3, 5})); },
          "rope: the last dim Dh of x must be even and at least 2, got Dh = 5 (x is [1,2,3,5])");
  e.error("odd_rotary_dim", [] { tg::rope(Tensor<float>::zeros({1, 2, 3, 8}), 10000.0, 0, 3); },
          "rope: rotary_dim must be even and in [2, Dh = 8], got 3 (x is [1,2,3,8])");
  e.error("rotary_dim_too_large", [] { tg::rope(Tensor<float>::zeros({1, 2, 3, 8}), 10000.0, 0, 10); },
          "rope: rotary_dim must be even and in [2, Dh = 8], got 10 (x is [1,2,3,8])");
  e.error("theta", [] { tg::rope(Tensor<float>::zeros({2, 4}), -1.0); }, "rope: theta must be positive and finite, got -1");
  e.error("offset", [] { tg::rope(Tensor<float>::zeros({2, 4}), 10000.0, -2); }, "rope: offset must be >= 0, got -2");
  return e;
}
TG_REGISTER_OP(rope_entry());

// Decoding with a KV cache: rope of positions k.. (offset k) equals those rows of rope over the whole sequence.
TEST(OpDb_rope_behaviour, OffsetMatchesTheFullSequence) {
  Generator gen(5);
  const Tensor<float> x = Tensor<float>::normal({2, 3, 9, 8}, 0.f, 1.f, gen);
  const Tensor<float> full = tg::rope(x).narrow(2, 6, 3).contiguous();
  const Tensor<float> tail = tg::rope(x.narrow(2, 6, 3), 10000.0, 6);
  EXPECT_EQ(tail.to_vector(), full.to_vector());
}

// One op, one node; elementwise-like with fp32 math for 16-bit storage (its declared autocast rule).
TEST(OpDb_rope_behaviour, RecordsOneNodeAndDeclaresItsRule) {
  static_assert(amp::rule_of<amp::op::rope>::value == amp::Rule::fp32_math);
  static_assert(std::is_same_v<amp::kernel_math_t<amp::op::rope, bf16>, float>);
  Tensor<float> x = Tensor<float>::ones({1, 2, 3, 4});
  x.requires_grad_();
  auto rope_nodes = [] {
    std::int64_t n = 0;
    for (const auto& node : autodiff::current_tape().live_nodes()) n += std::string(node->op()) == "rope";
    return n;
  };
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const std::int64_t rope0 = rope_nodes();
  const Tensor<float> y = tg::rope(x);
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 1);
  EXPECT_EQ(rope_nodes(), rope0 + 1);
  ASSERT_TRUE(y.requires_grad());
}

}  // namespace
}  // namespace tg::testing

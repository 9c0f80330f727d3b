// Op database entry for scale_masked_softmax (ops/scale_masked_softmax.hpp, Note [fused scale, mask and softmax]):
// softmax(masked_fill(x · scale, mask, fill)) over the last dim, the mask broadcast to x's shape. Index input 0 is
// the mask (drawn in {0, 1}); args = {scale, fill}. Scales are powers of two and fills finite (a fully masked row
// of -inf has no softmax), so the reference needs no rounding of either. The behaviour tests check what the note
// promises: the values and the gradient equal mul, masked_fill and softmax (and the div, no-scale and no-mask
// forms) bit for bit in fp64, fp32, bf16 and fp16, and the node keeps only the output beside the mask.
//
// Tolerances: the defaults (softmax's).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <typegrad/ops/attention.hpp>
#include <typegrad/ops/scale_masked_softmax.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

OpEntry scale_masked_softmax_entry() {
  OpEntry e = make_entry("scale_masked_softmax", [](const auto& x, const I& idx, const Sample& s) {
    return tg::scale_masked_softmax(x[0], s.args[0], on_device_of(x[0], idx[0].template to<std::uint8_t>()), s.args[1]);
  });
  e.sample("attention", {{{2, 3, 6, 6}}}, {IndexSpec{{6, 6}, 0, 2}}, {0.5, -1024.0})
      .sample("same_shape", {{{3, 7}}}, {IndexSpec{{3, 7}, 0, 2}}, {2.0, -3.0})
      .sample("broadcast_col", {{{2, 5, 3}}}, {IndexSpec{{5, 1}, 0, 2}}, {0.25, -1024.0})
      .sample("strided", {{{3, 8}, L::strided}}, {IndexSpec{{8}, 0, 2}}, {0.125, -1024.0})
      .sample("transposed", {{{6, 5}, L::transposed}}, {IndexSpec{{6, 5}, 0, 2}}, {4.0, -8.0})
      .sample("scalar_mask", {{{4, 9}}}, {IndexSpec{{}, 0, 2}}, {0.5, -2.0})
      .sample("parallel", {{{40, 520}}}, {IndexSpec{{520}, 0, 2}}, {0.5, -1024.0});  // > 2^14 elements: OpenMP rows
  e.reference([](const X& x, const I& idx, const Sample& s) {
    const Tensor<double> m = idx[0].to<double>();
    const Tensor<double> v = tabulate(x[0].shape(), [&](const auto& i) {
      return at_broadcast(m, i) != 0 ? s.args[1] : at_broadcast(x[0], i) * s.args[0];
    });
    const std::int64_t n = v.dim() ? v.shape()[v.dim() - 1] : 1, rows = v.numel() / n;
    Tensor<double> out = Tensor<double>::empty(v.shape());
    for (std::int64_t r = 0; r < rows; ++r) {
      const double* p = v.data() + r * n;
      double mx = -INFINITY, sum = 0;
      for (std::int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
      for (std::int64_t j = 0; j < n; ++j) sum += std::exp(p[j] - mx);
      for (std::int64_t j = 0; j < n; ++j) out.data()[r * n + j] = std::exp(p[j] - mx) / sum;
    }
    return out;
  });
  e.error("not_broadcastable", [] { tg::scale_masked_softmax(Tensor<float>::zeros({2, 4}), 0.5, Tensor<std::uint8_t>::zeros({3})); },
          "scale_masked_softmax: the mask of shape [3] cannot be broadcast to the input's shape [2,4]");
  e.error("undefined_mask", [] { tg::scale_masked_softmax(Tensor<float>::zeros({2}), 0.5, Tensor<std::uint8_t>()); },
          "scale_masked_softmax: the mask is an undefined tensor");
  e.error("scale_shape", [] {
    const Tensor<float> s = Tensor<float>::ones({2});
    tg::detail::scale_masked_softmax_at<fp32, cpu>(Tensor<float>::zeros({2, 2}), &s, false, nullptr, 0.0);
  }, "scale_masked_softmax: the scale must be one element, got [2]");
  e.error("scale_grad", [] {
    Tensor<float> s = Tensor<float>::ones(Shape());
    s.requires_grad_();
    tg::detail::scale_masked_softmax_at<fp32, cpu>(Tensor<float>::zeros({2, 2}), &s, false, nullptr, 0.0);
  }, "scale_masked_softmax: the scale must not require a gradient");
  return e;
}
TG_REGISTER_OP(scale_masked_softmax_entry());

// Each form against its separate ops, the values and the gradient of x: equal bit for bit (Note [fused scale,
// mask and softmax]). form: 0 mul, mask, softmax; 1 div, mask, softmax; 2 mul, softmax; 3 mask, softmax.
template <class T>
void check_against_separate_ops(const Shape& shape, const Tensor<std::uint8_t>& mask, double scale, double fill, int form) {
  Generator gen(11);
  const Tensor<float> x0 = Tensor<float>::normal(shape, 0.f, 2.f, gen), u0 = Tensor<float>::normal(shape, 0.f, 1.f, gen);
  Tensor<T> xf = leaf_as<T>(x0), xu = leaf_as<T>(x0);
  const Tensor<T> u = u0.to<T>();
  const Tensor<T> s = Tensor<T>::full(Shape(), scale);
  const bool scaled = form != 3, masked = form != 2, divide = form == 1;
  const Tensor<T> f = tg::detail::scale_masked_softmax_at(xf, scaled ? &s : nullptr, divide, masked ? &mask : nullptr, fill);
  Tensor<T> v = xu;
  if (scaled) v = divide ? tg::div(v, scale) : tg::mul(v, scale);
  if (masked) v = tg::masked_fill(v, mask, fill);
  const Tensor<T> y = tg::softmax(v);
  const std::string what = "form " + std::to_string(form) + " " + to_string(shape);
  EXPECT_TRUE(same_bits(f, y)) << what << ": the values";
  (f * u).backward(u);
  (y * u).backward(u);
  EXPECT_TRUE(same_bits(xf.grad(), xu.grad())) << what << ": dx";
}

template <class T>
void check_every_form() {
  for (int form = 0; form < 4; ++form) {
    check_against_separate_ops<T>({2, 3, 9, 9}, tg::causal_mask(9), 1.0 / 3.0, -INFINITY, form);
    check_against_separate_ops<T>({2, 4, 64, 64}, tg::causal_mask(64), 0.125, -INFINITY, form);  // the OpenMP path
    Generator g(3);
    const Tensor<std::uint8_t> m = Tensor<float>::uniform({5, 1, 13}, 0.f, 2.f, g).to<std::uint8_t>();  // 0 or 1
    check_against_separate_ops<T>({5, 3, 13}, tg::causal_mask(13).narrow(0, 0, 1), 0.7, -30.0, form);    // a [1,13] row
    check_against_separate_ops<T>({5, 3, 13}, m, 1.5, -30.0, form);
    check_against_separate_ops<T>({2, 11, 11}, tg::causal_mask(11).transpose(0, 1), 0.3, -30.0, form);  // mask stride 11 in a row
  }
}

// softmax's autocast rule: storage in the compute type, fp32 math for 16-bit storage (the kernels are softmax's).
static_assert(amp::rule_of<amp::op::scale_masked_softmax>::value == amp::Rule::fp32_math);
static_assert(std::is_same_v<amp::kernel_math_t<amp::op::scale_masked_softmax, bf16>, amp::kernel_math_t<amp::op::softmax, bf16>>);
static_assert(std::is_same_v<amp::kernel_math_t<amp::op::scale_masked_softmax, fp64>, double>);

TEST(OpDb_scale_masked_softmax_behaviour, EqualsTheSeparateOpsBitForBit) {
  check_every_form<fp32>();
  check_every_form<bf16>();
  check_every_form<fp16>();
  check_every_form<fp64>();
}

// attention_composite's middle (mul by 1/sqrt(hs), the causal mask, softmax) as the fused op: the same attention.
TEST(OpDb_scale_masked_softmax_behaviour, IsTheCompositeAttentionsMiddle) {
  Generator gen(5);
  const std::int64_t B = 2, H = 3, Tn = 17, hs = 8;
  const Tensor<float> q = Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen), k = Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen),
                      v = Tensor<float>::normal({B, H, Tn, hs}, 0.f, 1.f, gen);
  const Tensor<float> ref = tg::attention_composite(q, k, v);
  const Tensor<float> p = tg::scale_masked_softmax(tg::matmul(q, k.transpose(-2, -1)), 1.0 / std::sqrt(8.0), tg::causal_mask(Tn));
  EXPECT_TRUE(same_bits(tg::matmul(p, v), ref));
}

// One node that keeps y (and the mask and scale): the separate ops keep mul's input as well.
TEST(OpDb_scale_masked_softmax_behaviour, RecordsOneNode) {
  Tensor<float> x = Tensor<float>::ones({2, 4});
  x.requires_grad_();
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const Tensor<float> y = tg::scale_masked_softmax(x, 0.5, tg::causal_mask(4).narrow(0, 1, 1));  // [1,4]: 0 0 1 1
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 1);
  const std::vector<float> got = y.to_vector();
  const std::vector<float> want = {0.5f, 0.5f, 0.f, 0.f, 0.5f, 0.5f, 0.f, 0.f};
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace tg::testing

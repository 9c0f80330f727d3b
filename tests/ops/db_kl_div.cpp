// Op database entry for kl_div (ops/kl_div.hpp, Note [kl_div: batchmean over rows]): (1/R) Σ exp(t)·(t − x)
// over R = numel / V rows of log-probabilities x = log q (input) and t = log p (target). Samples with odd
// sizes, 1-D and 3-D inputs, non-contiguous layouts, one class per row, a teacher without gradient, and
// log-probabilities made by log_softmax (args = {1}: both inputs are logits, log_softmax'ed over the last
// dim first, as distillation and the PyTorch golden use the op; args = {0} or none: the op alone on raw
// values); its PyTorch golden (Note [goldens from the op database]); and behaviour the generic tests cannot
// express (one tape node and the autocast rule, zero for equal inputs, masked teacher tokens, the value
// does not depend on the thread count, the fp32 loss of 16-bit inputs, no rows).
//
// Tolerances: the defaults. Inputs are rounded to the precision under test before the reference sees them;
// the math is fp32 (fp64 for fp64) with one rounding of the loss and of each gradient element. With
// args = {1} the 16-bit log_softmax outputs are rounded too (log-probabilities above -8: bf16 steps of
// 2^-5 at most), which the bf16 / fp16 defaults absorb for these sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "ops/op_db.hpp"
#include "typegrad/detail/cpu/kernels.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

bool from_logits(const Sample& s) { return !s.args.empty() && s.args[0] != 0; }

/// log_softmax of one row of n values, in place (fp64, max-subtracted).
void ref_log_softmax(double* r, std::int64_t n) {
  double m = -INFINITY, se = 0;
  for (std::int64_t j = 0; j < n; ++j) m = std::max(m, r[j]);
  for (std::int64_t j = 0; j < n; ++j) se += std::exp(r[j] - m);
  const double l = m + std::log(se);
  for (std::int64_t j = 0; j < n; ++j) r[j] -= l;
}

OpEntry kl_div_entry() {
  OpEntry e = make_entry("kl_div", [](const auto& x, const I&, const Sample& s) {
    return from_logits(s) ? tg::kl_div(tg::log_softmax(x[0]), tg::log_softmax(x[1])) : tg::kl_div(x[0], x[1]);
  });
  e.sample("rows", {{{5, 7}, -4.0, 0.5}, {{5, 7}, -4.0, 0.5}})
      .sample("one_dim", {{{11}, -4.0, 0.5}, {{11}, -4.0, 0.5}})                         // one distribution, R = 1
      .sample("rank3", {{{2, 3, 9}, -4.0, 0.5}, {{2, 3, 9}, -4.0, 0.5}})                 // R = 6
      .sample("transposed", {{{6, 5}, -4.0, 0.5, L::transposed}, {{6, 5}, -4.0, 0.5, L::transposed}})
      .sample("strided", {{{3, 8}, -4.0, 0.5, L::strided}, {{3, 8}, -4.0, 0.5}})
      .sample("one_class", {{{4, 1}, -2.0, 0.0}, {{4, 1}, -2.0, 0.0}})                   // V = 1
      .sample("teacher_constant", {{{3, 6}, -4.0, 0.5}, InputSpec({3, 6}, -4.0, 0.5).constant()})
      .sample("logits", {{{4, 13}, -3.0, 3.0}, {{4, 13}, -3.0, 3.0}}, {}, {1})            // log_softmax'ed first
      .sample("logits_rank3_transposed", {{{2, 5, 6}, -3.0, 3.0, L::transposed}, {{2, 5, 6}, -3.0, 3.0}}, {}, {1})
      .golden();
  e.reference([](const X& x, const I&, const Sample& s) {
    const std::int64_t V = x[0].shape()[x[0].dim() - 1], rows = x[0].numel() / V;
    std::vector<double> lq(static_cast<std::size_t>(V)), lp(static_cast<std::size_t>(V));
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t j = 0; j < V; ++j) {
        lq[static_cast<std::size_t>(j)] = x[0].data()[r * V + j];
        lp[static_cast<std::size_t>(j)] = x[1].data()[r * V + j];
      }
      if (from_logits(s)) {
        ref_log_softmax(lq.data(), V);
        ref_log_softmax(lp.data(), V);
      }
      for (std::size_t j = 0; j < lq.size(); ++j) total += std::exp(lp[j]) * (lp[j] - lq[j]);
    }
    return Tensor<double>::full(Shape(), total / static_cast<double>(rows));
  });
  e.error("shape", [] { tg::kl_div(Tensor<float>::zeros({3, 5}), Tensor<float>::zeros({3, 6})); },
          "kl_div: input and target must have the same shape (..., V): input is [3,5], target is [3,6]");
  e.error("rank", [] { tg::kl_div(Tensor<float>::zeros({2, 3, 5}), Tensor<float>::zeros({6, 5})); },
          "kl_div: input and target must have the same shape (..., V): input is [2,3,5], target is [6,5]");
  e.error("scalar", [] { tg::kl_div(Tensor<float>::full(Shape(), 0.0), Tensor<float>::full(Shape(), 0.0)); },
          "kl_div: input must have at least one dim (..., V) of log-probabilities, got []");
  e.error("empty_classes", [] { tg::kl_div(Tensor<float>::zeros({3, 0}), Tensor<float>::zeros({3, 0})); },
          "kl_div: the last dim V (the classes of each distribution) must not be empty, got V = 0 (input is [3,0])");
  return e;
}
TG_REGISTER_OP(kl_div_entry());

/// Log-probabilities of random logits (B, V) in fp32, normal with standard deviation `sd`.
Tensor<float> random_log_probs(std::int64_t rows, std::int64_t v, float sd, std::uint64_t seed) {
  Generator gen(seed);
  NoGrad ng;
  return tg::log_softmax(Tensor<float>::normal({rows, v}, 0.f, sd, gen)).detach();
}

// One op, one node; fp32_math (its declared autocast rule), fp32 registers for 16-bit storage; a 0-dim result.
TEST(OpDb_kl_div_behaviour, RecordsOneNodeAndDeclaresItsRule) {
  static_assert(amp::rule_of<amp::op::kl_div>::value == amp::Rule::fp32_math);
  static_assert(std::is_same_v<amp::kernel_math_t<amp::op::kl_div, bf16>, float>);
  static_assert(std::is_same_v<amp::kernel_math_t<amp::op::kl_div, fp64>, double>);
  Tensor<float> x = random_log_probs(3, 8, 1.f, 1), t = random_log_probs(3, 8, 1.f, 2);
  x.requires_grad_();
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const Tensor<float> y = tg::kl_div(x, t);
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 1);
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(y.dim(), 0);
}

// KL(p ‖ p) = 0 exactly (every term is p·0); KL(p ‖ q) > 0 for distinct distributions (Gibbs' inequality).
TEST(OpDb_kl_div_behaviour, ZeroForEqualDistributionsPositiveOtherwise) {
  const Tensor<float> p = random_log_probs(5, 17, 2.f, 3), q = random_log_probs(5, 17, 2.f, 4);
  EXPECT_EQ(tg::kl_div(p, p).item(), 0.f);
  EXPECT_GT(tg::kl_div(q, p).item(), 0.f);
  EXPECT_GT(tg::kl_div(p, q).item(), 0.f);
}

// A teacher that does not require grad gets none; the student's gradient is −p / R.
TEST(OpDb_kl_div_behaviour, TeacherWithoutGradGetsNone) {
  Tensor<double> x = random_log_probs(4, 6, 1.f, 5).to<double>().detach();
  const Tensor<double> t = random_log_probs(4, 6, 1.f, 6).to<double>().detach();
  x.requires_grad_();
  tg::kl_div(x, t).backward();
  EXPECT_FALSE(t.grad().defined());
  ASSERT_TRUE(x.grad().defined());
  const auto g = x.grad().to_vector(), tv = t.to_vector();
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_NEAR(g[i], -std::exp(tv[i]) / 4.0, 1e-15) << i;
}

// A token the teacher masked out (log p = −inf) adds 0 and gets gradients 0, where exp(t)·(t − x) would be
// 0·(−inf) = NaN; a student that also masks it (−inf − (−inf)) is fine too.
TEST(OpDb_kl_div_behaviour, MaskedTeacherTokensAddNothing) {
  const float ninf = -std::numeric_limits<float>::infinity();
  Tensor<float> x = Tensor<float>::from_values({2, 3}, {-1.f, -0.5f, -2.f, -1.f, ninf, -0.3f});
  Tensor<float> t = Tensor<float>::from_values({2, 3}, {-0.7f, -0.9f, ninf, -0.2f, ninf, ninf});
  x.requires_grad_();
  t.requires_grad_();
  const Tensor<float> loss = tg::kl_div(x, t);
  const double want =  // the three terms with p > 0, over R = 2 rows
      (std::exp(-0.7) * (-0.7 + 1.0) + std::exp(-0.9) * (-0.9 + 0.5) + std::exp(-0.2) * (-0.2 + 1.0)) / 2.0;
  EXPECT_NEAR(loss.item(), want, 1e-6);
  loss.backward();
  const auto dx = x.grad().to_vector(), dt = t.grad().to_vector();
  for (std::size_t i = 0; i < dx.size(); ++i) {
    EXPECT_TRUE(std::isfinite(dx[i]) && std::isfinite(dt[i])) << i << ": " << dx[i] << ", " << dt[i];
  }
  for (std::size_t i : {2u, 4u, 5u}) {
    EXPECT_EQ(dx[i], 0.f) << i;
    EXPECT_EQ(dt[i], 0.f) << i;
  }
}

// Rows are summed in a fixed order: the loss is bit for bit the same on 1 and 2 threads (above the
// kernel's single-thread threshold).
TEST(OpDb_kl_div_behaviour, DoesNotDependOnTheThreadCount) {
  const Tensor<float> x = random_log_probs(96, 1001, 3.f, 7), t = random_log_probs(96, 1001, 3.f, 8);
  backend::cpu::set_num_threads(1);
  const float one = tg::kl_div(x, t).item();
  backend::cpu::set_num_threads(2);
  const float two = tg::kl_div(x, t).item();
  backend::cpu::set_num_threads(0);
  EXPECT_EQ(one, two);
}

// kl_div_as<fp32> of bf16 inputs: an fp32 loss, the fp32 op's value on the bf16-rounded inputs (the same
// fp32 math), and bf16 gradients.
TEST(OpDb_kl_div_behaviour, SixteenBitInputsGiveAnFp32Loss) {
  const Tensor<bf16> x = random_log_probs(6, 50, 2.f, 9).to<bf16>().detach();
  Tensor<bf16> xg = x.clone().detach();
  const Tensor<bf16> t = random_log_probs(6, 50, 2.f, 10).to<bf16>().detach();
  xg.requires_grad_();
  const Tensor<float> loss = tg::kl_div_as<float>(xg, t);
  static_assert(std::is_same_v<decltype(loss), const Tensor<float>>);
  EXPECT_EQ(loss.item(), tg::kl_div(x.to<float>().detach(), t.to<float>().detach()).item());
  loss.backward();
  ASSERT_TRUE(xg.grad().defined());
  EXPECT_EQ(xg.grad().shape(), x.shape());
}

// No rows: a mean over nothing is NaN (as torch's); the gradient is zeros of the input's shape.
TEST(OpDb_kl_div_behaviour, NoRowsGiveNaN) {
  Tensor<float> x = Tensor<float>::zeros({0, 5});
  x.requires_grad_();
  const Tensor<float> loss = tg::kl_div(x, Tensor<float>::zeros({0, 5}));
  EXPECT_TRUE(std::isnan(loss.item()));
  loss.backward();
  EXPECT_EQ(x.grad().shape(), (Shape{0, 5}));
}

}  // namespace
}  // namespace tg::testing

// The distillation loss (quant/distill.hpp, Note [distillation loss]): its value against the formula written
// as plain fp64 loops, a finite-difference gradcheck of the whole loss w.r.t. the student's logits in fp64,
// the edge weights (alpha = 0 is cross_entropy bit for bit, alpha = 1 needs no targets), the teacher getting
// no gradient, the fp32 loss of 16-bit logits, and the argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "typegrad/quant/distill.hpp"
#include "typegrad/typegrad.hpp"

namespace tg::testing {
namespace test_distill_cpp {  // the file's own names (Note [unity test sources])

constexpr std::int64_t kB = 2, kT = 3, kV = 7;

Tensor<double> logits(std::uint64_t seed, double sd = 2.0) {
  Generator gen(seed);
  return Tensor<double>::normal({kB, kT, kV}, 0.f, static_cast<float>(sd), gen);
}
Tensor<std::int64_t> targets(std::uint64_t seed, std::int64_t ignored_at = -1) {
  Generator gen(seed);
  Tensor<std::int64_t> y = Tensor<std::int64_t>::empty({kB, kT});
  for (std::int64_t i = 0; i < y.numel(); ++i) y.data()[i] = static_cast<std::int64_t>(gen.next_u64() % kV);
  if (ignored_at >= 0) y.data()[ignored_at] = -100;
  return y;
}

/// The Note's formula in fp64 loops over contiguous (rows, V) data: α τ² KL(softmax(t/τ) ‖ softmax(s/τ)) +
/// (1 − α) CE(s, y), the KL a mean over all rows, the CE over the rows whose target is not -100.
double reference_loss(const std::vector<double>& s, const std::vector<double>& t, const std::vector<std::int64_t>& y,
                      double alpha, double tau) {
  const std::size_t V = static_cast<std::size_t>(kV), rows = s.size() / V;
  auto log_softmax = [V](const double* z, double scale, std::vector<double>& out) {
    double m = -INFINITY, se = 0;
    for (std::size_t j = 0; j < V; ++j) m = std::max(m, z[j] * scale);
    for (std::size_t j = 0; j < V; ++j) se += std::exp(z[j] * scale - m);
    for (std::size_t j = 0; j < V; ++j) out[j] = z[j] * scale - m - std::log(se);
  };
  std::vector<double> lq(V), lp(V);
  double kl = 0, ce = 0;
  std::int64_t counted = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    log_softmax(s.data() + r * V, 1.0 / tau, lq);
    log_softmax(t.data() + r * V, 1.0 / tau, lp);
    for (std::size_t j = 0; j < V; ++j) kl += std::exp(lp[j]) * (lp[j] - lq[j]);
    if (y[r] == -100) continue;
    log_softmax(s.data() + r * V, 1.0, lq);
    ce -= lq[static_cast<std::size_t>(y[r])];
    ++counted;
  }
  return alpha * tau * tau * kl / static_cast<double>(rows) + (1 - alpha) * ce / static_cast<double>(counted);
}

TEST(Distill, ValueMatchesTheFormulaInFp64) {
  const Tensor<double> s = logits(1), t = logits(2);
  const Tensor<std::int64_t> y = targets(3, 4);
  const std::vector<std::pair<float, float>> weights = {{0.5f, 2.f}, {0.25f, 1.f}, {0.9f, 4.f}, {1.f, 3.f}};
  for (const auto& [alpha, tau] : weights) {
    SCOPED_TRACE("alpha " + std::to_string(alpha) + ", tau " + std::to_string(tau));
    const double want = reference_loss(s.to_vector(), t.to_vector(), y.to_vector(), alpha, tau);
    const Tensor<double> got = quant::distillation_loss(s, t, y, alpha, tau);
    EXPECT_EQ(got.dim(), 0);
    EXPECT_NEAR(got.item(), want, 1e-12 * std::abs(want));
    const Tensor<float> got32 = quant::distillation_loss(s.to<float>().detach(), t.to<float>().detach(), y, alpha, tau);
    EXPECT_NEAR(got32.item(), want, 2e-6 * std::abs(want));
  }
}

// Backward of the whole composite against central differences at every element of the student's logits.
TEST(Distill, GradcheckWrtStudentLogitsFp64) {
  const Tensor<std::int64_t> y = targets(4, 2);
  const Tensor<double> t = logits(5);
  for (const auto& [alpha, tau] : std::vector<std::pair<float, float>>{{0.5f, 2.f}, {0.7f, 1.f}, {1.f, 0.5f}}) {
    SCOPED_TRACE("alpha " + std::to_string(alpha) + ", tau " + std::to_string(tau));
    Tensor<double> s = logits(6).clone().detach();
    s.requires_grad_();
    quant::distillation_loss(s, t, y, alpha, tau).backward();
    ASSERT_TRUE(s.grad().defined());
    const std::vector<double> analytic = s.grad().to_vector();
    NoGrad ng;
    Tensor<double> p = s.detach();
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      const double saved = p.data()[i], h = 1e-6 * std::max(1.0, std::abs(saved));
      p.data()[i] = saved + h;
      const double fp = quant::distillation_loss(p, t, y, alpha, tau).item();
      p.data()[i] = saved - h;
      const double fm = quant::distillation_loss(p, t, y, alpha, tau).item();
      p.data()[i] = saved;
      const double numeric = (fp - fm) / (2 * h), a = analytic[static_cast<std::size_t>(i)];
      EXPECT_LE(std::abs(a - numeric), 1e-6 + 1e-4 * std::abs(numeric)) << "element " << i << ": backward " << a
                                                                       << ", finite differences " << numeric;
    }
  }
}

// alpha = 0 is the cross-entropy op itself: the same value and the same gradient, bit for bit (fp32 logits,
// and bf16 logits against the fp32 loss the training step computes, cross_entropy_as<fp32>).
TEST(Distill, AlphaZeroIsCrossEntropyBitForBit) {
  const Tensor<std::int64_t> y = targets(7, 3);
  Tensor<float> s1 = logits(8).to<float>().detach(), s2 = s1.clone().detach();
  s1.requires_grad_();
  s2.requires_grad_();
  const Tensor<float> d = quant::distillation_loss(s1, logits(9).to<float>().detach(), y, 0.f, 2.f);
  const Tensor<float> c = tg::cross_entropy(s2, y);
  EXPECT_EQ(d.item(), c.item());
  d.backward();
  c.backward();
  EXPECT_EQ(s1.grad().to_vector(), s2.grad().to_vector());

  Tensor<bf16> h1 = logits(8).to<bf16>().detach(), h2 = h1.clone().detach();
  h1.requires_grad_();
  h2.requires_grad_();
  const Tensor<float> dh = quant::distillation_loss(h1, logits(9).to<bf16>().detach(), y, 0.f, 2.f);
  const Tensor<float> ch = tg::cross_entropy_as<float>(h2, y);
  EXPECT_EQ(dh.item(), ch.item());
  dh.backward();
  ch.backward();
  const auto g1 = h1.grad().to<float>().to_vector(), g2 = h2.grad().to<float>().to_vector();
  EXPECT_EQ(g1, g2);
}

// alpha = 1 is τ² · kl_div(log_softmax(s/τ), log_softmax(t/τ)) alone: targets are not read (an empty tensor
// is accepted).
TEST(Distill, AlphaOneNeedsNoTargets) {
  const Tensor<float> s = logits(10).to<float>().detach(), t = logits(11).to<float>().detach();
  const float tau = 3.f;
  const Tensor<float> got = quant::distillation_loss(s, t, Tensor<std::int64_t>::zeros({0}), 1.f, tau);
  const double tau64 = tau;
  const Tensor<float> want = tg::kl_div(tg::log_softmax(s / tau64), tg::log_softmax(t / tau64)) * (tau64 * tau64);
  EXPECT_EQ(got.item(), want.item());
  EXPECT_EQ(quant::distillation_loss(s, t, targets(12), 1.f, tau).item(), got.item());  // real targets: the same
}

// The teacher never gets a gradient, even when it requires one; the student does.
TEST(Distill, TeacherGetsNoGradient) {
  Tensor<double> s = logits(13).clone().detach(), t = logits(14).clone().detach();
  s.requires_grad_();
  t.requires_grad_();
  const Tensor<double> loss = quant::distillation_loss(s, t, targets(15), 0.5f, 2.f);
  ASSERT_TRUE(loss.requires_grad());
  loss.backward();
  EXPECT_TRUE(s.grad().defined());
  EXPECT_FALSE(t.grad().defined());
}

// 16-bit logits give an fp32 loss (as the training step's): the fp32 loss of the same (rounded) logits up to
// the CE kernel's reading of bf16 (the same fp32 math; the KL branch converts to fp32 first), and a bf16
// gradient of the student's shape.
TEST(Distill, SixteenBitLogitsGiveAnFp32Loss) {
  const Tensor<std::int64_t> y = targets(16);
  Tensor<bf16> s = logits(17).to<bf16>().detach();
  const Tensor<bf16> t = logits(18).to<bf16>().detach();
  s.requires_grad_();
  const Tensor<float> loss = quant::distillation_loss(s, t, y, 0.5f, 2.f);
  static_assert(std::is_same_v<decltype(loss), const Tensor<float>>);
  const Tensor<float> s32 = s.detach().to<float>().detach(), t32 = t.to<float>().detach();
  const float want = quant::distillation_loss(s32, t32, y, 0.5f, 2.f).item();
  EXPECT_NEAR(loss.item(), want, 1e-6 * std::abs(want));
  loss.backward();
  ASSERT_TRUE(s.grad().defined());
  EXPECT_EQ(s.grad().shape(), s.shape());
}

void expect_error(const std::function<void()>& f, const std::string& expected) {
  try {
    f();
    ADD_FAILURE() << "no tg::Error; expected \"" << expected << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(expected), std::string::npos)
        << "message \"" << e.what() << "\" lacks \"" << expected << "\"";
  }
}

TEST(Distill, Errors) {
  const Tensor<float> s = Tensor<float>::zeros({2, 3, 7}), t = Tensor<float>::zeros({2, 3, 7});
  const Tensor<std::int64_t> y = Tensor<std::int64_t>::zeros({2, 3});
  expect_error([&] { quant::distillation_loss(s, t, y, -0.1f, 2.f); },
               "distillation_loss: alpha (the weight of the distillation term) must be in [0, 1], got -0.1");
  expect_error([&] { quant::distillation_loss(s, t, y, 1.5f, 2.f); }, "must be in [0, 1], got 1.5");
  expect_error([&] { quant::distillation_loss(s, t, y, std::numeric_limits<float>::quiet_NaN(), 2.f); },
               "must be in [0, 1], got nan");
  expect_error([&] { quant::distillation_loss(s, t, y, 0.5f, 0.f); },
               "distillation_loss: temperature must be positive and finite, got 0");
  expect_error([&] { quant::distillation_loss(s, t, y, 0.5f, -2.f); },
               "temperature must be positive and finite, got -2");
  expect_error([&] { quant::distillation_loss(s, t, y, 0.5f, std::numeric_limits<float>::infinity()); },
               "temperature must be positive and finite, got inf");
  expect_error([&] { quant::distillation_loss(s, Tensor<float>::zeros({2, 3, 8}), y, 0.5f, 2.f); },
               "distillation_loss: teacher_logits must have the shape of student_logits [2,3,7], got [2,3,8]");
  expect_error([&] { quant::distillation_loss(s, t, Tensor<std::int64_t>::zeros({2, 4}), 0.5f, 2.f); },
               "distillation_loss: targets must be [2,3] for student_logits [2,3,7], got [2,4]");
  expect_error([&] { quant::distillation_loss(s, t, Tensor<std::int64_t>::zeros({2, 4}), 0.f, 2.f); },
               "distillation_loss: targets must be [2,3] for student_logits [2,3,7], got [2,4]");
  expect_error([&] { quant::distillation_loss(Tensor<float>::zeros({7}), Tensor<float>::zeros({7}), y, 0.5f, 2.f); },
               "distillation_loss: student_logits must be [N, V] or [B, T, V], got [7]");
  expect_error([&] { quant::distillation_loss(s, t, Tensor<std::int64_t>::full({2, 3}, 7), 0.5f, 2.f); },
               "cross_entropy: target 7 at position 0 is out of range for the number of classes V = 7");
}

}  // namespace test_distill_cpp
}  // namespace tg::testing

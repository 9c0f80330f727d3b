// Global-norm gradient clipping (PyTorch semantics, inf/NaN passthrough) and gradient accumulation as a
// type: N micro-batches equal one big batch in gradients and updated weights, for GradAccum<N> and
// GradAccumRuntime, and the schedule counts optimizer steps.
#include <limits>

#include "optim/optim_test_util.hpp"

namespace tg::optim::testing {
namespace test_clip_accum_cpp {  // the file's own names (Note [unity test sources])

TEST(OptimClip, ScalesByMaxNormOverTotalWhenAbove) {
  std::vector<Param> ps{Param("a", Tensor<fp32>::zeros({2})), Param("b", Tensor<fp32>::zeros({1})),
                        Param("c", Tensor<fp32>::zeros({3}))};
  set_grad(ps[0], Tensor<fp32>::from_values({2}, {3, 4}));
  set_grad(ps[1], Tensor<fp32>::from_values({1}, {12}));  // total = sqrt(9 + 16 + 144) = 13; c has no grad
  EXPECT_DOUBLE_EQ(grad_norm(ps), 13.0);
  EXPECT_DOUBLE_EQ(clip_grad_norm(ps, 20.0), 13.0);  // below: untouched
  EXPECT_EQ(ps[0].tensor.grad().to_vector(), (std::vector<float>{3.f, 4.f}));
  const double norm = clip_grad_norm(ps, 6.5);
  EXPECT_DOUBLE_EQ(norm, 13.0);  // the norm before clipping
  const float c = static_cast<float>(6.5 / (13.0 + 1e-6));
  EXPECT_FLOAT_EQ(ps[0].tensor.grad().at({0}), 3.f * c);
  EXPECT_FLOAT_EQ(ps[0].tensor.grad().at({1}), 4.f * c);
  EXPECT_FLOAT_EQ(ps[1].tensor.grad().at({0}), 12.f * c);
  EXPECT_NEAR(grad_norm(ps), 6.5, 1e-5);
  EXPECT_FALSE(ps[2].tensor.grad().defined());
}

TEST(OptimClip, NonFiniteNormsAreReturnedAndNothingIsScaled) {
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<Param> ps{Param("a", Tensor<fp32>::zeros({2})), Param("b", Tensor<fp32>::zeros({2}))};
    set_grad(ps[0], Tensor<fp32>::from_values({2}, {3, 4}));
    set_grad(ps[1], Tensor<fp32>::from_vector({2}, {bad, 1.f}));
    const double norm = clip_grad_norm(ps, 1.0);
    if (std::isnan(bad)) EXPECT_TRUE(std::isnan(norm));
    else EXPECT_TRUE(std::isinf(norm));
    EXPECT_EQ(ps[0].tensor.grad().to_vector(), (std::vector<float>{3.f, 4.f}));
  }
}

TEST(OptimClip, OptimizerOverloadCoversEveryGroup) {
  std::vector<Param> ps{Param("h.0.mlp.c_fc.weight", Tensor<fp32>::zeros({1, 2})), Param("h.0.mlp.c_fc.bias", Tensor<fp32>::zeros({1}))};
  Sgd opt(default_groups(ps, 0.1f), {});
  set_grad(ps[0], Tensor<fp32>::from_values({1, 2}, {6, 8}));
  set_grad(ps[1], Tensor<fp32>::from_values({1}, {0}));
  EXPECT_DOUBLE_EQ(clip_grad_norm(opt, 5.0), 10.0);
  EXPECT_NEAR(ps[0].tensor.grad().at({0, 1}), 4.f, 1e-5f);
  EXPECT_THROW(clip_grad_norm(opt, -1.0), Error);
}

// ---- gradient accumulation ----------------------------------------------------------------------
// y_i = Σ_f x_if·w_f + b, loss = mean_i (y_i − t_i)²  over a batch of rows of x.
struct TinyModel {
  std::vector<Param> ps;
  explicit TinyModel(std::uint64_t seed) : ps{make_param("lin.weight", {1, 5}, seed), make_param("lin.bias", {1}, seed + 1)} {}
  Tensor<fp32> loss(const Tensor<fp32>& x, const Tensor<fp32>& t) const {
    auto y = tg::add(tg::sum(tg::mul(x, ps[0].tensor), {1}), ps[1].tensor);  // (B)
    auto d = tg::sub(y, t);
    return tg::mean(tg::mul(d, d));
  }
};

template <class Accum>
void check_accumulation_matches_big_batch(Accum accum) {
  const std::int64_t N = accum.n(), b = 3, steps = 3;
  TinyModel big(7), small(7);
  Adam big_opt(big.ps, {.lr = 0.05f});
  Adam small_opt(small.ps, {.lr = 0.05f});
  Schedule big_sched = Warmup{2}.then(Cosine{.peak = 0.05f, .steps = 10, .min_lr = 0.005f});
  Schedule small_sched = big_sched;
  double worst_grad = 0, worst_weight = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    Generator gen(100 + s);
    const auto x = Tensor<fp32>::normal({N * b, 5}, 0.f, 1.f, gen);
    const auto t = Tensor<fp32>::normal({N * b}, 0.f, 1.f, gen);
    big.loss(x, t).backward();
    for (std::int64_t i = 0; i < N; ++i) {
      accum.scale(small.loss(x.narrow(0, i * b, b), t.narrow(0, i * b, b))).backward();
      if (i < N - 1) {
        EXPECT_FALSE(accum.micro_step(small_opt, small_sched));
        EXPECT_EQ(accum.micro_index(), i + 1);
      }
    }
    for (std::size_t k = 0; k < big.ps.size(); ++k)
      worst_grad = std::max(worst_grad, rel_err_inf(small.ps[k].tensor.grad(), big.ps[k].tensor.grad()));
    EXPECT_TRUE(accum.micro_step(small_opt, small_sched));
    big_opt.set_lr(big_sched.lr());
    big_opt.step();
    big_sched.advance();
    big_opt.zero_grad();
    for (std::size_t k = 0; k < big.ps.size(); ++k) {
      worst_weight = std::max(worst_weight, rel_err_inf(small.ps[k].tensor, big.ps[k].tensor));
      EXPECT_FALSE(small.ps[k].tensor.grad().defined());  // zeroed by micro_step
    }
  }
  EXPECT_LE(worst_grad, 1e-5);
  EXPECT_LE(worst_weight, 1e-5);
  EXPECT_EQ(small_sched.step(), small_opt.step_count());
  EXPECT_EQ(small_opt.step_count(), steps);
  EXPECT_EQ(accum.steps(), steps);
  EXPECT_FLOAT_EQ(small_opt.lr(), big_sched.lr_at(steps - 1));
}

TEST(OptimGradAccum, CompileTimeCountMatchesOneBigBatch) {
  static_assert(GradAccum<4>{}.n() == 4 && GradAccum<4>{}.loss_scale() == 0.25, "N is a compile-time constant");
  EXPECT_EQ(GradAccum<4>{}.n(), 4);
  EXPECT_DOUBLE_EQ(GradAccum<4>{}.loss_scale(), 0.25);
  check_accumulation_matches_big_batch(GradAccum<4>{});
}

TEST(OptimGradAccum, RuntimeCountMatchesOneBigBatch) {
  EXPECT_EQ(GradAccumRuntime{3}.n(), 3);
  check_accumulation_matches_big_batch(GradAccumRuntime{3});
  check_accumulation_matches_big_batch(GradAccumRuntime{1});
  EXPECT_THROW(GradAccumRuntime{0}, Error);
}

TEST(OptimGradAccum, ScaleFoldsOneOverNIntoTheLossGradient) {
  GradAccum<8> accum;
  Param p("w", Tensor<fp32>::ones({3}));
  accum.scale(tg::sum(tg::mul(p.tensor, 2.0))).backward();
  for (float g : p.tensor.grad().to_vector()) EXPECT_FLOAT_EQ(g, 0.25f);
}

TEST(OptimGradAccum, ClipsTheAccumulatedGradientBeforeStepping) {
  GradAccumRuntime accum{2};
  Param p("w", Tensor<fp32>::zeros({2}));
  Sgd opt({p}, {.lr = 1.f});
  Schedule sched = Constant{1.f};
  set_grad(p, Tensor<fp32>::from_values({2}, {3, 4}));
  EXPECT_FALSE(accum.micro_step(opt, sched, 1.0));
  EXPECT_TRUE(accum.micro_step(opt, sched, 1.0));
  EXPECT_DOUBLE_EQ(accum.last_grad_norm(), 5.0);
  EXPECT_NEAR(p.tensor.at({0}), -0.6f, 1e-6f);  // p −= lr·g·(1/5)
  EXPECT_NEAR(p.tensor.at({1}), -0.8f, 1e-6f);
}

// Note [non-finite steps without a scaler]: stop throws before any update, skip drops the step like a
// scaler's overflow, apply (the default) steps as before; a finite step with the guard on equals one without.
TEST(OptimGradAccum, NonFiniteGradientStopsOrSkipsWithoutUpdating) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (float bad : {nan, inf}) {
    GradAccumRuntime accum{1};
    accum.on_non_finite(OnNonFinite::stop);
    Param p("w", Tensor<fp32>::ones({2}));
    Adam opt({p}, {.lr = 0.1f});
    Schedule sched = Constant{0.1f};
    set_grad(p, Tensor<fp32>::from_vector({2}, {bad, 1.f}));
    EXPECT_THROW(accum.micro_step(opt, sched, std::nullopt), NonFiniteStep);
    EXPECT_EQ(p.tensor.to_vector(), (std::vector<float>{1.f, 1.f}));
    EXPECT_EQ(sched.step(), 0);
    EXPECT_EQ(accum.steps(), 0);
    EXPECT_EQ(accum.micro_index(), 0);
    for (const auto& e : opt.state_tensors())  // no moment took the poison
      for (float v : e.tensor.to_vector()) EXPECT_TRUE(std::isfinite(v)) << e.name;

    accum.on_non_finite(OnNonFinite::skip);
    set_grad(p, Tensor<fp32>::from_vector({2}, {1.f, bad}));
    EXPECT_TRUE(accum.micro_step(opt, sched, 1.0));
    EXPECT_TRUE(accum.last_step_skipped());
    EXPECT_EQ(accum.skipped_steps(), 1);
    EXPECT_EQ(p.tensor.to_vector(), (std::vector<float>{1.f, 1.f}));
    EXPECT_EQ(sched.step(), 0);

    accum.on_non_finite(OnNonFinite::apply);  // the default: the poison goes in
    set_grad(p, Tensor<fp32>::from_vector({2}, {1.f, bad}));
    EXPECT_TRUE(accum.micro_step(opt, sched, std::nullopt));
    EXPECT_FALSE(std::isfinite(p.tensor.at({1})));
  }
}

TEST(OptimGradAccum, NonFiniteLossStopsEvenWithFiniteGradients) {
  GradAccumRuntime accum{2};
  accum.on_non_finite(OnNonFinite::stop);
  Param p("w", Tensor<fp32>::zeros({2}));
  Sgd opt({p}, {.lr = 1.f});
  Schedule sched = Constant{1.f};
  set_grad(p, Tensor<fp32>::from_values({2}, {3, 4}));
  accum.note_loss(1.5);
  EXPECT_FALSE(accum.micro_step(opt, sched, std::nullopt));
  accum.note_loss(std::numeric_limits<double>::infinity());
  try {
    accum.micro_step(opt, sched, std::nullopt);
    ADD_FAILURE() << "no NonFiniteStep";
  } catch (const NonFiniteStep& e) {
    EXPECT_NE(std::string(e.what()).find("the loss is inf; no update was applied"), std::string::npos) << e.what();
  }
  EXPECT_EQ(p.tensor.to_vector(), (std::vector<float>{0.f, 0.f}));
  // The flag does not outlive its step: the next finite step applies, and its norm is measured.
  set_grad(p, Tensor<fp32>::from_values({2}, {3, 4}));
  accum.note_loss(0.5);
  EXPECT_FALSE(accum.micro_step(opt, sched, std::nullopt));
  EXPECT_TRUE(accum.micro_step(opt, sched, std::nullopt));
  EXPECT_DOUBLE_EQ(accum.last_grad_norm(), 5.0);
  EXPECT_EQ(p.tensor.to_vector(), (std::vector<float>{-3.f, -4.f}));
}

TEST(OptimGradAccum, GuardedFiniteStepEqualsUnguardedStep) {
  for (bool clip : {false, true}) {
    TinyModel a(3), b(3);
    Adam opt_a(a.ps, {.lr = 0.05f}), opt_b(b.ps, {.lr = 0.05f});
    Schedule sa = Constant{0.05f}, sb = Constant{0.05f};
    GradAccumRuntime acc_a{1}, acc_b{1};
    acc_b.on_non_finite(OnNonFinite::stop);
    const std::optional<double> max_norm = clip ? std::optional<double>(0.1) : std::nullopt;
    for (int s = 0; s < 3; ++s) {
      Generator gen(10 + s);
      const auto x = Tensor<fp32>::normal({4, 5}, 0.f, 1.f, gen);
      const auto t = Tensor<fp32>::normal({4}, 0.f, 1.f, gen);
      a.loss(x, t).backward();
      const auto lb = b.loss(x, t);
      acc_b.note_loss(lb.item());
      lb.backward();
      acc_a.micro_step(opt_a, sa, max_norm);
      acc_b.micro_step(opt_b, sb, max_norm);
    }
    for (std::size_t i = 0; i < a.ps.size(); ++i) EXPECT_EQ(a.ps[i].tensor.to_vector(), b.ps[i].tensor.to_vector());
  }
}

}  // namespace test_clip_accum_cpp
}  // namespace tg::optim::testing

// LR schedules: exact values at key steps of constant, warmup, cosine, linear and inverse-sqrt schedules,
// their composition, the stateful stepper, and argument errors.
#include "optim/optim_test_util.hpp"

namespace tg::optim::testing {
namespace test_schedule_cpp {  // the file's own names (Note [unity test sources])

TEST(OptimSchedule, ConstantIsConstant) {
  const Schedule s = Constant{0.25f};
  EXPECT_EQ(s.lr_at(0), 0.25f);
  EXPECT_EQ(s.lr_at(123456), 0.25f);
  EXPECT_EQ(s.peak_lr(), 0.25f);
}

TEST(OptimSchedule, WarmupThenCosineKeyValues) {
  const Schedule s = Warmup{10}.then(Cosine{.peak = 1.f, .steps = 100, .min_lr = 0.1f});
  EXPECT_FLOAT_EQ(s.lr_at(0), 0.1f);   // peak·1/10
  EXPECT_FLOAT_EQ(s.lr_at(4), 0.5f);   // peak·5/10
  EXPECT_FLOAT_EQ(s.lr_at(9), 1.f);    // the peak, at the last warmup step
  EXPECT_FLOAT_EQ(s.lr_at(10), 1.f);   // cosine at its step 0
  EXPECT_FLOAT_EQ(s.lr_at(35), 0.1f + 0.9f * 0.5f * (1.f + std::cos(3.14159265358979f / 4.f)));
  EXPECT_FLOAT_EQ(s.lr_at(60), 0.55f); // half way: min + (peak − min)/2
  EXPECT_FLOAT_EQ(s.lr_at(110), 0.1f); // the floor at the end
  EXPECT_FLOAT_EQ(s.lr_at(5000), 0.1f);
  for (int t = 10; t < 110; ++t) EXPECT_LE(s.lr_at(t + 1), s.lr_at(t)) << t;  // monotone decay
}

TEST(OptimSchedule, LinearDecayToFloor) {
  const Schedule s = LinearDecay{.peak = 1.f, .steps = 100, .min_lr = 0.2f};
  EXPECT_FLOAT_EQ(s.lr_at(0), 1.f);
  EXPECT_FLOAT_EQ(s.lr_at(25), 0.8f);
  EXPECT_FLOAT_EQ(s.lr_at(50), 0.6f);
  EXPECT_FLOAT_EQ(s.lr_at(100), 0.2f);
  EXPECT_FLOAT_EQ(s.lr_at(1000), 0.2f);
  const Schedule w = Warmup{4}.then(LinearDecay{.peak = 2.f, .steps = 10});
  EXPECT_FLOAT_EQ(w.lr_at(1), 1.f);
  EXPECT_FLOAT_EQ(w.lr_at(9), 1.f);   // 2 + (0 − 2)·5/10
  EXPECT_FLOAT_EQ(w.lr_at(14), 0.f);
}

TEST(OptimSchedule, InverseSqrtKeyValues) {
  const Schedule s = InverseSqrt{.peak = 1.f, .timescale = 4};
  EXPECT_FLOAT_EQ(s.lr_at(0), 1.f);
  EXPECT_FLOAT_EQ(s.lr_at(12), 0.5f);   // sqrt(4/16)
  EXPECT_FLOAT_EQ(s.lr_at(396), 0.1f);  // sqrt(4/400)
  const Schedule w = Warmup{4}.then(InverseSqrt{.peak = 1.f, .timescale = 4});
  EXPECT_FLOAT_EQ(w.lr_at(0), 0.25f);
  EXPECT_FLOAT_EQ(w.lr_at(3), 1.f);
  EXPECT_FLOAT_EQ(w.lr_at(16), 0.5f);   // peak·sqrt(W)/sqrt(step) at step 16
}

TEST(OptimSchedule, WarmupThenConstantIsLinearWarmup) {
  const Schedule s = Warmup{5}.then(Constant{0.5f});
  EXPECT_FLOAT_EQ(s.lr_at(0), 0.1f);
  EXPECT_FLOAT_EQ(s.lr_at(2), 0.3f);
  EXPECT_FLOAT_EQ(s.lr_at(4), 0.5f);
  EXPECT_FLOAT_EQ(s.lr_at(99), 0.5f);
  const Schedule none = Warmup{0}.then(Constant{0.5f});
  EXPECT_FLOAT_EQ(none.lr_at(0), 0.5f);
}

TEST(OptimSchedule, StepperAdvancesAndResumes) {
  Schedule s = Warmup{2}.then(Cosine{.peak = 1.f, .steps = 4, .min_lr = 0.f});
  EXPECT_EQ(s.step(), 0);
  EXPECT_FLOAT_EQ(s.lr(), 0.5f);
  EXPECT_FLOAT_EQ(s.advance(), 1.f);
  EXPECT_EQ(s.step(), 1);
  s.advance();
  s.advance();
  EXPECT_EQ(s.step(), 3);
  EXPECT_FLOAT_EQ(s.lr(), s.lr_at(3));
  EXPECT_FLOAT_EQ(s.lr(), 0.5f * (1.f + std::cos(3.14159265358979f / 4.f)));
  Schedule resumed = Warmup{2}.then(Cosine{.peak = 1.f, .steps = 4, .min_lr = 0.f});
  resumed.set_step(3);
  EXPECT_EQ(resumed.lr(), s.lr());
  EXPECT_THROW(resumed.set_step(-1), Error);
}

TEST(OptimSchedule, InvalidLengthsAreRejected) {
  EXPECT_THROW(Schedule(Cosine{.peak = 1.f, .steps = 0}), Error);
  EXPECT_THROW(Schedule(LinearDecay{.peak = 1.f, .steps = -3}), Error);
  EXPECT_THROW(Schedule(InverseSqrt{.peak = 1.f, .timescale = 0}), Error);
  EXPECT_THROW(Schedule(Warmup{-1}.then(Constant{1.f})), Error);
}

}  // namespace test_schedule_cpp
}  // namespace tg::optim::testing

// The step boundary on the device (Note [the step boundary on the device]): on the CPU a TrainStep whose
// boundary is decided by the boundary kernels equals the host boundary bit for bit over 20 AdamW steps (fp32,
// bf16 and fp16 with its dynamic scaler, dropout, accumulation 3, clipping, an injected inf, the scale's
// growth; SGD with momentum; LAMB, its trust ratios too; Adafactor), with the same step counts, schedule, scaler state, skipped steps and reported norms; under
// OnNonFinite stop and skip it applies nothing; compiled it replays; it rejects what it cannot do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/quant/distill.hpp>
#include <typegrad/train/step.hpp>

namespace {

using tg::testing::small_gpt;

tg::data::Batch batch(std::int64_t k) {
  return {tg::testing::random_tokens(3, 12, 50, 700 + 2 * static_cast<std::uint64_t>(k)),
          tg::testing::random_tokens(3, 12, 50, 701 + 2 * static_cast<std::uint64_t>(k))};
}

struct Scenario {
  float dropout = 0.1f;
  std::int64_t accum = 3;
  int steps = 20;
  int inf_step = -1;   // this step's loss is multiplied by inf
  int nan_step = -1;   // this step's loss is multiplied by NaN (its gradients turn NaN too)
  int bad_loss_step = -1;  // NaN is added to this step's loss (its gradients stay finite)
  double clip = 1.0;   // 0: no clipping
  tg::optim::OnNonFinite on_non_finite = tg::optim::OnNonFinite::apply;
  bool compiled = false;
  bool watch_launches = false;  // compiled: each replay's launches compared with the last's (Note [graph blockers])
  enum class Opt { adamw, sgd, lamb, adafactor } opt = Opt::adamw;  // SGD: with Nesterov momentum
  bool distill = false;  // the loss: distillation_loss (kl_div) against a teacher made of the detached logits
};

struct Outcome {
  std::vector<double> losses, norms, scales;
  std::vector<float> lrs;
  std::vector<bool> skipped;
  std::vector<std::vector<float>> weights;
  std::vector<tg::optim::NamedTensor> opt_state;
  tg::amp::ScalerState scaler;
  std::int64_t steps_taken = 0, steps_skipped = 0, schedule_step = 0, opt_steps = 0;
  float opt_lr = 0;
  int thrown = 0;
  std::vector<std::string> errors;     // the NonFiniteStep messages
  std::int64_t decided_on_device = 0;  // steps whose boundary the device decided
  std::int64_t captures = 0, replays = 0;
  std::vector<double> trust_ratios;  // LAMB's, by parameter
  std::vector<std::string> graph_reports;  // watch_launches: each comparison of a replay with the one before
  tg::capture::GraphReport graph;          // the last of them
};

/// AdamW, SGD with momentum, LAMB or Adafactor (Scenario::opt), over the default groups (two weight decays) with lr scales
/// 0.3 and 2 (the device reads the lr and multiplies by each group's scale).
std::unique_ptr<tg::optim::Optimizer> optimizer(const std::vector<tg::optim::Param>& ps, Scenario::Opt kind) {
  const bool sgd = kind == Scenario::Opt::sgd;
  auto groups = tg::optim::default_groups(ps, sgd ? 0.01f : 0.1f);
  EXPECT_EQ(groups.size(), 2u);
  groups[0].lr_scale = 0.3f;  // not exact in fp32: the product with the lr rounds
  groups[1].lr_scale = 2.f;
  if (sgd) return std::make_unique<tg::optim::Sgd>(std::move(groups), tg::optim::SgdOptions{.lr = 3e-2f, .momentum = 0.9f, .nesterov = true});
  if (kind == Scenario::Opt::adafactor)  // relative steps (ρ = min(lr, 1/sqrt(t))), a first moment, decay
    return std::make_unique<tg::optim::Adafactor>(std::move(groups), tg::optim::AdafactorOptions{.lr = 3e-3f, .beta1 = 0.9f, .weight_decay = 0.1f});
  if (kind == Scenario::Opt::lamb)
    return std::make_unique<tg::optim::Lamb>(std::move(groups),
                                             tg::optim::LambOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-6f, .weight_decay = 0.1f});
  return std::make_unique<tg::optim::AdamW>(std::move(groups),
                                            tg::optim::AdamWOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
}

template <class Policy, class Scaler = tg::amp::default_scaler_t<Policy>>
Outcome train(const Scenario& s, bool device, Scaler scaler = Scaler{}) {
  tg::Generator init(3), drop(4);
  tg::nn::GPT model(small_gpt(s.dropout), init);
  const auto ps = model.named_parameters();
  const auto owned = optimizer(ps, s.opt);
  tg::optim::Optimizer& opt = *owned;
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
  tg::train::StepOptions options;
  if (s.clip > 0) options.clip = s.clip;
  options.on_non_finite = s.on_non_finite;
  options.device_boundary = device;
  tg::train::TrainStep<Policy, tg::NoCheckpoint, tg::cpu, tg::optim::GradAccumRuntime, Scaler> step(
      ps, opt, sched, options, tg::optim::GradAccumRuntime(s.accum), scaler);
  const tg::Tensor<float> poison = tg::Tensor<float>::ones({}), bad = tg::Tensor<float>::zeros({});
  std::int64_t k = 0;
  auto one_step = [&]() {
    return step.run(model, [&] { return batch(k++); }, drop, [&](const auto& logits, const tg::data::Batch& b) {
      if (s.distill)  // a teacher computed on the device, as a model's would be: 0.7 times the student's logits
        return tg::add(tg::mul(tg::quant::distillation_loss(logits, tg::mul(logits.detach(), 0.7), b.targets, 0.5f, 2.f), poison), bad);
      return tg::add(tg::mul(step.precision().loss(logits, b.targets), poison), bad);
    });
  };
  auto compiled = tg::compile(one_step, {.watch_launches = s.watch_launches});
  compiled.set_parameters(ps);
  Outcome out;
  for (int i = 0; i < s.steps; ++i) {
    poison.data()[0] = i == s.inf_step ? std::numeric_limits<float>::infinity()
                       : i == s.nan_step ? std::numeric_limits<float>::quiet_NaN()
                                         : 1.f;
    bad.data()[0] = i == s.bad_loss_step ? std::numeric_limits<float>::quiet_NaN() : 0.f;
    try {
      const tg::train::StepResult r = s.compiled ? compiled() : one_step();
      out.losses.push_back(r.loss);
      out.norms.push_back(r.grad_norm);
      out.scales.push_back(r.scale);
      out.lrs.push_back(r.lr);
      out.skipped.push_back(r.skipped);
      if (compiled.graph_report().compared) out.graph_reports.push_back(compiled.graph_report().describe());
    } catch (const tg::optim::NonFiniteStep& e) {
      ++out.thrown;
      out.errors.push_back(e.what());
      out.losses.push_back(-1);
      out.norms.push_back(-1);
      out.scales.push_back(-1);
      out.lrs.push_back(-1);
      out.skipped.push_back(true);
    }
  }
  for (const auto& p : ps) out.weights.push_back(p.tensor.to_vector());
  out.opt_state = opt.state_tensors();
  out.scaler = step.scaler().state();
  out.steps_taken = step.steps_taken();
  out.steps_skipped = step.steps_skipped();
  out.schedule_step = sched.step();
  out.opt_steps = opt.step_count();
  out.opt_lr = opt.lr();
  out.decided_on_device = step.steps_decided_on_device();
  out.captures = compiled.captures();
  out.replays = compiled.replays();
  out.graph = compiled.graph_report();
  if (const auto* lamb = dynamic_cast<const tg::optim::Lamb*>(&opt))
    for (const auto& p : ps) out.trust_ratios.push_back(lamb->last_trust_ratio(p.name));
  return out;
}

bool same_double(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_same(const Outcome& got, const Outcome& ref, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << what;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_TRUE(same_double(got.losses[i], ref.losses[i])) << what << ": step " << i << " loss " << got.losses[i] << " vs " << ref.losses[i];
    EXPECT_TRUE(same_double(got.norms[i], ref.norms[i])) << what << ": step " << i << " norm " << got.norms[i] << " vs " << ref.norms[i];
    EXPECT_TRUE(same_double(got.scales[i], ref.scales[i])) << what << ": step " << i;
    EXPECT_EQ(got.lrs[i], ref.lrs[i]) << what << ": step " << i;
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << what << ": step " << i;
  }
  ASSERT_EQ(got.weights.size(), ref.weights.size());
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << what << ": tensor " << t;
  ASSERT_EQ(got.opt_state.size(), ref.opt_state.size()) << what;
  for (std::size_t i = 0; i < ref.opt_state.size(); ++i) {
    EXPECT_EQ(got.opt_state[i].name, ref.opt_state[i].name) << what;
    const auto a = got.opt_state[i].tensor.to_vector(), b = ref.opt_state[i].tensor.to_vector();
    ASSERT_EQ(a.size(), b.size()) << what << ": " << ref.opt_state[i].name;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << ": " << ref.opt_state[i].name;
  }
  EXPECT_EQ(got.scaler, ref.scaler) << what;
  EXPECT_EQ(got.steps_taken, ref.steps_taken) << what;
  EXPECT_EQ(got.steps_skipped, ref.steps_skipped) << what;
  EXPECT_EQ(got.schedule_step, ref.schedule_step) << what;
  EXPECT_EQ(got.opt_steps, ref.opt_steps) << what;
  EXPECT_EQ(got.opt_lr, ref.opt_lr) << what;
  EXPECT_EQ(got.thrown, ref.thrown) << what;
  EXPECT_EQ(got.errors, ref.errors) << what;
  ASSERT_EQ(got.trust_ratios.size(), ref.trust_ratios.size()) << what;
  for (std::size_t i = 0; i < ref.trust_ratios.size(); ++i)
    EXPECT_TRUE(same_double(got.trust_ratios[i], ref.trust_ratios[i])) << what << ": trust ratio " << i;
  // The device decided every step of `got`, none of `ref` (the comparison is of the two boundaries).
  EXPECT_EQ(got.decided_on_device, static_cast<std::int64_t>(got.losses.size())) << what;
  EXPECT_EQ(ref.decided_on_device, 0) << what;
}

// A micro-batch that throws drops its step whole (GradAccum::abandon_step), on either boundary: no gradient is left
// and the next call starts a new step at micro-batch 0, so training goes on as if the failed step had never begun
// (before, the next call stepped the optimizer after the failed step's remaining micro-batches, with its partial
// gradients in). Dropout 0: the failed step's forwards draw nothing.
TEST(DeviceBoundary, AMicroBatchThatThrowsDropsItsStepOnEitherBoundary) {
  for (const bool device : {false, true}) {
    auto run = [&](int fail_at) {  // fail_at: the call of the loss that throws in the first step (0: none)
      tg::Generator init(3), drop(4);
      tg::nn::GPT model(small_gpt(0.f), init);
      const auto ps = model.named_parameters();
      const auto owned = optimizer(ps, Scenario::Opt::adamw);
      tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
      tg::train::TrainStep<tg::amp::fp32_policy, tg::NoCheckpoint, tg::cpu, tg::optim::GradAccumRuntime> step(
          ps, *owned, sched, {.clip = 1.0, .device_boundary = device}, tg::optim::GradAccumRuntime(3));
      std::int64_t k = 0;
      int calls = 0;
      if (fail_at > 0) {
        EXPECT_THROW(step.run(model, [&] { return batch(k++); }, drop,
                              [&](const auto& logits, const tg::data::Batch& b) {
                                if (++calls == fail_at) throw tg::Error("an injected failure");
                                return step.precision().loss(logits, b.targets);
                              }),
                     tg::Error);
        EXPECT_EQ(step.steps_taken(), 0);
        EXPECT_EQ(owned->step_count(), 0);
        for (const auto& p : ps) EXPECT_FALSE(p.tensor.grad().defined()) << p.name << ": a partial gradient was kept";
      }
      k = 100;  // from here both runs train on the same batches
      std::vector<double> losses;
      for (int i = 0; i < 3; ++i) losses.push_back(step.run(model, [&] { return batch(k++); }, drop).loss);
      EXPECT_EQ(step.steps_taken(), 3);
      EXPECT_EQ(owned->step_count(), 3);
      std::vector<std::vector<float>> w;
      for (const auto& p : ps) w.push_back(p.tensor.to_vector());
      return std::pair{losses, w};
    };
    const auto ref = run(0);
    for (const int fail_at : {1, 2, 3}) {
      const auto got = run(fail_at);
      EXPECT_EQ(got.first, ref.first) << (device ? "device" : "host") << " boundary, failure at micro-batch " << fail_at - 1;
      EXPECT_EQ(got.second, ref.second) << (device ? "device" : "host") << " boundary, failure at micro-batch " << fail_at - 1;
    }
  }
}

TEST(DeviceBoundary, EqualsTheHostBoundaryFp32WithDropoutAccumulationAndClipping) {
  const Scenario s{};
  const Outcome ref = train<tg::amp::fp32_policy>(s, false);
  expect_same(train<tg::amp::fp32_policy>(s, true), ref, "fp32, dropout 0.1, accumulation 3, clip 1");
  // Clipping changed some steps (the comparison covers the clipped gradients).
  int clipped = 0;
  for (double n : ref.norms) clipped += n > 1.0;
  EXPECT_GT(clipped, 0) << "no step was clipped: the scenario does not test clipping";
}

TEST(DeviceBoundary, EqualsTheHostBoundaryBf16WithoutClipping) {
  const Scenario s{.clip = 0};
  expect_same(train<tg::amp::bf16_mixed>(s, true), train<tg::amp::bf16_mixed>(s, false), "bf16 mixed, no clipping");
}

TEST(DeviceBoundary, EqualsTheHostBoundaryFp16WithAnInfAndTheScalesGrowth) {
  // Growth every 4 clean steps and an overflow at step 6: the scale backs off and grows on both sides.
  const Scenario s{.inf_step = 6};
  const tg::amp::DynamicScaler scaler({.init_scale = 1024.0, .growth_interval = 4});
  const Outcome ref = train<tg::amp::fp16_mixed>(s, false, scaler);
  ASSERT_TRUE(ref.skipped[6]);
  EXPECT_EQ(ref.steps_skipped, 1);
  EXPECT_GT(ref.scaler.scale, 1024.0) << "the scale never grew: the scenario does not test growth";
  expect_same(train<tg::amp::fp16_mixed>(s, true, scaler), ref, "fp16 mixed, dynamic scaler, inf at step 6");
}

TEST(DeviceBoundary, AStaticScaleThatOverflowsSkipsEveryStep) {
  const Scenario s{.steps = 3};
  const Outcome got = train<tg::amp::fp16_mixed, tg::amp::StaticScaler>(s, true, tg::amp::StaticScaler(1e30));
  expect_same(got, train<tg::amp::fp16_mixed, tg::amp::StaticScaler>(s, false, tg::amp::StaticScaler(1e30)), "static scale 1e30");
  EXPECT_EQ(got.steps_skipped, 3);
  EXPECT_EQ(got.steps_taken, 0);
  EXPECT_EQ(got.opt_steps, 0) << "a skipped step's counts are taken back";
  EXPECT_EQ(got.schedule_step, 0);
  EXPECT_TRUE(got.opt_state.size() == 1) << "no parameter state is exported after skipped steps only";
}

TEST(DeviceBoundary, NonFiniteLossesSkipOrStopAsOnTheHost) {
  for (const auto policy : {tg::optim::OnNonFinite::skip, tg::optim::OnNonFinite::stop}) {
    // Step 3: the loss and the gradients NaN (the norm decides); step 6: only the loss NaN (the loss decides).
    const Scenario s{.steps = 8, .nan_step = 3, .bad_loss_step = 6, .on_non_finite = policy};
    const Outcome ref = train<tg::amp::bf16_mixed>(s, false);
    const std::string what = policy == tg::optim::OnNonFinite::skip ? "skip" : "stop";
    EXPECT_EQ(ref.thrown, policy == tg::optim::OnNonFinite::stop ? 2 : 0) << what;
    EXPECT_TRUE(ref.skipped[3]) << what;
    EXPECT_TRUE(ref.skipped[6]) << what;
    if (policy == tg::optim::OnNonFinite::stop) {
      ASSERT_EQ(ref.errors.size(), 2u);
      EXPECT_NE(ref.errors[1].find("the loss is nan"), std::string::npos) << ref.errors[1];
    }
    expect_same(train<tg::amp::bf16_mixed>(s, true), ref, what + " on NaN losses at steps 3 and 6");
  }
}

TEST(DeviceBoundary, CompiledItReplaysTheEagerSteps) {
  const Scenario s{.inf_step = 5, .compiled = true};
  Scenario eager = s;
  eager.compiled = false;
  const Outcome got = train<tg::amp::fp16_mixed>(s, true);
  expect_same(got, train<tg::amp::fp16_mixed>(eager, false), "compiled fp16, inf at step 5");
  EXPECT_EQ(got.captures, 1) << "the skipped step replayed too";
  EXPECT_EQ(got.replays, s.steps - 1);
}

TEST(DeviceBoundary, EqualsTheHostBoundaryWithSgdAndAnInf) {
  const Scenario s{.inf_step = 4, .opt = Scenario::Opt::sgd};
  const Outcome ref = train<tg::amp::fp16_mixed>(s, false);
  ASSERT_TRUE(ref.skipped[4]);
  expect_same(train<tg::amp::fp16_mixed>(s, true), ref, "SGD with Nesterov momentum, fp16, inf at step 4");
}

// LAMB (Note [LAMB on the device]): its kernels read skip, lr and t from the state and keep the trust ratios on
// the device; fp16 with an overflow at step 4 (skipped: the ratios stay those of step 3), dropout, accumulation
// 3, clipping; eager and compiled.
TEST(DeviceBoundary, EqualsTheHostBoundaryWithLambAndAnInf) {
  Scenario s{.inf_step = 4, .opt = Scenario::Opt::lamb};
  const Outcome ref = train<tg::amp::fp16_mixed>(s, false);
  ASSERT_TRUE(ref.skipped[4]);
  ASSERT_FALSE(ref.trust_ratios.empty());
  int away_from_one = 0;
  for (double r : ref.trust_ratios) away_from_one += r > 0 && r != 1.0;
  EXPECT_GT(away_from_one, 0) << "every trust ratio is 1 or 0: the scenario does not test them";
  expect_same(train<tg::amp::fp16_mixed>(s, true), ref, "LAMB, fp16, inf at step 4");
  s.compiled = true;
  const Outcome compiled = train<tg::amp::fp16_mixed>(s, true);
  expect_same(compiled, ref, "LAMB compiled, fp16, inf at step 4");
  EXPECT_EQ(compiled.replays, s.steps - 1);
}

// Adafactor: its kernels read skip, lr, β̂2_t and 1/sqrt(t) from the state (factored matrices, full vectors, a
// first moment, relative steps under the schedule's lr); fp16 with an overflow at step 3; eager and compiled.
TEST(DeviceBoundary, EqualsTheHostBoundaryWithAdafactorAndAnInf) {
  Scenario s{.inf_step = 3, .opt = Scenario::Opt::adafactor};
  const Outcome ref = train<tg::amp::fp16_mixed>(s, false);
  ASSERT_TRUE(ref.skipped[3]);
  expect_same(train<tg::amp::fp16_mixed>(s, true), ref, "Adafactor, fp16, inf at step 3");
  s.compiled = true;
  expect_same(train<tg::amp::fp16_mixed>(s, true), ref, "Adafactor compiled, fp16, inf at step 3");
}

// The scalars Adafactor's kernels resolve from a boundary state equal the host's adafactor_scalars bit for bit,
// on both sides of ρ = min(lr, 1/sqrt(t)) (the training runs above stay below 1/sqrt(t)), with and without
// relative steps; a skipped state resolves to nothing.
TEST(DeviceBoundary, AdafactorResolvesTheHostsScalars) {
  for (const bool relative : {true, false})
    for (const std::int64_t t : {std::int64_t{1}, std::int64_t{7}, std::int64_t{10000}, std::int64_t{123457}})
      for (const float lr : {1e-2f, 3e-3f, 0.7f})
        for (const float scale : {1.f, 0.3f}) {
          tg::optim::AdafactorOptions o;
          o.relative_step = relative;
          const float group_lr = lr * scale;  // BasicOptimizer's group lr
          const auto host = tg::optim::adafactor_scalars(o, group_lr, 0.f, t);
          std::vector<double> state(tg::backend::kBoundarySize);
          float factor = 0;
          tg::backend::BoundaryStart b;
          b.lr = lr;
          b.step = static_cast<double>(t - 1);
          std::tie(b.bc1, b.bc2) = tg::optim::adafactor_step_constants(o, t);
          tg::backend::cpu::boundary_begin<float>(state.data(), &factor, &b);
          auto dev = tg::optim::adafactor_scalars(o, 123.f, 0.f, 999);  // rho and beta2 are the state's
          dev.boundary = state.data();
          dev.lr_scale = scale;
          ASSERT_TRUE(tg::backend::resolve_boundary(dev));
          EXPECT_TRUE(same_double(dev.rho, host.rho)) << "t " << t << " lr " << lr << " scale " << scale << ": " << dev.rho << " vs " << host.rho;
          EXPECT_TRUE(same_double(dev.beta2, host.beta2)) << "t " << t;
          state[tg::backend::kSkip] = 1;
          EXPECT_FALSE(tg::backend::resolve_boundary(dev));
        }
}

/// An update rule that does not read a device boundary (reads_device_boundary() stays false).
class NoBoundaryRule final : public tg::optim::BasicOptimizer<tg::cpu> {
 public:
  explicit NoBoundaryRule(std::vector<tg::optim::Param> ps) : BasicOptimizer(one_group(std::move(ps)), 1e-3f, 0.f, "NoBoundaryRule") {}
  const char* name() const override { return "NoBoundaryRule"; }

 protected:
  std::vector<tg::optim::SlotSpec> slots(const tg::Shape&) const override { return {}; }
  void update(std::span<Update>) override {}
};

TEST(DeviceBoundary, RejectsWhatItCannotDecide) {
  tg::Generator init(3);
  tg::nn::GPT model(small_gpt(0.f), init);
  const auto ps = model.named_parameters();
  tg::optim::Schedule sched = tg::optim::Constant{1e-3f};
  {
    NoBoundaryRule rule(ps);
    try {
      tg::train::TrainStep<tg::amp::fp32_policy> step(ps, rule, sched, {.device_boundary = true});
      ADD_FAILURE() << "an update rule that does not read the boundary accepted one";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("device_boundary needs an optimizer that reads it"), std::string::npos) << e.what();
    }
  }
  {
    tg::optim::AdamW opt(ps, {.lr = 1e-3f});
    EXPECT_THROW((tg::train::TrainStep<tg::amp::fp32_policy>(ps, opt, sched, {.clip = -1.0, .device_boundary = true})), tg::Error);
  }
}

}  // namespace

// Note [graph blockers]: a compiled step whose boundary the device decides launches the same kernels with the
// same arguments on every replay (the lr, the step count, the scale and the Philox base reach its kernels
// through the step inputs in memory), with every optimizer, in fp16 with a skipped step and in bf16 with
// clipping; the host boundary's step does not (its reads, its per-step arguments).
template <class Policy>
tg::capture::GraphReport graph_report(Scenario::Opt kind, bool device, int steps, int inf_step, std::vector<std::string>* reports = nullptr,
                                      bool distill = false) {
  const Outcome o =
      train<Policy>({.steps = steps, .inf_step = inf_step, .compiled = true, .watch_launches = true, .opt = kind, .distill = distill}, device);
  if (reports) *reports = o.graph_reports;
  return o.graph;
}

TEST(DeviceBoundary, CompiledItsLaunchesAreTheSameEveryStep) {
  for (const auto kind : {Scenario::Opt::adamw, Scenario::Opt::sgd, Scenario::Opt::lamb, Scenario::Opt::adafactor}) {
    const std::string what = "optimizer " + std::to_string(static_cast<int>(kind));
    std::vector<std::string> reports;
    const auto fp16 = graph_report<tg::amp::fp16_mixed>(kind, true, 7, 4, &reports);  // step 4 overflows: skipped on the device
    EXPECT_GE(reports.size(), 3u) << what << ": each replay after the first compares with the one before";
    for (const auto& r : reports) EXPECT_NE(r.find(" 0 that a graph could not repeat"), std::string::npos) << what << " fp16: " << r;
    EXPECT_TRUE(fp16.graph_ready()) << what << " fp16: " << fp16.describe();
    EXPECT_GT(fp16.launches, 100u) << what;
    const auto bf16 = graph_report<tg::amp::bf16_mixed>(kind, true, 5, -1);
    EXPECT_TRUE(bf16.graph_ready()) << what << " bf16: " << bf16.describe();
  }
}

// A distilled step (quant::distillation_loss: kl_div, Note [kl_div: batchmean over rows]) keeps its one read: kl_div
// writes its loss on the device and its backward reads the upstream gradient there. Before, its forward read the
// row sums back and passed the loss to a fill as an argument (two blockers per micro-batch here), and its backward
// read the gradient (item(): a download on a GPU, unseen by the CPU's watch).
TEST(DeviceBoundary, ADistilledStepEqualsTheHostBoundaryAndIsGraphReady) {
  const Scenario s{.steps = 6, .inf_step = 3, .distill = true};
  expect_same(train<tg::amp::fp16_mixed>(s, true), train<tg::amp::fp16_mixed>(s, false), "distilled, fp16 with an inf");
  const Scenario b{.steps = 5, .distill = true};
  expect_same(train<tg::amp::bf16_mixed>(b, true), train<tg::amp::bf16_mixed>(b, false), "distilled, bf16");
  const auto fp16 = graph_report<tg::amp::fp16_mixed>(Scenario::Opt::adamw, true, 6, 3, nullptr, true);
  EXPECT_TRUE(fp16.graph_ready()) << fp16.describe();
  const auto bf16 = graph_report<tg::amp::bf16_mixed>(Scenario::Opt::adamw, true, 5, -1, nullptr, true);
  EXPECT_TRUE(bf16.graph_ready()) << bf16.describe();
  EXPECT_GT(bf16.launches, graph_report<tg::amp::bf16_mixed>(Scenario::Opt::adamw, true, 3, -1).launches)
      << "the distilled step's report counts its kl_div launches";
}

TEST(DeviceBoundary, TheHostBoundarysStepIsNotGraphReady) {
  // The same step with its boundary on the host: its dropouts draw at absolute positions and its boundary reads.
  const auto r = graph_report<tg::amp::bf16_mixed>(Scenario::Opt::adamw, false, 5, -1);
  ASSERT_TRUE(r.compared && r.same_sequence) << r.describe();
  EXPECT_FALSE(r.graph_ready());
  bool dropout = false, reads = false;
  for (const auto& b : r.blockers) {
    if (b.kernel == "dropout_forward" && b.changed == std::vector<int>{5}) dropout = true;  // the offset
    if (b.returns_value) reads = true;
  }
  EXPECT_TRUE(dropout) << r.describe();
  EXPECT_TRUE(reads) << r.describe();
}

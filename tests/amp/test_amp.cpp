// Mixed precision (include/typegrad/amp): policies and autocast rules, loss scalers (skip on inf with
// weights and optimizer state unchanged, backoff, growth, unscale before clipping, state round trip),
// per-step weight copies (attached to their masters, one owner at a time, detached at destruction; refreshed
// once per optimizer step; stale ones refused; read by a checkpoint's recompute; gradients reaching the fp32
// masters), the activation memory of bf16 vs fp32, and bf16 / fp16 training of the tiny GPT tracking fp32.
#include <typegrad/config.hpp>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/detail/cpu/amx.hpp>
#include <typegrad/data/dataset.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/data/tokenizer.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

using namespace tg;
namespace amp = tg::amp;

// ---- policies and rules (compile time) --------------------------------------------------------------
static_assert(std::is_same_v<amp::bf16_mixed::param_type, fp32> && std::is_same_v<amp::bf16_mixed::compute_type, bf16>);
static_assert(std::is_same_v<amp::fp16_mixed::grad_type, fp32> && std::is_same_v<amp::fp16_mixed::accum_type, fp32>);
static_assert(amp::fp16_mixed::requires_loss_scaling && !amp::bf16_mixed::requires_loss_scaling &&
              !amp::fp32_policy::requires_loss_scaling);
static_assert(std::is_same_v<amp::default_scaler_t<amp::fp16_mixed>, amp::DynamicScaler>);
static_assert(std::is_same_v<amp::default_scaler_t<amp::bf16_mixed>, amp::NoScaler>);
static_assert(std::is_same_v<amp::default_scaler_t<amp::fp32_policy>, amp::NoScaler>);
// GEMM-like ops store in the compute type and accumulate in fp32.
static_assert(std::is_same_v<amp::storage_t<amp::op::linear, amp::bf16_mixed>, bf16>);
static_assert(std::is_same_v<amp::math_t<amp::op::linear, amp::bf16_mixed>, fp32>);
static_assert(std::is_same_v<amp::storage_t<amp::op::linear_gelu, amp::fp16_mixed>, fp16>);  // a GEMM, not an elementwise op
static_assert(std::is_same_v<amp::math_t<amp::op::linear_gelu, amp::fp16_mixed>, fp32>);
static_assert(std::is_same_v<amp::storage_t<amp::op::attention, amp::fp16_mixed>, fp16>);
// Numerically sensitive ops compute in fp32; the loss is stored in fp32.
static_assert(std::is_same_v<amp::math_t<amp::op::softmax, amp::bf16_mixed>, fp32>);
static_assert(std::is_same_v<amp::math_t<amp::op::layernorm, amp::fp16_mixed>, fp32>);
static_assert(std::is_same_v<amp::storage_t<amp::op::cross_entropy, amp::bf16_mixed>, fp32>);
static_assert(std::is_same_v<amp::input_t<amp::op::cross_entropy, amp::bf16_mixed>, bf16>);
// The optimizer works on the masters.
static_assert(std::is_same_v<amp::storage_t<amp::op::optimizer, amp::bf16_mixed>, fp32>);
// Elementwise promotion.
static_assert(std::is_same_v<amp::promote_t<bf16, bf16>, bf16>);
static_assert(std::is_same_v<amp::promote_t<bf16, fp32>, fp32>);
static_assert(std::is_same_v<amp::promote_t<bf16, fp16>, fp32>);
static_assert(std::is_same_v<amp::promote_t<fp32, fp64>, fp64>);
// The fp32 policy's MixedPrecision keeps no copies.
static_assert(std::is_same_v<decltype(amp::MixedPrecision<amp::fp32_policy>::weights), amp::NoCopies<cpu>>);
static_assert(std::is_same_v<decltype(amp::MixedPrecision<amp::fp32_policy, amp::NoScaler, cuda>::weights),
                             amp::NoCopies<cuda>>);
// The copies live on the masters' device; the CPU is the default.
static_assert(std::is_same_v<decltype(amp::MixedPrecision<amp::bf16_mixed>::weights), amp::WeightCopies<bf16, cpu>>);
static_assert(std::is_same_v<decltype(amp::MixedPrecision<amp::bf16_mixed, amp::NoScaler, cuda>::weights),
                             amp::WeightCopies<bf16, cuda>>);
static_assert(std::is_same_v<amp::WeightCopies<fp16>, amp::WeightCopies<fp16, cpu>>);
// Both optimizer families can be watched for stale copies; a type without step_count() cannot.
static_assert(amp::StepCountingOptimizer<optim::Optimizer> && amp::StepCountingOptimizer<optim::BasicAdamW<cuda>>);
static_assert(!amp::StepCountingOptimizer<int> && !std::is_constructible_v<amp::OptimizerSteps, const int*>);

TEST(AmpPolicy, RunTimeNamesBecomeTypes) {
  EXPECT_EQ(amp::with_precision("bf16", []<class P>() { return std::string(amp::policy_name<P>()); }), "bf16");
  EXPECT_EQ(amp::with_precision("fp16", []<class P>() { return sizeof(typename P::compute_type); }), 2u);
  EXPECT_EQ(amp::with_precision("fp32", []<class P>() { return sizeof(typename P::compute_type); }), 4u);
  EXPECT_TRUE(amp::with_precision("tf32", []<class P>() { return std::is_same_v<P, amp::tf32_policy>; }));
  for (const char* name : {"fp32", "tf32", "bf16", "fp16"})
    EXPECT_EQ(amp::with_precision(name, []<class P>() { return std::string(amp::policy_name<P>()); }), name);
  try {
    amp::with_precision("int8", []<class P>() { return 0; });
    FAIL() << "expected tg::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown precision 'int8' (expected fp32, tf32, bf16 or fp16)"), std::string::npos)
        << e.what();
  }
}

// Note [TF32 by policy]: only tf32_policy asks for TF32; it is fp32 in every type.
static_assert(amp::tf32_policy::fp32_matmul == amp::Fp32Matmul::tf32);
static_assert(amp::fp32_policy::fp32_matmul == amp::Fp32Matmul::ieee && amp::bf16_mixed::fp32_matmul == amp::Fp32Matmul::ieee);
static_assert(std::is_same_v<amp::tf32_policy::compute_type, fp32> && !amp::tf32_policy::uses_weight_copies &&
              !amp::tf32_policy::requires_loss_scaling);

TEST(AmpPolicy, Fp32MatmulScopeSetsThePolicysChoiceAndRestoresThePrevious) {
  const bool before = backend::cuda::allow_tf32();
  {
    amp::Fp32MatmulScope<amp::fp32_policy> ieee;  // IEEE works with or without the CUDA backend
    EXPECT_FALSE(backend::cuda::allow_tf32());
  }
  EXPECT_EQ(backend::cuda::allow_tf32(), before);
#if !TG_HAVE_CUDA
  // Without the CUDA backend there is no TF32 to switch on: a clear error, not a silent fp32 run.
  try {
    amp::Fp32MatmulScope<amp::tf32_policy> tf32;
    FAIL() << "expected tg::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("CUDA"), std::string::npos) << e.what();
  }
  EXPECT_EQ(backend::cuda::allow_tf32(), before);
  return;
#endif
  {
    amp::Fp32MatmulScope<amp::tf32_policy> tf32;
    EXPECT_TRUE(backend::cuda::allow_tf32());
    {
      amp::Fp32MatmulScope<amp::bf16_mixed> nested;
      EXPECT_FALSE(backend::cuda::allow_tf32());
    }
    EXPECT_TRUE(backend::cuda::allow_tf32());
  }
  EXPECT_EQ(backend::cuda::allow_tf32(), before);
}

TEST(AmpAutocast, CastForConvertsToTheOpsInputType) {
  const auto x = Tensor<fp32>::from_values({3}, {1.0, 1.00390625, -2.5});
  const Tensor<bf16> xb = amp::cast_for<amp::op::linear, amp::bf16_mixed>(x);
  EXPECT_EQ(static_cast<float>(xb.at({0})), 1.0f);
  EXPECT_EQ(static_cast<float>(xb.at({1})), 1.0f) << "1 + 2^-8 rounds to 1 in bf16 (ties to even)";
  const Tensor<fp32> xs = amp::cast_for<amp::op::optimizer, amp::bf16_mixed>(x);
  EXPECT_EQ(xs.data(), x.data()) << "the master type needs no conversion";
}

// ---- a small optimization problem for the scaler tests ------------------------------------------------
struct Problem {
  Tensor<fp32> w = Tensor<fp32>::from_values({2, 3}, {0.5, -0.25, 1.0, 0.75, 0.1, -0.6});
  Tensor<fp32> b = Tensor<fp32>::from_values({2}, {0.05, -0.02});
  Tensor<fp32> x = Tensor<fp32>::from_values({4, 3}, {1, 2, 3, -1, 0.5, 2, 0, 1, -1, 2, 2, 2});
  std::vector<optim::Param> params;
  Problem() {
    w.requires_grad_();
    b.requires_grad_();
    params = {optim::Param("fc.weight", w), optim::Param("fc.bias", b)};
  }
  Tensor<fp32> loss() const { return mean(mul(linear(x, w, b), linear(x, w, b))); }
};

std::vector<float> values(const Tensor<fp32>& t) { return t.to_vector(); }

std::vector<std::vector<float>> state_values(const optim::Optimizer& opt) {
  std::vector<std::vector<float>> out;
  for (const auto& nt : opt.state_tensors()) out.push_back(nt.tensor.to_vector());
  return out;
}

TEST(AmpScaler, DefaultsFollowGradScaler) {
  const amp::DynamicScaler s;
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().growth_factor, 2.0);
  EXPECT_EQ(s.state().backoff_factor, 0.5);
  EXPECT_EQ(s.state().growth_interval, 2000);
  EXPECT_EQ(s.state().growth_tracker, 0);
  EXPECT_EQ(s.state().skipped_steps, 0);
}

TEST(AmpScaler, InjectedInfSkipsTheStepAndHalvesTheScale) {
  Problem pb;
  optim::AdamW opt(pb.params, {.lr = 0.1f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f});
  optim::Schedule schedule = optim::Constant{0.1f};
  optim::GradAccum<1> accum;
  amp::DynamicScaler scaler;

  // A clean step first, so the optimizer has state to protect.
  accum.scale(pb.loss(), scaler).backward();
  ASSERT_TRUE(accum.micro_step(opt, schedule, 1.0, scaler));
  EXPECT_FALSE(accum.last_step_skipped());
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_EQ(scaler.scale(), 65536.0);
  EXPECT_EQ(scaler.state().growth_tracker, 1);

  const auto w0 = values(pb.w), b0 = values(pb.b);
  const auto st0 = state_values(opt);
  const std::int64_t sched0 = schedule.step();

  // Inject an inf into one gradient element after backward.
  accum.scale(pb.loss(), scaler).backward();
  pb.w.grad().data()[4] = std::numeric_limits<float>::infinity();
  ASSERT_TRUE(accum.micro_step(opt, schedule, 1.0, scaler)) << "a skipped step is still a step boundary";
  EXPECT_TRUE(accum.last_step_skipped());
  EXPECT_EQ(values(pb.w), w0) << "weights must not change on a skipped step";
  EXPECT_EQ(values(pb.b), b0);
  EXPECT_EQ(state_values(opt), st0) << "optimizer state (exp_avg, exp_avg_sq, step counts) must not change";
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_EQ(opt.param_step_count("fc.weight"), 1);
  EXPECT_EQ(schedule.step(), sched0) << "the schedule counts applied updates";
  EXPECT_FALSE(pb.w.grad().defined()) << "the overflowing gradients are dropped";
  EXPECT_EQ(scaler.scale(), 32768.0);
  EXPECT_EQ(scaler.state().growth_tracker, 0);
  EXPECT_EQ(scaler.state().skipped_steps, 1);
  EXPECT_EQ(accum.skipped_steps(), 1);

  // A NaN also skips.
  accum.scale(pb.loss(), scaler).backward();
  pb.b.grad().data()[0] = std::numeric_limits<float>::quiet_NaN();
  accum.micro_step(opt, schedule, 1.0, scaler);
  EXPECT_TRUE(accum.last_step_skipped());
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_EQ(values(pb.w), w0);

  // Clean steps then proceed: the weights move, the scale holds, the tracker counts.
  for (int i = 0; i < 3; ++i) {
    accum.scale(pb.loss(), scaler).backward();
    accum.micro_step(opt, schedule, 1.0, scaler);
    EXPECT_FALSE(accum.last_step_skipped());
  }
  EXPECT_NE(values(pb.w), w0);
  EXPECT_EQ(opt.step_count(), 4);
  EXPECT_EQ(schedule.step(), sched0 + 3);
  EXPECT_EQ(scaler.scale(), 16384.0);
  EXPECT_EQ(scaler.state().growth_tracker, 3);
  EXPECT_EQ(scaler.state().steps, 6);
  EXPECT_EQ(scaler.state().skipped_steps, 2);
}

TEST(AmpScaler, ScaledStepsEqualUnscaledSteps) {
  // The same problem with and without a (power-of-two) scale: identical updates, since gradients are
  // unscaled before clipping and the optimizer.
  Problem a, b;
  optim::AdamW oa(a.params, {.lr = 0.05f}), ob(b.params, {.lr = 0.05f});
  optim::Schedule sa = optim::Constant{0.05f}, sb = optim::Constant{0.05f};
  optim::GradAccum<2> acc_a, acc_b;
  amp::DynamicScaler scaler;
  for (int i = 0; i < 6; ++i) {
    acc_a.scale(a.loss(), scaler).backward();
    acc_a.micro_step(oa, sa, 0.5, scaler);
    acc_b.scale(b.loss()).backward();
    acc_b.micro_step(ob, sb, 0.5);
  }
  EXPECT_EQ(oa.step_count(), 3);
  EXPECT_EQ(values(a.w), values(b.w));
  EXPECT_EQ(values(a.b), values(b.b));
  EXPECT_DOUBLE_EQ(acc_a.last_grad_norm(), acc_b.last_grad_norm()) << "clipping must see unscaled gradients";
  EXPECT_GT(acc_b.last_grad_norm(), 0.5) << "the test must actually clip";
}

TEST(AmpScaler, GrowsAfterTheIntervalOfCleanSteps) {
  amp::DynamicScaler s;  // the default interval: 2000
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.state().growth_tracker, 1999);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);
  EXPECT_EQ(s.state().growth_tracker, 0);
  // An overflow resets the tracker: growth needs a full interval of clean steps again.
  for (int i = 0; i < 1500; ++i) s.update(false);
  s.update(true);
  EXPECT_EQ(s.scale(), 65536.0);
  for (int i = 0; i < 1999; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 65536.0);
  s.update(false);
  EXPECT_EQ(s.scale(), 131072.0);

  // Through the accumulator with a short interval.
  Problem pb;
  optim::Sgd opt(pb.params, {.lr = 0.01f});
  optim::Schedule schedule = optim::Constant{0.01f};
  optim::GradAccum<1> accum;
  amp::DynamicScaler fast(amp::DynamicScalerOptions{.init_scale = 8.0, .growth_interval = 3});
  for (int i = 0; i < 7; ++i) {
    accum.scale(pb.loss(), fast).backward();
    accum.micro_step(opt, schedule, std::nullopt, fast);
  }
  EXPECT_EQ(fast.scale(), 32.0) << "x2 after steps 3 and 6";
  EXPECT_EQ(fast.state().growth_tracker, 1);
}

TEST(AmpScaler, StaticAndNoScaler) {
  Problem pb;
  optim::Sgd opt(pb.params, {.lr = 0.01f});
  optim::Schedule schedule = optim::Constant{0.01f};
  optim::GradAccum<1> accum;
  amp::StaticScaler st(128.0);
  accum.scale(pb.loss(), st).backward();
  pb.w.grad().data()[0] = std::numeric_limits<float>::infinity();
  const auto w0 = values(pb.w);
  accum.micro_step(opt, schedule, std::nullopt, st);
  EXPECT_TRUE(accum.last_step_skipped());
  EXPECT_EQ(values(pb.w), w0);
  EXPECT_EQ(st.scale(), 128.0) << "a static scale never changes";
  EXPECT_EQ(st.state().skipped_steps, 1);

  amp::NoScaler none;
  EXPECT_EQ(none.scale(), 1.0);
  accum.scale(pb.loss(), none).backward();
  accum.micro_step(opt, schedule, std::nullopt, none);
  EXPECT_FALSE(accum.last_step_skipped());
  EXPECT_NE(values(pb.w), w0);
  EXPECT_EQ(none.state().steps, 1);
  EXPECT_THROW(amp::StaticScaler(0.0), Error);
  EXPECT_THROW(amp::StaticScaler(std::numeric_limits<double>::infinity()), Error);
}

TEST(AmpScaler, StateRoundTripsAndRejectsBadState) {
  amp::DynamicScaler a(amp::DynamicScalerOptions{.init_scale = 1024.0, .growth_interval = 10});
  for (int i = 0; i < 4; ++i) a.update(false);
  a.update(true);
  a.update(false);
  const amp::ScalerState st = a.state();
  EXPECT_EQ(st.scale, 512.0);
  EXPECT_EQ(st.growth_tracker, 1);
  EXPECT_EQ(st.skipped_steps, 1);
  EXPECT_EQ(st.steps, 6);

  amp::DynamicScaler b;
  b.load_state(st);
  EXPECT_EQ(b.state(), st);
  for (int i = 0; i < 9; ++i) {
    a.update(false);
    b.update(false);
  }
  EXPECT_EQ(b.state(), a.state()) << "a restored scaler continues exactly like the original";
  EXPECT_EQ(b.scale(), 1024.0);

  auto bad = st;
  bad.scale = -1;
  try {
    b.load_state(bad);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("DynamicScaler::load_state: scale must be finite and > 0, got -1"), std::string::npos) << e.what();
  }
  bad = st;
  bad.growth_tracker = 10;
  EXPECT_THROW(b.load_state(bad), Error);
  EXPECT_EQ(b.state(), a.state()) << "a rejected state changes nothing";
  amp::NoScaler none;
  EXPECT_THROW(none.load_state(st), Error);
}

// ---- per-step weight copies ------------------------------------------------------------------------------
struct TinySetup {
  Generator gen{3};
  nn::GPTConfig cfg = [] {
    auto c = nn::GPTConfig::preset("tiny");
    c.n_layer = 2;
    return c;
  }();
  nn::GPT model{cfg, gen};
  std::vector<optim::Param> params = model.named_parameters();
  Tensor<std::int64_t> idx, tgt;
  TinySetup(std::int64_t B, std::int64_t T) {
    idx = Tensor<std::int64_t>::empty({B, T});
    tgt = Tensor<std::int64_t>::empty({B, T});
    for (std::int64_t i = 0; i < B * T; ++i) {
      idx.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 256);
      tgt.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 256);
    }
  }
};

TEST(AmpWeights, CopiesAreRefreshedOncePerOptimizerStep) {
  TinySetup s(2, 16);
  optim::AdamW opt(s.params, {.lr = 1e-3f});
  optim::Schedule schedule = optim::Constant{1e-3f};
  optim::GradAccum<4> accum;
  amp::MixedPrecision<amp::bf16_mixed> mp(s.params, opt);
  EXPECT_EQ(mp.weights.refreshes(), 1) << "converted once at construction";
  EXPECT_EQ(mp.weights.nbytes(), nn::count_parameters(s.params) * 2);
  const Tensor<fp32>& wte = s.params[0].tensor;
  ASSERT_EQ(s.params[0].name, "wte.weight");
  const Tensor<bf16> copy = mp.weights.copy_of(wte);
  ASSERT_TRUE(copy.defined());
  {
    const Tensor<bf16> seen = amp::param_as<bf16>(wte);
    EXPECT_EQ(seen.data(), copy.data()) << "the forward reads the attached copy, no conversion";
    EXPECT_TRUE(seen.requires_grad());
  }
  EXPECT_EQ(amp::param_as<fp32>(wte).data(), wte.data()) << "an fp32 forward reads the master itself";
  EXPECT_NE(static_cast<const void*>(amp::param_as<fp16>(wte).data()), static_cast<const void*>(copy.data()))
      << "another compute type converts";

  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < 4; ++m) {
      const auto loss = mp.loss(mp.forward(s.model, s.idx, s.gen), s.tgt);
      accum.scale(loss, mp.scaler).backward();
      if (m < 3) {
        // Mid-accumulation: gradients reach the masters in fp32 and accumulate there.
        ASSERT_TRUE(wte.grad().defined());
        static_assert(std::is_same_v<decltype(wte.grad()), Tensor<fp32>>);
      }
      const bool stepped = accum.micro_step(opt, schedule, 1.0, mp.scaler);
      EXPECT_EQ(stepped, m == 3);
      if (stepped) mp.after_step(accum);
    }
    EXPECT_EQ(mp.weights.refreshes(), 2 + step) << "one refresh per optimizer step, not per micro-batch";
  }
  // The copies hold the current masters, rounded.
  const auto master = wte.to_vector();
  for (std::size_t i = 0; i < master.size(); i += 97)
    EXPECT_EQ(copy.data()[i].bits, bf16(master[i]).bits) << "element " << i;
}

TEST(AmpWeights, StaleCopiesAreAnError) {
  TinySetup s(1, 8);
  optim::Sgd opt(s.params, {.lr = 1e-2f});
  amp::WeightCopies<bf16> copies(s.params, &opt);
  cross_entropy(s.model.forward<fp32>(s.idx), s.tgt).backward();
  opt.step();
  EXPECT_TRUE(copies.stale());
  const auto expect_stale_error = [](auto&& f, const char* what) {
    try {
      f();
      FAIL() << "expected tg::Error from " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("weight copies are stale"), std::string::npos) << what << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("call refresh() after every optimizer step"), std::string::npos) << what;
    }
  };
  expect_stale_error([&] { copies.check_fresh(); }, "check_fresh()");
  // The copies are attached to the masters: any bf16 forward would read them, so param_as refuses.
  expect_stale_error([&] { (void)amp::param_as<bf16>(s.params[0].tensor); }, "param_as<bf16>");
  expect_stale_error([&] { (void)s.model.forward<bf16>(s.idx); }, "forward<bf16>");
  EXPECT_NO_THROW((void)s.model.forward<fp32>(s.idx)) << "fp32 reads the masters: never stale";
  copies.refresh();
  EXPECT_FALSE(copies.stale());
  EXPECT_NO_THROW(copies.check_fresh());
  EXPECT_NO_THROW((void)s.model.forward<bf16>(s.idx));
}

// Note [the optimizer writes the weight copies]: AdamW's update writes each parameter's copy, so
// after_step(accum, CopyRefresh::unwritten) converts none; copies and masters equal the full refresh's, bit for
// bit, over optimizer steps of two micro-batches each. An optimizer that writes no copies has them all
// converted.
template <class Policy, class Opt>
void expect_kept_copies_equal_refreshed(float lr, bool writes_copies) {
  using C = typename amp::MixedPrecision<Policy>::compute_type;
  // Both runs on one team size: under load the default team shrinks between them (Note [threads under
  // contention]), and a GEMM's split of K with it, which would change their sums' order.
  struct PinnedTeam {
    PinnedTeam() { backend::cpu::set_num_threads(backend::cpu::num_threads()); }
    ~PinnedTeam() { backend::cpu::set_num_threads(0); }
  } pinned;
  TinySetup full(2, 16), kept(2, 16);  // the same model and batch: the same seeds
  Opt opt_full(full.params, {.lr = lr}), opt_kept(kept.params, {.lr = lr});
  optim::Schedule schedule = optim::Constant{lr};
  optim::GradAccum<2> acc_full, acc_kept;
  amp::MixedPrecision<Policy> mp_full(full.params, opt_full), mp_kept(kept.params, opt_kept);
  const auto n = static_cast<std::int64_t>(full.params.size());
  auto micro = [&](TinySetup& s, Opt& opt, optim::GradAccum<2>& acc, amp::MixedPrecision<Policy>& mp,
                   amp::CopyRefresh which) {
    const auto loss = mp.loss(mp.forward(s.model, s.idx, s.gen), s.tgt);
    acc.scale(loss, mp.scaler).backward();
    return acc.micro_step(opt, schedule, 1.0, mp.scaler) && mp.after_step(acc, which);
  };
  int taken = 0;
  for (int m = 0; m < 6; ++m) {
    const bool a = micro(full, opt_full, acc_full, mp_full, amp::CopyRefresh::all);
    const bool b = micro(kept, opt_kept, acc_kept, mp_kept, amp::CopyRefresh::unwritten);
    ASSERT_EQ(a, b) << "micro-batch " << m;
    if (!a) continue;
    ++taken;
    EXPECT_EQ(mp_full.weights.last_converted(), n);
    EXPECT_EQ(mp_kept.weights.last_converted(), writes_copies ? 0 : n) << "micro-batch " << m;
    EXPECT_FALSE(mp_kept.weights.stale());
    for (std::size_t k = 0; k < full.params.size(); ++k) {
      ASSERT_EQ(full.params[k].tensor.to_vector(), kept.params[k].tensor.to_vector()) << full.params[k].name;
      const Tensor<C> cf = mp_full.weights.copy_of(full.params[k].tensor), ck = mp_kept.weights.copy_of(kept.params[k].tensor);
      const Tensor<C> fresh = kept.params[k].tensor.template to<C>();
      for (std::int64_t i = 0; i < ck.numel(); ++i) {
        ASSERT_EQ(ck.data()[i].bits, cf.data()[i].bits) << full.params[k].name << " element " << i;
        ASSERT_EQ(ck.data()[i].bits, fresh.data()[i].bits) << full.params[k].name << " element " << i;
      }
    }
  }
  EXPECT_GE(taken, 2) << "steps taken";
}

TEST(AmpWeights, AdamWWritesTheCopiesInItsUpdate) {
  expect_kept_copies_equal_refreshed<amp::bf16_mixed, optim::AdamW>(1e-2f, true);
  expect_kept_copies_equal_refreshed<amp::fp16_mixed, optim::AdamW>(1e-2f, true);
  expect_kept_copies_equal_refreshed<amp::bf16_mixed, optim::Adam>(1e-2f, true);
}

TEST(AmpWeights, CopiesOfAnOptimizerThatWritesNoneAreConverted) {
  expect_kept_copies_equal_refreshed<amp::bf16_mixed, optim::Sgd>(1e-1f, false);
}

TEST(AmpWeights, StaleCopiesOnTheCpuAreDetectedWithTheHostOptimizer) {
  // WeightCopies<bf16, cpu> spelled out, watching an AdamW: stale after each step until refresh().
  TinySetup s(1, 8);
  optim::AdamW opt(s.params, {.lr = 1e-2f});
  amp::WeightCopies<bf16, cpu> copies(s.params, &opt);
  const Tensor<fp32>& wte = s.params[0].tensor;
  for (int step = 1; step <= 2; ++step) {
    EXPECT_FALSE(copies.stale());
    EXPECT_NO_THROW(copies.check_fresh());
    EXPECT_EQ(amp::param_as<bf16>(wte).data(), copies.copy_of(wte).data());
    cross_entropy(s.model.forward<fp32>(s.idx), s.tgt).backward();
    opt.step();
    opt.zero_grad();
    EXPECT_TRUE(copies.stale()) << "step " << step;
    EXPECT_THROW(copies.check_fresh(), Error);
    EXPECT_THROW((void)amp::param_as<bf16>(wte), Error) << "param_as never returns a stale copy";
    EXPECT_EQ(copies.copy_of(wte).data()[0].bits, bf16(wte.data()[0]).bits)
        << "AdamW wrote the copy in its update (Note [the optimizer writes the weight copies]); it still counts "
           "as stale until refresh()";
    copies.refresh();
    EXPECT_EQ(copies.last_converted(), static_cast<std::int64_t>(s.params.size())) << "refresh() converts every copy";
    EXPECT_EQ(copies.copy_of(wte).data()[0].bits, bf16(wte.data()[0]).bits);
  }
  EXPECT_EQ(copies.refreshes(), 3);
}

TEST(AmpWeights, StaleCopiesAreDetectedWithADeviceOptimizer) {
  // BasicAdamW<D> spelled with its device (the form a device's training loop uses, here D = cpu) is watched
  // through its step count; MixedPrecision<..., D> takes it too.
  TinySetup s(1, 8);
  optim::BasicAdamW<cpu> opt(optim::default_groups(s.params, 0.1f), {.lr = 1e-2f});
  optim::Schedule schedule = optim::Constant{1e-2f};
  optim::GradAccum<1> accum;
  {
    amp::MixedPrecision<amp::bf16_mixed, amp::NoScaler, cpu> mp(s.params, opt);
    const auto loss = mp.loss(mp.forward(s.model, s.idx, s.gen), s.tgt);
    accum.scale(loss, mp.scaler).backward();
    ASSERT_TRUE(accum.micro_step(opt, schedule, std::nullopt, mp.scaler));
    EXPECT_EQ(opt.step_count(), 1);
    EXPECT_TRUE(mp.weights.stale());
    try {
      (void)mp.forward(s.model, s.idx, s.gen);
      FAIL() << "expected tg::Error: the forward after a step without after_step() reads stale copies";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("bf16 weight copies are stale on cpu"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("(step 1) after the last refresh() (step 0)"), std::string::npos) << e.what();
    }
    EXPECT_TRUE(mp.after_step(accum));
    EXPECT_FALSE(mp.weights.stale());
    EXPECT_NO_THROW((void)mp.forward(s.model, s.idx, s.gen));
  }  // mp's copies detach: the masters can take other copies
  // Without an optimizer the copies are never stale (nothing to compare with).
  amp::WeightCopies<bf16, cpu> unwatched(s.params, nullptr);
  opt.step();
  EXPECT_FALSE(unwatched.stale());
}

TEST(AmpWeights, RefreshWeightsAfterLoadingMastersOutsideTheOptimizer) {
  // Loading weights (a checkpoint, --init-from) changes the masters without a step: the step count cannot
  // tell, so the loader refreshes; until then the forward reads the old copies.
  TinySetup s(1, 8);
  TinySetup other(1, 8);
  optim::AdamW opt(s.params, {.lr = 1e-3f});
  amp::MixedPrecision<amp::bf16_mixed> mp(s.params, opt);
  const Tensor<fp32>& wte = s.params[0].tensor;
  for (std::int64_t i = 0; i < wte.numel(); ++i) other.params[0].tensor.data()[i] = wte.data()[i] + 0.5f;
  nn::copy_parameter_values(other.params, s.params);
  EXPECT_FALSE(mp.weights.stale()) << "no optimizer step: invisible to the step count";
  EXPECT_NE(mp.weights.copy_of(wte).data()[0].bits, bf16(wte.data()[0]).bits) << "the copy still holds the old master";
  mp.refresh_weights();
  EXPECT_EQ(mp.weights.refreshes(), 2);
  for (std::int64_t i = 0; i < wte.numel(); i += 31)
    EXPECT_EQ(mp.weights.copy_of(wte).data()[i].bits, bf16(wte.data()[i]).bits) << "element " << i;
}

TEST(AmpWeights, GradientThroughCopyMatchesGradientThroughTo) {
  // The cached path and the plain to<bf16>() path give the masters the same fp32 gradient.
  TinySetup s(2, 8);
  optim::Sgd opt(s.params, {.lr = 0.f});
  {
    amp::WeightCopies<bf16> copies(s.params, &opt);
    ASSERT_EQ(amp::param_as<bf16>(s.params[0].tensor).data(), copies.copy_of(s.params[0].tensor).data());
    cross_entropy_as<fp32>(s.model.forward<bf16>(s.idx), s.tgt).backward();
  }  // the copies detach: the second forward converts each use with to<bf16>()
  std::vector<std::vector<float>> g1;
  for (auto& p : s.params) g1.push_back(p.tensor.grad().to_vector());
  opt.zero_grad();
  for (auto& p : s.params) ASSERT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  cross_entropy_as<fp32>(s.model.forward<bf16>(s.idx), s.tgt).backward();
  for (std::size_t i = 0; i < s.params.size(); ++i)
    EXPECT_EQ(s.params[i].tensor.grad().to_vector(), g1[i]) << s.params[i].name;
}

/// The tensor bytes the CPU allocator holds now: a conversion allocates its output there, a read of an
/// attached copy allocates none (its tape node is ordinary heap memory).
std::int64_t tensor_bytes_in_use() { return allocator<cpu>().stats().bytes_in_use; }

TEST(AmpWeights, CopyIsAttachedToTheMasterAndDetachedAtDestruction) {
  TinySetup s(1, 8);
  const Tensor<fp32>& wte = s.params[0].tensor;
  for (const auto& p : s.params) ASSERT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  std::optional<amp::WeightCopies<bf16>> copies(std::in_place, s.params);
  EXPECT_EQ(copies->size(), s.params.size());
  for (const auto& p : s.params) {
    const AttachedCopy* slot = p.tensor.storage()->attached_copy();
    ASSERT_NE(slot, nullptr) << p.name << ": the master holds its copy";
    EXPECT_EQ(slot->dtype, dtype_traits<bf16>::dtype);
    EXPECT_EQ(slot->device, DeviceKind::cpu);
    const Tensor<bf16> copy = copies->copy_of(p.tensor);
    ASSERT_TRUE(copy.defined()) << p.name;
    const std::int64_t before = tensor_bytes_in_use();
    const Tensor<bf16> seen = amp::param_as<bf16>(p.tensor);
    EXPECT_EQ(tensor_bytes_in_use(), before) << p.name << ": param_as converted instead of reading the copy";
    EXPECT_EQ(seen.data(), copy.data()) << p.name;
    EXPECT_EQ(seen.shape(), p.tensor.shape());
  }
  // Every handle of the master shares its storage, so every handle sees the copy: a detached one too.
  EXPECT_EQ(amp::param_as<bf16>(wte.detach()).data(), copies->copy_of(wte).data());
  // A view of a master (other shape, or other offset) is not the master: a fresh conversion.
  EXPECT_NE(amp::param_as<bf16>(wte.narrow(0, 0, 2)).data(), copies->copy_of(wte).data());
  EXPECT_NE(amp::param_as<bf16>(wte.narrow(0, 1, 2)).data(), copies->copy_of(wte).data());
  // A tensor that is no parameter has no copy.
  const Tensor<fp32> other = Tensor<fp32>::ones({4, 4});
  EXPECT_FALSE(copies->copy_of(other).defined());
  EXPECT_EQ(other.storage()->attached_copy(), nullptr);

  // Moving the WeightCopies keeps the copies attached (and readable through the new owner).
  const void* copy_data = copies->copy_of(wte).data();
  amp::WeightCopies<bf16> moved(std::move(*copies));
  copies.reset();  // the moved-from object detaches nothing
  ASSERT_NE(wte.storage()->attached_copy(), nullptr);
  EXPECT_EQ(moved.copy_of(wte).data(), copy_data);
  EXPECT_EQ(amp::param_as<bf16>(wte).data(), copy_data);
  EXPECT_EQ(moved.size(), s.params.size());
  EXPECT_EQ(moved.refreshes(), 1);

  {
    amp::WeightCopies<bf16> gone(std::move(moved));
  }  // destroyed: every copy detached
  for (const auto& p : s.params) EXPECT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  const std::int64_t before = tensor_bytes_in_use();
  const Tensor<bf16> converted = amp::param_as<bf16>(wte);
  EXPECT_EQ(tensor_bytes_in_use() - before, static_cast<std::int64_t>(converted.nbytes()))
      << "without copies, param_as converts (a fresh to<bf16>())";
  EXPECT_TRUE(converted.requires_grad());
  EXPECT_EQ(converted.to_vector()[3].bits, bf16(wte.data()[3]).bits);
}

TEST(AmpWeights, ASecondOwnerOfTheSameMastersIsAnError) {
  // One compute copy per master: a model trains in one compute type. Another WeightCopies over masters
  // that hold copies is an error (of another type or the same), and the first copies stay intact.
  TinySetup s(1, 8);
  const Tensor<fp32>& wte = s.params[0].tensor;
  amp::WeightCopies<bf16> bf16_copies(s.params);
  const auto expect_error = [&](auto&& make, const std::string& fragment) {
    try {
      make();
      ADD_FAILURE() << "expected tg::Error containing '" << fragment << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_error([&] { amp::WeightCopies<fp16> second(s.params); },
               "amp::WeightCopies: parameter 'wte.weight' already holds bf16 compute copies on cpu attached by "
               "another amp::WeightCopies");
  expect_error([&] { amp::WeightCopies<bf16> second(s.params); }, "already holds bf16 compute copies on cpu");
  optim::Sgd sgd(s.params, {.lr = 0.f});
  expect_error([&] { amp::MixedPrecision<amp::fp16_mixed> second(s.params, sgd); },
               "destroy that WeightCopies (or the MixedPrecision holding it) before making fp16 copies");
  EXPECT_EQ(amp::param_as<bf16>(wte).data(), bf16_copies.copy_of(wte).data()) << "the first copies stay attached";
  for (const auto& p : s.params)
    EXPECT_EQ(p.tensor.storage()->attached_copy()->dtype, dtype_traits<bf16>::dtype) << p.name;
}

TEST(AmpWeights, AFailedConstructorDetachesWhatItAttached) {
  TinySetup s(1, 8);
  ASSERT_GE(s.params.size(), 3u);
  const std::vector<optim::Param> tail(s.params.begin() + 2, s.params.end());
  {
    amp::WeightCopies<bf16> on_tail(tail);
    // fp16 copies of every parameter: the first two attach, the third is taken, so the two are detached.
    EXPECT_THROW(amp::WeightCopies<fp16>{s.params}, Error);
    EXPECT_EQ(s.params[0].tensor.storage()->attached_copy(), nullptr);
    EXPECT_EQ(s.params[1].tensor.storage()->attached_copy(), nullptr);
    EXPECT_EQ(s.params[2].tensor.storage()->attached_copy()->dtype, dtype_traits<bf16>::dtype) << "the other owner's copy stays";
  }
  // A parameter listed twice: the same message as before, and nothing left attached.
  std::vector<optim::Param> twice = s.params;
  twice.push_back(s.params[1]);
  try {
    amp::WeightCopies<bf16> bad(twice);
    ADD_FAILURE() << "expected tg::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter '" + s.params[1].name + "' is listed twice"), std::string::npos)
        << e.what();
  }
  for (const auto& p : s.params) EXPECT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  amp::WeightCopies<fp16> all(s.params);  // now every master is free
  EXPECT_EQ(all.size(), s.params.size());
}

TEST(AmpWeights, TwoThreadsRacingToAttachGetOneOwner) {
  // bf16 and fp16 copies of the same masters built at once on two threads: the slot is atomic and both
  // walk the parameters in the same order, so exactly one succeeds and the other leaves nothing attached.
  TinySetup s(1, 8);
  for (int round = 0; round < 16; ++round) {
    std::optional<amp::WeightCopies<bf16>> a;
    std::optional<amp::WeightCopies<fp16>> b;
    std::atomic<int> failures{0};
    std::atomic<bool> go{false};
    std::thread ta([&] {
      while (!go.load()) {}
      try { a.emplace(s.params); } catch (const Error&) { ++failures; }
    });
    std::thread tb([&] {
      while (!go.load()) {}
      try { b.emplace(s.params); } catch (const Error&) { ++failures; }
    });
    go = true;
    ta.join();
    tb.join();
    ASSERT_EQ(failures.load(), 1) << "round " << round;
    ASSERT_NE(a.has_value(), b.has_value()) << "round " << round;
    const DType winner = a ? dtype_traits<bf16>::dtype : dtype_traits<fp16>::dtype;
    for (const auto& p : s.params) ASSERT_EQ(p.tensor.storage()->attached_copy()->dtype, winner) << p.name;
    a.reset();
    b.reset();
    for (const auto& p : s.params) ASSERT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  }
}

TEST(AmpWeights, CheckpointRecomputeReadsTheAttachedCopies) {
  // The masters are changed after the copies were made, without a refresh (invisible to the step count),
  // so the copies and a fresh conversion differ: a plain run and a checkpointed run (whose recompute in
  // backward runs outside any forward-time state) give the masters the same gradients only if the
  // recompute read the same copies as the forward (Note [regions see the copies]).
  Generator g(9);
  nn::Linear fc1(16, 32, g), fc2(32, 16, g);
  std::vector<optim::Param> ps;
  fc1.collect_parameters("fc1", ps);
  fc2.collect_parameters("fc2", ps);
  const Tensor<bf16> x = Tensor<fp32>::normal({4, 16}, 0.f, 1.f, g).to<bf16>();
  const auto block = [&](const Tensor<bf16>& in) { return fc2.forward(gelu_tanh(fc1.forward(in))); };
  const auto grads = [&](bool checkpointed) {
    for (auto& p : ps) p.tensor.zero_grad();
    const Tensor<bf16> y = checkpointed ? tg::checkpoint<RecomputeAll>(block, x) : block(x);
    sum(y.to<fp32>()).backward();
    std::vector<std::vector<float>> out;
    for (auto& p : ps) out.push_back(p.tensor.grad().to_vector());
    return out;
  };
  amp::WeightCopies<bf16> copies(ps);
  for (auto& p : ps)
    for (std::int64_t i = 0; i < p.tensor.numel(); ++i) p.tensor.data()[i] += 0.25f;  // the copies are now old
  ASSERT_NE(copies.copy_of(fc1.weight()).to_vector()[0].bits, bf16(fc1.weight().data()[0]).bits);
  const auto recomputes = autodiff::checkpoint_stats().recomputes;
  const auto plain = grads(false);
  const auto ckpt = grads(true);
  EXPECT_EQ(autodiff::checkpoint_stats().recomputes - recomputes, 1);
  for (std::size_t i = 0; i < ps.size(); ++i) EXPECT_EQ(ckpt[i], plain[i]) << "gradient of " << ps[i].name;
  copies.refresh();  // with fresh copies the gradients change: the copies really were the old weights
  EXPECT_NE(grads(true)[0], plain[0]);
}

// ---- memory: activations in bf16 vs fp32 -----------------------------------------------------------------
template <class Policy>
std::int64_t activation_peak_bytes(std::int64_t B, std::int64_t T) {
  TinySetup s(B, T);
  optim::AdamW opt(s.params, {.lr = 1e-3f});
  amp::MixedPrecision<Policy> mp(s.params, opt);
  auto& alloc = allocator<cpu>();
  alloc.empty_cache();  // no cached block of another run's sizes may serve (and inflate) this run's requests
  const std::int64_t base = alloc.stats().bytes_in_use;  // parameters and weight copies
  alloc.reset_peak();
  {
    const auto loss = mp.loss(mp.forward(s.model, s.idx, s.gen), s.tgt);  // the tape now holds every activation
    EXPECT_TRUE(std::isfinite(loss.item()));
  }
  return alloc.stats().peak_bytes - base;
}

TEST(AmpMemory, Bf16ActivationsTakeAtMostSixtyPercentOfFp32) {
  const std::int64_t B = 8, T = 64;
  const std::int64_t f32 = activation_peak_bytes<amp::fp32_policy>(B, T);
  const std::int64_t b16 = activation_peak_bytes<amp::bf16_mixed>(B, T);
  const double ratio = static_cast<double>(b16) / static_cast<double>(f32);
  std::printf("activation peak bytes (tiny GPT, 2 layers, B=%lld T=%lld): fp32 %lld, bf16 %lld, ratio %.3f\n",
              (long long)B, (long long)T, (long long)f32, (long long)b16, ratio);
  EXPECT_GT(f32, 0);
  EXPECT_LE(ratio, 0.60);
}

// ---- kernels ---------------------------------------------------------------------------------------------
TEST(AmpKernels, UnscaleAndCheckFindsInfAndNan) {
  std::vector<float> g(100000, 2.0f);
  EXPECT_FALSE(backend::cpu::unscale_and_check<float>(g.data(), static_cast<std::int64_t>(g.size()), 0.25f));
  EXPECT_EQ(g[0], 0.5f);
  EXPECT_EQ(g[99999], 0.5f);
  g[77777] = -std::numeric_limits<float>::infinity();
  EXPECT_TRUE(backend::cpu::unscale_and_check<float>(g.data(), static_cast<std::int64_t>(g.size()), 1.0f));
  g[77777] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(backend::cpu::unscale_and_check<float>(g.data(), 100000, 1.0f));
  g[77777] = std::numeric_limits<float>::max();
  EXPECT_FALSE(backend::cpu::unscale_and_check<float>(g.data(), 100000, 1.0f)) << "large but finite is fine";
}

TEST(AmpKernels, ConvertMatchesTheScalarReference) {
  std::vector<float> src(70001);
  Generator gen(9);
  for (auto& v : src) v = static_cast<float>((gen.uniform() - 0.5) * 1e5);
  src[1] = std::numeric_limits<float>::infinity();
  src[2] = std::numeric_limits<float>::quiet_NaN();
  src[3] = 1e-30f;       // fp16 underflow
  src[4] = 70000.f;      // fp16 overflow
  std::vector<bf16> b(src.size());
  std::vector<fp16> h(src.size());
  backend::cpu::convert_contiguous<float, bf16>(src.data(), b.data(), static_cast<std::int64_t>(src.size()));
  backend::cpu::convert_contiguous<float, fp16>(src.data(), h.data(), static_cast<std::int64_t>(src.size()));
  for (std::size_t i = 0; i < src.size(); ++i) {
    ASSERT_EQ(b[i].bits, bf16(src[i]).bits) << i;
    ASSERT_EQ(h[i].bits, fp16(src[i]).bits) << i;
  }
}

template <class T>
void check_gelu_16bit() {
  // Note [vectorized unary ops]: within one unit in the last place of T of the fp64 formula.
  const std::int64_t n = 20001;
  std::vector<double> xs(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) xs[static_cast<std::size_t>(i)] = -12.0 + 24.0 * static_cast<double>(i) / (n - 1);
  xs[0] = -200.0;
  xs[1] = 200.0;
  auto x = Tensor<T>::from_values({n}, xs);
  x.requires_grad_();
  const Tensor<T> y = gelu_tanh(x);
  y.backward(Tensor<T>::ones({n}));
  const double ulp = dtype_traits<T>::epsilon();
  for (std::int64_t i = 0; i < n; ++i) {
    const double xv = static_cast<double>(x.at({i}));
    const double s = 1.0 / (1.0 + std::exp(-2.0 * 0.7978845608028654 * (xv + 0.044715 * xv * xv * xv)));
    const double ref = xv * s;
    const double dref = s + xv * s * (1 - s) * 2 * 0.7978845608028654 * (1 + 3 * 0.044715 * xv * xv);
    ASSERT_NEAR(static_cast<double>(y.at({i})), ref, ulp * std::abs(ref) + 1e-6) << "gelu at x = " << xv;
    ASSERT_NEAR(static_cast<double>(x.grad().at({i})), dref, ulp * std::abs(dref) + 1e-6) << "gelu' at x = " << xv;
  }
}
TEST(AmpKernels, VectorizedGeluOn16BitStorage) {
  check_gelu_16bit<bf16>();
  check_gelu_16bit<fp16>();
}

TEST(AmpKernels, AmxBf16GemmMatchesFp64Reference) {
  if (!backend::cpu::amx_bf16_usable()) GTEST_SKIP() << "no AMX-BF16 on this CPU (or TG_AMX=0 / TG_GEMM_KERNEL set)";
  using backend::cpu::Trans;
  struct Case { std::int64_t M, N, K; Trans ta, tb; float beta; bool bias; };
  const Case cases[] = {{64, 96, 128, Trans::N, Trans::T, 0.f, true},  {37, 50, 77, Trans::N, Trans::N, 0.f, false},
                        {45, 33, 100, Trans::T, Trans::N, 1.f, false}, {16, 16, 32, Trans::T, Trans::T, 0.5f, true},
                        {130, 70, 31, Trans::N, Trans::T, 0.f, true},  {5, 200, 64, Trans::N, Trans::N, 0.f, false},
                        {80, 40, 64, Trans::N, Trans::N, 1.f, true},   {100, 72, 96, Trans::N, Trans::T, 0.f, false}};
  Generator gen(11);
  for (const Case& c : cases) {
    const std::int64_t ar = c.ta == Trans::N ? c.M : c.K, ac = c.ta == Trans::N ? c.K : c.M;
    const std::int64_t br = c.tb == Trans::N ? c.K : c.N, bc = c.tb == Trans::N ? c.N : c.K;
    const std::int64_t lda = ac + 3, ldb = bc + 1, ldc = c.N + 2;  // padded leading dimensions
    std::vector<bf16> A(static_cast<std::size_t>(ar * lda)), B(static_cast<std::size_t>(br * ldb)),
        C(static_cast<std::size_t>(c.M * ldc));
    for (auto& v : A) v = bf16(static_cast<float>(gen.uniform() * 2 - 1));
    for (auto& v : B) v = bf16(static_cast<float>(gen.uniform() * 2 - 1));
    for (auto& v : C) v = bf16(static_cast<float>(gen.uniform() * 2 - 1));
    std::vector<float> bias(static_cast<std::size_t>(c.N));
    for (auto& v : bias) v = static_cast<float>(gen.uniform());
    const std::vector<bf16> C0 = C;
    const float alpha = 0.75f;
    backend::cpu::gemm_bf16_amx(c.ta, c.tb, c.M, c.N, c.K, alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc,
                                c.bias ? bias.data() : nullptr);
    for (std::int64_t m = 0; m < c.M; ++m)
      for (std::int64_t n = 0; n < c.N; ++n) {
        double ref = 0, mag = 0;
        for (std::int64_t k = 0; k < c.K; ++k) {
          const double a = static_cast<float>(c.ta == Trans::N ? A[m * lda + k] : A[k * lda + m]);
          const double b = static_cast<float>(c.tb == Trans::N ? B[k * ldb + n] : B[n * ldb + k]);
          ref += a * b;
          mag += std::abs(a * b);
        }
        ref = alpha * ref + c.beta * static_cast<float>(C0[m * ldc + n]) + (c.bias ? bias[n] : 0.f);
        const double got = static_cast<float>(C[m * ldc + n]);
        ASSERT_NEAR(got, ref, 1e-5 * mag + 8e-3 * std::abs(ref) + 1e-6)
            << "M=" << c.M << " N=" << c.N << " K=" << c.K << " at (" << m << ", " << n << ")";
      }
    // Padding outside the M x N corner is untouched.
    for (std::int64_t m = 0; m < c.M; ++m)
      for (std::int64_t n = c.N; n < ldc; ++n) ASSERT_EQ(C[m * ldc + n].bits, C0[m * ldc + n].bits);
  }
}

// ---- training: bf16 and fp16 track fp32 ------------------------------------------------------------------
// Note [mixed-precision tracking test]
// The tiny GPT (4 layers, C=128, byte vocabulary) trains for 300 AdamW steps on the fortunes corpus with
// B=8, T=32 (the same batches in every precision; ~25 s per precision with one thread). The final
// training loss is the mean over the last 20 steps (single batches differ by more than 2% from step to
// step; the mean compares the models, not the batches).
template <class Policy>
double train_tiny(std::int64_t steps) {
  const data::ByteTokenizer tok;
  const auto ds = data::TextDataset::fortunes(tok, 0.1, 32);
  Generator gen(1337), dgen(1338);
  const nn::GPT model(nn::GPTConfig::preset("tiny", 256), gen);
  const auto params = model.named_parameters();
  optim::AdamW opt(optim::default_groups(params, 0.1f), {.lr = 2e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  optim::Schedule schedule = optim::Warmup{20}.then(optim::Cosine{2e-3f, steps - 20, 2e-4f});
  optim::GradAccum<1> accum;
  data::BatchSampler sampler(ds.train(), 8, 32, 7);
  amp::MixedPrecision<Policy> mp(params, opt);
  double tail = 0;
  const std::int64_t last = 20;
  for (std::int64_t step = 0; step < steps; ++step) {
    const auto b = sampler.next();
    const auto loss = mp.loss(mp.forward(model, b.inputs, dgen, true), b.targets);
    if (step >= steps - last) tail += static_cast<double>(loss.item());
    accum.scale(loss, mp.scaler).backward();
    if (accum.micro_step(opt, schedule, 1.0, mp.scaler)) mp.after_step(accum);
  }
  if constexpr (amp::MixedPrecision<Policy>::scaler_type::scales_loss)
    std::printf("%s: final scale %g, %lld skipped steps\n", std::string(amp::policy_name<Policy>()).c_str(),
                mp.scaler.scale(), (long long)accum.skipped_steps());
  return tail / static_cast<double>(last);
}

TEST(AmpTraining, Bf16AndFp16TrackFp32OnTheTinyGpt) {
  const std::int64_t steps = 300;
  const double f32 = train_tiny<amp::fp32_policy>(steps);
  const double b16 = train_tiny<amp::bf16_mixed>(steps);
  const double f16 = train_tiny<amp::fp16_mixed>(steps);
  std::printf("tiny GPT, %lld steps, final training loss (mean of the last 20): fp32 %.4f, bf16 %.4f (%+.2f%%), fp16 %.4f (%+.2f%%)\n",
              (long long)steps, f32, b16, 100 * (b16 / f32 - 1), f16, 100 * (f16 / f32 - 1));
  EXPECT_LT(f32, 3.0) << "the run must actually learn (ln 256 = 5.55 at the start)";
  EXPECT_NEAR(b16, f32, 0.02 * f32);
  EXPECT_NEAR(f16, f32, 0.02 * f32);
}

}  // namespace

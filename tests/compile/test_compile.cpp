// tg::compile (Note [compiled steps], Note [step memory plan]): a compiled training step equals the eager one
// bit for bit over 20 AdamW steps (fp32 and bf16, dropout, gradient accumulation 3, recomputed blocks, fp16
// with its scaler and an injected inf), makes no allocator call after its first step, predicts its peak,
// captures again for a new signature, rejects a step whose ops depend on its data, and never hands out memory
// that is still in use.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>

namespace test_compile_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::testing::small_gpt;

tg::data::Batch batch(std::int64_t k, std::int64_t T = 12) {
  return {tg::testing::random_tokens(3, T, 50, 500 + 2 * static_cast<std::uint64_t>(k)),
          tg::testing::random_tokens(3, T, 50, 501 + 2 * static_cast<std::uint64_t>(k))};
}

struct Scenario {
  float dropout = 0.f;
  std::int64_t accum = 1;
  int steps = 20;
  int inf_step = -1;  // this step's loss is multiplied by inf (the same ops: a scale tensor's value changes)
};

struct Outcome {
  std::vector<double> losses;
  std::vector<bool> skipped;
  std::vector<std::vector<float>> weights;
  std::vector<std::int64_t> allocations;  // allocator calls made by each step
  tg::capture::MemoryPlan plan;
  std::int64_t measured_peak = 0;  // the last step's allocator peak
  std::int64_t captures = 0, replays = 0, failed_replays = 0;
};

template <class Policy, class Ckpt = tg::NoCheckpoint>
Outcome train(const Scenario& s, bool compiled) {
  tg::Generator init(3), drop(4);
  tg::nn::GPT model(small_gpt(s.dropout), init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 18, 3e-4f});
  tg::train::TrainStep<Policy, Ckpt> step(ps, opt, sched, {.clip = 1.0}, tg::optim::GradAccumRuntime(s.accum));
  const tg::Tensor<float> scale = tg::Tensor<float>::ones({});
  std::int64_t k = 0;
  auto one_step = [&]() {
    return step.run(model, [&] { return batch(k++); }, drop, [&](const auto& logits, const tg::data::Batch& b) {
      return tg::mul(step.precision().loss(logits, b.targets), scale);
    });
  };
  auto c = tg::compile(one_step);
  c.set_parameters(ps);
  Outcome out;
  auto& a = tg::allocator<tg::cpu>();
  for (int i = 0; i < s.steps; ++i) {
    scale.data()[0] = i == s.inf_step ? std::numeric_limits<float>::infinity() : 1.f;
    const std::int64_t before = a.stats().allocations;
    a.reset_peak();
    const tg::train::StepResult r = compiled ? c() : one_step();
    out.allocations.push_back(a.stats().allocations - before);
    out.measured_peak = a.stats().peak_bytes;
    out.losses.push_back(r.loss);
    out.skipped.push_back(r.skipped);
    if (compiled && i > 0 && !c.last_replay().ok) ++out.failed_replays;
  }
  out.captures = c.captures();
  out.replays = c.replays();
  for (const auto& p : ps) out.weights.push_back(p.tensor.to_vector());
  out.plan = c.memory_plan();
  return out;
}

void expect_bitwise(const Outcome& got, const Outcome& ref, const char* what, std::int64_t captures = 1) {
  // The compiled run captured once (or again after a replay left the plan) and replayed every other step.
  EXPECT_EQ(got.captures, captures) << what;
  EXPECT_EQ(got.replays + got.captures, static_cast<std::int64_t>(got.losses.size())) << what;
  EXPECT_EQ(got.failed_replays, captures - 1) << what;
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&got.losses[i], &ref.losses[i], sizeof(double)), 0) << what << ": step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << what << ": step " << i;
  }
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << what << ": tensor " << t;
}

TEST(Compile, EqualsEagerBitwiseFp32WithDropoutAndAccumulation) {
  const Scenario s{.dropout = 0.1f, .accum = 3};
  expect_bitwise(train<tg::amp::fp32_policy>(s, true), train<tg::amp::fp32_policy>(s, false), "fp32, dropout 0.1, accumulation 3");
}

TEST(Compile, EqualsEagerBitwiseBf16) {
  const Scenario s{.dropout = 0.1f, .accum = 3};
  expect_bitwise(train<tg::amp::bf16_mixed>(s, true), train<tg::amp::bf16_mixed>(s, false), "bf16 mixed, dropout 0.1, accumulation 3");
}

TEST(Compile, EqualsEagerBitwiseRecomputedBlocks) {
  const Scenario s{.dropout = 0.1f, .accum = 3};
  expect_bitwise(train<tg::amp::fp32_policy, tg::RecomputeAll>(s, true), train<tg::amp::fp32_policy, tg::RecomputeAll>(s, false),
                 "fp32, blocks recomputed, dropout 0.1, accumulation 3");
}

TEST(Compile, EqualsEagerBitwiseFp16WithAnInf) {
  const Scenario s{.dropout = 0.1f, .accum = 3, .inf_step = 6};
  const Outcome got = train<tg::amp::fp16_mixed>(s, true), ref = train<tg::amp::fp16_mixed>(s, false);
  EXPECT_TRUE(ref.skipped[6]) << "the injected inf skips step 6";
  // The skipped step makes the same ops and allocations (the update works in place): replayed too.
  expect_bitwise(got, ref, "fp16 mixed with its scaler, an inf at step 6");
}

TEST(Compile, NoAllocatorCallsAfterTheFirstStep) {
  for (const std::int64_t accum : {1, 3}) {
    const Outcome r = train<tg::amp::bf16_mixed>({.dropout = 0.1f, .accum = accum, .steps = 6}, true);
    EXPECT_GT(r.allocations[0], 0);
    for (std::size_t i = 1; i < r.allocations.size(); ++i) EXPECT_EQ(r.allocations[i], 0) << "step " << i << ", accumulation " << accum;
  }
}

TEST(Compile, ThePlanPredictsThePeak) {
  // Each run starts from an empty cache: the caching allocator serves a request from a free block up to twice its
  // size, so what earlier tests left cached would change the eager step's measured peak with the order of the tests.
  tg::allocator<tg::cpu>().empty_cache();
  const Outcome compiled = train<tg::amp::fp32_policy>({.accum = 2, .steps = 4}, true);
  tg::allocator<tg::cpu>().empty_cache();
  const Outcome eager = train<tg::amp::fp32_policy>({.accum = 2, .steps = 4}, false);
  const auto& p = compiled.plan;
  // A replayed step's peak is the plan's (resident state + the arena's block; to the byte unless the allocator
  // serves the arena from a larger cached block): within 5%.
  const double replay_rel = std::abs(static_cast<double>(p.peak_bytes()) - static_cast<double>(compiled.measured_peak)) / compiled.measured_peak;
  EXPECT_LE(replay_rel, 0.05) << p.peak_bytes() << " planned, " << compiled.measured_peak << " measured";
  // The eager step's peak, predicted from the trace in the allocator's sizes (the plan was traced on the
  // first step, which also created the optimizer state): within 5%.
  const double eager_rel = std::abs(static_cast<double>(p.eager_peak_bytes) - static_cast<double>(eager.measured_peak)) / eager.measured_peak;
  EXPECT_LE(eager_rel, 0.05) << p.eager_peak_bytes << " predicted, " << eager.measured_peak << " measured";
  // The arena packs within 5% of the lower bound (the most bytes alive at once).
  EXPECT_LE(p.arena_bytes, p.max_live_bytes * 105 / 100);
  EXPECT_GT(p.activation_bytes, 0);
  EXPECT_LE(p.activation_bytes, p.max_live_bytes);
  std::int64_t weights = 0;
  for (const auto& w : compiled.weights) weights += static_cast<std::int64_t>(w.size() * sizeof(float));
  EXPECT_EQ(p.weight_bytes, weights);
  std::printf("[ plan ] replayed peak %lld, plan %lld; eager peak %lld, predicted %lld (%.2f%%); arena %lld, max live %lld, activations %lld\n%s",
              (long long)compiled.measured_peak, (long long)p.peak_bytes(), (long long)eager.measured_peak, (long long)p.eager_peak_bytes,
              100 * eager_rel, (long long)p.arena_bytes, (long long)p.max_live_bytes, (long long)p.activation_bytes, p.describe().c_str());
}

/// A model, its AdamW and its fp32 training step, for the tests that call TrainStep::run themselves.
struct Trainer {
  tg::Generator init{3}, drop{4};
  tg::nn::GPT model{small_gpt(0.f), init};
  std::vector<tg::optim::Param> ps = model.named_parameters();
  tg::optim::AdamW opt{tg::optim::default_groups(ps, 0.1f), {}};
  tg::optim::Schedule sched = tg::optim::Constant{1e-3f};
  tg::train::TrainStep<tg::amp::fp32_policy> step{ps, opt, sched, {}};
};

TEST(Compile, ANewSignatureIsCapturedAgain) {
  Trainer t;
  auto& [init, drop, model, ps, opt, sched, step] = t;
  auto c = tg::compile([&](const tg::data::Batch& b) { return step.run(model, [&] { return b; }, drop); });
  c(batch(0, 12));
  c(batch(1, 12));
  testing::internal::CaptureStderr();
  c(batch(2, 8));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tg::compile: a new input signature (batch(int64[3,8]cpu;int64[3,8]cpu;);): capturing it"), std::string::npos) << err;
  c(batch(3, 8));
  c(batch(4, 12));  // the first signature is still cached: replayed
  EXPECT_EQ(c.variants(), 2u);
  // each signature is captured twice (found, then fused: without dropout a block's last residual add is read by
  // the next LayerNorm, a pair run as add_layernorm, Note [pair rewrites]); the fifth call replays the first
  EXPECT_EQ(c.fused_pairs().size(), 2u);
  EXPECT_EQ(c.captures(), 4);
  EXPECT_EQ(c.replays(), 1);
  EXPECT_TRUE(c.last_replay().ok) << c.last_replay().divergence;
}

TEST(Compile, DataDependentControlFlowIsAnError) {
  Trainer t;
  auto& [init, drop, model, ps, opt, sched, step] = t;
  int calls = 0;
  auto c = tg::compile([&](const tg::data::Batch& b) {
    ++calls;
    return step.run(model, [&] { return b; }, drop, [&](const tg::Tensor<float>& logits, const tg::data::Batch& bb) {
      tg::Tensor<float> l = step.precision().loss(logits, bb.targets);
      if (calls == 3) l = tg::mul(l, tg::Tensor<float>::full({}, 0.5f));  // as if it depended on the loss's value
      return l;
    });
  });
  c(batch(0));
  c(batch(1));
  try {
    c(batch(2));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    // the extra op is named, whether the captured step ran another op there or had no more ops (the GPT's
    // backward formulas call kernels only, so its captured ops end with the loss)
    EXPECT_NE(std::string(e.what()).find("is 'mul'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("its ops depend on its data"), std::string::npos) << e.what();
  }
}

TEST(Compile, ATensorKeptPastTheStepIsNeverOverwritten) {
  // The third call keeps a block of the arena past the step (a user's cache): the replay notices, that arena
  // is retired (freed with the kept tensor), the next call captures again, and later steps never write there.
  std::vector<tg::Tensor<float>> kept;
  int call = 0;
  auto c = tg::compile([&]() {
    ++call;
    tg::Tensor<float> a = tg::Tensor<float>::full({32, 32}, static_cast<float>(call));
    tg::Tensor<float> b = tg::mul(a, a);
    if (call == 3) kept.push_back(b);  // this replay's block outlives the step
    return b.data()[5];
  });
  for (int i = 1; i <= 6; ++i) {
    const float v = c();
    EXPECT_EQ(v, static_cast<float>(i * i));
    if (i == 3) {
      EXPECT_FALSE(c.last_replay().ok);
      EXPECT_NE(c.last_replay().divergence.find("outlived the step"), std::string::npos) << c.last_replay().divergence;
    }
  }
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].data()[7], 9.f);  // not overwritten by steps 4-6
}

}  // namespace

}  // namespace test_compile_cpp

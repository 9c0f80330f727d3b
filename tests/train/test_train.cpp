// tg::train: the training step type (Note [the training step]) against the loop it replaces, its
// accumulation forms, checkpointing policies, loss scaling and non-finite handling; the run log (Note [the
// run log]) and the run's clock.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/data/tokenizer.hpp>
#include <typegrad/nn/generate.hpp>
#include <typegrad/train/evaluate.hpp>
#include <typegrad/train/log.hpp>
#include <typegrad/train/run.hpp>
#include <typegrad/train/step.hpp>

namespace {

tg::nn::GPTConfig tiny_config(float dropout = 0.1f) {
  tg::nn::GPTConfig c;
  c.vocab_size = 48;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  c.dropout = dropout;
  return c;
}

using tg::testing::random_tokens;

struct Batch {
  tg::Tensor<std::int64_t> inputs, targets;
};
/// The k-th micro-batch of a fixed stream.
Batch batch(std::int64_t k, std::int64_t V) { return {random_tokens(2, 12, V, 100 + 2 * k), random_tokens(2, 12, V, 101 + 2 * k)}; }

std::vector<std::vector<float>> values(const std::vector<tg::optim::Param>& ps) {
  std::vector<std::vector<float>> out;
  for (const auto& p : ps) out.push_back(p.tensor.to_vector());
  return out;
}
bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) return false;
  return true;
}

tg::optim::AdamWOptions adamw() { return {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}; }
tg::optim::Schedule schedule() { return tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 10, 3e-4f}); }

/// The tiny GPT, its AdamW and its schedule that both loops below train (the same seeds: the same run).
struct TinyRun {
  tg::nn::GPTConfig cfg = tiny_config();
  tg::Generator init{7}, drop{11};
  tg::nn::GPT model{cfg, init};
  std::vector<tg::optim::Param> ps = model.named_parameters();
  tg::optim::AdamW opt{tg::optim::default_groups(ps, 0.1f), adamw()};
  tg::optim::Schedule sched = schedule();
};

/// `steps` optimizer steps of `n` micro-batches the way a loop wrote them before TrainStep: GradAccumulator +
/// MixedPrecision by hand. Returns the weights, and the per-step losses and norms.
template <class Policy, class Accum>
std::vector<std::vector<float>> by_hand(Accum accum, int steps, std::vector<double>& losses, std::vector<double>& norms) {
  TinyRun r;
  auto& [cfg, init, drop, model, ps, opt, sched] = r;
  tg::amp::MixedPrecision<Policy> amp(ps, opt);
  std::int64_t k = 0;
  for (int s = 0; s < steps; ++s) {
    double loss = 0;
    for (std::int64_t m = 0; m < accum.n(); ++m) {
      const Batch b = batch(k++, cfg.vocab_size);
      const auto l = amp.loss(amp.forward(model, b.inputs, drop), b.targets);
      loss += static_cast<double>(l.item()) / static_cast<double>(accum.n());
      accum.scale(l, amp.scaler).backward();
      if (accum.micro_step(opt, sched, 1.0, amp.scaler)) amp.after_step(accum);
    }
    losses.push_back(loss);
    norms.push_back(accum.last_grad_norm());
  }
  return values(ps);
}

template <class Policy, class Ckpt = tg::NoCheckpoint, class Accum = tg::optim::GradAccumRuntime>
std::vector<std::vector<float>> with_step_type(Accum accum, int steps, std::vector<tg::train::StepResult>& results) {
  TinyRun r;
  auto& [cfg, init, drop, model, ps, opt, sched] = r;
  tg::train::TrainStep<Policy, Ckpt, tg::cpu, Accum> step(ps, opt, sched, {.clip = 1.0}, accum);
  std::int64_t k = 0;
  for (int s = 0; s < steps; ++s) results.push_back(step.run(model, [&] { return batch(k++, cfg.vocab_size); }, drop));
  EXPECT_EQ(step.steps_taken(), steps);
  EXPECT_EQ(opt.step_count(), steps);
  EXPECT_EQ(sched.step(), steps);
  return values(ps);
}

template <class Policy>
void expect_same_as_by_hand(const char* what) {
  std::vector<double> losses, norms;
  const auto ref = by_hand<Policy>(tg::optim::GradAccumRuntime(2), 3, losses, norms);
  std::vector<tg::train::StepResult> got;
  const auto w = with_step_type<Policy>(tg::optim::GradAccumRuntime(2), 3, got);
  EXPECT_TRUE(same_bits(ref, w)) << what << ": TrainStep's weights differ from the hand-written loop's";
  const auto sched = schedule();
  for (std::size_t s = 0; s < got.size(); ++s) {
    EXPECT_EQ(got[s].loss, losses[s]) << what << " step " << s;
    EXPECT_EQ(got[s].grad_norm, norms[s]) << what << " step " << s;
    EXPECT_GT(got[s].grad_norm, 0.0);
    EXPECT_EQ(got[s].lr, sched.lr_at(static_cast<std::int64_t>(s))) << what << " step " << s;
    EXPECT_FALSE(got[s].skipped);
  }
}

TEST(TrainStep, Fp32EqualsTheHandWrittenLoop) { expect_same_as_by_hand<tg::amp::fp32_policy>("fp32"); }
TEST(TrainStep, Bf16EqualsTheHandWrittenLoop) { expect_same_as_by_hand<tg::amp::bf16_mixed>("bf16"); }
TEST(TrainStep, Fp16EqualsTheHandWrittenLoop) { expect_same_as_by_hand<tg::amp::fp16_mixed>("fp16"); }

TEST(TrainStep, CompileTimeAndRunTimeAccumulationAreOneClass) {
  std::vector<tg::train::StepResult> a, b;
  const auto rt = with_step_type<tg::amp::bf16_mixed>(tg::optim::GradAccumRuntime(3), 2, a);
  const auto ct = with_step_type<tg::amp::bf16_mixed, tg::NoCheckpoint, tg::optim::GradAccum<3>>({}, 2, b);
  EXPECT_TRUE(same_bits(rt, ct));
  static_assert(std::is_base_of_v<tg::optim::GradAccumulator<tg::optim::detail::RuntimeCount>, tg::optim::GradAccumRuntime>);
}

TEST(TrainStep, CheckpointingPoliciesGiveTheSameWeights) {
  std::vector<tg::train::StepResult> r0, r1, r2;
  const auto none = with_step_type<tg::amp::bf16_mixed>(tg::optim::GradAccumRuntime(2), 2, r0);
  const auto sel = with_step_type<tg::amp::bf16_mixed, tg::SelectiveRecompute>(tg::optim::GradAccumRuntime(2), 2, r1);
  const auto blocks = with_step_type<tg::amp::bf16_mixed, tg::RecomputeAll>(tg::optim::GradAccumRuntime(2), 2, r2);
  EXPECT_TRUE(same_bits(none, sel));
  EXPECT_TRUE(same_bits(none, blocks));
}

TEST(TrainStep, WithCheckpointingIsTheOneRunTimeBoundary) {
  EXPECT_STREQ(tg::with_checkpointing("none", []<class C>() { return C::name; }), "none");
  EXPECT_STREQ(tg::with_checkpointing("selective", []<class C>() { return C::name; }), "selective");
  EXPECT_STREQ(tg::with_checkpointing("blocks", []<class C>() { return C::name; }), "blocks");
  try {
    tg::with_checkpointing("some", []<class C>() { return 0; });
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown mode 'some' (expected none, selective or blocks)"), std::string::npos) << e.what();
  }
}

// The hooks (StepOptions::before_update / after_update): before_update once per optimizer step, after the last
// micro-batch's backward (the gradients are complete) and before the update; after_update after the update and
// before the weight copies are refreshed, never on a skipped step. A loss function given to run() replaces the
// cross-entropy: the same one gives the same run bit for bit.
TEST(TrainStep, HooksAndACustomLoss) {
  std::vector<tg::train::StepResult> ref_results;
  const auto ref = with_step_type<tg::amp::bf16_mixed>(tg::optim::GradAccumRuntime(2), 3, ref_results);
  TinyRun r;
  auto& [cfg, init, drop, model, ps, opt, sched] = r;
  std::vector<std::string> events;
  tg::train::StepOptions options{.clip = 1.0};
  options.before_update = [&] {
    events.push_back("before " + std::to_string(opt.step_count()));
    EXPECT_TRUE(ps[0].tensor.grad().defined()) << "the gradients exist when before_update runs";
  };
  options.after_update = [&] { events.push_back("after " + std::to_string(opt.step_count())); };
  std::int64_t k = 0, calls = 0;
  {  // one TrainStep at a time holds the masters' weight copies
    tg::train::TrainStep<tg::amp::bf16_mixed> step(ps, opt, sched, options, tg::optim::GradAccumRuntime(2));
    auto loss = [&](const tg::Tensor<tg::bf16>& logits, const Batch& b) {
      ++calls;
      return tg::cross_entropy_as<float>(logits, b.targets);
    };
    for (int s = 0; s < 3; ++s) {
      const auto got = step.run(model, [&] { return batch(k++, cfg.vocab_size); }, drop, loss);
      EXPECT_EQ(got.loss, ref_results[static_cast<std::size_t>(s)].loss);
    }
  }
  EXPECT_EQ(calls, 6);
  EXPECT_TRUE(same_bits(ref, values(ps)));
  EXPECT_EQ(events, (std::vector<std::string>{"before 0", "after 1", "before 1", "after 2", "before 2", "after 3"}));
  // after_update's change to the masters reaches the next forward: it runs before the copies are refreshed.
  tg::train::StepOptions zeroing;
  zeroing.after_update = [&] {
    tg::NoGrad g;
    tg::detail::copy_tensor(tg::Tensor<float>::zeros(ps[0].tensor.shape()), ps[0].tensor);
  };
  tg::train::TrainStep<tg::amp::bf16_mixed> zero_step(ps, opt, sched, zeroing, tg::optim::GradAccumRuntime(1));
  zero_step.run(model, [&] { return batch(k++, cfg.vocab_size); }, drop);
  const auto copy = tg::amp::param_as<tg::bf16>(ps[0].tensor).template to<float>().to_vector();
  for (float v : copy) ASSERT_EQ(v, 0.f) << "the bf16 copy was refreshed after after_update";
}

// Note [the optimizer writes the weight copies]: a replica sync whose after_update changes the masters (as
// ZeRO's gather does) says so, and the copies are converted again; one that does not keeps the copies AdamW
// wrote, which are the masters rounded either way.
class ChangingSync final : public tg::train::StepSync {
 public:
  ChangingSync(const tg::Tensor<float>& w, bool says) : w_(w), says_(says) {}
  void sum(std::span<double>) const override {}
  bool sharded_grads() const override { return false; }
  int ranks() const override { return 1; }
  void before_backward(std::int64_t, std::int64_t) override {}
  void after_backward(std::int64_t, std::int64_t) override {}
  void after_update() override {
    if (!says_) return;
    tg::NoGrad g;
    tg::detail::copy_tensor(tg::Tensor<float>::full(w_.shape(), 0.25f), w_);
  }
  bool changes_weights_after_update() const override { return says_; }

 private:
  tg::Tensor<float> w_;
  bool says_;
};
TEST(TrainStep, ASyncThatChangesTheMastersAfterTheUpdateHasTheCopiesConverted) {
  for (const bool changes : {true, false}) {
    TinyRun r;
    auto& [cfg, init, drop, model, ps, opt, sched] = r;
    ChangingSync sync(ps[0].tensor, changes);
    tg::train::StepOptions options;
    options.sync = &sync;
    std::int64_t k = 0;
    tg::train::TrainStep<tg::amp::bf16_mixed> step(ps, opt, sched, options, tg::optim::GradAccumRuntime(1));
    for (int s = 0; s < 2; ++s) step.run(model, [&] { return batch(k++, cfg.vocab_size); }, drop);
    for (const auto& p : ps) {
      const auto copy = tg::amp::param_as<tg::bf16>(p.tensor).template to<float>().to_vector();
      const auto want = p.tensor.template to<tg::bf16>().template to<float>().to_vector();
      ASSERT_EQ(copy, want) << p.name << (changes ? ", changed by the sync" : "");
    }
    if (changes) EXPECT_EQ(ps[0].tensor.to_vector()[0], 0.25f);
  }
}

TEST(TrainStep, AnOverflowingScaleSkipsTheUpdate) {
  const auto cfg = tiny_config(0.f);
  tg::Generator init(7), drop(11);
  tg::nn::GPT model(cfg, init);
  const auto ps = model.named_parameters();
  const auto before = values(ps);
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  auto sched = schedule();
  // A scale so large that the scaled fp16 gradients overflow: every step is skipped.
  tg::train::TrainStep<tg::amp::fp16_mixed, tg::NoCheckpoint, tg::cpu, tg::optim::GradAccumRuntime, tg::amp::StaticScaler> step(
      ps, opt, sched, {.clip = 1.0}, tg::optim::GradAccumRuntime(1), tg::amp::StaticScaler(1e30));
  std::int64_t k = 0;
  const tg::train::StepResult r = step.run(model, [&] { return batch(k++, cfg.vocab_size); }, drop);
  EXPECT_TRUE(r.skipped);
  EXPECT_EQ(r.scale, 1e30);
  EXPECT_TRUE(std::isfinite(r.loss));
  EXPECT_EQ(step.steps_taken(), 0);
  EXPECT_EQ(step.steps_skipped(), 1);
  EXPECT_EQ(sched.step(), 0) << "a skipped step does not advance the schedule";
  EXPECT_EQ(opt.step_count(), 0);
  EXPECT_TRUE(same_bits(before, values(ps)));
  EXPECT_EQ(step.scaler().state().skipped_steps, 1);
}

TEST(TrainStep, NonFiniteStepsStopOrSkipWithoutAScaler) {
  for (const auto policy : {tg::optim::OnNonFinite::stop, tg::optim::OnNonFinite::skip}) {
    const auto cfg = tiny_config(0.f);
    tg::Generator init(7), drop(11);
    tg::nn::GPT model(cfg, init);
    const auto ps = model.named_parameters();
    tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
    auto sched = schedule();
    tg::train::TrainStep<tg::amp::bf16_mixed> step(ps, opt, sched, {.clip = 1.0, .on_non_finite = policy});
    ps.back().tensor.data()[0] = std::numeric_limits<float>::quiet_NaN();  // ln_f.bias: the loss turns NaN
    step.refresh_weights();
    const auto before = values(ps);
    std::int64_t k = 0;
    auto next = [&] { return batch(k++, cfg.vocab_size); };
    if (policy == tg::optim::OnNonFinite::stop) {
      EXPECT_THROW(step.run(model, next, drop), tg::optim::NonFiniteStep);
      EXPECT_EQ(step.steps_skipped(), 0);
    } else {
      const auto r = step.run(model, next, drop);
      EXPECT_TRUE(r.skipped);
      EXPECT_TRUE(std::isnan(r.loss));
      EXPECT_EQ(step.steps_skipped(), 1);
    }
    EXPECT_EQ(opt.step_count(), 0);
    EXPECT_EQ(step.steps_taken(), 0);
    const auto after = values(ps);
    for (std::size_t i = 0; i + 1 < after.size(); ++i) EXPECT_TRUE(same_bits({before[i]}, {after[i]})) << ps[i].name;
  }
}

// ---- evaluation and text --------------------------------------------------------------------------

TEST(Evaluate, LossAndBitsPerByte) {
  const auto cfg = tiny_config(0.f);
  tg::Generator init(7), g(3);
  tg::nn::GPT model(cfg, init);
  std::vector<std::int32_t> toks(4000);
  for (auto& t : toks) t = static_cast<std::int32_t>(g.next_u64() % static_cast<std::uint64_t>(cfg.vocab_size));
  const tg::data::TextDataset ds(toks, 0.25, 12, "random");
  const std::vector<std::int32_t> one(cfg.vocab_size, 1), two(cfg.vocab_size, 2);
  const tg::train::Evaluation e1 = tg::train::evaluate(model, ds, 2, 12, 3, one);
  // The reference: the same three sequential batches by hand.
  auto sampler = tg::data::BatchSampler::sequential(ds.validation(), 2, 12);
  double sum = 0;
  for (int i = 0; i < 3; ++i) {
    const auto b = sampler.next();
    sum += static_cast<double>(tg::cross_entropy(model.forward<tg::fp32>(b.inputs), b.targets).item());
  }
  EXPECT_DOUBLE_EQ(e1.loss, sum / 3);
  EXPECT_NEAR(e1.bits_per_byte, e1.loss / std::log(2.0), 1e-12);
  const tg::train::Evaluation e2 = tg::train::evaluate(model, ds, 2, 12, 3, two);
  EXPECT_DOUBLE_EQ(e2.loss, e1.loss);
  EXPECT_NEAR(e2.bits_per_byte, e1.bits_per_byte / 2, 1e-12);
  EXPECT_GT(e1.loss, 0.5 * std::log(static_cast<double>(cfg.vocab_size)));
  const std::vector<std::int32_t> too_short(3, 1);
  EXPECT_THROW(tg::train::evaluate(model, ds, 2, 12, 1, too_short), tg::Error);
}

TEST(GenerateText, KeepsThePromptAndFollowsTheDecoder) {
  const auto cfg = tiny_config(0.f);
  tg::Generator init(7);
  tg::nn::GPT model(cfg, init);
  // A byte-level tokenizer with a vocabulary of 48: ids 0..47 decode to those bytes.
  struct SmallBytes {
    std::vector<std::int32_t> encode(const std::string& s) const {
      std::vector<std::int32_t> out;
      for (unsigned char c : s) out.push_back(static_cast<std::int32_t>(c % 48));
      return out;
    }
    std::string decode(std::span<const std::int32_t> ids) const {
      std::string out;
      for (auto id : ids) out += static_cast<char>(id);
      return out;
    }
  } tok;
  const tg::nn::SamplingOptions opts{0.9f, 10, 1.0};
  tg::Generator g1(5), g2(5);
  const std::string text = tg::nn::generate_text(model, tok, "\x01\x02", 20, opts, g1, 8);
  ASSERT_EQ(text.size(), 22u);
  EXPECT_EQ(text.substr(0, 2), "\x01\x02");
  tg::nn::Decoder<tg::cpu> dec(model, 8);
  const std::vector<std::int32_t> prompt{1, 2};
  dec.set_prompt(prompt);
  for (std::size_t i = 2; i < text.size(); ++i) EXPECT_EQ(static_cast<std::int32_t>(text[i]), dec.next(opts, g2)) << i;
  EXPECT_THROW(tg::nn::generate_text(model, tok, "a", 1, opts, g1, 0), tg::Error);
}

// ---- the run log ----------------------------------------------------------------------------------

std::filesystem::path temp_path(const std::string& name) {
  return std::filesystem::temp_directory_path() / ("tg_train_" + std::to_string(::getpid()) + "_" + name);
}
std::vector<std::string> lines_of(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

TEST(LogRecord, WritesFieldsInOrderAsJson) {
  tg::train::LogRecord r;
  r.add("step", std::int64_t{12}).add("loss", 0.25).add("name", "a \"b\"\n").add("ok", true).add("n", 3);
  EXPECT_EQ(r.json(), R"({"step":12,"loss":0.25,"name":"a \"b\"\n","ok":true,"n":3})");
  r.add("loss", std::numeric_limits<double>::quiet_NaN()).add("inf", std::numeric_limits<double>::infinity());
  EXPECT_EQ(r.json(), R"({"step":12,"loss":null,"name":"a \"b\"\n","ok":true,"n":3,"inf":null})");
  EXPECT_EQ(tg::train::LogRecord().add("x", 0.1).add("y", 1.0 / 3.0).json(), R"({"x":0.1,"y":0.3333333333333333})");
}

TEST(JsonLinesLog, AResumedRunKeepsTheLinesUpToItsStep) {
  const auto p = temp_path("resume.jsonl");
  {
    tg::train::JsonLinesLog log(p.string(), 0, tg::train::OnLogError::stop);
    for (std::int64_t s = 1; s <= 5; ++s) log.write(s, tg::train::LogRecord().add("step", s).add("loss", 1.0 / s));
  }
  { std::ofstream(p, std::ios::app) << "not json\n{\"step\":\"x\"}\n"; }
  EXPECT_EQ(lines_of(p).size(), 7u);
  {
    tg::train::JsonLinesLog log(p.string(), 3, tg::train::OnLogError::stop);
    log.write(4, tg::train::LogRecord().add("step", std::int64_t{4}).add("loss", 9.0));
  }
  const auto lines = lines_of(p);
  ASSERT_EQ(lines.size(), 4u);
  EXPECT_EQ(lines[0], R"({"step":1,"loss":1.0})");
  EXPECT_EQ(lines[2], R"({"step":3,"loss":0.3333333333333333})");
  EXPECT_EQ(lines[3], R"({"step":4,"loss":9.0})");
  std::filesystem::remove(p);
}

TEST(JsonLinesLog, AFailedWriteStopsOrWarns) {
  if (!std::filesystem::exists("/dev/full")) GTEST_SKIP() << "no /dev/full on this system";
  {
    tg::train::JsonLinesLog log("/dev/full", 0, tg::train::OnLogError::stop);
    try {
      log.write(7, tg::train::LogRecord().add("step", std::int64_t{7}));
      FAIL() << "no error";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("--log: writing '/dev/full' failed at step 7"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("--log-errors warn"), std::string::npos) << e.what();
    }
    EXPECT_FALSE(log.is_open());
  }
  tg::train::JsonLinesLog log("/dev/full", 0, tg::train::OnLogError::warn);
  EXPECT_NO_THROW(log.write(1, tg::train::LogRecord().add("step", std::int64_t{1})));
  EXPECT_FALSE(log.is_open());
  EXPECT_NO_THROW(log.write(2, tg::train::LogRecord().add("step", std::int64_t{2})));
}

TEST(JsonLinesLog, AnUnwritablePathIsAnErrorAtOnce) {
  try {
    tg::train::JsonLinesLog log("/nonexistent-dir/x.jsonl", 0, tg::train::OnLogError::stop);
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--log: cannot open '/nonexistent-dir/x.jsonl' for writing"), std::string::npos) << e.what();
  }
  tg::train::JsonLinesLog closed("", 0, tg::train::OnLogError::stop);
  EXPECT_FALSE(closed.is_open());
  EXPECT_NO_THROW(closed.write(1, tg::train::LogRecord().add("step", std::int64_t{1})));
}

/// `steps` TrainStep steps of the tiny run under Policy with `opt` (plain or offloaded); the weights after.
template <class Policy>
std::vector<std::vector<float>> train_with(TinyRun& r, tg::optim::Optimizer& opt, int steps, std::vector<double>& losses) {
  tg::train::TrainStep<Policy> step(r.ps, opt, r.sched, {.clip = 1.0}, tg::optim::GradAccumRuntime(2));
  std::int64_t k = 0;
  for (int s = 0; s < steps; ++s) losses.push_back(step.run(r.model, [&] { return batch(k++, r.cfg.vocab_size); }, r.drop).loss);
  return values(r.ps);
}

template <class Policy>
void expect_offload_is_the_plain_update(const char* what) {
  TinyRun plain, off;
  std::vector<double> lp, lo;
  const auto wp = train_with<Policy>(plain, plain.opt, 6, lp);
  auto offloaded = tg::optim::offload<tg::cpu>(tg::optim::default_groups(off.ps, 0.1f), [](std::vector<tg::optim::ParamGroup> g) {
    return std::make_unique<tg::optim::AdamW>(std::move(g), adamw());
  });
  const auto wo = train_with<Policy>(off, *offloaded, 6, lo);
  EXPECT_TRUE(same_bits(wp, wo)) << what << ": the offloaded update differs from the plain one";
  EXPECT_EQ(lp, lo) << what;
  EXPECT_STREQ(offloaded->name(), "AdamW");
  const auto sp = plain.opt.state_tensors(), so = offloaded->state_tensors();
  ASSERT_EQ(sp.size(), so.size());
  for (std::size_t i = 0; i < sp.size(); ++i) {
    EXPECT_EQ(sp[i].name, so[i].name);
    EXPECT_EQ(sp[i].tensor.to_vector(), so[i].tensor.to_vector()) << sp[i].name;
  }
}

TEST(OptimizerOffload, Fp32IsThePlainUpdateBitForBit) { expect_offload_is_the_plain_update<tg::amp::fp32_policy>("fp32"); }
TEST(OptimizerOffload, Bf16IsThePlainUpdateBitForBit) { expect_offload_is_the_plain_update<tg::amp::bf16_mixed>("bf16"); }

TEST(OptimizerOffload, KeepsNoStateOnTheDeviceAndSharesTheCheckpointFormat) {
  TinyRun a, b;
  auto off = std::make_unique<tg::optim::OffloadedOptimizer<tg::cpu>>(tg::optim::default_groups(a.ps, 0.1f), [](std::vector<tg::optim::ParamGroup> g) {
    return std::make_unique<tg::optim::AdamW>(std::move(g), adamw());
  });
  std::vector<double> la;
  train_with<tg::amp::fp32_policy>(a, *off, 3, la);
  // The state lives in the host optimizer; the plain optimizer loads it, and the offloaded one takes it back.
  EXPECT_GT(off->host().param_step_count("wte.weight"), 0);
  EXPECT_EQ(off->param_step_count("wte.weight"), off->host().param_step_count("wte.weight"));
  b.opt.load_state(off->state_tensors());
  off->load_state(b.opt.state_tensors());
  EXPECT_THROW(off->load_state({{"no.such.entry", tg::Tensor<float>::zeros({1})}}), tg::Error);
  // Weights changed outside the optimizer (a checkpoint load, pruning) are what the next update starts from.
  for (const auto& p : a.ps) tg::detail::copy_tensor(tg::Tensor<float>::zeros(p.tensor.shape()), p.tensor.detach());
  std::vector<double> more;
  const auto w = train_with<tg::amp::fp32_policy>(a, *off, 1, more);
  double largest = 0;
  for (const auto& t : w)
    for (float v : t) largest = std::max(largest, static_cast<double>(std::abs(v)));
  EXPECT_LT(largest, 0.1) << "the update started from stale host masters, not the zeroed weights";
}

TEST(RunClock, CountsTheStepsOfThisProcess) {
  tg::train::RunClock c(/*tokens_per_step=*/1000, /*start_step=*/10, /*last_step=*/20);
  EXPECT_EQ(c.steps_run(), 0);
  EXPECT_EQ(c.tokens_per_second(), 0.0);
  c.step_done(11, 0.5);
  c.step_done(12, 1.5);
  EXPECT_EQ(c.steps_run(), 2);
  EXPECT_DOUBLE_EQ(c.train_seconds(), 2.0);
  EXPECT_DOUBLE_EQ(c.tokens_per_second(), 1000.0);
  EXPECT_DOUBLE_EQ(c.ms_per_step(), 1000.0);
  EXPECT_DOUBLE_EQ(c.seconds_left(), 8.0);
}

TEST(RunBookkeeping, FormatsAndIds) {
  EXPECT_EQ(tg::train::human_bytes(3 << 20), "3.0 MiB");
  EXPECT_EQ(tg::train::human_bytes(std::int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(tg::train::human_time(125.9), "2m05s");
  EXPECT_EQ(tg::train::human_time(-1), "0m00s");
  const std::string a = tg::train::new_run_id(), b = tg::train::new_run_id();
  EXPECT_EQ(a.size(), 16u);
  EXPECT_EQ(a.find_first_not_of("0123456789abcdef"), std::string::npos);
  EXPECT_NE(a, b);
}

}  // namespace

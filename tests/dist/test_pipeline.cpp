// Pipeline parallelism (Note [pipeline parallelism]) over the whole world as one pipeline (1, 2 or 3 stages
// under CTest): the 1F1B step equals one process accumulating the same micro-batches, at most p - s
// micro-batches alive on stage s, the tied embedding's copies kept equal, and the errors for pipelines that do
// not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/pipeline.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>

namespace test_pipeline_cpp {  // the file's own names (Note [unity test sources])

namespace {

tg::dist::Communicator& W() { return tg::dist::world(); }

tg::nn::GPTConfig config(float dropout = 0.f) {
  tg::nn::GPTConfig c;
  c.vocab_size = 40;
  c.block_size = 16;
  c.n_layer = 4;
  c.n_head = 2;
  c.n_embd = 32;
  c.dropout = dropout;
  return c;
}

struct Batch {
  tg::Tensor<std::int64_t> inputs, targets;
};
Batch batch(std::int64_t k) { return {tg::testing::random_tokens(2, 10, 40, 700 + 2 * k), tg::testing::random_tokens(2, 10, 40, 701 + 2 * k)}; }
tg::optim::AdamWOptions adamw() { return {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}; }

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;
  std::uint64_t dropout_offset = 0;  // the dropout generator's position after the run
};

template <class Policy>
Run one_process(std::int64_t micro, int steps, float dropout = 0.f) {
  tg::Generator init(3), drop(4);
  tg::nn::GPT model(config(dropout), init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::train::TrainStep<Policy> step(ps, opt, sched, {.clip = 0.5}, tg::optim::GradAccumRuntime(micro));
  Run out;
  std::int64_t k = 0;
  for (int i = 0; i < steps; ++i) out.losses.push_back(step.run(model, [&] { return batch(k++); }, drop).loss);
  for (const auto& p : ps) out.weights[p.name] = p.tensor.to_vector();
  out.dropout_offset = drop.offset();
  return out;
}

template <class Policy, class Ckpt = tg::NoCheckpoint>
Run pipeline(std::int64_t micro, int steps, int* max_alive = nullptr, float dropout = 0.f) {
  tg::Generator init(3), drop(4);
  const tg::nn::GPT full(config(dropout), init);
  auto pp = W().split(0, W().rank());
  tg::dist::PipelineGPT<> stage(full, *pp);
  const auto ps = stage.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::dist::PipelineStep<Policy, Ckpt> step(stage, opt, sched, {.clip = 0.5}, micro);
  Run out;
  std::int64_t k = 0;
  for (int i = 0; i < steps; ++i) {
    out.losses.push_back(step.run([&] { return batch(k++); }, drop).loss);
    if (max_alive) *max_alive = std::max(*max_alive, step.stats().max_alive);
  }
  for (const auto& p : ps) out.weights[p.name] = p.tensor.to_vector();
  out.dropout_offset = drop.offset();
  return out;
}

void expect_close(const Run& got, const Run& ref, double tol, const std::string& what) {
  double worst_loss = 0, num = 0, den = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    const double rel = std::abs(got.losses[i] - ref.losses[i]) / ref.losses[i];
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LE(rel, tol) << what << ": step " << i;
  }
  for (const auto& [name, w] : got.weights) {
    const auto& r = ref.weights.at(name);
    std::size_t skip_begin = 0, skip_end = 0;  // the key third of c_attn.bias: rounding noise (tests/dist/test_dist.cpp)
    if (name.ends_with("c_attn.bias")) skip_begin = r.size() / 3, skip_end = 2 * r.size() / 3;
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (i >= skip_begin && i < skip_end) continue;
      num += (static_cast<double>(w[i]) - r[i]) * (static_cast<double>(w[i]) - r[i]);
      den += static_cast<double>(r[i]) * r[i];
    }
  }
  double sums[2] = {num, den};
  W().all_reduce(std::span<double>(sums, 2), tg::dist::ReduceOp::sum);  // over every stage's parameters
  const double rel = std::sqrt(sums[0] / sums[1]);
  EXPECT_LE(rel, tol) << what << ": the weights";
  if (W().rank() == 0)
    std::printf("[ pp ] %s, %d stages, vs one process: loss %.2g, weights %.2g; tolerance %.0e\n", what.c_str(), W().size(), worst_loss, rel, tol);
}

TEST(Pipeline, OneF1BEqualsOneProcessFp32) {
  for (std::int64_t m : {2, 4}) {
    int alive = 0;
    const auto got = pipeline<tg::amp::fp32_policy>(m, 8, &alive);
    expect_close(got, one_process<tg::amp::fp32_policy>(m, 8), 1e-5, "fp32, " + std::to_string(m) + " micro-batches");
    EXPECT_LE(alive, std::min<int>(static_cast<int>(m), W().size() - W().rank())) << "1F1B keeps at most p - s micro-batches alive";
  }
}

TEST(Pipeline, Bf16AndRecomputedBlocks) {
  expect_close(pipeline<tg::amp::bf16_mixed>(4, 8), one_process<tg::amp::bf16_mixed>(4, 8), 1e-2, "bf16 mixed, 4 micro-batches");
  expect_close(pipeline<tg::amp::fp32_policy, tg::RecomputeAll>(3, 6), one_process<tg::amp::fp32_policy>(3, 6), 1e-5,
               "fp32, blocks recomputed, 3 micro-batches");
}

TEST(Pipeline, DropoutDrawsTheOneProcessMasks) {
  // Note [pipeline parallelism]: each stage draws micro-batch i's numbers at the one-process run's counters,
  // whatever the schedule's order, and every stage's generator ends where the one-process run's does.
  for (std::int64_t m : {2, 3}) {
    const auto got = pipeline<tg::amp::fp32_policy>(m, 6, nullptr, 0.1f);
    const auto ref = one_process<tg::amp::fp32_policy>(m, 6, 0.1f);
    expect_close(got, ref, 1e-5, "fp32, dropout 0.1, " + std::to_string(m) + " micro-batches");
    EXPECT_EQ(got.dropout_offset, ref.dropout_offset) << "stage " << W().rank();
  }
  expect_close(pipeline<tg::amp::fp32_policy, tg::RecomputeAll>(3, 4, nullptr, 0.1f), one_process<tg::amp::fp32_policy>(3, 4, 0.1f), 1e-5,
               "fp32, dropout 0.1, blocks recomputed, 3 micro-batches");
}

TEST(Pipeline, TheTiedEmbeddingCopiesStayEqual) {
  const auto got = pipeline<tg::amp::fp32_policy>(2, 5);
  // Stage 0 and the last stage both hold "wte.weight"; the last sends its copy to stage 0 to compare.
  const int p = W().size(), s = W().rank();
  if (p == 1) GTEST_SKIP() << "one stage: one copy";
  auto pp = W().split(0, s);
  if (s != 0 && s != p - 1) return;  // a middle stage holds no copy
  const auto& w = got.weights.at("wte.weight");
  if (s == p - 1) pp->send(tg::dist::Buffer{const_cast<float*>(w.data()), static_cast<std::int64_t>(w.size())}, 0, 7);
  if (s == 0) {
    std::vector<float> last(w.size());
    pp->recv(tg::dist::Buffer{last.data(), static_cast<std::int64_t>(last.size())}, p - 1, 7);
    EXPECT_EQ(last, w) << "the last stage's copy of wte drifted from stage 0's";
  }
}

TEST(Pipeline, BubbleFractionAndErrors) {
  tg::Generator init(3);
  const tg::nn::GPT full(config(), init);
  auto pp = W().split(0, W().rank());
  tg::dist::PipelineGPT<> stage(full, *pp);
  const auto ps = stage.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::dist::PipelineStep<tg::amp::fp32_policy> step(stage, opt, sched, {}, 6);
  const double p = W().size();
  EXPECT_DOUBLE_EQ(step.bubble_fraction(), (p - 1) / (6 + p - 1));
  EXPECT_EQ(stage.last_block() - stage.first_block(), (W().rank() + 1) * 4 / W().size() - W().rank() * 4 / W().size());
  auto c = config();
  c.n_layer = 1;
  const tg::nn::GPT shallow(c, init);
  if (W().size() > 1) {
    try {
      tg::dist::PipelineGPT<> s2(shallow, *pp);
      ADD_FAILURE() << "no error for more stages than blocks";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("stages for 1 blocks"), std::string::npos) << e.what();
    }
  }
}

}  // namespace

}  // namespace test_pipeline_cpp

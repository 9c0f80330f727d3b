// Process grids (Note [process grid]): every factorization dp x pp x tp of the world (1 to 4 ranks under
// CTest) trains the one-process GPT's steps: tensor-parallel stages (Note [tensor parallelism]) in a 1F1B
// pipeline (Note [pipeline parallelism]) or a TrainStep, replicas averaged over the data-parallel group.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/grid.hpp>
#include <typegrad/dist/pipeline.hpp>
#include <typegrad/dist/tensor_parallel.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>

namespace test_grid_cpp {  // the file's own names (Note [unity test sources])

namespace {

tg::dist::Communicator& W() { return tg::dist::world(); }

tg::nn::GPTConfig config() {
  tg::nn::GPTConfig c;
  c.vocab_size = 50;
  c.block_size = 16;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_embd = 32;
  c.dropout = 0.f;
  return c;
}

constexpr std::int64_t kRows = 2, kT = 12;  // a multiple of every tensor-parallel size here (sequence parallelism)
struct Batch {
  tg::Tensor<std::int64_t> inputs, targets;
};
/// Rows [first, first + rows) of global micro-batch k of `global` rows.
Batch rows_of(std::int64_t k, std::int64_t global, std::int64_t first, std::int64_t rows) {
  const auto x = tg::testing::random_tokens(global, kT, 50, 900 + 2 * static_cast<std::uint64_t>(k));
  const auto y = tg::testing::random_tokens(global, kT, 50, 901 + 2 * static_cast<std::uint64_t>(k));
  Batch b{tg::Tensor<std::int64_t>::empty({rows, kT}), tg::Tensor<std::int64_t>::empty({rows, kT})};
  std::copy(x.data() + first * kT, x.data() + (first + rows) * kT, b.inputs.data());
  std::copy(y.data() + first * kT, y.data() + (first + rows) * kT, b.targets.data());
  return b;
}
tg::optim::AdamWOptions adamw() { return {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}; }

struct GridRun {
  std::vector<double> losses;
  std::map<std::string, std::vector<float>> weights;  // the one-process layout
  std::vector<tg::optim::NamedTensor> params, state;  // one_process: its own; on_grid: gathered (model group rank 0)
};

template <class Policy>
GridRun one_process(std::int64_t dp, std::int64_t micro, int steps, std::int64_t first_batch = 0, const GridRun* from = nullptr) {
  tg::Generator init(8), drop(9);
  tg::nn::GPT model(config(), init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  if (from) {
    for (std::size_t i = 0; i < ps.size(); ++i) tg::detail::copy_tensor(from->params[i].tensor, ps[i].tensor.detach());
    opt.load_state(from->state);
  }
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::train::TrainStep<Policy> step(ps, opt, sched, {.clip = 0.5}, tg::optim::GradAccumRuntime(micro));
  GridRun out;
  std::int64_t k = first_batch;
  for (int i = 0; i < steps; ++i) out.losses.push_back(step.run(model, [&] { return rows_of(k++, dp * kRows, 0, dp * kRows); }, drop).loss);
  for (const auto& p : ps) {
    out.weights[p.name] = p.tensor.to_vector();
    out.params.push_back({p.name, p.tensor.detach().clone()});
  }
  out.state = opt.state_tensors();
  return out;
}

/// `steps` steps on the grid tp x pp (dp: the rest), from the seed or, with `from`, from a one-process run's
/// parameters and optimizer state (its next batch: `first_batch`).
template <class Policy, class Ckpt = tg::NoCheckpoint>
GridRun on_grid(int tp, int pp, std::int64_t micro, int steps, std::int64_t first_batch = 0, const GridRun* from = nullptr,
            tg::dist::Sharding sharding = tg::dist::Sharding::none, bool sequence_parallel = false) {
  tg::dist::ProcessGrid grid(W(), tp, pp);
  tg::Generator init(from ? 77 : 8), drop(9);  // resumed: another seed, so the loaded weights must count
  const tg::nn::GPT full(config(), init);
  tg::dist::TensorParallelGPT<> model(full, grid, {.sequence_parallel = sequence_parallel});
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  if (from) tg::dist::load_one_process_state(model, opt, from->params, from->state);
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  const std::int64_t global = grid.dp_size * kRows, first = grid.dp_rank * kRows;
  GridRun out;
  std::int64_t k = first_batch;
  auto next = [&] { return rows_of(k++, global, first, kRows); };
  std::optional<tg::dist::GridSync<tg::cpu>> sync;
  std::optional<tg::dist::ConsolidatedState> consolidated_state;  // under ZeRO: each replica's shards joined
  if (pp > 1) {
    tg::dist::PipelineStep<Policy, Ckpt, tg::cpu, tg::amp::default_scaler_t<Policy>, tg::dist::TensorParallelGPT<>> step(
        model, opt, sched, {.clip = 0.5}, micro, {}, grid.dp.get(), grid.world,
        tg::dist::DataParallelOptions{.sharding = sharding, .bucket_bytes = 8 << 10});
    if (from && step.data_parallel()) step.data_parallel()->shard_loaded_state(opt);
    for (int i = 0; i < steps; ++i) out.losses.push_back(step.run(next, drop).loss);
    if (step.data_parallel()) consolidated_state.emplace(opt, step.data_parallel()->gather_optimizer_state(opt));
  } else {
    sync.emplace(model, grid, tg::dist::DataParallelOptions{.sharding = sharding, .bucket_bytes = 8 << 10});
    if (from) sync->data_parallel().shard_loaded_state(opt);
    tg::train::TrainStep<Policy, Ckpt> step(ps, opt, sched, {.clip = 0.5, .sync = &*sync}, tg::optim::GradAccumRuntime(micro));
    for (int i = 0; i < steps; ++i)
      out.losses.push_back(step.run(model, next, drop, [&](const auto& logits, const Batch& b) { return model.loss(logits, b.targets); }).loss);
  }
  for (const auto& e : model.gather_full()) out.weights[e.name] = e.tensor.to_vector();
  // Under ZeRO each replica holds a shard of the optimizer state: consolidated over the data-parallel group first.
  if (sync) consolidated_state.emplace(opt, sync->data_parallel().gather_optimizer_state(opt));
  const tg::optim::AnyOptimizer& state = consolidated_state ? static_cast<const tg::optim::AnyOptimizer&>(*consolidated_state) : opt;
  auto gathered = tg::dist::gather_one_process_state(model, state);
  out.params = std::move(gathered.params);
  out.state = std::move(gathered.state);
  return out;
}

void expect_close(const GridRun& got, const GridRun& ref, double tol, const std::string& what) {
  double worst = 0, sums[2] = {0, 0};
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    const double rel = std::abs(got.losses[i] - ref.losses[i]) / ref.losses[i];
    worst = std::max(worst, rel);
    EXPECT_LE(rel, tol) << what << ": step " << i;
  }
  for (const auto& [name, w] : got.weights) {
    const auto& r = ref.weights.at(name);
    ASSERT_EQ(w.size(), r.size()) << name;
    std::size_t skip_begin = 0, skip_end = 0;  // the key third of c_attn.bias: rounding noise (tests/dist/test_dist.cpp)
    if (name.ends_with("c_attn.bias")) skip_begin = r.size() / 3, skip_end = 2 * r.size() / 3;
    for (std::size_t i = 0; i < w.size(); ++i) {
      if (i >= skip_begin && i < skip_end) continue;
      sums[0] += (static_cast<double>(w[i]) - r[i]) * (static_cast<double>(w[i]) - r[i]);
      sums[1] += static_cast<double>(r[i]) * r[i];
    }
  }
  W().all_reduce(std::span<double>(sums, 2), tg::dist::ReduceOp::sum);
  const double rel = std::sqrt(sums[0] / sums[1]);
  EXPECT_LE(rel, tol) << what << ": the weights";
  if (W().rank() == 0)
    std::printf("[ grid ] %s vs one process: loss %.2g (last %.9f vs %.9f), weights %.2g; tolerance %.0e\n", what.c_str(), worst,
                got.losses.back(), ref.losses.back(), rel, tol);
}

/// A grid with tensor and pipeline parallelism where the world allows: tp 2 on an even world, the pipeline
/// over what is left (2 stages, or all of an odd remainder).
std::pair<int, int> largest_grid() {
  const int n = W().size(), tp = n % 2 == 0 ? 2 : 1, rest = n / tp;
  return {tp, rest % 2 == 0 ? 2 : rest};
}

TEST(ProcessGrid, EveryFactorizationEqualsOneProcess) {
  const int n = W().size();
  for (int tp = 1; tp <= n; ++tp)
    for (int pp = 1; pp * tp <= n; ++pp) {
      if (n % (tp * pp) != 0 || 4 % tp != 0 || pp > 4) continue;
      const int dp = n / (tp * pp);
      for (std::int64_t m : {2}) {
        const std::string what = "dp " + std::to_string(dp) + " x pp " + std::to_string(pp) + " x tp " + std::to_string(tp) + ", fp32, " +
                                 std::to_string(m) + " micro-batches";
        // Measured (2026-12-05, 12 positions): at most 7.3e-7 on the weights, losses 3.1e-8 (with 10 positions
        // tp 4, one head per rank, had reached 3.4e-5, spread evenly over every tensor).
        expect_close(on_grid<tg::amp::fp32_policy>(tp, pp, m, 6), one_process<tg::amp::fp32_policy>(dp, m, 6), 1e-4, what);
      }
    }
}

TEST(ProcessGrid, SequenceParallelOnEveryGrid) {
  // Note [sequence parallelism] on every grid with tensor parallelism, through TrainStep and PipelineStep,
  // under DDP and ZeRO-2 over the replicas where there are any, and with the blocks recomputed.
  const int n = W().size();
  if (n == 1) GTEST_SKIP() << "one rank: no tensor-parallel group";
  for (int tp = 2; tp <= n; ++tp)
    for (int pp = 1; pp * tp <= n; ++pp) {
      if (n % (tp * pp) != 0 || kT % tp != 0 || 4 % tp != 0) continue;
      const int dp = n / (tp * pp);
      const std::string grid = "dp " + std::to_string(dp) + " x pp " + std::to_string(pp) + " x tp " + std::to_string(tp);
      const GridRun ref = one_process<tg::amp::fp32_policy>(dp, 2, 6);
      expect_close(on_grid<tg::amp::fp32_policy>(tp, pp, 2, 6, 0, nullptr, tg::dist::Sharding::none, true), ref, 1e-4,
                   "sequence parallel, " + grid + ", fp32");
      if (dp > 1)
        expect_close(on_grid<tg::amp::fp32_policy>(tp, pp, 2, 6, 0, nullptr, tg::dist::Sharding::gradients, true), ref, 1e-4,
                     "sequence parallel, zero2, " + grid + ", fp32");
      expect_close(on_grid<tg::amp::fp32_policy, tg::RecomputeAll>(tp, pp, 2, 4, 0, nullptr, tg::dist::Sharding::none, true),
                   one_process<tg::amp::fp32_policy>(dp, 2, 4), 1e-4, "sequence parallel, blocks recomputed, " + grid);
    }
}

TEST(ProcessGrid, ZeroOverTensorParallelAndPipelineReplicas) {
  const int n = W().size();
  if (n == 1 || n == 3) GTEST_SKIP() << "needs an even world: replicas of a split model, or of a whole one";
  const int split = n >= 4 ? 2 : 1, dp = n / split;
  for (const bool pipeline : {false, true})  // the split is tensor parallel, then a pipeline
    for (const auto sharding : {tg::dist::Sharding::none, tg::dist::Sharding::optimizer, tg::dist::Sharding::gradients}) {
      const int tp = pipeline ? 1 : split, pp = pipeline ? split : 1;
      if (pipeline && pp == 1) continue;  // a 1-stage pipeline is the tensor-parallel case
      const std::string what = std::string(tg::dist::sharding_name(sharding)) + ", dp " + std::to_string(dp) + " x pp " + std::to_string(pp) +
                               " x tp " + std::to_string(tp);
      const GridRun got = on_grid<tg::amp::fp32_policy>(tp, pp, 2, 6, 0, nullptr, sharding);
      const GridRun ref = one_process<tg::amp::fp32_policy>(dp, 2, 6);
      expect_close(got, ref, 1e-4, what);
      if (W().rank() == 0) EXPECT_EQ(got.state.size(), ref.state.size()) << what << ": the consolidated state lacks entries";
    }
}

TEST(ProcessGrid, RecomputedBlocksOnTheLargestGrid) {
  const auto [tp, pp] = largest_grid();
  const int dp = W().size() / (tp * pp);
  for (const bool pipeline : {true, false}) {  // through PipelineStep, and (tensor parallelism alone) TrainStep
    const int p = pipeline ? pp : 1, t = pipeline ? tp : W().size() % 2 == 0 ? 2 : 1, d = W().size() / (t * p);
    (void)dp;
    expect_close(on_grid<tg::amp::fp32_policy, tg::RecomputeAll>(t, p, 2, 4), one_process<tg::amp::fp32_policy>(d, 2, 4), 1e-4,
                 "blocks recomputed, pp " + std::to_string(p) + " x tp " + std::to_string(t));
  }
}

TEST(ProcessGrid, Bf16OnTheLargestGrid) {
  const int n = W().size();
  const auto [tp, pp] = largest_grid();
  expect_close(on_grid<tg::amp::bf16_mixed>(tp, pp, 4, 6), one_process<tg::amp::bf16_mixed>(n / (tp * pp), 4, 6), 1e-2,
               "bf16, pp " + std::to_string(pp) + " x tp " + std::to_string(tp));
}

TEST(ProcessGrid, CheckpointsAreInTheOneProcessLayout) {
  const auto [tp, pp] = largest_grid();
  const int dp = W().size() / (tp * pp);
  const GridRun got = on_grid<tg::amp::fp32_policy>(tp, pp, 2, 4), ref = one_process<tg::amp::fp32_policy>(dp, 2, 4);
  if (W().rank() != 0) return;  // the model group's rank 0 of replica 0 holds them
  ASSERT_EQ(got.params.size(), ref.params.size());
  for (std::size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_EQ(got.params[i].name, ref.params[i].name);  // the one-process order
    EXPECT_EQ(got.params[i].tensor.shape(), ref.params[i].tensor.shape()) << ref.params[i].name;
  }
  std::map<std::string, const tg::Tensor<float>*> by_name;
  for (const auto& e : got.state) by_name[e.name] = &e.tensor;
  ASSERT_EQ(got.state.size(), ref.state.size()) << "entries missing from the gathered optimizer state";
  for (const auto& e : ref.state) {
    ASSERT_TRUE(by_name.count(e.name)) << e.name;
    ASSERT_EQ(by_name[e.name]->shape(), e.tensor.shape()) << e.name;
    if (e.name.ends_with(".step")) EXPECT_EQ(by_name[e.name]->to_vector(), e.tensor.to_vector()) << e.name;
  }
}

TEST(ProcessGrid, ResumesAOneProcessCheckpoint) {
  const auto [tp, pp] = largest_grid();
  const int dp = W().size() / (tp * pp);
  const GridRun first = one_process<tg::amp::fp32_policy>(dp, 2, 3);   // 3 steps, batches 0-5
  const GridRun all = one_process<tg::amp::fp32_policy>(dp, 2, 6);     // 6 steps
  const GridRun rest = on_grid<tg::amp::fp32_policy>(tp, pp, 2, 3, 6, &first);
  GridRun tail = all;
  tail.losses.erase(tail.losses.begin(), tail.losses.begin() + 3);
  expect_close(rest, tail, 1e-4, "pp " + std::to_string(pp) + " x tp " + std::to_string(tp) + " resumed from a one-process step 3");
  // And the other way: the grid's gathered state resumes alone.
  const GridRun mid = on_grid<tg::amp::fp32_policy>(tp, pp, 2, 3);
  if (W().rank() == 0) {
    const GridRun alone = one_process<tg::amp::fp32_policy>(dp, 2, 3, 6, &mid);
    for (std::size_t i = 0; i < 3; ++i) EXPECT_LE(std::abs(alone.losses[i] - all.losses[3 + i]) / all.losses[3 + i], 1e-4) << "step " << 3 + i;
  }
}

// A step whose last backward throws after its buckets' reductions started (every rank alike) is dropped whole on a
// data x tensor-parallel grid too: GridSync passes StepSync::abandon_step on to its DataParallel, so no reduction of
// the failed step writes into the next step's gradients (DataParallel.AStepThatThrowsInItsBackwardIsDroppedOnEveryRank
// in test_dist.cpp for a plain DataParallel). The next steps equal those of a run that never had it, bit for bit.
TEST(ProcessGrid, AStepThatThrowsInItsBackwardIsDroppedOnEveryRank) {
  const int tp = W().size() >= 4 && W().size() % 2 == 0 ? 2 : 1;  // at least two replicas: something to reduce
  for (const auto sharding : {tg::dist::Sharding::none, tg::dist::Sharding::gradients}) {
    auto run = [&](bool fail) {
      tg::dist::ProcessGrid grid(W(), tp, 1);
      tg::Generator init(8), drop(9);
      const tg::nn::GPT full(config(), init);
      tg::dist::TensorParallelGPT<> model(full, grid);
      const auto ps = model.named_parameters();
      tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
      tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
      tg::dist::GridSync<tg::cpu> sync(model, grid, tg::dist::DataParallelOptions{.sharding = sharding, .bucket_bytes = 8 << 10});
      tg::train::TrainStep<tg::amp::fp32_policy> step(ps, opt, sched, {.clip = 0.5, .sync = &sync}, tg::optim::GradAccumRuntime(2));
      const std::int64_t global = grid.dp_size * kRows, first = grid.dp_rank * kRows;
      std::int64_t k = 0;
      auto next = [&] { return rows_of(k++, global, first, kRows); };
      auto loss = [&](const auto& logits, const Batch& b) { return model.loss(logits, b.targets); };
      // The first parameter (the embedding) gets its last gradient at the end of each backward: the hook after
      // DataParallel's throws there, when armed.
      int deliveries = 0, per_backward = 0;
      bool armed = false;
      auto& hooks = ps.front().tensor.autograd_meta()->grad_ready_hooks;
      hooks.push_back([&](const tg::Tensor<float>&) {
        if (++deliveries == per_backward && armed) throw tg::Error("an injected failure in the backward");
      });
      step.run(model, next, drop, loss);  // the first step: DataParallel counts the gradients, and so does the hook
      per_backward = deliveries / 2;
      EXPECT_GT(per_backward, 0);
      if (fail) {
        int calls = 0;
        EXPECT_THROW(step.run(model, next, drop,
                              [&](const auto& logits, const Batch& b) {
                                armed = ++calls == 2;  // the step's last micro-batch: the one that reduces
                                deliveries = 0;
                                // the last replica starts that backward late: the others' reductions are in flight
                                if (armed && grid.dp_rank == grid.dp_size - 1) std::this_thread::sleep_for(std::chrono::milliseconds(100));
                                return model.loss(logits, b.targets);
                              }),
                     tg::Error);
        armed = false;
      }
      hooks.pop_back();
      k = 100;
      std::vector<double> losses;
      for (int i = 0; i < 3; ++i) losses.push_back(step.run(model, next, drop, loss).loss);
      std::map<std::string, std::vector<float>> w;
      for (const auto& e : model.gather_full()) w[e.name] = e.tensor.to_vector();
      return std::pair{losses, w};
    };
    const std::string what = std::string(sharding == tg::dist::Sharding::none ? "ddp" : "zero2") + ", tp " + std::to_string(tp);
    const auto ref = run(false), got = run(true);
    EXPECT_EQ(got.first, ref.first) << what;
    EXPECT_TRUE(got.second == ref.second) << what << ": the weights differ";
  }
}

TEST(ProcessGrid, GridsThatDoNotFitAreClearErrors) {
  const int n = W().size();
  try {
    tg::dist::ProcessGrid bad(W(), n + 1, 1);
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not a multiple of --tp"), std::string::npos) << e.what();
  }
  if (n >= 2) {
    tg::dist::ProcessGrid grid(W(), 1, n);
    auto c = config();
    c.n_layer = n - 1;
    tg::Generator init(1);
    const tg::nn::GPT shallow(c, init);
    try {
      tg::dist::TensorParallelGPT<> m(shallow, grid);
      ADD_FAILURE() << "no error for more stages than blocks";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("stages for"), std::string::npos) << e.what();
    }
  }
}

}  // namespace

}  // namespace test_grid_cpp

// tg::compile on the GPU (Note [compiled steps], Note [step memory plan]): a compiled training step of
// nn::BasicGPT<cuda> equals the eager GPU step bit for bit over 10 AdamW steps (fp32 and bf16, gradient
// accumulation 2, dropout), and its replays make no call to the CUDA allocator; with CUDA graphs (Note [CUDA
// graphs of a step]) the same bits, the step's stretches between host reads launched as updated graphs. Skips
// without a GPU; the CPU tests are tests/compile/test_compile.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <stdexcept>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_compile_cpp {  // the file's own names (Note [unity test sources])

namespace {

const tg::nn::GPTConfig kConfig{64, 16, 2, 2, 32, 0.1f};

tg::data::Batch batch(std::uint64_t k) {
  tg::Generator gen(900 + k);
  auto x = tg::Tensor<std::int64_t>::empty({2, 16}), y = tg::Tensor<std::int64_t>::empty({2, 16});
  for (std::int64_t i = 0; i < 32; ++i) {
    x.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
    y.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
  }
  return {x, y};
}

struct Outcome {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
  std::vector<std::int64_t> allocations;
  std::int64_t captures = 0, replays = 0;
  tg::backend::cuda::GraphStats graph;
};

struct Mode {
  bool compiled = false;
  bool switch_streams = false;   // steps 4-6 run on a side stream (a StreamGuard), the others on the default stream
  bool graphs = false;           // CompileOptions::cuda_graphs
  bool device_boundary = false;  // StepOptions::device_boundary
  std::size_t graph_chunk = 64;  // CompileOptions::graph_chunk
};

template <class Policy>
Outcome train(Mode mode) {
  tg::Generator init(3), drop(4);
  const tg::nn::GPT host(kConfig, init);
  const tg::nn::BasicGPT<tg::cuda> model(host);
  const auto ps = model.named_parameters();
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 8, 3e-4f});
  tg::train::TrainStep<Policy, tg::NoCheckpoint, tg::cuda> step(ps, opt, sched, {.clip = 1.0, .device_boundary = mode.device_boundary},
                                                                tg::optim::GradAccumRuntime(2));
  std::uint64_t k = 0;
  auto one = [&] { return step.run(model, [&] { return batch(k++); }, drop); };
  auto c = tg::compile<tg::cuda>(one, {.cuda_graphs = mode.graphs, .graph_chunk = mode.graph_chunk});
  c.set_parameters(ps);
  Outcome out;
  auto& a = tg::allocator<tg::cuda>();
  tg::backend::cuda::Stream side;
  for (int i = 0; i < 10; ++i) {
    std::optional<tg::backend::cuda::StreamGuard> on;
    if (mode.switch_streams && i >= 4 && i <= 6) on.emplace(side);
    const std::int64_t before = a.stats().allocations;
    out.losses.push_back((mode.compiled ? c() : one()).loss);
    out.allocations.push_back(a.stats().allocations - before);
  }
  tg::backend::cuda::synchronize();
  for (const auto& p : ps) out.weights.push_back(p.tensor.detach().template to<tg::cpu>().to_vector());
  out.captures = c.captures();
  out.replays = c.replays();
  out.graph = c.graph_stats();
  return out;
}

template <class Policy>
void expect_bitwise() {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<Policy>({.compiled = true}), ref = train<Policy>({});
  EXPECT_EQ(got.captures, 1);
  EXPECT_EQ(got.replays, 9);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
  for (std::size_t i = 1; i < got.allocations.size(); ++i) EXPECT_EQ(got.allocations[i], 0) << "step " << i << " called the CUDA allocator";
}

TEST(CudaCompile, EqualsEagerBitwiseFp32) { expect_bitwise<tg::amp::fp32_policy>(); }

// Note [compiled steps], streams: a call on another stream waits for the device and takes a new arena there, so the
// replays on the side stream and back on the default one give the eager step's results.
TEST(CudaCompile, ACallOnAnotherStreamGivesTheSameSteps) {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<tg::amp::fp32_policy>({.compiled = true, .switch_streams = true}), ref = train<tg::amp::fp32_policy>({});
  EXPECT_EQ(got.captures, 1);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
  for (int i : {5, 6, 8, 9}) EXPECT_EQ(got.allocations[static_cast<std::size_t>(i)], 0) << "step " << i << " called the CUDA allocator";
}
TEST(CudaCompile, EqualsEagerBitwiseBf16) { expect_bitwise<tg::amp::bf16_mixed>(); }

// Note [CUDA graphs of a step]: the replays captured and launched as graphs give the eager step's bits, make no
// call to the allocator, and update the executable graphs of the last call instead of making new ones. With the
// boundary on the host the step reads its losses and norm mid-step, so it is several stretches; with it on the
// device, an fp32 step is one graph (its one read comes after its last kernel) and a bf16 step two (the weight
// copies are refreshed after the read), when stretches are not cut into chunks (graph_chunk 0). With chunks of 8
// launches the same bits come from many more graphs.
template <class Policy>
void expect_graphs_bitwise(bool device_boundary, std::int64_t stretches_per_step, std::size_t chunk = 0) {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<Policy>({.compiled = true, .graphs = true, .device_boundary = device_boundary, .graph_chunk = chunk});
  const Outcome ref = train<Policy>({.device_boundary = device_boundary});
  EXPECT_EQ(got.captures, 1);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
  for (std::size_t i = 1; i < got.allocations.size(); ++i) EXPECT_EQ(got.allocations[i], 0) << "step " << i << " called the CUDA allocator";
  const auto& g = got.graph;
  EXPECT_EQ(g.calls, got.replays) << "every replay ran as graphs";
  if (stretches_per_step > 0 && chunk == 0) EXPECT_EQ(g.launches, stretches_per_step * g.calls);
  if (chunk > 0) EXPECT_GE(g.launches * static_cast<std::int64_t>(chunk), g.nodes / 4) << "graphs of at most " << chunk << " launches";
  EXPECT_GT(g.launches, 0);
  EXPECT_GT(g.nodes, 50 * g.calls) << "the step's kernels are in its graphs";
  EXPECT_GT(g.updated, 0);
  EXPECT_EQ(g.updated + g.instantiated, g.launches);
  EXPECT_LT(g.instantiated, g.launches) << "the later calls update the executable graphs";
  EXPECT_GT(g.uploads, 0) << "the token ids and targets, from the graphs' pinned blocks";
}
TEST(CudaGraphs, HostBoundaryStepEqualsEagerBitwiseFp32) { expect_graphs_bitwise<tg::amp::fp32_policy>(false, 0); }
TEST(CudaGraphs, HostBoundaryStepEqualsEagerBitwiseBf16) { expect_graphs_bitwise<tg::amp::bf16_mixed>(false, 0); }
TEST(CudaGraphs, DeviceBoundaryStepIsOneGraphFp32) { expect_graphs_bitwise<tg::amp::fp32_policy>(true, 1); }
TEST(CudaGraphs, DeviceBoundaryStepIsTwoGraphsBf16) { expect_graphs_bitwise<tg::amp::bf16_mixed>(true, 2); }
TEST(CudaGraphs, ChunksOfEightLaunchesGiveTheSameBitsFp32) { expect_graphs_bitwise<tg::amp::fp32_policy>(true, 0, 8); }
TEST(CudaGraphs, ChunksOfEightLaunchesGiveTheSameBitsBf16) { expect_graphs_bitwise<tg::amp::bf16_mixed>(false, 0, 8); }

// The capture's state is per call: a step that throws inside its capture leaves nothing open, and the next calls
// run (here the same signature, so they replay as graphs again).
TEST(CudaGraphs, AStepThatThrowsLeavesTheNextCallsWorking) {
  TG_SKIP_WITHOUT_GPU();
  const auto w = tg::Tensor<float>::full({4, 4}, 0.5).to<tg::cuda>();
  int calls = 0;
  auto c = tg::compile<tg::cuda>(
      [&] {
        auto y = tg::mul(w, w);
        if (++calls == 3) throw std::runtime_error("the step failed");
        return y.to<tg::cpu>().to_vector();
      },
      {.cuda_graphs = true});
  EXPECT_EQ(c()[0], 0.25f);
  EXPECT_EQ(c()[0], 0.25f);
  EXPECT_THROW(c(), std::runtime_error);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(c()[0], 0.25f);
  EXPECT_GT(c.graph_stats().calls, 0);
  EXPECT_EQ(tg::backend::cuda::current_stream(), nullptr) << "the caller's stream is back";
}

}  // namespace

}  // namespace test_cuda_compile_cpp

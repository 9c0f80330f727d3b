// tg::compile on the GPU (Note [compiled steps], Note [step memory plan]): a compiled training step of
// nn::BasicGPT<cuda> equals the eager GPU step bit for bit over 10 AdamW steps (fp32 and bf16, gradient
// accumulation 2, dropout), and its replays make no call to the CUDA allocator. Skips without a GPU; the CPU
// tests are tests/compile/test_compile.cpp.
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

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
};

/// `switch_streams`: steps 4-6 run on a side stream (a StreamGuard), the others on the default stream.
template <class Policy>
Outcome train(bool compiled, bool switch_streams = false) {
  tg::Generator init(3), drop(4);
  const tg::nn::GPT host(kConfig, init);
  const tg::nn::BasicGPT<tg::cuda> model(host);
  const auto ps = model.named_parameters();
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 8, 3e-4f});
  tg::train::TrainStep<Policy, tg::NoCheckpoint, tg::cuda> step(ps, opt, sched, {.clip = 1.0}, tg::optim::GradAccumRuntime(2));
  std::uint64_t k = 0;
  auto one = [&] { return step.run(model, [&] { return batch(k++); }, drop); };
  auto c = tg::compile<tg::cuda>(one);
  c.set_parameters(ps);
  Outcome out;
  auto& a = tg::allocator<tg::cuda>();
  tg::backend::cuda::Stream side;
  for (int i = 0; i < 10; ++i) {
    std::optional<tg::backend::cuda::StreamGuard> on;
    if (switch_streams && i >= 4 && i <= 6) on.emplace(side);
    const std::int64_t before = a.stats().allocations;
    out.losses.push_back((compiled ? c() : one()).loss);
    out.allocations.push_back(a.stats().allocations - before);
  }
  tg::backend::cuda::synchronize();
  for (const auto& p : ps) out.weights.push_back(p.tensor.detach().template to<tg::cpu>().to_vector());
  out.captures = c.captures();
  out.replays = c.replays();
  return out;
}

template <class Policy>
void expect_bitwise() {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<Policy>(true), ref = train<Policy>(false);
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
  const Outcome got = train<tg::amp::fp32_policy>(true, true), ref = train<tg::amp::fp32_policy>(false);
  EXPECT_EQ(got.captures, 1);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) EXPECT_EQ(got.losses[i], ref.losses[i]) << "step " << i;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
  for (int i : {5, 6, 8, 9}) EXPECT_EQ(got.allocations[static_cast<std::size_t>(i)], 0) << "step " << i << " called the CUDA allocator";
}
TEST(CudaCompile, EqualsEagerBitwiseBf16) { expect_bitwise<tg::amp::bf16_mixed>(); }

}  // namespace

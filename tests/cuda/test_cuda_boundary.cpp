// The step boundary on the GPU (Note [the step boundary on the device]): a TrainStep of nn::BasicGPT<cuda> whose
// boundary the device decides logs the host boundary's losses, skips the same fp16 steps, ends at the same
// weights (within the rounding of the device's fp64 pow in Adam's bias corrections) and reads the device once
// per step. Skips without a GPU; the CPU tests (bit for bit there) are tests/train/test_device_boundary.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
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
  tg::Generator gen(1900 + k);
  auto x = tg::Tensor<std::int64_t>::empty({2, 16}), y = tg::Tensor<std::int64_t>::empty({2, 16});
  for (std::int64_t i = 0; i < 32; ++i) {
    x.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
    y.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
  }
  return {x, y};
}

struct Outcome {
  std::vector<double> losses, norms;
  std::vector<bool> skipped;
  std::vector<std::int64_t> reads;  // device-to-host reads per step
  std::vector<std::vector<float>> weights;
  tg::amp::ScalerState scaler;
  std::int64_t steps_taken = 0;
};

template <class Policy>
Outcome train(bool device, int inf_step) {
  tg::Generator init(3), drop(4);
  const tg::nn::GPT host(kConfig, init);
  const tg::nn::BasicGPT<tg::cuda> model(host);
  const auto ps = model.named_parameters();
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 8, 3e-4f});
  tg::train::StepOptions options{.clip = 1.0};
  options.device_boundary = device;
  tg::train::TrainStep<Policy, tg::NoCheckpoint, tg::cuda> step(ps, opt, sched, options, tg::optim::GradAccumRuntime(2));
  tg::Tensor<float, tg::cuda> poison;  // 1, or inf at inf_step (the same ops: only a value changes)
  std::uint64_t k = 0;
  Outcome out;
  for (int i = 0; i < 10; ++i) {
    poison = tg::Tensor<float>::full({}, i == inf_step ? std::numeric_limits<double>::infinity() : 1.0).template to<tg::cuda>();
    const std::int64_t before = tg::backend::cuda::device_to_host_reads();
    const auto r = step.run(model, [&] { return batch(k++); }, drop, [&](const auto& logits, const tg::data::Batch& b) {
      return tg::mul(step.precision().loss(logits, b.targets), poison);
    });
    out.reads.push_back(tg::backend::cuda::device_to_host_reads() - before);
    out.losses.push_back(r.loss);
    out.norms.push_back(r.grad_norm);
    out.skipped.push_back(r.skipped);
  }
  for (const auto& p : ps) out.weights.push_back(p.tensor.detach().template to<tg::cpu>().to_vector());
  out.scaler = step.scaler().state();
  out.steps_taken = step.steps_taken();
  return out;
}

template <class Policy>
void expect_same_steps(int inf_step) {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<Policy>(true, inf_step), ref = train<Policy>(false, inf_step);
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::abs(ref.losses[i])) << "step " << i;
    EXPECT_NEAR(got.norms[i], ref.norms[i], 1e-5 * std::abs(ref.norms[i]) + 1e-12) << "step " << i;
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << "step " << i;
    EXPECT_EQ(got.reads[i], 1) << "step " << i << ": the device boundary reads the device once per step";
    EXPECT_GT(ref.reads[i], 1) << "step " << i << ": the host boundary reads the losses and the norm (or the overflow flag) apart";
  }
  EXPECT_EQ(got.scaler, ref.scaler);
  EXPECT_EQ(got.steps_taken, ref.steps_taken);
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    for (std::size_t j = 0; j < ref.weights[t].size(); ++j)
      ASSERT_NEAR(got.weights[t][j], ref.weights[t][j], 1e-5f + 1e-4f * std::abs(ref.weights[t][j])) << "tensor " << t << " element " << j;
}

TEST(CudaBoundary, DecidesTheHostBoundarysStepsInBf16) { expect_same_steps<tg::amp::bf16_mixed>(-1); }
TEST(CudaBoundary, SkipsTheSameFp16StepsWithAnInf) { expect_same_steps<tg::amp::fp16_mixed>(4); }

}  // namespace

// The step boundary on the GPU (Note [the step boundary on the device]): a TrainStep of nn::BasicGPT<cuda> whose
// boundary the device decides logs the host boundary's losses, skips the same steps (fp16 overflows, a NaN
// loss under OnNonFinite::skip), keeps the optimizer's lr, ends at the same weights bit for bit and reads the
// device once per step; AdamW, SGD, LAMB (its trust ratios too) and Adafactor, with per-group lr scales. Skips without a GPU; the CPU tests (bit for bit there) are tests/train/test_device_boundary.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_boundary_cpp {  // the file's own names (Note [unity test sources])

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

struct Case {
  int inf_step = -1;       // the loss (and so the gradients) times inf at this step
  int bad_loss_step = -1;  // NaN added to the loss at this step (the gradients stay finite)
  bool sgd = false;        // SGD with momentum instead of AdamW
  bool lamb = false;       // LAMB instead of AdamW (Note [LAMB on the device])
  bool adafactor = false;  // Adafactor (with a first moment) instead of AdamW
  bool clip = true;
  tg::optim::OnNonFinite on_non_finite = tg::optim::OnNonFinite::apply;
};

struct Outcome {
  std::vector<double> losses, norms;
  std::vector<float> opt_lrs;  // the optimizer's lr after each step
  std::vector<bool> skipped;
  std::vector<std::int64_t> reads;  // device-to-host reads per step
  std::vector<std::vector<float>> weights;
  tg::amp::ScalerState scaler;
  std::int64_t steps_taken = 0;
  std::vector<double> trust_ratios;  // LAMB's, by parameter
};

template <class Policy>
Outcome train(bool device, const Case& c) {
  tg::Generator init(3), drop(4);
  const tg::nn::GPT host(kConfig, init);
  const tg::nn::BasicGPT<tg::cuda> model(host);
  const auto ps = model.named_parameters();
  auto groups = tg::optim::default_groups(ps, 0.1f);
  groups[0].lr_scale = 0.3f;  // the device multiplies the state's lr by each group's scale (0.3: not exact in fp32)
  groups[1].lr_scale = 2.f;
  std::unique_ptr<tg::optim::BasicOptimizer<tg::cuda>> opt;
  if (c.sgd) opt = std::make_unique<tg::optim::BasicSgd<tg::cuda>>(std::move(groups), tg::optim::SgdOptions{.lr = 3e-2f, .momentum = 0.9f});
  else if (c.adafactor)
    opt = std::make_unique<tg::optim::BasicAdafactor<tg::cuda>>(std::move(groups), tg::optim::AdafactorOptions{.lr = 3e-3f, .beta1 = 0.9f, .weight_decay = 0.1f});
  else if (c.lamb)
    opt = std::make_unique<tg::optim::BasicLamb<tg::cuda>>(std::move(groups), tg::optim::LambOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .weight_decay = 0.1f});
  else opt = std::make_unique<tg::optim::BasicAdamW<tg::cuda>>(std::move(groups), tg::optim::AdamWOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::optim::Schedule sched = tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 8, 3e-4f});
  tg::train::StepOptions options;
  if (c.clip) options.clip = 1.0;
  options.on_non_finite = c.on_non_finite;
  options.device_boundary = device;
  tg::train::TrainStep<Policy, tg::NoCheckpoint, tg::cuda> step(ps, *opt, sched, options, tg::optim::GradAccumRuntime(2));
  tg::Tensor<float, tg::cuda> poison, bad;  // only values change between steps: the same ops
  std::uint64_t k = 0;
  Outcome out;
  for (int i = 0; i < 10; ++i) {
    poison = tg::Tensor<float>::full({}, i == c.inf_step ? std::numeric_limits<double>::infinity() : 1.0).template to<tg::cuda>();
    bad = tg::Tensor<float>::full({}, i == c.bad_loss_step ? std::numeric_limits<double>::quiet_NaN() : 0.0).template to<tg::cuda>();
    const std::int64_t before = tg::backend::cuda::device_to_host_reads();
    const auto r = step.run(model, [&] { return batch(k++); }, drop, [&](const auto& logits, const tg::data::Batch& b) {
      return tg::add(tg::mul(step.precision().loss(logits, b.targets), poison), bad);
    });
    out.reads.push_back(tg::backend::cuda::device_to_host_reads() - before);
    out.losses.push_back(r.loss);
    out.norms.push_back(r.grad_norm);
    out.skipped.push_back(r.skipped);
    out.opt_lrs.push_back(opt->lr());
  }
  for (const auto& p : ps) out.weights.push_back(p.tensor.detach().template to<tg::cpu>().to_vector());
  out.scaler = step.scaler().state();
  out.steps_taken = step.steps_taken();
  if (const auto* lamb = dynamic_cast<const tg::optim::BasicLamb<tg::cuda>*>(opt.get()))
    for (const auto& p : ps) out.trust_ratios.push_back(lamb->last_trust_ratio(p.name));
  return out;
}

template <class Policy>
void expect_same_steps(const Case& c) {
  TG_SKIP_WITHOUT_GPU();
  const Outcome got = train<Policy>(true, c), ref = train<Policy>(false, c);
  // The same kernels and the same fp64 arithmetic on both sides (the norm's chunk sums added in the same
  // order, Adam's constants from the host's bias corrections, each fp64 operation rounded on its own): equal.
  // Bit for bit (memcmp): a step with +inf and -inf gradients has a NaN norm on both sides, and NaN == NaN is false.
  const auto same = [](double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; };
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_TRUE(same(got.losses[i], ref.losses[i])) << "step " << i << " loss " << got.losses[i] << " vs " << ref.losses[i];
    EXPECT_TRUE(same(got.norms[i], ref.norms[i])) << "step " << i << " norm " << got.norms[i] << " vs " << ref.norms[i];
    EXPECT_EQ(got.skipped[i], ref.skipped[i]) << "step " << i;
    EXPECT_EQ(got.opt_lrs[i], ref.opt_lrs[i]) << "step " << i;
    EXPECT_EQ(got.reads[i], 1) << "step " << i << ": the device boundary reads the device once per step";
    EXPECT_GT(ref.reads[i], 1) << "step " << i << ": the host boundary reads each micro-batch's loss apart";
  }
  if (c.inf_step >= 0) EXPECT_TRUE(ref.skipped[static_cast<std::size_t>(c.inf_step)]);
  if (c.bad_loss_step >= 0) EXPECT_TRUE(ref.skipped[static_cast<std::size_t>(c.bad_loss_step)]);
  EXPECT_EQ(got.scaler, ref.scaler);
  EXPECT_EQ(got.steps_taken, ref.steps_taken);
  ASSERT_EQ(got.trust_ratios.size(), ref.trust_ratios.size());
  for (std::size_t t = 0; t < ref.trust_ratios.size(); ++t) EXPECT_TRUE(same(got.trust_ratios[t], ref.trust_ratios[t])) << "trust ratio " << t;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
}

TEST(CudaBoundary, DecidesTheHostBoundarysStepsInBf16) { expect_same_steps<tg::amp::bf16_mixed>({}); }
TEST(CudaBoundary, SkipsTheSameFp16StepsWithAnInf) { expect_same_steps<tg::amp::fp16_mixed>({.inf_step = 4}); }
TEST(CudaBoundary, SkipsANonFiniteLossWithFiniteGradients) {
  expect_same_steps<tg::amp::bf16_mixed>({.inf_step = 3, .bad_loss_step = 6, .clip = false, .on_non_finite = tg::optim::OnNonFinite::skip});
}
TEST(CudaBoundary, SgdWithMomentumInFp16) { expect_same_steps<tg::amp::fp16_mixed>({.inf_step = 5, .sgd = true}); }
TEST(CudaBoundary, LambInFp16WithAnInf) { expect_same_steps<tg::amp::fp16_mixed>({.inf_step = 3, .lamb = true}); }
TEST(CudaBoundary, AdafactorInFp16WithAnInf) { expect_same_steps<tg::amp::fp16_mixed>({.inf_step = 3, .adafactor = true}); }

}  // namespace

}  // namespace test_cuda_boundary_cpp

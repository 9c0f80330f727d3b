// nn::GPT on CUDA (nn::BasicGPT<cuda>, copied from a CPU model) against the CPU model: logits, loss and
// every parameter's gradient in fp32 and bf16, activation checkpointing on the GPU, and the GPU trainer's
// step (BasicAdamW / BasicSgd / BasicLamb / BasicAdafactor<cuda>, clipping on the GPU, GradAccumRuntime)
// against the CPU trainer's (AdamW / Sgd / Lamb / Adafactor: the same classes on the CPU), including a state
// round trip GPU -> CPU optimizer -> GPU (a checkpoint resumed across devices).
// Every test skips with the reason when there is no GPU; the CPU halves are tests/optim/test_adam_multi_tensor.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <vector>

#include <typegrad/amp/scaler.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_train_cpp {  // the file's own names (Note [unity test sources])

namespace {

const tg::nn::GPTConfig kTiny{64, 16, 2, 2, 32, 0.f};

std::vector<double> host_values(const tg::Tensor<float>& t) {
  const auto v = t.to_vector();
  return {v.begin(), v.end()};
}
template <class T, class D>
std::vector<double> values(const tg::Tensor<T, D>& t) {
  return host_values(t.detach().template to<tg::fp32>().template to<tg::cpu>());
}
/// max|a − b| / max|b| (the optimizer tests' metric).
double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den == 0 ? num : num / den;
}
std::pair<tg::Tensor<std::int64_t>, tg::Tensor<std::int64_t>> batch(std::uint64_t seed, std::int64_t B = 2,
                                                                    std::int64_t T = 16, std::uint64_t V = 64) {
  tg::Generator gen(seed);
  auto x = tg::Tensor<std::int64_t>::empty({B, T}), y = tg::Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) {
    x.data()[i] = static_cast<std::int64_t>(gen.next_u64() % V);
    y.data()[i] = static_cast<std::int64_t>(gen.next_u64() % V);
  }
  return {x, y};
}

// fp32: the backends differ by summation order (~1e-6 relative per op). bf16: one rounding (2^-8) of an
// activation can differ, and gradients pass through several; 3e-2 of each tensor's largest entry for the
// logits, 1e-1 for gradients (a wrong or missing term gives errors of order 1).
template <class T>
void compare_gpt(double tol, double grad_tol, const tg::nn::GPTConfig& config = kTiny) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(42);
  const tg::nn::GPT cpu_model(config, gen);
  const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
  const auto cpu_params = cpu_model.named_parameters();
  const auto gpu_params = gpu_model.named_parameters();
  ASSERT_EQ(cpu_params.size(), gpu_params.size());
  for (std::size_t i = 0; i < cpu_params.size(); ++i) {
    ASSERT_EQ(gpu_params[i].name, cpu_params[i].name);
    EXPECT_EQ(values(gpu_params[i].tensor), host_values(cpu_params[i].tensor)) << "copy of " << cpu_params[i].name;
  }
  const auto [x, y] = batch(7, 2, 16, static_cast<std::uint64_t>(config.vocab_size));
  const tg::Tensor<T> cpu_logits = cpu_model.forward<T>(x);
  const tg::Tensor<T, tg::cuda> gpu_logits = gpu_model.forward<T>(x);
  EXPECT_LT(rel_err(values(gpu_logits), values(cpu_logits)), tol) << "logits in " << tg::dtype_traits<T>::name;
  const auto cpu_loss = tg::cross_entropy_as<tg::fp32>(cpu_logits, y);
  const auto gpu_loss = tg::cross_entropy_as<tg::fp32>(gpu_logits, y);
  EXPECT_NEAR(gpu_loss.item(), cpu_loss.item(), tol * std::abs(cpu_loss.item()));
  cpu_loss.backward();
  gpu_loss.backward();
  for (std::size_t i = 0; i < cpu_params.size(); ++i) {
    ASSERT_TRUE(gpu_params[i].tensor.grad().defined()) << gpu_params[i].name;
    EXPECT_LT(rel_err(values(gpu_params[i].tensor.grad()), host_values(cpu_params[i].tensor.grad())), grad_tol)
        << "gradient of " << cpu_params[i].name << " in " << tg::dtype_traits<T>::name;
  }
}

TEST(GptCuda, LogitsLossAndGradsMatchTheCpuInFp32) { compare_gpt<tg::fp32>(1e-4, 1e-3); }
TEST(GptCuda, LogitsLossAndGradsMatchTheCpuInBf16) { compare_gpt<tg::bf16>(3e-2, 1e-1); }
// A vocabulary of 60 stored as 64 rows (Note [padded vocabulary]): the LM head's GEMMs on the padded rows and
// the cross-entropy's gradient written into the padded logits' rows (Note [cross-entropy on padded logits]).
tg::nn::GPTConfig padded_tiny() {
  tg::nn::GPTConfig c{60, 16, 2, 2, 32, 0.f};
  c.vocab_multiple = 16;
  return c;
}
TEST(GptCuda, PaddedVocabularyMatchesTheCpuInFp32) { compare_gpt<tg::fp32>(1e-4, 1e-3, padded_tiny()); }
TEST(GptCuda, PaddedVocabularyMatchesTheCpuInBf16) { compare_gpt<tg::bf16>(3e-2, 1e-1, padded_tiny()); }

TEST(GptCuda, CheckpointedBlocksGiveTheSameGradients) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(3);
  const tg::nn::GPT cpu_model(kTiny, gen);
  tg::nn::BasicGPT<tg::cuda> plain(cpu_model), ckpt(cpu_model);
  const auto [x, y] = batch(9);
  tg::cross_entropy(plain.forward<tg::fp32>(x), y).backward();
  tg::Generator unused(0);
  tg::cross_entropy(ckpt.forward<tg::fp32, tg::RecomputeAll>(x, unused, true), y).backward();  // the blocks checkpointed
  const auto a = plain.named_parameters(), b = ckpt.named_parameters();
  for (std::size_t i = 0; i < a.size(); ++i)
    EXPECT_LT(rel_err(values(b[i].tensor.grad()), values(a[i].tensor.grad())), 1e-5) << a[i].name;
}

// An optimizer as train_gpt builds it on each device: one class over default_groups (Note [device optimizers]).
struct OptimizerKind {
  std::function<std::unique_ptr<tg::optim::Optimizer>(const std::vector<tg::optim::Param>&)> host;
  std::function<std::unique_ptr<tg::optim::BasicOptimizer<tg::cuda>>(const std::vector<tg::optim::BasicParam<tg::cuda>>&)> device;
};
template <template <tg::Device> class Opt, class Options>
OptimizerKind kind_of(Options o) {
  return {[o](const std::vector<tg::optim::Param>& ps) -> std::unique_ptr<tg::optim::Optimizer> {
            return std::make_unique<Opt<tg::cpu>>(tg::optim::default_groups(ps, o.weight_decay), o);
          },
          [o](const std::vector<tg::optim::BasicParam<tg::cuda>>& ps) -> std::unique_ptr<tg::optim::BasicOptimizer<tg::cuda>> {
            return std::make_unique<Opt<tg::cuda>>(tg::optim::default_groups(ps, o.weight_decay), o);
          }};
}
OptimizerKind adamw_kind() {
  return kind_of<tg::optim::BasicAdamW>(
      tg::optim::AdamWOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
}
OptimizerKind sgd_kind() {
  return kind_of<tg::optim::BasicSgd>(tg::optim::SgdOptions{.lr = 3e-2f, .momentum = 0.9f, .nesterov = true, .weight_decay = 0.1f});
}
OptimizerKind lamb_kind() { return kind_of<tg::optim::BasicLamb>(tg::optim::LambOptions{.lr = 3e-3f, .weight_decay = 0.1f}); }
OptimizerKind adafactor_kind() {
  tg::optim::AdafactorOptions o;
  o.lr = 3e-3f;
  o.relative_step = false;
  o.weight_decay = 0.1f;
  return kind_of<tg::optim::BasicAdafactor>(o);
}

// The trainer's step on both devices: 2 micro-batches per step, clipping at 0.5, warmup then cosine.
template <class T, class Scaler = tg::amp::NoScaler>
void compare_training(double atol, double rtol, const OptimizerKind& kind = adamw_kind()) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(11);
  const tg::nn::GPT cpu_model(kTiny, gen);
  const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
  const auto cpu_params = cpu_model.named_parameters();
  const auto gpu_params = gpu_model.named_parameters();
  const auto cpu_opt_ptr = kind.host(cpu_params);
  const auto gpu_opt_ptr = kind.device(gpu_params);
  tg::optim::Optimizer& cpu_opt = *cpu_opt_ptr;
  tg::optim::BasicOptimizer<tg::cuda>& gpu_opt = *gpu_opt_ptr;
  auto schedule = [] { return tg::optim::Schedule(tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 8, 3e-4f})); };
  tg::optim::Schedule cpu_sched = schedule(), gpu_sched = schedule();
  tg::optim::GradAccumRuntime cpu_acc(2), gpu_acc(2);
  Scaler cpu_scaler, gpu_scaler;
  for (int micro = 0; micro < 16; ++micro) {
    const auto [x, y] = batch(100 + static_cast<std::uint64_t>(micro));
    const auto cpu_loss = tg::cross_entropy_as<tg::fp32>(cpu_model.forward<T>(x), y);
    const auto gpu_loss = tg::cross_entropy_as<tg::fp32>(gpu_model.forward<T>(x), y);
    EXPECT_NEAR(gpu_loss.item(), cpu_loss.item(), atol + rtol * std::abs(cpu_loss.item()))
        << cpu_opt.name() << " micro-batch " << micro << " in " << tg::dtype_traits<T>::name;
    cpu_acc.scale(cpu_loss, cpu_scaler).backward();
    gpu_acc.scale(gpu_loss, gpu_scaler).backward();
    cpu_acc.micro_step(cpu_opt, cpu_sched, 0.5, cpu_scaler);
    gpu_acc.micro_step(gpu_opt, gpu_sched, 0.5, gpu_scaler);
    EXPECT_NEAR(gpu_acc.last_grad_norm(), cpu_acc.last_grad_norm(), atol + rtol * cpu_acc.last_grad_norm());
    EXPECT_EQ(gpu_acc.skipped_steps(), cpu_acc.skipped_steps()) << "micro-batch " << micro;
  }
  EXPECT_EQ(gpu_opt.step_count(), cpu_opt.step_count());
  EXPECT_EQ(gpu_sched.step(), cpu_sched.step());

  // Across devices: GPU weights and state into a CPU model and optimizer, then back onto a fresh GPU model.
  tg::Generator other(99);
  const tg::nn::GPT host(kTiny, other);
  const auto host_params = host.named_parameters();
  const auto host_opt = kind.host(host_params);
  tg::nn::copy_parameter_values(gpu_params, host_params);
  host_opt->load_state(gpu_opt.state_tensors());
  const tg::nn::BasicGPT<tg::cuda> resumed(host);
  const auto resumed_opt = kind.device(resumed.named_parameters());
  resumed_opt->load_state(host_opt->state_tensors());
  const auto r_params = resumed.named_parameters();
  for (std::size_t i = 0; i < gpu_params.size(); ++i)
    EXPECT_EQ(values(r_params[i].tensor), values(gpu_params[i].tensor)) << gpu_params[i].name;
  const auto a = gpu_opt.state_tensors(), b = resumed_opt->state_tensors();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].tensor.to_vector(), b[i].tensor.to_vector()) << a[i].name;
  }
}

// AdamW's m/√v turns round-off in tiny gradients into full-size steps (docs/cuda.md), hence the looser bounds.
TEST(TrainerCuda, AccumulatedClippedAdamWStepsMatchTheCpuInFp32) { compare_training<tg::fp32>(1e-3, 1e-2); }
TEST(TrainerCuda, AccumulatedClippedAdamWStepsMatchTheCpuInBf16) { compare_training<tg::bf16>(1e-2, 3e-2); }
// fp16 with the dynamic loss scaler (2^16 at first: early steps may overflow and be skipped, on both devices).
TEST(TrainerCuda, AccumulatedClippedAdamWStepsMatchTheCpuInFp16WithLossScaling) {
  compare_training<tg::fp16, tg::amp::DynamicScaler>(1e-2, 3e-2);
}

// The other optimizers of train_gpt --device cuda, in fp32 (their kernels are the same in every precision:
// the masters and state are fp32).
TEST(TrainerCuda, AccumulatedClippedSgdStepsMatchTheCpuInFp32) { compare_training<tg::fp32>(1e-3, 1e-2, sgd_kind()); }
TEST(TrainerCuda, AccumulatedClippedLambStepsMatchTheCpuInFp32) { compare_training<tg::fp32>(1e-3, 1e-2, lamb_kind()); }
TEST(TrainerCuda, AccumulatedClippedAdafactorStepsMatchTheCpuInFp32) {
  compare_training<tg::fp32>(1e-3, 1e-2, adafactor_kind());
}

// A checkpoint written straight from the GPU model and optimizer (io::save_train_state over BasicParam<cuda>
// and BasicOptimizer<cuda>) resumes on the CPU, and one written there resumes on the GPU: the same weights
// and optimizer state, exactly, for every optimizer (Note [training on a GPU]).
TEST(TrainerCuda, CheckpointsMoveBetweenDevicesForEveryOptimizer) {
  TG_SKIP_WITHOUT_GPU();
  const std::string dir = (std::filesystem::temp_directory_path() / "tg_cuda_ckpt_across_devices").string();
  std::filesystem::create_directories(dir);
  for (const OptimizerKind& kind : {adamw_kind(), sgd_kind(), lamb_kind(), adafactor_kind()}) {
    tg::Generator gen(21);
    const tg::nn::GPT cpu_model(kTiny, gen);
    const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
    const auto gpu_params = gpu_model.named_parameters();
    const auto gpu_opt = kind.device(gpu_params);
    for (int step = 0; step < 2; ++step) {
      const auto [x, y] = batch(500 + static_cast<std::uint64_t>(step));
      tg::cross_entropy(gpu_model.forward<tg::fp32>(x), y).backward();
      gpu_opt->step();
      gpu_opt->zero_grad();
    }
    tg::io::TrainStateRecord rec;
    rec.step = 2;
    const std::string gpu_file = dir + "/gpu.safetensors", cpu_file = dir + "/cpu.safetensors";
    tg::io::save_train_state(gpu_file, gpu_params, *gpu_opt, rec);

    tg::Generator other(77);
    const tg::nn::GPT host(kTiny, other);  // other weights: everything must come from the file
    const auto host_params = host.named_parameters();
    const auto host_opt = kind.host(host_params);
    EXPECT_EQ(tg::io::load_train_state(gpu_file, host_params, *host_opt).step, 2);
    for (std::size_t i = 0; i < gpu_params.size(); ++i)
      EXPECT_EQ(host_values(host_params[i].tensor), values(gpu_params[i].tensor)) << host_opt->name() << " " << gpu_params[i].name;
    const auto want = gpu_opt->state_tensors(), got = host_opt->state_tensors();
    ASSERT_EQ(got.size(), want.size()) << host_opt->name();
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i].tensor.to_vector(), want[i].tensor.to_vector()) << want[i].name;

    tg::io::save_train_state(cpu_file, host_params, *host_opt, rec);
    tg::Generator third(78);
    const tg::nn::BasicGPT<tg::cuda> resumed(tg::nn::GPT(kTiny, third));
    const auto r_params = resumed.named_parameters();
    const auto r_opt = kind.device(r_params);
    tg::io::load_train_state(cpu_file, r_params, *r_opt);
    for (std::size_t i = 0; i < gpu_params.size(); ++i)
      EXPECT_EQ(values(r_params[i].tensor), values(gpu_params[i].tensor)) << r_opt->name() << " " << gpu_params[i].name;
    const auto again = r_opt->state_tensors();
    ASSERT_EQ(again.size(), want.size());
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_EQ(again[i].tensor.to_vector(), want[i].tensor.to_vector()) << want[i].name;
    EXPECT_EQ(r_opt->step_count(), 2);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

}  // namespace test_cuda_train_cpp

// One full GPT training step (forward, backward, AdamW; in bf16/fp16 mixed precision also the loss
// scaling and the weight copies, written by AdamW in its update) timed as the median of several steps after warm-up.
// Prints a table row and one JSON line (read by compare_pytorch.py).
// --compile runs the step through tg::compile (Note [compiled steps]): captured on the first step, replayed after.
//   bench_train_step --model gpt2 --batch 4 --seq 64 --steps 6 --warmup 2 --precision bf16 [--compile]
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {
struct Args {
  std::string model_name = "gpt2", precision = "fp32";
  std::int64_t B = 4, T = 64, steps = 6, warmup = 2;
  int threads = 2;
  bool compile = false;
};

template <class Policy>
int bench(const Args& a) {
  const std::string& model_name = a.model_name;
  const std::int64_t B = a.B, T = a.T, steps = a.steps, warmup = a.warmup;
  const int threads = a.threads;
  tg::backend::cpu::set_num_threads(threads);

  tg::Generator gen(1);
  const auto config = tg::nn::GPTConfig::preset(model_name);
  const tg::nn::GPT model(config, gen);
  const auto params = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::amp::MixedPrecision<Policy> amp(params, opt);
  tg::optim::GradAccum<1> accum;
  tg::optim::Schedule schedule = tg::optim::Constant{1e-4f};
  auto idx = tg::Tensor<std::int64_t>::empty({B, T}), tgt = tg::Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) {
    idx.data()[i] = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
    tgt.data()[i] = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
  }
  std::vector<double> ms;
  float loss_value = 0;
  auto step = [&] {
    const auto loss = amp.loss(amp.forward(model, idx, gen, false), tgt);
    accum.scale(loss, amp.scaler).backward();
    // as TrainStep: the copies AdamW wrote in its update are kept (Note [the optimizer writes the weight copies])
    if (accum.micro_step(opt, schedule, std::nullopt, amp.scaler)) amp.after_step(accum, tg::amp::CopyRefresh::unwritten);
    return loss.item();
  };
  auto compiled = tg::compile(step);
  compiled.set_parameters(params);
  for (std::int64_t s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    loss_value = a.compile ? compiled() : step();
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) ms.push_back(dt);
  }
  const std::string prec = std::string(tg::amp::policy_name<Policy>()) + (a.compile ? " compiled" : "");
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double n_params = static_cast<double>(tg::nn::count_parameters(params));
  const double flops = 6.0 * n_params * static_cast<double>(B * T) +
                       12.0 * static_cast<double>(config.n_layer * config.n_embd) * static_cast<double>(T) * static_cast<double>(B * T);
  const auto mem = tg::allocator<tg::cpu>().stats();
  std::printf("| typegrad %s | %s B=%lld T=%lld | %d threads | median %.1f ms/step (min %.1f, max %.1f) | %.0f tokens/s | %.1f GFLOP/s | peak %.0f MiB |\n",
              prec.c_str(), model_name.c_str(), (long long)B, (long long)T, threads, median, ms.front(), ms.back(),
              static_cast<double>(B * T) / (median / 1e3), flops / (median / 1e3) / 1e9, static_cast<double>(mem.peak_bytes) / (1 << 20));
  std::printf("{\"system\":\"typegrad\",\"compiled\":%s,\"precision\":\"%s\",\"median_ms\":%.3f,\"min_ms\":%.3f,\"max_ms\":%.3f,\"tokens_per_s\":%.1f,\"loss\":%.4f,\"peak_bytes\":%lld}\n",
              a.compile ? "true" : "false", std::string(tg::amp::policy_name<Policy>()).c_str(), median, ms.front(), ms.back(),
              static_cast<double>(B * T) / (median / 1e3), loss_value, (long long)mem.peak_bytes);
  if (a.compile) {
    if (compiled.eager()) std::printf("note: the step ran eagerly after its allocations left the plan (%s)\n", compiled.last_replay().divergence.c_str());
    std::printf("compiled: %lld capture(s), %lld replays, %zu fused chains of elementwise ops, %zu fused pairs; the memory plan:\n%s",
                (long long)compiled.captures(), (long long)compiled.replays(), compiled.fused_chains().size(), compiled.fused_pairs().size(),
                compiled.memory_plan().describe().c_str());
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  Args a;
  std::string& model_name = a.model_name;
  std::int64_t &B = a.B, &T = a.T, &steps = a.steps, &warmup = a.warmup;
  int& threads = a.threads;
  CLI::App app{"bench_train_step: median time of one GPT training step"};
  app.add_option("--model", model_name)->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--batch", B)->check(CLI::PositiveNumber);
  app.add_option("--seq", T)->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--precision", a.precision, "fp32, or bf16 / fp16 mixed precision")->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_flag("--compile", a.compile, "run the step through tg::compile (captured once, replayed from the arena)");
  CLI11_PARSE(app, argc, argv);
  return tg::amp::with_precision(a.precision, [&]<class Policy>() {
    if constexpr (Policy::fp32_matmul == tg::amp::Fp32Matmul::tf32) return 2;  // not offered: a CPU benchmark
    else return bench<Policy>(a);
  });
}

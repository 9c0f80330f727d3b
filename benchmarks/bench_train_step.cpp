// One full GPT training step (forward, backward, AdamW) timed as the median of several steps after
// warm-up. Prints a table row and one JSON line (read by compare_pytorch.py).
//   bench_train_step --model gpt2 --batch 4 --seq 64 --steps 6 --warmup 2
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

int main(int argc, char** argv) {
  std::string model_name = "gpt2";
  std::int64_t B = 4, T = 64, steps = 6, warmup = 2;
  int threads = 2;
  CLI::App app{"bench_train_step: median time of one GPT training step"};
  app.add_option("--model", model_name)->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--batch", B)->check(CLI::PositiveNumber);
  app.add_option("--seq", T)->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  tg::backend::cpu::set_num_threads(threads);

  tg::Generator gen(1);
  const auto config = tg::nn::GPTConfig::preset(model_name);
  const tg::nn::GPT model(config, gen);
  const auto params = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  auto idx = tg::Tensor<std::int64_t>::empty({B, T}), tgt = tg::Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) {
    idx.data()[i] = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
    tgt.data()[i] = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
  }
  std::vector<double> ms;
  float loss_value = 0;
  for (std::int64_t s = 0; s < warmup + steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto loss = tg::cross_entropy(model.forward<tg::fp32>(idx), tgt);
    loss.backward();
    opt.step();
    opt.zero_grad();
    loss_value = loss.item();
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= warmup) ms.push_back(dt);
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double n_params = static_cast<double>(tg::nn::count_parameters(params));
  const double flops = 6.0 * n_params * static_cast<double>(B * T) +
                       12.0 * static_cast<double>(config.n_layer * config.n_embd) * static_cast<double>(T) * static_cast<double>(B * T);
  const auto mem = tg::allocator<tg::cpu>().stats();
  std::printf("| typegrad fp32 | %s B=%lld T=%lld | %d threads | median %.1f ms/step (min %.1f, max %.1f) | %.0f tokens/s | %.1f GFLOP/s | peak %.0f MiB |\n",
              model_name.c_str(), (long long)B, (long long)T, threads, median, ms.front(), ms.back(),
              static_cast<double>(B * T) / (median / 1e3), flops / (median / 1e3) / 1e9, static_cast<double>(mem.peak_bytes) / (1 << 20));
  std::printf("{\"system\":\"typegrad\",\"precision\":\"fp32\",\"median_ms\":%.3f,\"min_ms\":%.3f,\"max_ms\":%.3f,\"tokens_per_s\":%.1f,\"loss\":%.4f,\"peak_bytes\":%lld}\n",
              median, ms.front(), ms.back(), static_cast<double>(B * T) / (median / 1e3), loss_value, (long long)mem.peak_bytes);
  return 0;
}

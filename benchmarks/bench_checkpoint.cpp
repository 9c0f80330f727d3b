// Activation checkpointing: peak activation memory (from the allocator's statistics) and step time of a
// GPT training step under each policy (none, selective, blocks), printed as a table.
//   bench_checkpoint --model small --batch 8 --seq 256 --steps 3 --warmup 1
//   bench_checkpoint --model tiny --batch 4 --seq 64 --threads 1
//
// Peak activation bytes: the parameters' gradients are kept from the previous backward (backward then
// accumulates into them), bytes_in_use is read, the peak is reset, and one forward + backward runs; the
// figure is peak - bytes_in_use before. It holds the activations saved for backward, a recomputed
// region's activations and the transient activation gradients, but neither the parameters, their
// gradients nor the optimizer state, which all policies share. "held after fwd" is bytes_in_use after the
// forward minus before: what the tape keeps between forward and backward.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <typegrad/autodiff/checkpoint.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

struct Row {
  const char* mode = "";  // the policy's name
  std::int64_t peak = 0, held = 0;
  double ms = 0, ms_min = 0, ms_max = 0, cpu_ms = 0;
  float loss = 0;
};

/// CPU time of the whole process (all threads): less sensitive than wall time to other processes' load.
double process_cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double mib(std::int64_t b) { return static_cast<double>(b) / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  std::string model_name = "small";
  std::int64_t B = 8, T = 256, steps = 3, warmup = 1;
  int threads = 2;
  float dropout = 0.1f;
  CLI::App app{"bench_checkpoint: peak activation memory and step time per activation-checkpointing policy"};
  app.add_option("--model", model_name)->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--batch", B)->check(CLI::PositiveNumber);
  app.add_option("--seq", T)->check(CLI::PositiveNumber);
  app.add_option("--steps", steps, "timed steps per policy (median reported)")->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup, "untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", threads)->check(CLI::PositiveNumber);
  app.add_option("--dropout", dropout, "dropout probability (replayed by the recompute)")->check(CLI::Range(0.0, 0.99));
  CLI11_PARSE(app, argc, argv);
  tg::backend::cpu::set_num_threads(threads);

  auto config = tg::nn::GPTConfig::preset(model_name);
  config.block_size = std::max(config.block_size, T);
  config.dropout = dropout;
  tg::Generator data_gen(5);
  auto idx = tg::Tensor<std::int64_t>::empty({B, T}), tgt = tg::Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) {
    idx.data()[i] = static_cast<std::int64_t>(data_gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
    tgt.data()[i] = static_cast<std::int64_t>(data_gen.next_u64() % static_cast<std::uint64_t>(config.vocab_size));
  }
  auto& alloc = tg::allocator<tg::cpu>();
  // One model per policy (same init, same dropout stream); steps interleave the policies round-robin so
  // that load from other processes falls on all of them alike.
  struct Runner {
    Row row;
    tg::Generator init{1}, drop{2};
    std::unique_ptr<tg::nn::GPT> model;
    std::unique_ptr<tg::optim::AdamW> opt;
    std::function<tg::Tensor<float>()> forward;  // the model's forward under the runner's policy
    std::vector<double> ms, cpu_ms;
  };
  std::vector<std::unique_ptr<Runner>> runners;
  auto add_runner = [&]<class C>() {
    auto r = std::make_unique<Runner>();
    r->row.mode = C::name;
    r->model = std::make_unique<tg::nn::GPT>(config, r->init);
    r->forward = [&idx, m = r->model.get(), drop = &r->drop] { return m->forward<tg::fp32, C>(idx, *drop, true); };
    r->opt = std::make_unique<tg::optim::AdamW>(tg::optim::default_groups(r->model->named_parameters(), 0.1f),
                                                tg::optim::AdamWOptions{.lr = 1e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
    runners.push_back(std::move(r));
  };
  add_runner.template operator()<tg::NoCheckpoint>();
  add_runner.template operator()<tg::SelectiveRecompute>();
  add_runner.template operator()<tg::RecomputeAll>();
  for (std::int64_t s = 0; s < warmup + steps; ++s)
    for (auto& r : runners) {
      const auto t0 = std::chrono::steady_clock::now();
      const double c0 = process_cpu_ms();
      const auto loss = tg::cross_entropy(r->forward(), tgt);
      loss.backward();
      r->opt->step();
      r->opt->zero_grad();
      r->row.loss = loss.item();
      const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      const double cpu = process_cpu_ms() - c0;
      if (s >= warmup) {
        r->ms.push_back(dt);
        r->cpu_ms.push_back(cpu);
      }
    }
  std::vector<Row> rows;
  for (auto& r : runners) {
    std::sort(r->ms.begin(), r->ms.end());
    r->row.ms = r->ms[r->ms.size() / 2];
    r->row.ms_min = r->ms.front();
    r->row.ms_max = r->ms.back();
    std::sort(r->cpu_ms.begin(), r->cpu_ms.end());
    r->row.cpu_ms = r->cpu_ms[r->cpu_ms.size() / 2];
    // Memory: gradients allocated by one backward, then the measured forward + backward on top of them.
    tg::cross_entropy(r->forward(), tgt).backward();
    const std::int64_t base = alloc.stats().bytes_in_use;
    alloc.reset_peak();
    {
      const auto loss = tg::cross_entropy(r->forward(), tgt);
      r->row.held = alloc.stats().bytes_in_use - base;
      loss.backward();
    }
    r->row.peak = alloc.stats().peak_bytes - base;
    r->opt->zero_grad();
    rows.push_back(r->row);
  }

  double load1 = 0;
  std::ifstream("/proc/loadavg") >> load1;
  std::printf("GPT %s (L=%lld H=%lld C=%lld V=%lld), B=%lld T=%lld, dropout %.2f, fp32, %d threads, load average %.2f\n",
              model_name.c_str(), (long long)config.n_layer, (long long)config.n_head, (long long)config.n_embd,
              (long long)config.vocab_size, (long long)B, (long long)T, dropout, threads, load1);
  std::printf("| policy | peak activation MiB | vs none | held after fwd MiB | ms/step (median) | min-max | overhead | CPU ms/step | CPU overhead |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const Row& none = rows.front();
  for (const Row& r : rows)
    std::printf("| %s | %.1f | %.3f | %.1f | %.0f | %.0f-%.0f | %+.1f%% | %.0f | %+.1f%% |\n", r.mode,
                mib(r.peak), static_cast<double>(r.peak) / static_cast<double>(none.peak), mib(r.held), r.ms, r.ms_min,
                r.ms_max, (r.ms / none.ms - 1.0) * 100.0, r.cpu_ms, (r.cpu_ms / none.cpu_ms - 1.0) * 100.0);
  for (const Row& r : rows)
    std::printf("{\"policy\":\"%s\",\"peak_activation_bytes\":%lld,\"held_after_forward_bytes\":%lld,\"ms_per_step\":%.2f,\"cpu_ms_per_step\":%.2f,\"loss\":%.6f}\n",
                r.mode, (long long)r.peak, (long long)r.held, r.ms, r.cpu_ms, r.loss);
  const double ratio = static_cast<double>(rows.back().peak) / static_cast<double>(none.peak);
  std::printf("blocks/none peak activation ratio %.3f (target <= 0.333: %s)\n", ratio, ratio <= 1.0 / 3.0 ? "met" : "NOT met");
  return 0;
}

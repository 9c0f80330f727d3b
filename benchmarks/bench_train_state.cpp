// Checkpoint I/O speed: CRC32C (SSE4.2 vs table), and saving / loading a training checkpoint of a GPT
// with AdamW state (atomic write with fsync, full validation and checksums on load).
//   bench_train_state --benchmark_filter=Crc                 # checksum throughput
//   TG_BENCH_CKPT_DIR=/tmp bench_train_state --benchmark_filter=Checkpoint
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <unistd.h>

#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

std::vector<std::uint8_t> random_bytes(std::size_t n) {
  std::vector<std::uint8_t> b(n);
  std::mt19937_64 rng(1);
  for (std::size_t i = 0; i + 8 <= n; i += 8) {
    const std::uint64_t v = rng();
    std::memcpy(b.data() + i, &v, 8);
  }
  return b;
}

void BM_Crc32c_hardware(benchmark::State& state) {
  const auto b = random_bytes(static_cast<std::size_t>(state.range(0)));
  if (!tg::io::detail::crc32c_hardware_available()) {
    state.SkipWithError("no SSE4.2");
    return;
  }
  for (auto _ : state) benchmark::DoNotOptimize(tg::io::crc32c(b.data(), b.size()));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_Crc32c_hardware)->Arg(1 << 24);

void BM_Crc32c_table(benchmark::State& state) {
  const auto b = random_bytes(static_cast<std::size_t>(state.range(0)));
  for (auto _ : state) benchmark::DoNotOptimize(tg::io::detail::crc32c_portable(b.data(), b.size(), 0));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * state.range(0));
}
BENCHMARK(BM_Crc32c_table)->Arg(1 << 24);

/// A GPT preset with one AdamW step taken (so the optimizer state exists).
struct Setup {
  tg::Generator gen{1};
  tg::nn::GPT model;
  std::vector<tg::optim::Param> params;
  tg::optim::AdamW opt;
  std::string dir;
  explicit Setup(const std::string& preset)
      : model(tg::nn::GPTConfig::preset(preset, 256), gen),
        params(model.named_parameters()),
        opt(tg::optim::default_groups(params, 0.1f), tg::optim::AdamWOptions{}) {
    for (auto& p : params) {
      p.tensor.zero_grad();
      tg::sum(p.tensor).backward();
    }
    opt.step();
    const char* d = std::getenv("TG_BENCH_CKPT_DIR");
    dir = std::string(d ? d : "/tmp") + "/tg_bench_ckpt_" + std::to_string(::getpid());
    std::filesystem::create_directories(dir);
  }
  ~Setup() { std::filesystem::remove_all(dir); }
};

void BM_Checkpoint_save(benchmark::State& state, const char* preset) {
  Setup s(preset);
  tg::io::TrainStateRecord rec;
  std::int64_t bytes = 0;
  for (auto _ : state) {
    rec.step = 1;
    const std::string p = s.dir + "/ckpt.safetensors";
    tg::io::save_train_state(p, s.params, s.opt, rec);
    bytes = static_cast<std::int64_t>(std::filesystem::file_size(p));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  state.counters["file_MB"] = static_cast<double>(bytes) / 1e6;
}
void BM_Checkpoint_load(benchmark::State& state, const char* preset) {
  Setup s(preset);
  const std::string p = s.dir + "/ckpt.safetensors";
  tg::io::save_train_state(p, s.params, s.opt, {});
  const auto bytes = static_cast<std::int64_t>(std::filesystem::file_size(p));
  for (auto _ : state) benchmark::DoNotOptimize(tg::io::load_train_state(p, s.params, s.opt).step);
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * bytes);
  state.counters["file_MB"] = static_cast<double>(bytes) / 1e6;
}
BENCHMARK_CAPTURE(BM_Checkpoint_save, small, "small")->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();
BENCHMARK_CAPTURE(BM_Checkpoint_load, small, "small")->Unit(benchmark::kMillisecond)->MinTime(2.0)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

// GPU training-step benchmark: a GPT (tests/cuda/functional_gpt.hpp, nn::GPT's architecture written with
// ops) trained on synthetic tokens on CUDA with fp32 master weights, compute in --precision, AdamW (one
// multi-tensor launch per step, backend::cuda::adam_step_multi). Prints
// ms/step, tokens/s and MFU (6·N + 12·L·T·C FLOPs per token, Kaplan et al. / PaLM appendix B, against
// --peak-tflops), then one machine-readable RESULT line for scripts/gpu-check.sh.
//   bench_cuda_gpt --model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10
//   bench_cuda_gpt --model tiny --precision fp32 --steps 20 --peak-tflops 67
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/functional_gpt.hpp"

namespace {

struct Args {
  std::string model = "gpt2", precision = "bf16";
  std::int64_t batch = 16, seq = 1024;
  int steps = 10, warmup = 2;
  double peak_tflops = 989.0;  // dense bf16 of an H100 / H200 SXM (datasheet)
};

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr,
               "bench_cuda_gpt: %s\nusage: bench_cuda_gpt [--model tiny|small|gpt2] [--precision bf16|fp16|fp32] "
               "[--batch B] [--seq T] [--steps N] [--warmup N] [--peak-tflops X]\n",
               why);
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (i + 1 >= argc) usage(("missing value for " + k).c_str());
    const std::string v = argv[++i];
    if (k == "--model") a.model = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--batch") a.batch = std::stoll(v);
    else if (k == "--seq") a.seq = std::stoll(v);
    else if (k == "--steps") a.steps = std::stoi(v);
    else if (k == "--warmup") a.warmup = std::stoi(v);
    else if (k == "--peak-tflops") a.peak_tflops = std::stod(v);
    else usage(("unknown flag " + k).c_str());
  }
  return a;
}

tg::testing::FunctionalGptConfig config_of(const std::string& m, std::int64_t seq) {
  tg::testing::FunctionalGptConfig c;
  if (m == "tiny") c = {256, 256, 4, 4, 128};
  else if (m == "small") c = {50257, 1024, 6, 6, 384};
  else if (m == "gpt2") c = {50257, 1024, 12, 12, 768};
  else usage(("unknown model " + m).c_str());
  if (seq > c.block) usage("--seq exceeds the model's block size");
  return c;
}

template <class T>
int run(const Args& a) {
  const auto cfg = config_of(a.model, a.seq);
  tg::testing::FunctionalGpt<tg::cuda> model(cfg, /*seed=*/1);
  const double n_params = static_cast<double>(model.num_parameters());
  const double flops_per_token = 6.0 * n_params + 12.0 * static_cast<double>(cfg.layers * a.seq * cfg.embd);
  double first_loss = 0, last_loss = 0;
  auto step = [&](int i) {
    const auto [x, y] = tg::testing::synthetic_batch(a.batch, a.seq, cfg.vocab, 7, static_cast<std::uint64_t>(i));
    const tg::Tensor<T, tg::cuda> loss = model.template loss<T>(x, y);
    loss.backward();
    model.fused_adamw_step(3e-4);
    return loss;
  };
  for (int i = 0; i < a.warmup; ++i) first_loss = tg::scalar_cast<double>(step(i).item());
  tg::backend::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  tg::Tensor<T, tg::cuda> loss;
  for (int i = 0; i < a.steps; ++i) loss = step(a.warmup + i);
  tg::backend::cuda::synchronize();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_loss = tg::scalar_cast<double>(loss.item());
  const double tokens = static_cast<double>(a.batch * a.seq) * a.steps;
  const double tps = tokens / secs, mfu = tps * flops_per_token / (a.peak_tflops * 1e12);
  const auto stats = tg::allocator<tg::cuda>().stats();
  std::printf("device        %s\n", tg::backend::cuda::device_description().c_str());
  std::printf("model         %s (%.1fM parameters), %s, B=%lld T=%lld, AdamW, %d steps after %d warm-up\n",
              a.model.c_str(), n_params / 1e6, a.precision.c_str(), static_cast<long long>(a.batch),
              static_cast<long long>(a.seq), a.steps, a.warmup);
  std::printf("loss          %.4f (warm-up) -> %.4f\n", first_loss, last_loss);
  std::printf("ms/step       %.1f\n", 1e3 * secs / a.steps);
  std::printf("tokens/s      %.0f\n", tps);
  std::printf("MFU           %.1f%% of %.0f TFLOP/s\n", 100 * mfu, a.peak_tflops);
  std::printf("peak memory   %.2f GiB (caching allocator)\n", static_cast<double>(stats.peak_bytes) / (1 << 30));
  std::printf("RESULT tokens_per_s=%.0f ms_per_step=%.2f mfu=%.4f loss=%.4f\n", tps, 1e3 * secs / a.steps, mfu, last_loss);
  return std::isfinite(last_loss) ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (tg::backend::cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_cuda_gpt: no CUDA device (%s)\n", tg::backend::cuda::device_description().c_str());
    return 1;
  }
  try {
    if (a.precision == "bf16") return run<tg::bf16>(a);
    if (a.precision == "fp16") return run<tg::fp16>(a);
    if (a.precision == "fp32") return run<float>(a);
    usage(("unknown precision " + a.precision).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_gpt: %s\n", e.what());
    return 1;
  }
}

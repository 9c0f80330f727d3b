// GPU training-step benchmark on the path a user runs: nn::BasicGPT<cuda> (include/typegrad/nn/gpt.hpp)
// trained on synthetic tokens with fp32 master weights, amp::MixedPrecision<policy, its default scaler,
// cuda> (compute in --precision through per-step bf16/fp16 weight copies refreshed on the GPU after each
// step; fp16 with DynamicScaler), optim::BasicAdamW<cuda> over default_groups (one multi-tensor launch per
// parameter group and step) and
// GradAccumRuntime(--grad-accum) for the step, as train_gpt --device cuda does (without clipping, as PyTorch's
// benchmarks/torch_gpt_cuda.py runs). A step is --grad-accum micro-batches of B x T tokens. The timed steps
// run between profiler_start and profiler_stop, so `ncu --profile-from-start off` profiles those alone. Prints ms/step, tokens/s and MFU (6·N + 12·L·T·C FLOPs per token,
// Kaplan et al. / PaLM appendix B, against --peak-tflops), then one machine-readable RESULT line for
// scripts/gpu-check.sh.
//   bench_cuda_gpt --model gpt2 --precision bf16 --batch 16 --seq 1024 --steps 10
//   bench_cuda_gpt --model gpt2 --precision bf16 --batch 8 --seq 1024 --grad-accum 2 --steps 10
//   bench_cuda_gpt --model tiny --precision fp32 --steps 20 --peak-tflops 67
//   bench_cuda_gpt --model tiny --precision fp32 --steps 50 --compile --cuda-graphs   // Note [CUDA graphs of a step]
// --compile runs the step through tg::compile<cuda> (captured once, replayed from one arena); --cuda-graphs also
// launches each replay as CUDA graphs, of at most --graph-chunk launches each (0: one per stretch between reads).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include <typegrad/amp/amp.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/synthetic_batch.hpp"  // tg::testing::synthetic_batch (the benchmark's token stream)

namespace {

struct Args {
  std::string model = "gpt2", precision = "bf16";
  std::int64_t batch = 16, seq = 1024;
  int steps = 10, warmup = 2, grad_accum = 1;
  bool compile = false, cuda_graphs = false;
  std::size_t graph_chunk = tg::CompileOptions{}.graph_chunk;
  double peak_tflops = 989.0;  // dense bf16 of an H100 / H200 SXM (datasheet)
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_cuda_gpt: %s\nusage: bench_cuda_gpt [--model tiny|small|gpt2] [--precision bf16|fp16|fp32] "
               "[--batch B] [--seq T] [--grad-accum N] [--steps N] [--warmup N] [--peak-tflops X] [--compile [--cuda-graphs [--graph-chunk N]]]\n",
               why.c_str());
  std::exit(2);
}

/// A whole number in [1, 10^9] (or [0, 10^9] when `zero_ok`) for `flag`, else usage().
long long number(const std::string& flag, const std::string& v, bool zero_ok = false) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < (zero_ok ? 0 : 1) || n > 1'000'000'000)
    usage(flag + " needs a whole number from " + (zero_ok ? "0" : "1") + " to 10^9, got '" + v + "'");
  return n;
}

/// The benchmark's models: GPT-2's tokenizer (50257 tokens, as benchmarks/torch_gpt_cuda.py builds them), its
/// embedding stored padded to 50304 rows as train_gpt's gpt2 preset stores it (Note [padded vocabulary]: the
/// loss sees the 50257 real tokens; the LM-head GEMMs run on aligned shapes). benchmarks/torch_gpt_cuda.py pads
/// PyTorch's model the same way (--vocab-multiple 128).
tg::nn::GPTConfig config_of(const std::string& m, std::int64_t seq) {
  tg::nn::GPTConfig c;
  if (m == "tiny") c = {256, 256, 4, 4, 128, 0.f};
  else if (m == "small") c = {50257, 1024, 6, 6, 384, 0.f};
  else if (m == "gpt2") c = {50257, 1024, 12, 12, 768, 0.f};
  else usage("unknown model '" + m + "' (expected tiny, small or gpt2)");
  if (m != "tiny") c.vocab_multiple = 128;
  if (seq > c.block_size) usage("--seq " + std::to_string(seq) + " exceeds the model's block size " + std::to_string(c.block_size));
  return c;
}

/// The flags, checked (a bad one exits 2 with the usage, before any GPU work).
Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "-h" || k == "--help") usage("GPU training-step benchmark");
    if (k == "--compile" || k == "--cuda-graphs") {
      (k == "--compile" ? a.compile : a.cuda_graphs) = true;
      continue;
    }
    if (i + 1 >= argc) usage("missing value for " + k);
    const std::string v = argv[++i];
    if (k == "--model") a.model = v;
    else if (k == "--precision") a.precision = v;
    else if (k == "--batch") a.batch = number(k, v);
    else if (k == "--seq") a.seq = number(k, v);
    else if (k == "--grad-accum") a.grad_accum = static_cast<int>(number(k, v));
    else if (k == "--steps") a.steps = static_cast<int>(number(k, v));
    else if (k == "--warmup") a.warmup = static_cast<int>(number(k, v, /*zero_ok=*/true));
    else if (k == "--graph-chunk") a.graph_chunk = static_cast<std::size_t>(number(k, v, /*zero_ok=*/true));
    else if (k == "--peak-tflops") {
      char* end = nullptr;
      a.peak_tflops = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !(a.peak_tflops > 0)) usage("--peak-tflops needs a positive number, got '" + v + "'");
    } else {
      usage("unknown flag " + k);
    }
  }
  if (a.precision != "bf16" && a.precision != "fp16" && a.precision != "fp32")
    usage("unknown precision '" + a.precision + "' (expected bf16, fp16 or fp32)");
  (void)config_of(a.model, a.seq);  // the model and --seq
  if (a.cuda_graphs && !a.compile) usage("--cuda-graphs runs the compiled step's replays as graphs: give it with --compile");
  return a;
}

template <class Policy>
int run(const Args& a) {
  const tg::nn::GPTConfig cfg = config_of(a.model, a.seq);
  tg::Generator init(1), dropout_gen(2);
  const tg::nn::BasicGPT<tg::cuda> model(cfg, init);  // initialized on the GPU from the host generator
  const auto params = model.named_parameters();
  // torch_gpt_cuda.py's AdamW settings (there every parameter decays; here the matrices do, Note [which
  // parameters decay], as train_gpt trains).
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(params, 0.1f),
                                      {.lr = 3e-4f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::amp::MixedPrecision<Policy, tg::amp::default_scaler_t<Policy>, tg::cuda> amp(params, opt);
  tg::optim::Schedule schedule = tg::optim::Constant{3e-4f};
  tg::optim::GradAccumRuntime accum(a.grad_accum);

  double n_params = 0;  // the tied LM head counted once (nn::count_parameters' count)
  for (const auto& p : params) n_params += static_cast<double>(p.tensor.numel());
  const double flops_per_token =
      6.0 * n_params + 12.0 * static_cast<double>(cfg.n_layer * a.seq * cfg.n_embd);
  auto step = [&](int i) {  // one optimizer step: grad_accum micro-batches; returns the last one's loss
    tg::Tensor<float, tg::cuda> loss;
    for (int m = 0; m < a.grad_accum; ++m) {
      const auto batch = static_cast<std::uint64_t>(i) * static_cast<std::uint64_t>(a.grad_accum) + static_cast<std::uint64_t>(m);
      const auto [x, y] = tg::testing::synthetic_batch(a.batch, a.seq, cfg.vocab_size, 7, batch);
      loss = amp.loss(amp.forward(model, x, dropout_gen), y);  // fp32 loss
      accum.scale(loss, amp.scaler).backward();
      // The copies: AdamW wrote them in its update, the rest (none here) are converted.
      if (accum.micro_step(opt, schedule, std::nullopt, amp.scaler)) amp.after_step(accum, tg::amp::CopyRefresh::unwritten);
    }
    return loss;
  };
  // --compile: the step captured once and replayed (its arena planned); --cuda-graphs: the replays as CUDA graphs
  auto compiled = tg::compile<tg::cuda>(step, {.verbose = false, .cuda_graphs = a.cuda_graphs, .graph_chunk = a.graph_chunk});
  compiled.set_parameters(params);
  auto run_step = [&](int i) { return a.compile ? compiled(i) : step(i); };
  double first_loss = 0, last_loss = 0;
  for (int i = 0; i < a.warmup; ++i) first_loss = static_cast<double>(run_step(i).item());
  tg::backend::cuda::synchronize();
  tg::backend::cuda::profiler_start();
  const auto t0 = std::chrono::steady_clock::now();
  tg::Tensor<float, tg::cuda> loss;
  for (int i = 0; i < a.steps; ++i) loss = run_step(a.warmup + i);
  tg::backend::cuda::synchronize();
  tg::backend::cuda::profiler_stop();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  last_loss = static_cast<double>(loss.item());
  const double tokens = static_cast<double>(a.batch * a.seq) * a.grad_accum * a.steps;
  const double tps = tokens / secs, mfu = tps * flops_per_token / (a.peak_tflops * 1e12);
  const auto stats = tg::allocator<tg::cuda>().stats();
  std::printf("device        %s\n", tg::backend::cuda::device_description().c_str());
  std::printf("model         %s (%.1fM parameters, nn::BasicGPT<cuda>), %s, B=%lld T=%lld, grad-accum %d, "
              "AdamW (BasicAdamW<cuda>), %d steps after %d warm-up%s\n",
              a.model.c_str(), n_params / 1e6, a.precision.c_str(), static_cast<long long>(a.batch),
              static_cast<long long>(a.seq), a.grad_accum, a.steps, a.warmup,
              a.cuda_graphs ? ", compiled, as CUDA graphs" : a.compile ? ", compiled" : "");
  if (a.cuda_graphs) {
    const auto g = compiled.graph_stats();
    std::printf("cuda graphs   %lld steps: %lld launches (%lld nodes), %lld updated, %lld instantiated\n", (long long)g.calls,
                (long long)g.launches, (long long)g.nodes, (long long)g.updated, (long long)g.instantiated);
  }
  std::printf("precision     %s: weight copies %.1f MiB (refreshed %lld times), loss scaler %s\n",
              std::string(tg::amp::policy_name<Policy>()).c_str(), static_cast<double>(amp.weights.nbytes()) / (1 << 20),
              static_cast<long long>(amp.weights.refreshes()), decltype(amp.scaler)::kind());
  std::printf("loss          %.4f (warm-up) -> %.4f\n", first_loss, last_loss);
  std::printf("ms/step       %.1f\n", 1e3 * secs / a.steps);
  std::printf("tokens/s      %.0f\n", tps);
  std::printf("MFU           %.1f%% of %.0f TFLOP/s\n", 100 * mfu, a.peak_tflops);
  std::printf("peak memory   %.2f GiB (caching allocator)\n", static_cast<double>(stats.peak_bytes) / (1 << 30));
  const double peak_gib = static_cast<double>(stats.peak_bytes) / (1 << 30);
  std::printf("RESULT tokens_per_s=%.0f ms_per_step=%.2f mfu=%.4f peak_gib=%.2f loss=%.4f\n", tps, 1e3 * secs / a.steps,
              mfu, peak_gib, last_loss);
  if (!std::isfinite(last_loss)) {
    std::fprintf(stderr, "bench_cuda_gpt: the loss is not finite (%g)\n", last_loss);
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (tg::backend::cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_cuda_gpt: no CUDA device (%s); this benchmark needs an NVIDIA GPU\n",
                 tg::backend::cuda::device_description().c_str());
    return 1;
  }
  try {
    if (a.precision == "bf16") return run<tg::amp::bf16_mixed>(a);
    if (a.precision == "fp16") return run<tg::amp::fp16_mixed>(a);
    return run<tg::amp::fp32_policy>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_gpt: %s\n", e.what());
    return 1;
  }
}

// The fused causal attention on the GPU against the composite, forward + backward (Note [flash attention on
// the GPU] in backends/cuda/flash_attention.cu): causal_attention on (B, H, T, D) tensors, the WMMA-tile
// kernels, the register-resident kernels (Note [flash attention in registers]) and the composite alternated
// round by round (set_flash_attention, set_flash_attention_kernels), the median of each. benchmarks/torch_sdpa_cuda.py times
// PyTorch's scaled_dot_product_attention on the same shapes; scripts/gpu-check.sh runs both.
//   bench_cuda_attention --precision bf16 --batch 16 --heads 12 --seq 1024 --head-size 64
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <typegrad/detail/cuda/attention.hpp>
#include <typegrad/typegrad.hpp>

namespace {

struct Args {
  std::string precision = "bf16";
  std::int64_t batch = 16, heads = 12, seq = 1024, head_size = 64;
  int reps = 20, rounds = 5;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "bench_cuda_attention: %s\nusage: bench_cuda_attention [--precision bf16|fp16] [--batch B] [--heads H] "
               "[--seq T] [--head-size D] [--reps N] [--rounds N]\n",
               why.c_str());
  std::exit(2);
}

long long number(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || n < 1 || n > 1'000'000) usage(flag + " needs a whole number from 1 to 10^6, got '" + v + "'");
  return n;
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) usage(f + " needs a value");
    const std::string v = argv[++i];
    if (f == "--precision") {
      if (v != "bf16" && v != "fp16") usage("--precision must be bf16 or fp16, got '" + v + "'");
      a.precision = v;
    } else if (f == "--batch") a.batch = number(f, v);
    else if (f == "--heads") a.heads = number(f, v);
    else if (f == "--seq") a.seq = number(f, v);
    else if (f == "--head-size") a.head_size = number(f, v);
    else if (f == "--reps") a.reps = static_cast<int>(number(f, v));
    else if (f == "--rounds") a.rounds = static_cast<int>(number(f, v));
    else usage("unknown option " + f);
  }
  return a;
}

template <class T>
int run(const Args& a) {
  tg::Generator gen(1);
  const tg::Shape s{a.batch, a.heads, a.seq, a.head_size};
  auto make = [&] { return tg::Tensor<float>::normal(s, 0.f, 1.f, gen).to<T>().template to<tg::cuda>().requires_grad_(); };
  auto q = make(), k = make(), v = make();
  const auto u = tg::Tensor<float>::normal(s, 0.f, 1.f, gen).to<T>().template to<tg::cuda>();
  auto once = [&] {
    const auto y = tg::causal_attention(q, k, v);
    y.backward(u);
    q.zero_grad();
    k.zero_grad();
    v.zero_grad();
  };
  using tg::backend::cuda::FlashKernels;
  const FlashKernels chosen = tg::backend::cuda::flash_attention_kernels();  // what training runs
  bool fused_ran[3] = {true, true, true};  // a set whose kernels do not fit the device runs the composite
  auto time_ms = [&](int path) {  // 0 composite, 1 WMMA tiles, 2 registers
    tg::backend::cuda::set_flash_attention(path != 0);
    if (path != 0) tg::backend::cuda::set_flash_attention_kernels(path == 1 ? FlashKernels::tiles : FlashKernels::registers);
    const std::int64_t calls = tg::backend::cuda::flash_attention_calls();
    once();  // warm-up (and the fused kernels' shared-memory attribute)
    tg::backend::cuda::synchronize();
    if (path != 0 && tg::backend::cuda::flash_attention_calls() != calls + 2) fused_ran[path] = false;
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < a.reps; ++r) once();
    tg::backend::cuda::synchronize();
    return 1e3 * std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.reps;
  };
  std::vector<double> times[3];
  for (int r = 0; r < a.rounds; ++r)
    for (int path : {1, 2, 0}) times[path].push_back(time_ms(path));
  tg::backend::cuda::set_flash_attention(true);
  tg::backend::cuda::set_flash_attention_kernels(chosen);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const double c = median(times[0]), t = median(times[1]), g = median(times[2]);
  const double f = chosen == FlashKernels::registers ? g : t;
  // causal: half of the 4·B·H·T²·D forward FLOPs, backward 2.5x the forward
  const double flops = 3.5 * 2.0 * static_cast<double>(a.batch * a.heads) * static_cast<double>(a.seq * a.seq) *
                       static_cast<double>(a.head_size);
  std::printf("device     %s\n", tg::backend::cuda::device_description().c_str());
  std::printf("shape      %s B=%lld H=%lld T=%lld D=%lld, causal, forward + backward, %d rounds of %d\n",
              a.precision.c_str(), static_cast<long long>(a.batch), static_cast<long long>(a.heads),
              static_cast<long long>(a.seq), static_cast<long long>(a.head_size), a.rounds, a.reps);
  auto note = [&](int path, FlashKernels k) {
    std::string n = fused_ran[path] ? "" : "  (NOT FUSED: the kernels do not fit this device; the composite ran)";
    if (chosen == k) n += "  (the process's choice)";
    return n;
  };
  std::printf("tiles      %.3f ms (%.1f TFLOP/s)%s\n", t, flops / (t * 1e-3) / 1e12, note(1, FlashKernels::tiles).c_str());
  std::printf("registers  %.3f ms (%.1f TFLOP/s)%s\n", g, flops / (g * 1e-3) / 1e12, note(2, FlashKernels::registers).c_str());
  std::printf("composite  %.3f ms (%.1f TFLOP/s)\n", c, flops / (c * 1e-3) / 1e12);
  std::printf("RESULT fused_ms=%.3f tiles_ms=%.3f registers_ms=%.3f composite_ms=%.3f\n", f, t, g, c);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse(argc, argv);
  if (tg::backend::cuda::device_count() == 0) {
    std::fprintf(stderr, "bench_cuda_attention: no CUDA device (%s); this benchmark needs an NVIDIA GPU\n",
                 tg::backend::cuda::device_description().c_str());
    return 1;
  }
  try {
    return a.precision == "bf16" ? run<tg::bf16>(a) : run<tg::fp16>(a);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_attention: %s\n", e.what());
    return 1;
  }
}

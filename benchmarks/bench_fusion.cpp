// bench_fusion: the median time and peak memory of a training step written with separate ops, run eagerly, or
// through tg::compile with and without its fusion rewrites. Two steps:
//   --step mlp    an MLP stack whose GELU is spelled out: 0.5 h (1 + tanh(√(2/π)(h + 0.044715 h³))), and a
//                 squared-error loss (Note [fusion rewrites]: chains of elementwise ops);
//   --step block  pre-LN blocks written with separate ops: linear, gelu_tanh, linear, dropout and the residual add,
//                 a second branch (linear), the residual add and the next LayerNorm (Note [pair rewrites]: dropout_add
//                 and add_layernorm; the loss's sub and mul are a chain);
//   --step attention  pre-LN causal self-attention blocks written with tg::attention_composite (matmul, mul by
//                 1/√hs, masked_fill, softmax, matmul), the residual add and the next LayerNorm (Note [pair rewrites]:
//                 scale_masked_softmax and add_layernorm).
//   bench_fusion --mode eager|fused|plain --step mlp|block|attention --precision fp32|bf16 --batch 8 --seq 128 --width 256 --layers 2
// The last line is JSON (median_ms, peak_bytes, chains, pairs) for benchmarks/fusion.sh.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <typegrad/compile/compile.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

using tg::Tensor;

struct Args {
  std::string mode = "eager", precision = "fp32", step = "mlp";
  double dropout = 0.1;
  std::int64_t B = 8, S = 128, C = 256, layers = 2, steps = 20, warmup = 3, heads = 4;
  int threads = 2;
};

template <class T>
int bench(const Args& a) {
  tg::backend::cpu::set_num_threads(a.threads);
  const std::int64_t H = 4 * a.C;
  tg::Generator gen(5), drop(6);
  std::vector<tg::optim::Param> ps;
  const bool block = a.step == "block", attention = a.step == "attention";
  TG_CHECK(!attention || a.C % a.heads == 0, "bench_fusion: --width ", a.C, " must be a multiple of --heads ", a.heads);
  for (std::int64_t l = 0; l < a.layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    if (attention) {
      ps.emplace_back(p + "wqkv", Tensor<float>::normal({3 * a.C, a.C}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "bqkv", Tensor<float>::zeros({3 * a.C}));
      ps.emplace_back(p + "wo", Tensor<float>::normal({a.C, a.C}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "ln.weight", Tensor<float>::ones({a.C}));
      ps.emplace_back(p + "ln.bias", Tensor<float>::zeros({a.C}));
    } else if (block) {  // linear weights are [out, in]
      ps.emplace_back(p + "w1", Tensor<float>::normal({H, a.C}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "b1", Tensor<float>::zeros({H}));
      ps.emplace_back(p + "w2", Tensor<float>::normal({a.C, H}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "b2", Tensor<float>::zeros({a.C}));
      ps.emplace_back(p + "w3", Tensor<float>::normal({a.C, a.C}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "ln.weight", Tensor<float>::ones({a.C}));
      ps.emplace_back(p + "ln.bias", Tensor<float>::zeros({a.C}));
    } else {
      ps.emplace_back(p + "w1", Tensor<float>::normal({a.C, H}, 0.f, 0.02f, gen));
      ps.emplace_back(p + "b1", Tensor<float>::zeros({H}));
      ps.emplace_back(p + "w2", Tensor<float>::normal({H, a.C}, 0.f, 0.02f, gen));
    }
  }
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.f), {.lr = 1e-4f});
  const Tensor<float> x = Tensor<float>::normal({a.B, a.S, a.C}, 0.f, 1.f, gen), y = Tensor<float>::normal({a.B, a.S, a.C}, 0.f, 1.f, gen);
  auto finish = [&](const Tensor<T>& out) {  // every step's end: a squared-error loss, backward, AdamW
    const Tensor<float> d = out.template to<float>() - y;
    const Tensor<float> loss = tg::sum(d * d) * (1.0 / static_cast<double>(d.numel()));
    loss.backward();
    opt.step();
    opt.zero_grad();
    return static_cast<double>(loss.item());
  };
  auto block_step = [&] {
    std::vector<Tensor<T>> w;  // the weights in the compute type, cast first (no op between a pair's two ops)
    for (const auto& p : ps) w.push_back(p.tensor.template to<T>());
    Tensor<T> h = x.to<T>(), z = h;
    for (std::int64_t l = 0; l < a.layers; ++l) {
      const auto i = static_cast<std::size_t>(7 * l);
      const Tensor<T> m = tg::linear(tg::gelu_tanh(tg::linear(z, w[i], w[i + 1])), w[i + 2], w[i + 3]);
      h = tg::add(h, tg::dropout(m, a.dropout, drop));  // dropout -> add
      const Tensor<T> v = tg::linear(h, w[i + 4]);
      h = tg::add(h, v);                                // add -> layernorm
      z = tg::layernorm(h, w[i + 5], w[i + 6]);
    }
    return finish(z);
  };
  auto attention_step = [&] {
    std::vector<Tensor<T>> w;
    for (const auto& p : ps) w.push_back(p.tensor.template to<T>());
    const std::int64_t hs = a.C / a.heads;
    Tensor<T> h = x.to<T>(), z = h;
    for (std::int64_t l = 0; l < a.layers; ++l) {
      const auto i = static_cast<std::size_t>(5 * l);
      const Tensor<T> qkv = tg::linear(z, w[i], w[i + 1]);
      auto heads = [&](std::int64_t part) {
        return qkv.narrow(2, part * a.C, a.C).reshape({a.B, a.S, a.heads, hs}).transpose(1, 2).contiguous();
      };
      const Tensor<T> att = tg::attention_composite(heads(0), heads(1), heads(2));  // mul -> masked_fill -> softmax
      h = tg::add(h, tg::linear(att.transpose(1, 2).reshape({a.B, a.S, a.C}), w[i + 2]));  // add -> layernorm
      z = tg::layernorm(h, w[i + 3], w[i + 4]);
    }
    return finish(z);
  };
  auto mlp_step = [&] {
    Tensor<T> h = x.to<T>();
    for (std::int64_t l = 0; l < a.layers; ++l) {
      const auto i = static_cast<std::size_t>(3 * l);
      const Tensor<T> u = tg::add(tg::matmul(h, ps[i].tensor.to<T>()), ps[i + 1].tensor.to<T>());
      const Tensor<T> g = 0.5 * u * (1.0 + tg::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u)));
      h = h + tg::matmul(g, ps[i + 2].tensor.to<T>());
    }
    return finish(h);
  };
  auto step = [&] { return attention ? attention_step() : block ? block_step() : mlp_step(); };
  auto compiled = tg::compile(step, tg::CompileOptions{.verbose = false, .fuse = a.mode == "fused"});
  std::vector<double> ms;
  double loss = 0;
  auto& alloc = tg::allocator<tg::cpu>();
  for (std::int64_t s = 0; s < a.warmup + a.steps; ++s) {
    if (s == a.warmup) alloc.reset_peak();
    const auto t0 = std::chrono::steady_clock::now();
    loss = a.mode == "eager" ? step() : compiled();
    const double dt = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (s >= a.warmup) ms.push_back(dt);
  }
  std::sort(ms.begin(), ms.end());
  const auto mem = alloc.stats();
  std::size_t links = 0;
  for (const auto& c : compiled.fused_chains()) links += c.links.size();
  std::printf("| %s %s %s | B=%lld S=%lld C=%lld layers=%lld | %d threads | median %.2f ms/step (min %.2f, max %.2f) | peak %.1f MiB | %zu chains, %zu ops; %zu pairs |\n",
              a.step.c_str(), a.mode.c_str(), a.precision.c_str(), (long long)a.B, (long long)a.S, (long long)a.C, (long long)a.layers, a.threads,
              ms[ms.size() / 2], ms.front(), ms.back(), static_cast<double>(mem.peak_bytes) / (1 << 20), compiled.fused_chains().size(), links,
              compiled.fused_pairs().size());
  std::printf("{\"mode\":\"%s\",\"precision\":\"%s\",\"median_ms\":%.3f,\"peak_bytes\":%lld,\"chains\":%zu,\"pairs\":%zu,\"loss\":%.6f}\n",
              a.mode.c_str(), a.precision.c_str(), ms[ms.size() / 2], (long long)mem.peak_bytes, compiled.fused_chains().size(),
              compiled.fused_pairs().size(), loss);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"bench_fusion: a step of separate elementwise ops, eager or compiled with and without fusion"};
  app.add_option("--mode", a.mode, "eager, fused (tg::compile), plain (tg::compile without fusion)")->check(CLI::IsMember({"eager", "fused", "plain"}));
  app.add_option("--step", a.step,
                 "mlp (a spelled-out GELU: chains), block (pre-LN blocks of separate ops: pairs) or attention (attention_composite "
                 "blocks: scale_masked_softmax)")
      ->check(CLI::IsMember({"mlp", "block", "attention"}));
  app.add_option("--heads", a.heads, "the attention step's heads")->check(CLI::PositiveNumber);
  app.add_option("--dropout", a.dropout, "the block step's dropout probability")->check(CLI::Range(0.0, 0.99));
  app.add_option("--precision", a.precision)->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--batch", a.B)->check(CLI::PositiveNumber);
  app.add_option("--seq", a.S)->check(CLI::PositiveNumber);
  app.add_option("--width", a.C, "model width C (the MLP is 4C wide)")->check(CLI::PositiveNumber);
  app.add_option("--layers", a.layers)->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps, "timed steps")->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "untimed steps first (at least 2: a fused step is captured twice)")->check(CLI::Range(2, 1000000));
  app.add_option("--threads", a.threads)->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return a.precision == "bf16" ? bench<tg::bf16>(a) : bench<float>(a);
  } catch (const tg::Error& e) {
    std::fprintf(stderr, "bench_fusion: %s\n", e.what());
    return 1;
  }
}

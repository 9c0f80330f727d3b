// The exponential-heavy row kernels of a GPT-2 training step on the CPU, at its B=4, T=64 shapes: the
// cross-entropy over the 50257-token vocabulary (forward: logsumexp per row; backward: the softmax minus the
// one-hot), GELU (tanh form) forward and backward over the MLP's 256 x 3072 activations, and a softmax /
// log_softmax over the same logits, and the residual stream's row ops over 256 x 768: dropout (p = 0.1; its
// backward is the same kernel), dropout fused with the residual add, LayerNorm, and the residual add fused with
// LayerNorm. Each reports elements per second; fp32 and bf16 storage.
//   bench_rowops                                  # all
//   bench_rowops --benchmark_filter=CrossEntropy  # one kernel
// OMP_NUM_THREADS sets the team (the kernels split rows over it), as in a training step.
#include <benchmark/benchmark.h>

#include <cstdint>
#include <random>
#include <vector>

#include <typegrad/detail/cpu/kernels.hpp>
#include <typegrad/ops/add_layernorm.hpp>
#include <typegrad/ops/dropout_add.hpp>

namespace {

constexpr std::int64_t kTokens = 256;  // B=4 x T=64
constexpr std::int64_t kVocab = 50257;
constexpr std::int64_t kHidden = 3072;  // 4 x 768
constexpr std::int64_t kWidth = 768;    // the residual stream's width

template <class T>
std::vector<T> random_values(std::int64_t n, float stddev, std::uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, stddev);
  std::vector<T> v(static_cast<std::size_t>(n));
  for (T& x : v) x = tg::scalar_cast<T>(dist(gen));
  return v;
}

/// Logits [kTokens, kVocab] with their targets, and the per-row logsumexp the forward writes.
template <class T>
struct CrossEntropyInputs {
  std::vector<T> logits = random_values<T>(kTokens * kVocab, 2.f, 1);
  std::vector<std::int64_t> targets = std::vector<std::int64_t>(kTokens);
  std::vector<tg::accum_t<T>> lse = std::vector<tg::accum_t<T>>(kTokens);
  tg::accum_t<T> loss = 0, dloss = 1;
  CrossEntropyInputs() {
    for (std::int64_t r = 0; r < kTokens; ++r) targets[static_cast<std::size_t>(r)] = (r * 7919) % kVocab;
  }
  tg::accum_t<T> forward() {
    tg::backend::cpu::cross_entropy_forward<T>(logits.data(), targets.data(), lse.data(), &loss, kTokens, kVocab, kVocab,
                                               -100, kTokens);
    return loss;
  }
};

template <class T>
void BM_CrossEntropyForward(benchmark::State& state) {
  CrossEntropyInputs<T> in;
  for (auto _ : state) benchmark::DoNotOptimize(in.forward());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kVocab);
}

template <class T>
void BM_CrossEntropyBackward(benchmark::State& state) {
  CrossEntropyInputs<T> in;
  in.forward();
  std::vector<T> dlogits(in.logits.size());
  for (auto _ : state) {
    tg::backend::cpu::cross_entropy_backward<T>(in.logits.data(), in.targets.data(), in.lse.data(), &in.dloss, kTokens,
                                                dlogits.data(), kTokens, kVocab, kVocab, kVocab, -100);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kVocab);
}

template <class T>
void BM_SoftmaxForward(benchmark::State& state) {
  const bool log = state.range(0) != 0;
  const auto x = random_values<T>(kTokens * kVocab, 2.f, 2);
  std::vector<T> y(x.size());
  for (auto _ : state) {
    tg::backend::cpu::softmax_forward<T>(x.data(), y.data(), kTokens, kVocab, log);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kVocab);
}

template <class T>
void BM_GeluForward(benchmark::State& state) {
  const auto x = random_values<T>(kTokens * kHidden, 1.f, 3);
  std::vector<T> y(x.size());
  const tg::Shape shape{kTokens, kHidden}, strides{kHidden, 1};
  for (auto _ : state) {
    tg::backend::cpu::unary_forward<T>(tg::math::Unary::gelu_tanh, x.data(), strides, y.data(), shape);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kHidden);
}

template <class T>
void BM_GeluBackward(benchmark::State& state) {
  const auto x = random_values<T>(kTokens * kHidden, 1.f, 3);
  const auto dy = random_values<T>(kTokens * kHidden, 1.f, 4);
  std::vector<T> dx(x.size());
  const tg::Shape shape{kTokens, kHidden}, strides{kHidden, 1};
  for (auto _ : state) {
    tg::backend::cpu::unary_backward<T>(tg::math::Unary::gelu_tanh, x.data(), strides, dy.data(), strides, dx.data(),
                                        shape);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kHidden);
}

template <class T>
void BM_DropoutForward(benchmark::State& state) {
  const auto x = random_values<T>(kTokens * kWidth, 1.f, 5);
  std::vector<T> y(x.size());
  const tg::Shape shape{kTokens, kWidth}, strides{kWidth, 1};
  std::uint64_t offset = 0;
  for (auto _ : state) {
    tg::backend::cpu::dropout_forward<T>(x.data(), strides, y.data(), shape, 1234, offset, nullptr, 0.1);
    offset += static_cast<std::uint64_t>(x.size());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kWidth);
}

template <class T>
void BM_DropoutAddForward(benchmark::State& state) {
  const auto x = random_values<T>(kTokens * kWidth, 1.f, 6), r = random_values<T>(kTokens * kWidth, 1.f, 7);
  std::vector<T> out(x.size());
  std::uint64_t offset = 0;
  for (auto _ : state) {
    tg::backend::cpu::dropout_add_forward<T>(x.data(), r.data(), out.data(), kTokens * kWidth, 1234, offset, nullptr, 0.1);
    offset += static_cast<std::uint64_t>(x.size());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kWidth);
}

/// LayerNorm over [kTokens, kWidth] (arg 0), or the residual add fused with it (arg 1).
template <class T>
void BM_LayerNormForward(benchmark::State& state) {
  const bool fused = state.range(0) != 0;
  const auto x = random_values<T>(kTokens * kWidth, 1.f, 8), r = random_values<T>(kTokens * kWidth, 1.f, 9);
  const auto w = random_values<T>(kWidth, 1.f, 10), b = random_values<T>(kWidth, 1.f, 11);
  std::vector<T> h(x.size()), y(x.size());
  std::vector<tg::accum_t<T>> mean(kTokens), rstd(kTokens);
  for (auto _ : state) {
    if (fused)
      tg::backend::cpu::add_layernorm_forward<T>(x.data(), r.data(), w.data(), b.data(), h.data(), y.data(), mean.data(),
                                                 rstd.data(), kTokens, kWidth, 1e-5);
    else
      tg::backend::cpu::layernorm_forward<T>(x.data(), w.data(), b.data(), y.data(), mean.data(), rstd.data(), kTokens,
                                             kWidth, 1e-5);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations()) * kTokens * kWidth);
}

BENCHMARK_TEMPLATE(BM_CrossEntropyForward, tg::fp32)->Name("rowops/fp32/cross_entropy_fwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_CrossEntropyForward, tg::bf16)->Name("rowops/bf16/cross_entropy_fwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_CrossEntropyBackward, tg::fp32)->Name("rowops/fp32/cross_entropy_bwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_CrossEntropyBackward, tg::bf16)->Name("rowops/bf16/cross_entropy_bwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SoftmaxForward, tg::fp32)->Name("rowops/fp32/softmax")->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SoftmaxForward, tg::fp32)->Name("rowops/fp32/log_softmax")->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_SoftmaxForward, tg::bf16)->Name("rowops/bf16/softmax")->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeluForward, tg::fp32)->Name("rowops/fp32/gelu_fwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeluForward, tg::bf16)->Name("rowops/bf16/gelu_fwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeluBackward, tg::fp32)->Name("rowops/fp32/gelu_bwd")->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_GeluBackward, tg::bf16)->Name("rowops/bf16/gelu_bwd")->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_TEMPLATE(BM_DropoutForward, tg::fp32)->Name("rowops/fp32/dropout")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_DropoutForward, tg::bf16)->Name("rowops/bf16/dropout")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_DropoutAddForward, tg::fp32)->Name("rowops/fp32/dropout_add")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_DropoutAddForward, tg::bf16)->Name("rowops/bf16/dropout_add")->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LayerNormForward, tg::fp32)->Name("rowops/fp32/layernorm")->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LayerNormForward, tg::bf16)->Name("rowops/bf16/layernorm")->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LayerNormForward, tg::fp32)->Name("rowops/fp32/add_layernorm")->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_TEMPLATE(BM_LayerNormForward, tg::bf16)->Name("rowops/bf16/add_layernorm")->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();

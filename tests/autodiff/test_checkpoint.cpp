// Checkpoint regions (autodiff/checkpoint.hpp): GPT gradients under every policy bitwise equal to those
// without checkpointing (fp32 and bf16 compute, dropout on), nested regions, recompute and memory
// evidence from the counters and the allocator, grad-ready hooks, gradient accumulation, and errors.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/autodiff/checkpoint.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

using F = tg::Tensor<float>;
/// Calls f.template operator()<C>() for every activation-checkpointing policy C of a model.
template <class Fn>
void for_each_checkpointing(Fn&& f) {
  f.template operator()<tg::NoCheckpoint>();
  f.template operator()<tg::SelectiveRecompute>();
  f.template operator()<tg::RecomputeAll>();
}
template <class C>
constexpr bool is_none = std::is_same_v<C, tg::NoCheckpoint>;

tg::nn::GPTConfig small_config(float dropout = 0.1f) {
  tg::nn::GPTConfig c;
  c.vocab_size = 64;
  c.block_size = 32;
  c.n_layer = 3;
  c.n_head = 4;
  c.n_embd = 64;
  c.dropout = dropout;
  return c;
}

using tg::testing::random_tokens;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct GradSnapshot {
  std::vector<std::string> names;
  std::vector<std::vector<float>> grads;
  float loss = 0;
};

GradSnapshot snapshot(const std::vector<tg::nn::NamedParameter>& ps, float loss) {
  GradSnapshot s;
  s.loss = loss;
  for (const auto& p : ps) {
    s.names.push_back(p.name);
    const F g = p.tensor.grad();
    s.grads.push_back(g.defined() ? g.to_vector() : std::vector<float>{});
  }
  return s;
}

void expect_bitwise_equal(const GradSnapshot& ref, const GradSnapshot& got, const std::string& what) {
  ASSERT_EQ(ref.grads.size(), got.grads.size());
  EXPECT_EQ(std::memcmp(&ref.loss, &got.loss, sizeof(float)), 0) << what << ": loss " << ref.loss << " vs " << got.loss;
  for (std::size_t i = 0; i < ref.grads.size(); ++i) {
    ASSERT_FALSE(ref.grads[i].empty()) << ref.names[i] << " got no gradient";
    EXPECT_TRUE(same_bits(ref.grads[i], got.grads[i])) << what << ": gradient of " << ref.names[i] << " differs";
  }
}

/// One forward + backward of a fresh GPT (same init, same dropout stream) with the given checkpointing.
template <class T, class C>
GradSnapshot gpt_grads(const tg::nn::GPTConfig& cfg, std::uint64_t dropout_seed = 11) {
  tg::Generator init(7), drop(dropout_seed);
  tg::nn::GPT model(cfg, init);
  const auto idx = random_tokens(2, 16, cfg.vocab_size, 1), tgt = random_tokens(2, 16, cfg.vocab_size, 2);
  const F loss = tg::cross_entropy(model.forward<T, C>(idx, drop, true).template to<tg::fp32>(), tgt);
  loss.backward();
  return snapshot(model.named_parameters(), loss.item());
}

TEST(CheckpointRegion, GptGradientsBitwiseEqualUnderEveryPolicyFp32) {
  const auto cfg = small_config(0.1f);
  const GradSnapshot ref = gpt_grads<tg::fp32, tg::NoCheckpoint>(cfg);
  for_each_checkpointing([&]<class C>() { expect_bitwise_equal(ref, gpt_grads<tg::fp32, C>(cfg), C::name); });
  // Dropout is really on: another dropout stream changes the gradients (so equality above is not vacuous).
  const GradSnapshot other = gpt_grads<tg::fp32, tg::RecomputeAll>(cfg, 12);
  EXPECT_FALSE(same_bits(ref.grads[2], other.grads[2])) << ref.names[2];
}

TEST(CheckpointRegion, GptGradientsBitwiseEqualUnderEveryPolicyBf16Compute) {
  const auto cfg = small_config(0.1f);
  const GradSnapshot ref = gpt_grads<tg::bf16, tg::NoCheckpoint>(cfg);
  for_each_checkpointing([&]<class C>() { expect_bitwise_equal(ref, gpt_grads<tg::bf16, C>(cfg), std::string("bf16 ") + C::name); });
  // bf16 compute really differs from fp32 compute.
  const GradSnapshot f32 = gpt_grads<tg::fp32, tg::NoCheckpoint>(cfg);
  EXPECT_FALSE(same_bits(ref.grads[2], f32.grads[2]));
}

TEST(CheckpointRegion, EvalForwardUnchangedAndNoGradRecordsNothing) {
  const auto cfg = small_config(0.1f);
  tg::Generator init(7);
  tg::nn::GPT model(cfg, init);
  const auto idx = random_tokens(2, 16, cfg.vocab_size, 1);
  const auto ref = model.forward<tg::fp32>(idx).to_vector();
  for_each_checkpointing([&]<class C>() {
    tg::Generator unused(0);
    EXPECT_TRUE(same_bits(ref, model.forward<tg::fp32, C>(idx, unused, false).to_vector())) << C::name;
    tg::autodiff::checkpoint_stats() = {};
    tg::NoGrad no_grad;
    const F y = model.forward<tg::fp32, C>(idx, unused, false);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_TRUE(same_bits(ref, y.to_vector()));
    EXPECT_EQ(tg::autodiff::checkpoint_stats().regions_recorded, 0);
    EXPECT_EQ(tg::autodiff::checkpoint_stats().kept_outputs, 0);
  });
}

std::int64_t count_ops(const std::string& op) {
  std::int64_t n = 0;
  for (const auto& node : tg::autodiff::current_tape().live_nodes()) n += op == node->op();
  return n;
}

TEST(CheckpointRegion, RegionsRecordOneNodeAndRecomputeInBackward) {
  const auto cfg = small_config(0.1f);
  const std::int64_t L = cfg.n_layer;
  for_each_checkpointing([&]<class C>() {
    SCOPED_TRACE(C::name);
    tg::Generator init(7), drop(11);
    tg::nn::GPT model(cfg, init);
    const auto idx = random_tokens(2, 16, cfg.vocab_size, 1), tgt = random_tokens(2, 16, cfg.vocab_size, 2);
    tg::autodiff::checkpoint_stats() = {};
    const F loss = tg::cross_entropy(model.forward<tg::fp32, C>(idx, drop, true), tgt);
    const auto& st = tg::autodiff::checkpoint_stats();
    // Each block has 4 GEMMs: 3 linears (c_attn, attn c_proj, mlp c_proj) and c_fc fused with its GELU
    // (linear_gelu_tanh); the LM head is one more linear.
    if (is_none<C>) {
      EXPECT_EQ(count_ops("linear"), 3 * L + 1);
      EXPECT_EQ(count_ops("linear_gelu_tanh"), L);
      EXPECT_EQ(count_ops("gelu_tanh"), 0);
      EXPECT_EQ(st.regions_recorded, 0);
    } else {
      EXPECT_EQ(count_ops("linear"), 1) << "the blocks' linears must not be on the tape after forward";
      EXPECT_EQ(count_ops("linear_gelu_tanh"), 0);
      EXPECT_EQ(count_ops("layernorm"), 1) << "only ln_f";
      EXPECT_EQ(count_ops(std::is_same_v<C, tg::RecomputeAll> ? "checkpoint[blocks]" : "checkpoint[selective]"), L);
      EXPECT_EQ(st.regions_recorded, L);
    }
    constexpr bool selective = std::is_same_v<C, tg::SelectiveRecompute>;
    EXPECT_EQ(st.kept_outputs, selective ? 4 * L : 0);
    EXPECT_EQ(st.recomputes, 0);
    loss.backward();
    EXPECT_EQ(st.recomputes, is_none<C> ? 0 : L);
    EXPECT_EQ(st.reused_outputs, selective ? 4 * L : 0);
  });
}

/// Bytes in use after forward and the peak above the starting point during forward + backward.
struct MemoryUse {
  std::int64_t after_forward = 0, peak = 0;
};

template <class C>
MemoryUse gpt_memory() {
  tg::nn::GPTConfig cfg = small_config(0.1f);
  cfg.n_layer = 4;
  tg::Generator init(7), drop(11);
  tg::nn::GPT model(cfg, init);
  const auto idx = random_tokens(4, 32, cfg.vocab_size, 1), tgt = random_tokens(4, 32, cfg.vocab_size, 2);
  auto& alloc = tg::allocator<tg::cpu>();
  MemoryUse u;
  const std::int64_t base = alloc.stats().bytes_in_use;
  alloc.reset_peak();
  {
    const F loss = tg::cross_entropy(model.forward<tg::fp32, C>(idx, drop, true), tgt);
    u.after_forward = alloc.stats().bytes_in_use - base;
    loss.backward();
  }
  u.peak = alloc.stats().peak_bytes - base;
  return u;
}

TEST(CheckpointRegion, ActivationsAreFreedAndPeakIsLower) {
  const MemoryUse none = gpt_memory<tg::NoCheckpoint>(), sel = gpt_memory<tg::SelectiveRecompute>(),
                  blocks = gpt_memory<tg::RecomputeAll>();
  // After forward the blocks' intermediates are gone: blocks keeps one (B,T,C) input per block, selective
  // adds the GEMM outputs (9·C per token per block), none keeps about 17·C per token per block.
  EXPECT_LT(blocks.after_forward * 3, none.after_forward) << blocks.after_forward << " vs " << none.after_forward;
  EXPECT_LT(blocks.after_forward, sel.after_forward);
  EXPECT_LT(sel.after_forward, none.after_forward);
  EXPECT_LT(blocks.peak, sel.peak);
  EXPECT_LT(sel.peak, none.peak);
}

/// A small residual MLP-ish function with dropout from an explicit generator and the default one.
struct TinyBlock {
  F w1, w2;
  double p = 0.25;
  int* calls = nullptr;
  F forward(const F& x, tg::Generator& gen) const {
    if (calls) ++*calls;
    const F h = tg::dropout(tg::gelu_tanh(tg::linear(x, w1)), p, gen);
    return tg::add(x, tg::dropout(tg::linear(h, w2), p));  // the second dropout draws from default_generator()
  }
};

TEST(CheckpointRegion, NestedRegionsMatchPlainBitwise) {
  tg::Generator init(3);
  int calls = 0;
  TinyBlock a{F::normal({24, 16}, 0.f, 0.3f, init).requires_grad_(), F::normal({16, 24}, 0.f, 0.3f, init).requires_grad_(), 0.25, &calls};
  TinyBlock b{F::normal({24, 16}, 0.f, 0.3f, init).requires_grad_(), F::normal({16, 24}, 0.f, 0.3f, init).requires_grad_(), 0.25, &calls};
  const F x0 = F::normal({5, 16}, 0.f, 1.f, init);
  const std::vector<F> params{a.w1, a.w2, b.w1, b.w2};

  // inner: 0 plain, 1 blocks, 2 selective; outer likewise.
  auto run = [&](int outer, int inner) {
    for (const auto& p : params) p.zero_grad();
    tg::Generator gen(99);
    tg::default_generator().set_state(5, 0);
    F x = x0.detach();
    x.requires_grad_();
    auto step = [&](const TinyBlock& blk, const F& in) -> F {
      if (inner == 1) return tg::Checkpoint<TinyBlock, tg::RecomputeAll>(blk).forward(in, gen);
      if (inner == 2) return tg::Checkpoint<TinyBlock, tg::SelectiveRecompute>(blk).forward(in, gen);
      return blk.forward(in, gen);
    };
    auto both = [&](const F& in) { return step(b, step(a, in)); };
    F y;
    if (outer == 1) y = tg::checkpoint<tg::RecomputeAll>(both, x);
    else if (outer == 2) y = tg::checkpoint<tg::SelectiveRecompute>(both, x);
    else y = both(x);
    tg::sum(tg::mul(y, y)).backward();
    std::vector<std::vector<float>> g{x.grad().to_vector()};
    for (const auto& p : params) g.push_back(p.grad().to_vector());
    return g;
  };
  calls = 0;
  const auto ref = run(0, 0);
  EXPECT_EQ(calls, 2);
  for (int outer = 0; outer < 3; ++outer)
    for (int inner = 0; inner < 3; ++inner) {
      SCOPED_TRACE("outer " + std::to_string(outer) + ", inner " + std::to_string(inner));
      calls = 0;
      tg::autodiff::checkpoint_stats() = {};
      const auto got = run(outer, inner);
      for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(same_bits(ref[i], got[i])) << "gradient " << i;
      // Forward calls: 2, plus 2 for the outer recompute, plus 2 for the inner recomputes (once each).
      const int expected = 2 + (outer ? 2 : 0) + (inner ? 2 : 0);
      EXPECT_EQ(calls, expected);
      EXPECT_EQ(tg::autodiff::checkpoint_stats().recomputes, (outer ? 1 : 0) + (inner ? 2 : 0));
    }
  // The generators' states after a checkpointed step equal those after a plain one (recompute restores them).
  tg::Generator after_plain(0);
  {
    tg::Generator gen(99);
    F x = x0.detach();
    x.requires_grad_();
    tg::sum(b.forward(a.forward(x, gen), gen)).backward();
    after_plain = gen;
  }
  tg::Generator gen(99);
  F x = x0.detach();
  x.requires_grad_();
  tg::sum(tg::checkpoint<tg::RecomputeAll>([&](const F& in) { return b.forward(a.forward(in, gen), gen); }, x)).backward();
  EXPECT_EQ(gen.offset(), after_plain.offset());
}

TEST(CheckpointRegion, GradReadyHooksFireAsWithoutCheckpointing) {
  const auto cfg = small_config(0.1f);
  auto run = [&]<class C>() {
    tg::Generator init(7), drop(11);
    tg::nn::GPT model(cfg, init);
    const auto ps = model.named_parameters();
    std::vector<int> calls(ps.size(), 0);
    std::vector<std::vector<float>> last(ps.size());
    for (std::size_t i = 0; i < ps.size(); ++i) {
      F t = ps[i].tensor;
      t.autograd_meta()->grad_ready_hooks.push_back([&calls, &last, i](const F& g) {
        ++calls[i];
        last[i] = g.to_vector();
      });
    }
    const auto idx = random_tokens(2, 16, cfg.vocab_size, 1), tgt = random_tokens(2, 16, cfg.vocab_size, 2);
    tg::cross_entropy(model.forward<tg::fp32, C>(idx, drop, true), tgt).backward();
    for (std::size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(same_bits(last[i], ps[i].tensor.grad().to_vector())) << ps[i].name;
    for (auto& p : ps) F(p.tensor).autograd_meta()->grad_ready_hooks.clear();
    return calls;
  };
  const auto ref = run.template operator()<tg::NoCheckpoint>();
  for (int c : ref) EXPECT_GE(c, 1);
  EXPECT_EQ(run.template operator()<tg::SelectiveRecompute>(), ref);
  EXPECT_EQ(run.template operator()<tg::RecomputeAll>(), ref);
}

TEST(CheckpointRegion, ComposesWithGradientAccumulation) {
  const auto cfg = small_config(0.1f);
  auto run = [&]<class C>() {
    tg::Generator init(7), drop(11);
    tg::nn::GPT model(cfg, init);
    const auto ps = model.named_parameters();
    tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
    tg::optim::Schedule schedule = tg::optim::Constant{1e-2f};
    tg::optim::GradAccum<3> accum;
    for (int micro = 0; micro < 3; ++micro) {
      const auto idx = random_tokens(2, 16, cfg.vocab_size, 10 + micro), tgt = random_tokens(2, 16, cfg.vocab_size, 20 + micro);
      accum.scale(tg::cross_entropy(model.forward<tg::fp32, C>(idx, drop, true), tgt)).backward();
      const bool stepped = accum.micro_step(opt, schedule, 1.0);
      EXPECT_EQ(stepped, micro == 2);
    }
    std::vector<std::vector<float>> values;
    for (const auto& p : ps) values.push_back(p.tensor.to_vector());
    values.push_back({static_cast<float>(accum.last_grad_norm())});
    return values;
  };
  const auto ref = run.template operator()<tg::NoCheckpoint>();
  for_each_checkpointing([&]<class C>() {
    const auto got = run.template operator()<C>();
    ASSERT_EQ(got.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      EXPECT_TRUE(same_bits(ref[i], got[i])) << C::name << ": parameter " << i << " after the step";
  });
}

/// Two optimizer steps of GradAccum<2> under amp::MixedPrecision<Policy> (fp32 masters, per-step 16-bit
/// copies, the policy's loss scaler), dropout on: the weights, the gradient norm and the loss scale after.
template <class Policy, class C>
std::vector<std::vector<float>> mixed_precision_steps() {
  const auto cfg = small_config(0.1f);
  tg::Generator init(7), drop(11);
  tg::nn::GPT model(cfg, init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f});
  tg::amp::MixedPrecision<Policy> amp(ps, opt);
  tg::optim::Schedule schedule = tg::optim::Constant{1e-2f};
  tg::optim::GradAccum<2> accum;
  for (int micro = 0; micro < 4; ++micro) {
    const auto idx = random_tokens(2, 16, cfg.vocab_size, 30 + micro), tgt = random_tokens(2, 16, cfg.vocab_size, 40 + micro);
    using T = typename decltype(amp)::compute_type;
    accum.scale(amp.loss(model.forward<T, C>(idx, drop, true), tgt), amp.scaler).backward();
    if (accum.micro_step(opt, schedule, 1.0, amp.scaler)) {
      EXPECT_FALSE(accum.last_step_skipped()) << "no overflow expected in this run";
      amp.after_step(accum);
    }
  }
  std::vector<std::vector<float>> values;
  for (const auto& p : ps) values.push_back(p.tensor.to_vector());
  values.push_back({static_cast<float>(accum.last_grad_norm()), static_cast<float>(amp.scaler.scale())});
  return values;
}

template <class Policy>
void expect_checkpointing_composes_with(const char* what) {
  const auto ref = mixed_precision_steps<Policy, tg::NoCheckpoint>();
  for_each_checkpointing([&]<class C>() {
    const auto got = mixed_precision_steps<Policy, C>();
    ASSERT_EQ(got.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i)
      EXPECT_TRUE(same_bits(ref[i], got[i])) << what << " " << C::name << ": value " << i << " after two steps";
  });
}

TEST(CheckpointRegion, ComposesWithBf16MixedPrecisionAndAccumulation) {
  expect_checkpointing_composes_with<tg::amp::bf16_mixed>("bf16_mixed");
}
TEST(CheckpointRegion, ComposesWithFp16MixedPrecisionScalerAndAccumulation) {
  expect_checkpointing_composes_with<tg::amp::fp16_mixed>("fp16_mixed");
  // The fp16 run really scales its loss (2^16, no overflow in 2 steps), so the scaler took part.
  EXPECT_EQ((mixed_precision_steps<tg::amp::fp16_mixed, tg::RecomputeAll>().back()[1]), 65536.f);
}

/// The recompute in backward reads the forward's per-step weight copies (Note [regions see the copies]),
/// not fresh conversions of the masters: param_as sees the same copy storage in both runs of the region,
/// and allocates no tensor for it. Nothing was captured: the copy hangs on the master.
TEST(CheckpointRegion, RecomputeReadsTheForwardsWeightCopies) {
  tg::Generator g(5);
  const F w = tg::nn::normal_parameter({8, 8}, 1.f, g);
  const std::vector<tg::optim::Param> ps{tg::optim::Param("w", w)};
  tg::amp::WeightCopies<tg::bf16> copies(ps);
  std::vector<const void*> seen;
  std::vector<std::int64_t> allocated;  // tensor bytes param_as allocated: 0 when it reads the copy
  const auto fn = [&](const tg::Tensor<tg::bf16>& x) {
    const std::int64_t before = tg::allocator<tg::cpu>().stats().bytes_in_use;
    const tg::Tensor<tg::bf16> wb = tg::amp::param_as<tg::bf16>(w);
    allocated.push_back(tg::allocator<tg::cpu>().stats().bytes_in_use - before);
    seen.push_back(wb.data());
    return tg::matmul(x, wb);
  };
  tg::Tensor<tg::bf16> x = tg::Tensor<tg::bf16>::full({4, 8}, 0.5);
  const tg::Tensor<tg::bf16> y = tg::checkpoint<tg::RecomputeAll>(fn, x);
  const auto recomputes = tg::autodiff::checkpoint_stats().recomputes;
  tg::sum(y.to<tg::fp32>()).backward();
  EXPECT_EQ(tg::autodiff::checkpoint_stats().recomputes - recomputes, 1);
  ASSERT_EQ(seen.size(), 2u) << "one forward and one recompute";
  EXPECT_EQ(seen[0], copies.copy_of(w).data());
  EXPECT_EQ(seen[1], copies.copy_of(w).data()) << "the recompute converted the master again";
  EXPECT_EQ(allocated, (std::vector<std::int64_t>{0, 0})) << "a conversion allocated its output";
  EXPECT_TRUE(w.grad().defined()) << "the gradient reaches the fp32 master through the copy";
  // d/dw Σ(x·w) = xᵀ·1: every entry is Σ_rows 0.5 = 2 (exact in bf16 and fp32).
  for (float v : w.grad().to_vector()) EXPECT_EQ(v, 2.f);
  EXPECT_NE(w.storage()->attached_copy(), nullptr) << "the copy stays attached to the master";
}

F region_fn_input(std::uint64_t seed) {
  tg::Generator g(seed);
  F x = F::normal({4, 8}, 0.f, 1.f, g);
  x.requires_grad_();
  return x;
}

void expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
    FAIL() << "no tg::Error (expected one mentioning '" << needle << "')";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(CheckpointRegion, BackwardTwiceThroughReleasedRegionIsAClearError) {
  F x = region_fn_input(1);
  const F y = tg::checkpoint<tg::RecomputeAll>([](const F& t) { return tg::gelu_tanh(tg::mul(t, t)); }, x);
  tg::sum(y).backward();
  const auto first = x.grad().to_vector();
  expect_error([&] { tg::sum(y).backward(); }, "checkpoint[blocks] backward: this checkpoint region was already released");
  EXPECT_TRUE(same_bits(first, x.grad().to_vector())) << "the failed backward changed the gradient";
}

TEST(CheckpointRegion, RetainGraphAllowsASecondBackward) {
  F x = region_fn_input(1);
  auto fn = [](const F& t) { return tg::gelu_tanh(tg::linear(t, t)); };
  F plain_x = x.detach();
  plain_x.requires_grad_();
  const F p = fn(plain_x);
  tg::sum(p).backward(true);
  tg::sum(p).backward();
  const F y = tg::checkpoint<tg::SelectiveRecompute>(fn, x);
  tg::sum(y).backward(true);
  tg::sum(y).backward();
  EXPECT_TRUE(same_bits(plain_x.grad().to_vector(), x.grad().to_vector()));
}

TEST(CheckpointRegion, NondeterministicRegionsAreRejected) {
  // Draws a different count of random numbers on the recompute.
  {
    F x = region_fn_input(2);
    tg::Generator gen(4);
    int call = 0;
    const F y = tg::checkpoint<tg::RecomputeAll>(
        [&](const F& t) { return ++call == 1 ? tg::dropout(t, 0.5, gen) : tg::dropout(tg::dropout(t, 0.5, gen), 0.5, gen); }, x);
    expect_error([&] { tg::sum(y).backward(); }, "random numbers from a generator");
    EXPECT_EQ(gen.offset(), tg::detail::dropout_counters(static_cast<std::uint64_t>(x.numel())))
        << "the generator must be restored after a failed recompute";
  }
  // Draws from a generator the forward did not use.
  {
    F x = region_fn_input(2);
    tg::Generator g1(4), g2(5);
    int call = 0;
    const F y = tg::checkpoint<tg::RecomputeAll>([&](const F& t) { return tg::dropout(t, 0.5, ++call == 1 ? g1 : g2); }, x);
    expect_error([&] { tg::sum(y).backward(); }, "its forward did not use");
  }
  // Runs another number of GEMMs under a selective policy.
  {
    F x = region_fn_input(2);
    int call = 0;
    const F y = tg::checkpoint<tg::SelectiveRecompute>(
        [&](const F& t) {
          const F tt = t.transpose(0, 1);
          return ++call == 1 ? tg::matmul(tg::matmul(t, tt), t) : tg::matmul(tg::matmul(tg::matmul(t, tt), t), tt);
        }, x);
    expect_error([&] { tg::sum(y).backward(); }, "forward kept only 2 outputs");
  }
  // Returns another shape.
  {
    F x = region_fn_input(2);
    int call = 0;
    const F y = tg::checkpoint<tg::RecomputeAll>([&](const F& t) { return ++call == 1 ? tg::mul(t, 2.0) : tg::sum(t); }, x);
    expect_error([&] { tg::sum(y).backward(); }, "the recompute returned shape");
  }
}

TEST(CheckpointRegion, RegionOnInputsWithoutGradAndParametersInside) {
  tg::Generator g(8);
  F w = F::normal({8, 8}, 0.f, 0.5f, g);
  w.requires_grad_();
  const F x = F::normal({3, 8}, 0.f, 1.f, g);  // does not require grad
  // Nothing requires grad: a plain result.
  const F plain = tg::checkpoint<tg::RecomputeAll>([](const F& t) { return tg::gelu_tanh(t); }, x);
  EXPECT_FALSE(plain.requires_grad());
  // Only a parameter inside requires grad: the region still records and delivers to it.
  const F y = tg::checkpoint<tg::RecomputeAll>([&](const F& t) { return tg::gelu_tanh(tg::linear(t, w)); }, x);
  EXPECT_TRUE(y.requires_grad());
  tg::sum(y).backward();
  const auto dw = w.grad().to_vector();
  w.zero_grad();
  tg::sum(tg::gelu_tanh(tg::linear(x, w))).backward();
  EXPECT_TRUE(same_bits(dw, w.grad().to_vector()));
  // An identity region does not hijack its input's autograd meta.
  F z = region_fn_input(3);
  const F id = tg::checkpoint<tg::RecomputeAll>([](const F& t) { return t; }, z);
  EXPECT_TRUE(z.autograd_meta()->is_leaf());
  tg::sum(tg::mul(id, 3.0)).backward();
  for (float v : z.grad().to_vector()) EXPECT_EQ(v, 3.f);
}

TEST(CheckpointRegion, ModeNamesParse) {
  // with_checkpointing is the one name -> type boundary; each policy's name leads back to it.
  for_each_checkpointing([]<class C>() {
    EXPECT_TRUE(tg::with_checkpointing(C::name, []<class P>() { return std::is_same_v<P, C>; })) << C::name;
  });
  expect_error([] { tg::with_checkpointing("everything", []<class P>() { return 0; }); },
               "unknown mode 'everything' (expected none, selective or blocks)");
}

}  // namespace

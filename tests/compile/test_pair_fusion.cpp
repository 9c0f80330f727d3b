// tg::compile's pair rewrite (Note [pair rewrites]): a pre-LN block written with separate ops (linear then
// gelu_tanh, dropout then the residual add on either side, the residual add then layernorm) trained 20 AdamW steps
// compiled with fusion against the same steps run eagerly: the fused ops it runs instead equal the pairs bit for
// bit on the CPU (fp32 and bf16), no allocator call once fused, and the errors: a pending value read on the host,
// a pair whose consumer changes, and the recapture without fusion after it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <cstring>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "compile/fusion_test_util.hpp"

namespace test_pair_fusion_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::Tensor;
using Trained = tg::testing::FusionRun;
using tg::testing::count;
using tg::testing::expect_bitwise;

/// An embedding projection, an MLP (linear, gelu_tanh, linear), dropout and a residual add, a linear, a residual
/// add and its LayerNorm, a linear, dropout on the left of a residual add, and a head with cross-entropy.
/// T: the compute type (the fp32 masters are cast to it first, as mixed precision does).
template <class T>
struct Block {
  static constexpr std::int64_t B = 4, S = 32, C = 64, H = 256, V = 96;
  static constexpr double p = 0.1;
  tg::Generator init{5};
  tg::Generator drop{77};
  std::vector<tg::optim::Param> ps;
  std::vector<Tensor<float>> masters;
  std::unique_ptr<tg::optim::AdamW> opt;
  int calls = 0;
  bool relu_at_4 = false;     // the 4th call's activation after the first MLP linear is relu (another consumer)
  bool read_dropped = false;  // reads the first dropout's value on the host (an error when fused)
  bool sum_between_at_4 = false;  // the 4th call records an op between the residual add and its layernorm

  Block() {
    auto w = [&](tg::Shape s, float sd) { return Tensor<float>::normal(s, 0.f, sd, init); };
    masters = {w({C, C}, 0.1f), w({C}, 0.02f), w({H, C}, 0.1f), w({H}, 0.02f), w({C, H}, 0.05f), w({C}, 0.02f), w({C, C}, 0.1f),
               Tensor<float>::ones({C}), Tensor<float>::zeros({C}), w({C, C}, 0.1f), w({C}, 0.02f), w({V, C}, 0.1f)};
    const char* names[] = {"we", "be", "w1", "b1", "w2", "b2", "w3", "lw", "lb", "w4", "b4", "wout"};
    for (std::size_t i = 0; i < masters.size(); ++i) ps.push_back({names[i], masters[i]});
    opt = std::make_unique<tg::optim::AdamW>(tg::optim::default_groups(ps, 0.01f), tg::optim::AdamWOptions{.lr = 3e-3f, .beta2 = 0.95f});
  }
  Tensor<float> input(int k) const {
    tg::Generator g(100 + static_cast<std::uint64_t>(k));
    return Tensor<float>::normal({B, S, C}, 0.f, 1.f, g);
  }
  Tensor<std::int64_t> targets(int k) const {
    std::vector<std::int64_t> t(static_cast<std::size_t>(B * S));
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int64_t>((i * 37 + static_cast<std::size_t>(k) * 11) % V);
    return Tensor<std::int64_t>::from_vector({B, S}, t);
  }
  double step(const Tensor<float>& x, const Tensor<std::int64_t>& y) {
    ++calls;
    opt->zero_grad();
    std::vector<Tensor<T>> w;  // the weights in the compute type, cast before the block (no op between a pair's two)
    for (const auto& q : ps) w.push_back(q.tensor.template to<T>());
    const Tensor<T> e = tg::linear(x.to<T>(), w[0], w[1]);
    const Tensor<T> u = tg::linear(e, w[2], w[3]);
    const Tensor<T> g = relu_at_4 && calls == 4 ? tg::relu(u) : tg::gelu_tanh(u);  // linear -> gelu_tanh
    const Tensor<T> m = tg::linear(g, w[4], w[5]);
    const Tensor<T> d = tg::dropout(m, p, drop);
    if (read_dropped) (void)d.to_vector();
    const Tensor<T> h = tg::add(e, d);                                // dropout -> add (the right operand)
    const Tensor<T> v = tg::linear(h, w[6]);
    const Tensor<T> h2 = tg::add(h, v);                               // add -> layernorm; h2 read on below
    if (sum_between_at_4 && calls == 4) (void)tg::sum(v);
    const Tensor<T> z = tg::layernorm(h2, w[7], w[8]);
    const Tensor<T> o = tg::linear(z, w[9], w[10]);
    const Tensor<T> h3 = tg::add(tg::dropout(o, p, drop), h2);      // dropout -> add (the left operand)
    const Tensor<float> loss = tg::cross_entropy_as<float>(tg::linear(h3, w[11]), y);
    loss.backward();
    opt->step();
    opt->zero_grad();
    return static_cast<double>(loss.item());
  }
};

/// TG_FUSE_PAIRS set to `value` (null: unset) for the scope, the previous value restored after it.
class FusePairsEnv {
 public:
  explicit FusePairsEnv(const char* value) {
    if (const char* v = std::getenv("TG_FUSE_PAIRS")) previous_ = v, had_ = true;
    if (value) ::setenv("TG_FUSE_PAIRS", value, 1);
    else ::unsetenv("TG_FUSE_PAIRS");
  }
  ~FusePairsEnv() {
    if (had_) ::setenv("TG_FUSE_PAIRS", previous_.c_str(), 1);
    else ::unsetenv("TG_FUSE_PAIRS");
  }
  FusePairsEnv(const FusePairsEnv&) = delete;
  FusePairsEnv& operator=(const FusePairsEnv&) = delete;

 private:
  std::string previous_;
  bool had_ = false;
};
/// TG_FUSE_PAIRS=all: linear -> gelu_tanh is rewritten on the CPU too (Note [pair rewrites]).
struct EveryDevice : FusePairsEnv {
  EveryDevice() : FusePairsEnv("all") {}
};
/// The default: linear -> gelu_tanh kept as written on the CPU.
struct DefaultPairs : FusePairsEnv {
  DefaultPairs() : FusePairsEnv(nullptr) {}
};

/// `warm`: one eager step first (the optimizer's state exists before the capture, so two plans compare).
template <class T>
Trained train(bool compiled, bool fuse, int steps = 20, bool warm = false) {
  Block<T> m;
  if (warm) m.step(m.input(99), m.targets(99));
  return tg::testing::run_model(m, compiled, fuse, steps);
}

template <class T>
void fuses_the_pairs_bit_for_bit(const std::string& dtype) {
  std::optional<DefaultPairs> env(std::in_place);
  const Trained eager = train<T>(false, true), fused = train<T>(true, true);
  // on the CPU linear -> gelu_tanh stays as written (its fused op runs the same kernels, and keeps more memory)
  std::vector<std::string> want = {"dropout -> add [4,32,64] " + dtype + " as dropout_add",
                                   "add -> layernorm [4,32,64] " + dtype + " as add_layernorm",
                                   "dropout -> add [4,32,64] " + dtype + " as dropout_add"};
  EXPECT_EQ(fused.pairs, want);
  EXPECT_EQ(fused.chains, 0u);
  // the fused capture ran the fused ops in place of the pairs (the plain one ran the pairs)
  EXPECT_EQ(count(fused.ops, "dropout_add"), 2u);
  EXPECT_EQ(count(fused.ops, "add_layernorm"), 1u);
  EXPECT_EQ(count(fused.ops, "dropout"), 0u);
  EXPECT_EQ(count(fused.ops, "layernorm"), 0u);
  EXPECT_EQ(count(fused.ops, "gelu_tanh"), 1u);
  for (std::size_t i = 1; i < eager.losses.size(); ++i) EXPECT_NE(eager.losses[i], eager.losses[0]);  // it trains
  expect_bitwise(fused, eager, dtype.c_str());
  // from the third call (the second captured the fused step) no allocator call
  for (std::size_t i = 2; i < fused.allocations.size(); ++i) EXPECT_EQ(fused.allocations[i], 0) << "step " << i;
  // and the fused capture's plan predicts the replays' peak within 5%
  tg::testing::expect_plan_predicts_peak(fused);
  // the fused step allocates no dropped-out branch: its plan is at most the plain compiled step's (both captured
  // with the optimizer's state in place)
  const Trained plain = train<T>(true, false, 4, true), warm = train<T>(true, true, 4, true);
  EXPECT_TRUE(plain.pairs.empty());
  EXPECT_EQ(count(plain.ops, "dropout"), 2u);
  EXPECT_EQ(count(plain.ops, "layernorm"), 1u);
  EXPECT_EQ(warm.pairs, want);
  EXPECT_LE(warm.plan.peak_bytes(), plain.plan.peak_bytes()) << warm.plan.describe() << plain.plan.describe();
  EXPECT_LE(warm.plan.arena_bytes, plain.plan.arena_bytes) << warm.plan.describe() << plain.plan.describe();
  // the GPU's pair too, which on the CPU runs the same kernels: still the eager step bit for bit
  env.reset();
  EveryDevice all;
  const Trained every = train<T>(true, true);
  EXPECT_EQ(count(every.ops, "linear_gelu_tanh"), 1u);
  EXPECT_EQ(count(every.ops, "gelu_tanh"), 0u);
  want.insert(want.begin(), "linear -> gelu_tanh [4,32,256] " + dtype + " as linear_gelu_tanh");
  EXPECT_EQ(every.pairs, want);
  expect_bitwise(every, eager, (dtype + " with linear_gelu_tanh").c_str());
  for (std::size_t i = 2; i < every.allocations.size(); ++i) EXPECT_EQ(every.allocations[i], 0) << "step " << i;
}

TEST(CompilePairs, Fp32PairsRunAsTheirFusedOpsBitForBit) { fuses_the_pairs_bit_for_bit<float>("fp32"); }
TEST(CompilePairs, Bf16PairsRunAsTheirFusedOpsBitForBit) { fuses_the_pairs_bit_for_bit<tg::bf16>("bf16"); }

TEST(CompilePairs, TgFusePairsTakesAllOrNothing) {
  std::optional<FusePairsEnv> env(std::in_place, "some");
  Block<float> m;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); },
                       tg::CompileOptions{.verbose = false});
  try {
    c(m.input(0), m.targets(0));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("TG_FUSE_PAIRS must be 'all' (or unset), got 'some'"), std::string::npos) << e.what();
  }
  env.reset();
  const DefaultPairs unset;
  EXPECT_TRUE(std::isfinite(c(m.input(1), m.targets(1))));
}

TEST(CompilePairs, ReadingADroppedOutValueIsAnError) {
  const DefaultPairs env;
  Block<float> m;
  m.read_dropped = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); },
                       tg::CompileOptions{.verbose = false});
  c(m.input(0), m.targets(0));  // found: the host read is not an op, so the dropout is a pair's producer
  try {
    c(m.input(1), m.targets(1));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the pair dropout -> add [4,32,64] fp32 as dropout_add"), std::string::npos) << msg;
    EXPECT_NE(msg.find("never stores"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CompileOptions{.fuse = false}"), std::string::npos) << msg;
  }
}

TEST(CompilePairs, AConsumerThatChangesIsAnErrorThenTheStepRunsUnfused) {
  EveryDevice all;
  Block<float> m, ref;
  m.relu_at_4 = ref.relu_at_4 = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); });
  testing::internal::CaptureStderr();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(c(m.input(k), m.targets(k)), ref.step(ref.input(k), ref.targets(k))) << "call " << k;
  EXPECT_EQ(c.fused_pairs().size(), 4u);
  try {
    c(m.input(3), m.targets(3));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'relu' [4,32,256] fp32 ran right after the pair's first op where the captured step ran its consumer"),
              std::string::npos) << msg;
    EXPECT_NE(msg.find("fused pair 0: linear -> gelu_tanh"), std::string::npos) << msg;
    EXPECT_NE(msg.find("its ops depend on its data"), std::string::npos) << msg;
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tg::compile: fusing 4 pairs of ops into fused ops (the first: linear -> gelu_tanh"), std::string::npos) << err;
  EXPECT_NE(err.find("this signature is captured again without fusion"), std::string::npos) << err;
  // the failed call stopped before its optimizer step; the reference skips that call's step as well
  ref.calls = m.calls;
  for (int k = 4; k < 7; ++k) EXPECT_EQ(c(m.input(k), m.targets(k)), ref.step(ref.input(k), ref.targets(k))) << "call " << k;
  EXPECT_TRUE(c.fused_pairs().empty());
  EXPECT_TRUE(c.last_replay().ok) << c.last_replay().divergence;
}

TEST(CompilePairs, AnOpRecordedBetweenThePairIsAnError) {
  const DefaultPairs env;
  Block<float> m;
  m.sum_between_at_4 = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); },
                       tg::CompileOptions{.verbose = false});
  for (int k = 0; k < 3; ++k) c(m.input(k), m.targets(k));
  ASSERT_EQ(c.fused_pairs().size(), 3u);
  try {
    c(m.input(3), m.targets(3));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("op 'sum' was recorded between the pair's ops (fused pair 1: add -> layernorm [4,32,64] fp32 as add_layernorm)"),
              std::string::npos) << msg;
  }
  for (int k = 4; k < 7; ++k) EXPECT_TRUE(std::isfinite(c(m.input(k), m.targets(k))));
  EXPECT_TRUE(c.fused_pairs().empty());  // captured again without fusion
  EXPECT_TRUE(c.last_replay().ok) << c.last_replay().divergence;
}

}  // namespace

}  // namespace test_pair_fusion_cpp

// tg::compile's rewrite of a hand-written attention's scale, mask and softmax (Note [pair rewrites], Note [fused scale,
// mask and softmax]): a one-layer attention model written with separate ops, trained 20 AdamW steps compiled with
// fusion against the same steps run eagerly. Each form (attention_composite's mul, masked_fill and softmax; a
// div by sqrt(hs); no mask; no scale) runs as scale_masked_softmax, bit for bit on the CPU in fp32 and bf16, with
// no allocator call once fused and a smaller plan (the scores are not kept); a form that changes between calls
// and a host read of a pending value are errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "compile/fusion_test_util.hpp"

namespace test_attention_fusion_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::Tensor;
using Trained = tg::testing::FusionRun;
using tg::testing::count;

enum class Form { composite, divide, no_mask, no_scale };

/// qkv projection, causal attention written with separate ops, output projection, a head with cross-entropy.
template <class T>
struct Attn {
  static constexpr std::int64_t B = 2, S = 32, C = 32, H = 4, hs = C / H, V = 48;  // hs 8: 1/sqrt(8) is inexact
  Form form;
  int calls = 0;
  int change_at = 0;         // from this call on, log_softmax replaces softmax (another consumer)
  bool read_masked = false;  // reads the masked scores on the host (an error when fused)
  tg::Generator init{9};
  std::vector<tg::optim::Param> ps;
  std::unique_ptr<tg::optim::AdamW> opt;

  explicit Attn(Form f) : form(f) {
    auto w = [&](tg::Shape s, float sd) { return Tensor<float>::normal(s, 0.f, sd, init); };
    const std::vector<Tensor<float>> m = {w({C, C}, 0.2f), w({3 * C, C}, 0.2f), w({3 * C}, 0.02f), w({C, C}, 0.1f), w({V, C}, 0.1f)};
    const char* names[] = {"we", "wqkv", "bqkv", "wo", "wout"};
    for (std::size_t i = 0; i < m.size(); ++i) ps.push_back({names[i], m[i]});
    opt = std::make_unique<tg::optim::AdamW>(tg::optim::default_groups(ps, 0.01f), tg::optim::AdamWOptions{.lr = 3e-3f, .beta2 = 0.95f});
  }
  Tensor<float> input(int k) const {
    tg::Generator g(200 + static_cast<std::uint64_t>(k));
    return Tensor<float>::normal({B, S, C}, 0.f, 1.f, g);
  }
  Tensor<std::int64_t> targets(int k) const {
    std::vector<std::int64_t> t(static_cast<std::size_t>(B * S));
    for (std::size_t i = 0; i < t.size(); ++i) t[i] = static_cast<std::int64_t>((i * 29 + static_cast<std::size_t>(k) * 7) % V);
    return Tensor<std::int64_t>::from_vector({B, S}, t);
  }
  Tensor<T> probabilities(const Tensor<T>& att) const {
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    const Tensor<std::uint8_t> mask = tg::causal_mask(S);
    Tensor<T> v;
    switch (form) {
      case Form::composite: v = tg::masked_fill(tg::mul(att, scale), mask, -INFINITY); break;
      case Form::divide: v = tg::masked_fill(tg::div(att, std::sqrt(static_cast<double>(hs))), mask, -INFINITY); break;
      case Form::no_mask: v = tg::mul(att, scale); break;
      case Form::no_scale: v = tg::masked_fill(att, mask, -1e4); break;
    }
    if (read_masked) (void)v.to_vector();
    return change_at && calls >= change_at ? tg::exp(tg::log_softmax(v)) : tg::softmax(v);
  }
  double step(const Tensor<float>& x, const Tensor<std::int64_t>& y) {
    ++calls;
    opt->zero_grad();
    std::vector<Tensor<T>> w;
    for (const auto& q : ps) w.push_back(q.tensor.template to<T>());
    const Tensor<T> e = tg::linear(x.to<T>(), w[0]);
    const Tensor<T> qkv = tg::linear(e, w[1], w[2]);
    auto heads = [&](std::int64_t part) { return qkv.narrow(2, part * C, C).reshape({B, S, H, hs}).transpose(1, 2).contiguous(); };
    const Tensor<T> q = heads(0), k = heads(1), v = heads(2);
    Tensor<T> a;
    if (form == Form::composite && !read_masked && !change_at) {
      a = tg::attention_composite(q, k, v);  // the library's own composite
    } else {
      a = tg::matmul(probabilities(tg::matmul(q, k.transpose(-2, -1))), v);
    }
    const Tensor<T> o = tg::add(e, tg::linear(a.transpose(1, 2).reshape({B, S, C}), w[3]));
    const Tensor<float> loss = tg::cross_entropy_as<float>(tg::linear(o, w[4]), y);
    loss.backward();
    opt->step();
    opt->zero_grad();
    return static_cast<double>(loss.item());
  }
};

template <class T>
Trained train(Form form, bool compiled, bool fuse, int steps = 20, bool warm = false) {
  Attn<T> m(form);
  if (warm) m.step(m.input(99), m.targets(99));
  return tg::testing::run_model(m, compiled, fuse, steps);
}

template <class T>
void runs_as_the_fused_op_bit_for_bit(Form form, const std::string& pattern, const std::string& dtype) {
  const Trained eager = train<T>(form, false, true), fused = train<T>(form, true, true);
  const std::vector<std::string> want = {pattern + " [2,4,32,32] " + dtype + " as scale_masked_softmax"};
  EXPECT_EQ(fused.pairs, want);
  EXPECT_EQ(count(fused.ops, "scale_masked_softmax"), 1u);
  EXPECT_EQ(count(fused.ops, "softmax"), 0u);
  EXPECT_EQ(count(fused.ops, "masked_fill"), 0u);
  for (std::size_t i = 1; i < eager.losses.size(); ++i) EXPECT_NE(eager.losses[i], eager.losses[0]);  // it trains
  tg::testing::expect_bitwise(fused, eager, pattern + ' ' + dtype);
  for (std::size_t i = 2; i < fused.allocations.size(); ++i) EXPECT_EQ(fused.allocations[i], 0) << "step " << i;
  // the fused capture's plan predicts its replays' peak (the arena is its own block, not the larger one the
  // first capture's arena left in the allocator's cache): within 5%
  tg::testing::expect_plan_predicts_peak(fused);
  // neither the scaled nor the masked scores are stored: mul keeps its input (the scores) for its backward, the
  // fused op does not, so with a scale the plan is smaller than the plain compiled step's (and never larger)
  const Trained plain = train<T>(form, true, false, 4, true), warm = train<T>(form, true, true, 4, true);
  EXPECT_TRUE(plain.pairs.empty());
  EXPECT_EQ(count(plain.ops, "softmax"), 1u);
  EXPECT_EQ(warm.pairs, want);
  if (form == Form::no_scale) EXPECT_LE(warm.plan.peak_bytes(), plain.plan.peak_bytes()) << warm.plan.describe() << plain.plan.describe();
  else EXPECT_LT(warm.plan.peak_bytes(), plain.plan.peak_bytes()) << warm.plan.describe() << plain.plan.describe();
}

TEST(CompileAttention, CompositeRunsAsScaleMaskedSoftmaxBitForBit) {
  runs_as_the_fused_op_bit_for_bit<float>(Form::composite, "mul -> masked_fill -> softmax", "fp32");
  runs_as_the_fused_op_bit_for_bit<tg::bf16>(Form::composite, "mul -> masked_fill -> softmax", "bf16");
}
TEST(CompileAttention, DivisionRunsAsScaleMaskedSoftmaxBitForBit) {
  runs_as_the_fused_op_bit_for_bit<float>(Form::divide, "div -> masked_fill -> softmax", "fp32");
  runs_as_the_fused_op_bit_for_bit<tg::bf16>(Form::divide, "div -> masked_fill -> softmax", "bf16");
}
TEST(CompileAttention, ScaleOrMaskAloneRunsAsScaleMaskedSoftmaxBitForBit) {
  runs_as_the_fused_op_bit_for_bit<float>(Form::no_mask, "mul -> softmax", "fp32");
  runs_as_the_fused_op_bit_for_bit<float>(Form::no_scale, "masked_fill -> softmax", "fp32");
  runs_as_the_fused_op_bit_for_bit<tg::bf16>(Form::no_scale, "masked_fill -> softmax", "bf16");
}

TEST(CompileAttention, AConsumerThatChangesIsAnErrorThenTheStepRunsUnfused) {
  Attn<float> m(Form::composite), ref(Form::composite);
  m.change_at = ref.change_at = 4;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); });
  testing::internal::CaptureStderr();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(c(m.input(k), m.targets(k)), ref.step(ref.input(k), ref.targets(k))) << "call " << k;
  ASSERT_EQ(c.fused_pairs().size(), 1u);
  try {
    c(m.input(3), m.targets(3));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    // log_softmax has no hook: it reads the masked scores, which the fused op never stores
    EXPECT_NE(msg.find("this tensor is the value of the pair mul -> masked_fill -> softmax [2,4,32,32] fp32 as scale_masked_softmax, "
                       "which the fused op never stores"),
              std::string::npos) << msg;
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("this signature is captured again without fusion"), std::string::npos) << err;
  ref.calls = m.calls;
  for (int k = 4; k < 7; ++k) EXPECT_EQ(c(m.input(k), m.targets(k)), ref.step(ref.input(k), ref.targets(k))) << "call " << k;
  EXPECT_TRUE(c.fused_pairs().empty());
  EXPECT_TRUE(c.last_replay().ok) << c.last_replay().divergence;
}

TEST(CompileAttention, ReadingTheMaskedScoresIsAnError) {
  Attn<float> m(Form::composite);
  m.read_masked = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); },
                       tg::CompileOptions{.verbose = false});
  c(m.input(0), m.targets(0));  // found: the host read is not an op
  try {
    c(m.input(1), m.targets(1));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the pair mul -> masked_fill -> softmax [2,4,32,32] fp32 as scale_masked_softmax"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CompileOptions{.fuse = false}"), std::string::npos) << msg;
  }
}

}  // namespace

}  // namespace test_attention_fusion_cpp

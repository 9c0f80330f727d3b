// tg::compile's fusion rewrite (Note [fusion rewrites]): a user's model written with separate elementwise ops
// (a hand-written GELU, a squared error) trained 20 AdamW steps compiled with fusion against the same steps run
// eagerly (fp32 and bf16, within a stated tolerance), the chains it finds, the memory it saves, no allocator call
// once fused, bitwise equality with fusion off, and the errors: a chain's intermediate read outside an op, and a
// step whose chain changes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace test_fusion_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::Tensor;

/// A two-layer MLP whose activation and loss are written as separate ops, its AdamW, and one training step.
/// T: the compute type (the fp32 masters are cast to it, as mixed precision does).
template <class T>
struct Mlp {
  static constexpr std::int64_t B = 4, S = 64, C = 64, H = 256;
  tg::Generator gen{21};
  Tensor<float> w1 = Tensor<float>::normal({C, H}, 0.f, 0.05f, gen), b1 = Tensor<float>::normal({H}, 0.f, 0.05f, gen),
                w2 = Tensor<float>::normal({H, C}, 0.f, 0.05f, gen);
  std::vector<tg::optim::Param> ps{{"w1", w1}, {"b1", b1}, {"w2", w2}};
  tg::optim::AdamW opt{tg::optim::default_groups(ps, 0.f), {.lr = 3e-3f, .beta2 = 0.95f}};
  int calls = 0;
  bool read_intermediate = false;  // reads the tanh's value on the host (an error when fused)
  bool change_at_4 = false;        // the 4th call's activation is another chain

  Tensor<float> input(int k) const {
    tg::Generator g(100 + static_cast<std::uint64_t>(k));
    return Tensor<float>::normal({B, S, C}, 0.f, 1.f, g);
  }
  double step(const Tensor<float>& x, const Tensor<float>& y) {
    ++calls;
    opt.zero_grad();
    const Tensor<float>&w1p = ps[0].tensor, &b1p = ps[1].tensor, &w2p = ps[2].tensor;  // the leaves (requiring grad)
    const Tensor<T> h = tg::add(tg::matmul(x.to<T>(), w1p.to<T>()), b1p.to<T>());
    Tensor<T> act;
    if (change_at_4 && calls == 4) {
      act = tg::sigmoid(h) * h;
    } else {
      const Tensor<T> t = tg::tanh(0.7978845608028654 * (h + 0.044715 * h * h * h));
      if (read_intermediate) (void)t.to_vector();
      act = 0.5 * h * (1.0 + t);
    }
    const Tensor<float> out = tg::matmul(act, w2p.to<T>()).template to<float>();
    const Tensor<float> d = out - y;
    const Tensor<float> loss = tg::sum(d * d) * (1.0 / static_cast<double>(d.numel()));
    loss.backward();
    opt.step();
    opt.zero_grad();  // the gradients die with the step (as TrainStep's do), so the arena holds them too
    return static_cast<double>(loss.item());
  }
};

struct Trained {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
  std::vector<std::int64_t> allocations;
  std::int64_t peak = 0;  // the last step's allocator peak
  std::vector<tg::capture::FusedChain> chains;
  tg::capture::MemoryPlan plan;
};

template <class T>
Trained train(bool compiled, bool fuse, int steps = 20) {
  Mlp<T> m;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return m.step(x, y); },
                       tg::CompileOptions{.verbose = false, .fuse = fuse});
  Trained r;
  auto& a = tg::allocator<tg::cpu>();
  for (int k = 0; k < steps; ++k) {
    const Tensor<float> x = m.input(2 * k), y = m.input(2 * k + 1);
    const std::int64_t before = a.stats().allocations;
    a.reset_peak();
    r.losses.push_back(compiled ? c(x, y) : m.step(x, y));
    r.allocations.push_back(a.stats().allocations - before);
    r.peak = a.stats().peak_bytes;
  }
  for (const auto& p : m.ps) r.weights.push_back(p.tensor.to_vector());
  r.chains = c.fused_chains();
  r.plan = c.memory_plan();
  return r;
}

void expect_close(const Trained& got, const Trained& ref, double tol, const char* what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * std::abs(ref.losses[i])) << what << ": step " << i;
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    for (std::size_t i = 0; i < ref.weights[t].size(); ++i)
      ASSERT_NEAR(got.weights[t][i], ref.weights[t][i], tol * (1 + std::abs(ref.weights[t][i]))) << what << ": tensor " << t << " at " << i;
}

TEST(CompileFusion, FusesAHandWrittenGeluAndTheSquaredError) {
  const Trained eager = train<float>(false, true), fused = train<float>(true, true);
  ASSERT_EQ(fused.chains.size(), 2u);
  // the bias add and the GELU's nine ops over [4, 64, 256]; the error's sub and mul over [4, 64, 64]
  EXPECT_EQ(fused.chains[0].links.size(), 10u) << fused.chains[0].describe();
  EXPECT_EQ(fused.chains[0].describe().substr(0, 10), "add -> mul") << fused.chains[0].describe();
  EXPECT_NE(fused.chains[0].describe().find("tanh"), std::string::npos) << fused.chains[0].describe();
  EXPECT_NE(fused.chains[0].describe().find("[4,64,256] fp32"), std::string::npos) << fused.chains[0].describe();
  EXPECT_EQ(fused.chains[1].describe(), "sub -> mul [4,64,64] fp32");
  // fp32: the forward is the unfused ops' bit for bit; the gradients differ in the order of their additions
  expect_close(fused, eager, 2e-5, "fp32");
  // from the third call (the second captured the fused step) no allocator call
  for (std::size_t i = 2; i < fused.allocations.size(); ++i) EXPECT_EQ(fused.allocations[i], 0) << "step " << i;
  // the fused step keeps the GELU's input where the ops kept every intermediate: its plan against the plan of
  // the same step compiled without fusion (the allocator's measured peak may show a larger cached block
  // serving the arena, so the plans are compared)
  const Trained plain = train<float>(true, false);
  EXPECT_LT(fused.plan.activation_bytes * 3, plain.plan.activation_bytes) << fused.plan.describe() << plain.plan.describe();
  EXPECT_LT(fused.plan.peak_bytes() * 10, plain.plan.peak_bytes() * 7) << fused.plan.describe() << plain.plan.describe();
  std::printf("[ fusion ] planned: activations %lld -> %lld bytes, peak %lld -> %lld bytes; eager measured peak %lld\n",
              static_cast<long long>(plain.plan.activation_bytes), static_cast<long long>(fused.plan.activation_bytes),
              static_cast<long long>(plain.plan.peak_bytes()), static_cast<long long>(fused.plan.peak_bytes()), static_cast<long long>(eager.peak));
}

TEST(CompileFusion, Bf16WithinItsRounding) {
  const Trained eager = train<tg::bf16>(false, true), fused = train<tg::bf16>(true, true);
  ASSERT_EQ(fused.chains.size(), 2u);
  EXPECT_NE(fused.chains[0].describe().find("bf16"), std::string::npos) << fused.chains[0].describe();
  // the fused chain skips the ops' nine intermediate bf16 roundings: the losses stay within bf16's resolution
  expect_close(fused, eager, 2e-2, "bf16");
}

TEST(CompileFusion, OffIsTheEagerStepBitForBit) {
  const Trained eager = train<float>(false, false, 6), plain = train<float>(true, false, 6);
  EXPECT_TRUE(plain.chains.empty());
  for (std::size_t i = 0; i < eager.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&plain.losses[i], &eager.losses[i], sizeof(double)), 0) << "step " << i;
  for (std::size_t t = 0; t < eager.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(plain.weights[t].data(), eager.weights[t].data(), eager.weights[t].size() * sizeof(float)), 0) << "tensor " << t;
}

TEST(CompileFusion, ReadingAnIntermediateIsAnError) {
  Mlp<float> m;
  m.read_intermediate = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return m.step(x, y); }, tg::CompileOptions{.verbose = false});
  c(m.input(0), m.input(1));  // found: the host read is not an op, so the tanh is a link of the chain
  try {
    c(m.input(2), m.input(3));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'tanh' [4,64,256] fp32"), std::string::npos) << msg;
    EXPECT_NE(msg.find("never computed"), std::string::npos) << msg;
    EXPECT_NE(msg.find("CompileOptions{.fuse = false}"), std::string::npos) << msg;
  }
  // without fusion the same step compiles and replays
  Mlp<float> plain;
  plain.read_intermediate = true;
  auto p = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return plain.step(x, y); },
                       tg::CompileOptions{.verbose = false, .fuse = false});
  for (int k = 0; k < 3; ++k) EXPECT_TRUE(std::isfinite(p(plain.input(2 * k), plain.input(2 * k + 1))));
}

TEST(CompileFusion, AChainThatChangesIsAnError) {
  Mlp<float> m;
  m.change_at_4 = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return m.step(x, y); }, tg::CompileOptions{.verbose = false});
  for (int k = 0; k < 3; ++k) c(m.input(2 * k), m.input(2 * k + 1));
  try {
    c(m.input(6), m.input(7));
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("tg::compile: fusion: link 1 is 'sigmoid'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("its ops depend on its data"), std::string::npos) << msg;
  }
}

TEST(CompileFusion, AFailedFusedStepIsCapturedAgainWithoutFusion) {
  Mlp<float> m;
  m.change_at_4 = true;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return m.step(x, y); });
  testing::internal::CaptureStderr();
  for (int k = 0; k < 3; ++k) c(m.input(2 * k), m.input(2 * k + 1));
  EXPECT_THROW(c(m.input(6), m.input(7)), tg::Error);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("this signature is captured again without fusion"), std::string::npos) << err;
  for (int k = 4; k < 7; ++k) EXPECT_TRUE(std::isfinite(c(m.input(2 * k), m.input(2 * k + 1))));
  EXPECT_TRUE(c.fused_chains().empty());
  EXPECT_TRUE(c.last_replay().ok) << c.last_replay().divergence;
}

// Values a chain must not take over, or must take over as they are: a detached link value (a straight-through
// estimator: no gradient may flow through it), a tensor next to its own detach (two inputs, not one), a
// constant computed by an elementwise op, and a constant of higher rank (the result keeps the ops' shape).
TEST(CompileFusion, DetachesAndConstantsAsTheOpsHaveThem) {
  tg::Generator gen(8);
  const Tensor<float> x0 = Tensor<float>::normal({16, 128}, 0.f, 1.f, gen), q0 = Tensor<float>::normal({16, 128}, 0.f, 1.f, gen);
  const Tensor<float> c = Tensor<float>::full({}, 0.3f), wide = Tensor<float>::full({1, 1, 1}, 1.5f);
  auto step = [&](std::vector<std::vector<float>>* out) {
    Tensor<float> x = x0.clone().detach(), q = q0.clone().detach();
    x.requires_grad_();
    q.requires_grad_();
    const Tensor<float> ste = x + (tg::tanh(q) - x).detach();               // forward tanh(q), gradient to x only
    const Tensor<float> gate = tg::mul(tg::sigmoid(x.detach()) * 2.0, x);    // x and x.detach(): two inputs
    const Tensor<float> k = tg::exp(c);                                      // a constant made by an op
    const Tensor<float> lifted = tg::exp(tg::mul(x, wide)) * k;              // [1,16,128] after the ops
    EXPECT_EQ(lifted.shape(), tg::Shape({1, 16, 128}));
    const Tensor<float> loss = tg::sum(ste * ste) + tg::sum(gate) + tg::sum(lifted);
    loss.backward();
    *out = {ste.to_vector(), gate.to_vector(), lifted.to_vector(), x.grad().to_vector(), q.grad().defined() ? q.grad().to_vector() : std::vector<float>{}};
    return static_cast<double>(loss.item());
  };
  std::vector<std::vector<float>> eager, fused;
  const double l0 = step(&eager);
  EXPECT_TRUE(eager[4].empty());  // no gradient reaches q through the detach
  auto compiled = tg::compile([&] { return step(&fused); }, tg::CompileOptions{.verbose = false});
  for (int call = 0; call < 4; ++call) {
    const double l = compiled();
    EXPECT_NEAR(l, l0, 1e-5 * std::abs(l0)) << "call " << call;
    ASSERT_EQ(fused.size(), eager.size());
    for (std::size_t t = 0; t < eager.size(); ++t) {
      ASSERT_EQ(fused[t].size(), eager[t].size()) << "call " << call << " tensor " << t;
      for (std::size_t i = 0; i < eager[t].size(); ++i)
        ASSERT_NEAR(fused[t][i], eager[t][i], 1e-5 * (1 + std::abs(eager[t][i]))) << "call " << call << " tensor " << t << " at " << i;
    }
  }
  std::string chains;
  for (const auto& ch : compiled.fused_chains()) chains += ch.describe() + "; ";
  // tanh -> sub ends where its value is detached; the straight-through add is read later (not a link);
  // sigmoid -> mul -> mul over x.detach() and x; mul -> exp -> mul with the constants [1,1,1] and e^0.3
  EXPECT_EQ(chains, "tanh -> sub [16,128] fp32; sigmoid -> mul -> mul [16,128] fp32; mul -> exp -> mul [1,16,128] fp32; ");
  EXPECT_TRUE(compiled.last_replay().ok) << compiled.last_replay().divergence;
  // a fused step called under NoGrad is another signature, whose ops run as written
  auto forward_only = [&] {
    const Tensor<float> y = tg::exp(tg::mul(x0, wide)) * tg::exp(c);
    return static_cast<double>(tg::sum(y).item());
  };
  const double f0 = forward_only();
  auto fwd = tg::compile(forward_only, tg::CompileOptions{.verbose = false});
  for (int call = 0; call < 3; ++call) EXPECT_NEAR(fwd(), f0, 1e-6 * std::abs(f0));
  EXPECT_EQ(fwd.fused_chains().size(), 1u);
  tg::NoGrad off;
  for (int call = 0; call < 3; ++call) EXPECT_NEAR(fwd(), f0, 1e-6 * std::abs(f0));
  EXPECT_TRUE(fwd.fused_chains().empty());
  EXPECT_EQ(fwd.variants(), 2u);
}

TEST(CompileFusion, ReportsTheChainsOnce) {
  Mlp<float> m;
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<float>& y) { return m.step(x, y); });
  testing::internal::CaptureStderr();
  for (int k = 0; k < 4; ++k) c(m.input(2 * k), m.input(2 * k + 1));
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tg::compile: fusing 2 chains of elementwise ops (12 ops; the first: add -> mul"), std::string::npos) << err;
  EXPECT_EQ(err.find("tg::compile: fusing", err.find("tg::compile: fusing") + 1), std::string::npos) << err;
  EXPECT_EQ(c.captures(), 2);  // found, then fused
  EXPECT_EQ(c.replays(), 2);
}

}  // namespace

}  // namespace test_fusion_cpp

// LAMB and Adafactor vs plain fp64 implementations of the papers' equations (written here, independent of
// the library's kernels); parameter groups, zero_grad, skipped parameters, state round trips, the no-
// allocation steady state, and argument errors, for every optimizer.
#include <functional>
#include <memory>
#include <numeric>

#include "optim/optim_test_util.hpp"

namespace tg::optim::testing {
namespace test_optimizers_cpp {  // the file's own names (Note [unity test sources])

constexpr double kTol = 1e-5;

// ---- fp64 references ----------------------------------------------------------------------------
// You et al. 2019, Algorithm 2 (φ = identity).
struct LambRef {
  std::vector<double> p, m, v;
  int t = 0;
  explicit LambRef(std::vector<double> init) : p(std::move(init)), m(p.size(), 0.0), v(p.size(), 0.0) {}
  void step(const std::vector<double>& g, double lr, double b1, double b2, double eps, double wd) {
    ++t;
    std::vector<double> u(p.size());
    double pn = 0, un = 0;
    for (std::size_t i = 0; i < p.size(); ++i) {
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * g[i] * g[i];
      const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
      u[i] = mh / (std::sqrt(vh) + eps) + wd * p[i];
      pn += p[i] * p[i];
      un += u[i] * u[i];
    }
    const double r = (pn == 0 || un == 0) ? 1.0 : std::sqrt(pn) / std::sqrt(un);
    for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * r * u[i];
  }
};

// Shazeer & Stern 2018, Algorithms 4 / 5 with relative steps and update clipping.
struct AdafactorRef {
  std::vector<double> p, R, C, V, M;
  std::int64_t rows = 1, cols = 1;
  bool factored = false;
  int t = 0;
  AdafactorRef(std::vector<double> init, const Shape& shape) : p(std::move(init)) {
    factored = shape.size() >= 2;
    if (factored) {
      cols = shape.back();
      rows = static_cast<std::int64_t>(p.size()) / cols;
      R.assign(rows, 0.0);
      C.assign(cols, 0.0);
    } else {
      V.assign(p.size(), 0.0);
    }
    M.assign(p.size(), 0.0);
  }
  static double rms(const std::vector<double>& x) {
    double s = 0;
    for (double e : x) s += e * e;
    return std::sqrt(s / static_cast<double>(x.size()));
  }
  void step(const std::vector<double>& g, const AdafactorOptions& o, double lr) {
    ++t;
    const double rho = o.relative_step ? std::min(lr, 1.0 / std::sqrt(double(t))) : lr;
    const double alpha = o.scale_parameter ? std::max(double(o.eps2), rms(p)) * rho : rho;
    const double b2 = 1.0 - std::pow(double(t), -double(o.decay_rate));
    const double e1 = o.eps1;
    std::vector<double> u(p.size());
    if (factored) {
      for (std::int64_t i = 0; i < rows; ++i) {
        double s = 0;
        for (std::int64_t j = 0; j < cols; ++j) s += g[i * cols + j] * g[i * cols + j] + e1;
        R[i] = b2 * R[i] + (1 - b2) * s;
      }
      for (std::int64_t j = 0; j < cols; ++j) {
        double s = 0;
        for (std::int64_t i = 0; i < rows; ++i) s += g[i * cols + j] * g[i * cols + j] + e1;
        C[j] = b2 * C[j] + (1 - b2) * s;
      }
      const double rsum = std::accumulate(R.begin(), R.end(), 0.0);
      for (std::int64_t i = 0; i < rows; ++i)
        for (std::int64_t j = 0; j < cols; ++j) u[i * cols + j] = g[i * cols + j] / std::sqrt(R[i] * C[j] / rsum);
    } else {
      for (std::size_t i = 0; i < p.size(); ++i) {
        V[i] = b2 * V[i] + (1 - b2) * (g[i] * g[i] + e1);
        u[i] = g[i] / std::sqrt(V[i]);
      }
    }
    const double clip = std::max(1.0, rms(u) / o.clip_threshold);
    for (std::size_t i = 0; i < p.size(); ++i) {
      double upd = u[i] / clip;
      if (o.beta1 > 0) upd = M[i] = o.beta1 * M[i] + (1 - o.beta1) * upd;
      p[i] = p[i] - alpha * o.weight_decay * p[i] - alpha * upd;
    }
  }
};

std::vector<Param> small_model(std::uint64_t seed) {
  return {make_param("h.0.attn.c_attn.weight", {6, 9}, seed), make_param("h.0.attn.c_attn.bias", {9}, seed + 1),
          make_param("h.0.mlp.c_proj.weight", {2, 3, 4}, seed + 2)};
}

TEST(OptimLamb, MatchesFp64ReferenceOverTenSteps) {
  for (float wd : {0.f, 0.05f}) {
    auto ps = small_model(11);
    std::vector<LambRef> ref;
    for (auto& p : ps) ref.emplace_back(as_doubles(p.tensor));
    Lamb opt(ps, {.lr = 0.02f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-6f, .weight_decay = wd});
    double worst = 0;
    for (int s = 0; s < 10; ++s) {
      for (std::size_t k = 0; k < ps.size(); ++k) {
        const auto g = random_like(ps[k], 100 * s + k, k == 1 ? 0.1f : 1.f);
        set_grad(ps[k], g);
        ref[k].step(as_doubles(g), 0.02, 0.9f, 0.99f, 1e-6f, wd);
      }
      opt.step();
      for (std::size_t k = 0; k < ps.size(); ++k) worst = std::max(worst, rel_err_inf(ps[k].tensor, ref[k].p));
    }
    EXPECT_LE(worst, kTol) << "weight_decay " << wd;
    std::cout << "[ optim ] LAMB (wd " << wd << ") max relative error vs fp64 reference: " << worst << "\n";
    EXPECT_GT(opt.last_trust_ratio("h.0.attn.c_attn.weight"), 0.0);
  }
}

TEST(OptimLamb, TrustRatioIsOneForAZeroParameter) {
  Param p("w", Tensor<fp32>::zeros({4, 4}));
  Lamb opt({p}, {.lr = 0.1f, .weight_decay = 0.f});
  set_grad(p, Tensor<fp32>::full({4, 4}, 2.0));
  opt.step();
  EXPECT_DOUBLE_EQ(opt.last_trust_ratio("w"), 1.0);
  // m̂ = g, v̂ = g², u = g/(|g| + ε) ≈ 1: p = −lr·1·u.
  for (float v : p.tensor.to_vector()) EXPECT_NEAR(v, -0.1f * 2.f / (2.f + 1e-6f), 1e-7f);
}

TEST(OptimAdafactor, MatchesFp64ReferenceOverTenSteps) {
  struct Case {
    const char* what;
    AdafactorOptions o;
  };
  const Case cases[] = {
      {"paper defaults", {}},
      {"first moment and decay", {.beta1 = 0.9f, .weight_decay = 0.01f}},
      {"absolute lr, no parameter scale", {.lr = 3e-2f, .relative_step = false, .scale_parameter = false}},
      {"tight update clipping", {.clip_threshold = 0.5f}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    auto ps = small_model(21);
    std::vector<AdafactorRef> ref;
    for (auto& p : ps) ref.emplace_back(as_doubles(p.tensor), p.tensor.shape());
    Adafactor opt(ps, c.o);
    double worst = 0;
    for (int s = 0; s < 10; ++s) {
      for (std::size_t k = 0; k < ps.size(); ++k) {
        const auto g = random_like(ps[k], 1000 + 100 * s + k, k == 2 ? 5.f : 1.f);
        set_grad(ps[k], g);
        ref[k].step(as_doubles(g), c.o, c.o.lr);
      }
      opt.step();
      for (std::size_t k = 0; k < ps.size(); ++k) worst = std::max(worst, rel_err_inf(ps[k].tensor, ref[k].p));
    }
    EXPECT_LE(worst, kTol);
    std::cout << "[ optim ] Adafactor (" << c.what << ") max relative error vs fp64 reference: " << worst << "\n";
  }
}

TEST(OptimAdafactor, FactoredStateIsRowsPlusColumns) {
  auto ps = small_model(3);
  Adafactor opt(ps, {});
  for (auto& p : ps) set_grad(p, random_like(p, 5));
  opt.step();
  std::map<std::string, Shape> shapes;
  for (auto& e : opt.state_tensors()) shapes[e.name] = e.tensor.shape();
  EXPECT_EQ(shapes.at("h.0.attn.c_attn.weight.exp_avg_sq_row"), (Shape{6}));
  EXPECT_EQ(shapes.at("h.0.attn.c_attn.weight.exp_avg_sq_col"), (Shape{9}));
  EXPECT_EQ(shapes.at("h.0.mlp.c_proj.weight.exp_avg_sq_row"), (Shape{6}));  // [2,3,4] viewed as [6,4]
  EXPECT_EQ(shapes.at("h.0.mlp.c_proj.weight.exp_avg_sq_col"), (Shape{4}));
  EXPECT_EQ(shapes.at("h.0.attn.c_attn.bias.exp_avg_sq"), (Shape{9}));
  EXPECT_FALSE(shapes.count("h.0.attn.c_attn.weight.exp_avg"));  // no first moment by default
}

// ---- behaviour shared by every optimizer ---------------------------------------------------------
using MakeOpt = std::function<std::unique_ptr<Optimizer>(std::vector<ParamGroup>)>;
struct Named {
  const char* name;
  MakeOpt make;
};
std::vector<Named> all_optimizers() {
  return {
      {"Sgd", [](auto g) { return std::make_unique<Sgd>(std::move(g), SgdOptions{.lr = 0.1f, .momentum = 0.9f, .nesterov = true, .weight_decay = 0.01f}); }},
      {"Adam", [](auto g) { return std::make_unique<Adam>(std::move(g), AdamOptions{.lr = 0.01f, .weight_decay = 0.01f}); }},
      {"AdamW", [](auto g) { return std::make_unique<AdamW>(std::move(g), AdamWOptions{.lr = 0.01f, .weight_decay = 0.1f}); }},
      {"Lamb", [](auto g) { return std::make_unique<Lamb>(std::move(g), LambOptions{.lr = 0.01f}); }},
      {"Adafactor", [](auto g) { return std::make_unique<Adafactor>(std::move(g), AdafactorOptions{.beta1 = 0.9f}); }},
  };
}
std::vector<ParamGroup> groups_of(std::vector<Param> ps) {
  std::vector<ParamGroup> g(1);
  g[0].params = std::move(ps);
  return g;
}
std::vector<Param> clone_params(const std::vector<Param>& ps) {
  std::vector<Param> out;
  for (auto& p : ps) out.emplace_back(p.name, Tensor<fp32>::from_vector(p.tensor.shape(), p.tensor.to_vector()));
  return out;
}

TEST(OptimAll, StateRoundTripContinuesIdentically) {
  for (const auto& o : all_optimizers()) {
    SCOPED_TRACE(o.name);
    auto a_ps = small_model(31);
    auto a = o.make(groups_of(a_ps));
    for (int s = 0; s < 3; ++s) {
      for (std::size_t k = 0; k < a_ps.size(); ++k) set_grad(a_ps[k], random_like(a_ps[k], 50 * s + k));
      a->step();
    }
    const auto saved = a->state_tensors();
    auto b_ps = clone_params(a_ps);
    auto b = o.make(groups_of(b_ps));
    b->load_state(saved);
    EXPECT_EQ(b->step_count(), 3);
    for (int s = 3; s < 6; ++s) {
      for (std::size_t k = 0; k < a_ps.size(); ++k) {
        const auto g = random_like(a_ps[k], 50 * s + k);
        set_grad(a_ps[k], g);
        set_grad(b_ps[k], g);
      }
      a->step();
      b->step();
    }
    for (std::size_t k = 0; k < a_ps.size(); ++k) EXPECT_EQ(a_ps[k].tensor.to_vector(), b_ps[k].tensor.to_vector()) << a_ps[k].name;
    const auto sa = a->state_tensors(), sb = b->state_tensors();
    ASSERT_EQ(sa.size(), sb.size());
    for (std::size_t i = 0; i < sa.size(); ++i) {
      EXPECT_EQ(sa[i].name, sb[i].name);
      EXPECT_EQ(sa[i].tensor.to_vector(), sb[i].tensor.to_vector()) << sa[i].name;
    }
  }
}

TEST(OptimAll, ParamsWithoutGradAreSkipped) {
  for (const auto& o : all_optimizers()) {
    SCOPED_TRACE(o.name);
    auto ps = small_model(41);
    auto opt = o.make(groups_of(ps));
    const auto before = ps[1].tensor.to_vector();
    const auto w_before = ps[0].tensor.to_vector();
    for (int s = 0; s < 2; ++s) {
      opt->zero_grad();
      set_grad(ps[0], random_like(ps[0], s));
      set_grad(ps[2], random_like(ps[2], s + 7));
      opt->step();
    }
    EXPECT_EQ(ps[1].tensor.to_vector(), before);
    EXPECT_NE(ps[0].tensor.to_vector(), w_before);
    EXPECT_EQ(opt->param_step_count(ps[1].name), 0);
    EXPECT_EQ(opt->param_step_count(ps[0].name), 2);
    for (auto& e : opt->state_tensors()) EXPECT_FALSE(e.name.starts_with(ps[1].name + ".")) << e.name;
  }
}

TEST(OptimAll, NoSystemAllocationsAfterTheFirstStep) {
  for (const auto& o : all_optimizers()) {
    SCOPED_TRACE(o.name);
    auto ps = small_model(51);
    auto opt = o.make(default_groups(ps, 0.1f));
    Generator gen(9);
    const auto x = Tensor<fp32>::normal({6, 9}, 0.f, 1.f, gen);
    auto iteration = [&] {
      // loss = mean((x·W + b)²) + mean(V²) with elementwise ops (W, V: weights, b: bias)
      auto h = tg::add(tg::mul(x, ps[0].tensor), ps[1].tensor);
      auto loss = tg::add(tg::mean(tg::mul(h, h)), tg::mean(tg::mul(ps[2].tensor, ps[2].tensor)));
      loss.backward();
      clip_grad_norm(*opt, 1.0);
      opt->step();
      opt->zero_grad();
    };
    // Two warm-up iterations: the first creates the optimizer state; in a fresh process the cache's
    // best-fit reuse (a block up to twice the request) can still shuffle sizes once in the second.
    iteration();
    iteration();
    const auto after_warmup = allocator<cpu>().stats().system_allocations;
    for (int i = 0; i < 5; ++i) iteration();
    EXPECT_EQ(allocator<cpu>().stats().system_allocations, after_warmup);
    EXPECT_EQ(opt->step_count(), 7);
  }
}

TEST(OptimAll, ZeroGradDropsOrZeroFillsGradients) {
  for (const auto& o : all_optimizers()) {
    SCOPED_TRACE(o.name);
    auto ps = small_model(61);
    auto opt = o.make(groups_of(ps));
    for (auto& p : ps) set_grad(p, random_like(p, 3));
    const float* buffer = ps[0].tensor.grad().data();
    opt->zero_grad(/*set_to_none=*/false);
    ASSERT_TRUE(ps[0].tensor.grad().defined());
    EXPECT_EQ(ps[0].tensor.grad().data(), buffer);  // same buffer, zero-filled
    for (auto& p : ps)
      for (float v : p.tensor.grad().to_vector()) EXPECT_EQ(v, 0.f);
    opt->zero_grad();
    for (auto& p : ps) EXPECT_FALSE(p.tensor.grad().defined());
  }
}

// ---- parameter groups ----------------------------------------------------------------------------
TEST(OptimParamGroups, DefaultGroupsPutBiasesNormsAndEmbeddingsInNoDecay) {
  std::vector<Param> ps{make_param("wte", {10, 4}, 1),           make_param("wpe", {8, 4}, 2),
                        make_param("h.0.ln_1.weight", {4}, 3),   make_param("h.0.ln_1.bias", {4}, 4),
                        make_param("h.0.attn.c_attn.weight", {4, 12}, 5), make_param("h.0.attn.c_attn.bias", {12}, 6),
                        make_param("ln_f.weight", {4}, 7),       make_param("h.0.mlp.c_fc.weight", {4, 16}, 8),
                        make_param("kiln.weight", {3, 3}, 9),    make_param("h.0.gain", {4}, 10)};
  const auto g = default_groups(ps, 0.1f);
  ASSERT_EQ(g.size(), 2u);
  std::vector<std::string> decay, no_decay;
  for (auto& p : g[0].params) decay.push_back(p.name);
  for (auto& p : g[1].params) no_decay.push_back(p.name);
  EXPECT_EQ(decay, (std::vector<std::string>{"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "kiln.weight"}));
  EXPECT_EQ(no_decay, (std::vector<std::string>{"wte", "wpe", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.0.attn.c_attn.bias",
                                                "ln_f.weight", "h.0.gain"}));
  EXPECT_EQ(g[0].weight_decay, 0.1f);
  EXPECT_EQ(g[1].weight_decay, 0.f);
}

TEST(OptimParamGroups, AdamWDecaysOnlyTheDecayGroup) {
  std::vector<Param> ps{make_param("h.0.mlp.c_fc.weight", {3, 4}, 1), make_param("h.0.mlp.c_fc.bias", {4}, 2)};
  const auto w0 = ps[0].tensor.to_vector(), b0 = ps[1].tensor.to_vector();
  AdamW opt(default_groups(ps, 0.5f), {.lr = 0.1f});
  EXPECT_EQ(opt.group_weight_decay(0), 0.5f);
  EXPECT_EQ(opt.group_weight_decay(1), 0.f);
  // Zero gradients: Adam's direction is 0, so only the decoupled decay p *= 1 − lr·λ moves anything.
  for (auto& p : ps) set_grad(p, Tensor<fp32>::zeros(p.tensor.shape()));
  opt.step();
  const auto w1 = ps[0].tensor.to_vector(), b1 = ps[1].tensor.to_vector();
  for (std::size_t i = 0; i < w0.size(); ++i) EXPECT_FLOAT_EQ(w1[i], w0[i] * (1.f - 0.1f * 0.5f));
  EXPECT_EQ(b1, b0);
}

TEST(OptimParamGroups, LrScaleAndPerGroupLr) {
  std::vector<Param> a{make_param("a.weight", {2, 2}, 1)}, b{make_param("b.weight", {2, 2}, 2)};
  std::vector<ParamGroup> groups{{a, 1.f, {}}, {b, 0.1f, {}}};
  Sgd opt(std::move(groups), {.lr = 1.f});
  EXPECT_FLOAT_EQ(opt.group_lr(0), 1.f);
  EXPECT_FLOAT_EQ(opt.group_lr(1), 0.1f);
  opt.set_lr(0.5f);
  EXPECT_FLOAT_EQ(opt.lr(), 0.5f);
  EXPECT_FLOAT_EQ(opt.group_lr(1), 0.05f);
  opt.set_group_lr(1, 2.f);
  const auto b0 = b[0].tensor.to_vector();
  set_grad(b[0], Tensor<fp32>::ones({2, 2}));
  opt.step();
  const auto b1 = b[0].tensor.to_vector();
  for (std::size_t i = 0; i < b0.size(); ++i) EXPECT_FLOAT_EQ(b1[i], b0[i] - 2.f);  // SGD: p −= lr·g
  EXPECT_THROW(opt.group_lr(2), Error);
}

// ---- errors --------------------------------------------------------------------------------------
TEST(OptimErrors, BadStateAndOptionsAreRejectedWithNames) {
  auto ps = small_model(71);
  Adam a(ps, {});
  for (auto& p : ps) set_grad(p, random_like(p, 1));
  a.step();
  auto state = a.state_tensors();
  auto expect_error = [](auto&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "no error; expected one containing '" << needle << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    Adam b(clone_params(ps), {});
    auto s = state;
    s.erase(std::find_if(s.begin(), s.end(), [](auto& e) { return e.name == "h.0.attn.c_attn.weight.exp_avg"; }));
    expect_error([&] { b.load_state(s); }, "missing entry 'h.0.attn.c_attn.weight.exp_avg'");
  }
  {
    Adam b(clone_params(ps), {});
    auto s = state;
    for (auto& e : s)
      if (e.name == "h.0.attn.c_attn.bias.exp_avg_sq") e.tensor = Tensor<fp32>::zeros({3});
    expect_error([&] { b.load_state(s); }, "'h.0.attn.c_attn.bias.exp_avg_sq' has shape [3], expected [9]");
  }
  {
    Adam b(clone_params(ps), {});
    auto s = state;
    s.push_back({"h.9.typo.exp_avg", Tensor<fp32>::zeros({1})});
    expect_error([&] { b.load_state(s); }, "unknown entry 'h.9.typo.exp_avg'");
  }
  expect_error([&] { Sgd s(clone_params(ps), {.momentum = 0.9f, .dampening = 0.1f, .nesterov = true}); }, "Nesterov");
  expect_error([&] { Sgd s(std::vector<Param>{ps[0], ps[0]}, {}); }, "appears twice");
  expect_error([&] { Param p("w", Tensor<fp32>::zeros({3, 4}).transpose(0, 1)); }, "contiguous");
}

}  // namespace test_optimizers_cpp
}  // namespace tg::optim::testing

// Sgd, Lamb and Adafactor's multi-tensor path (Note [device optimizers]: one kernel call per run of updates
// sharing lr, decay and step count; the code the GPU runs except for the element kernels) over
// default_groups, against the same optimizer over one group per parameter: bit for bit (decay and no-decay
// parameters, a parameter skipped on one step), the same state names, state round trips between the
// layouts with an identical continuation, clear errors on bad state, and clipping through the base class.
// The CUDA side is tests/cuda/test_cuda_optim.cpp and tests/cuda/test_cuda_train.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "optim/optim_test_util.hpp"

namespace test_optimizer_multi_tensor_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::optim::testing::make_param;
using tg::optim::testing::random_like;
using tg::optim::testing::set_grad;
using tg::optim::testing::by_name;
using tg::optim::testing::group_per_param;

/// A matrix, a 3-D weight, a bias and a LayerNorm gain: both decay groups, factored and full Adafactor
/// moments.
std::vector<tg::optim::Param> four_params(std::uint64_t seed) {
  return {make_param("h.0.mlp.c_fc.weight", {5, 7}, seed), make_param("h.0.attn.c_attn.weight", {2, 3, 4}, seed + 1),
          make_param("h.0.mlp.c_fc.bias", {5}, seed + 2), make_param("h.0.ln_1.weight", {7}, seed + 3)};
}
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const tg::Error& e) {
    return e.what();
  }
  return "(no error)";
}

/// One optimizer over one group per parameter (`ref`) and one over default_groups (`dev`), over copies of the
/// same parameters.
struct Pair {
  std::vector<tg::optim::Param> ref_params, dev_params;
  std::unique_ptr<tg::optim::Optimizer> ref;
  std::unique_ptr<tg::optim::Optimizer> dev;
  float base_lr = 0.f;
};
using Factory = std::function<Pair(std::uint64_t seed)>;

template <class Opt, class Options>
Factory factory(Options o, float weight_decay) {
  return [o, weight_decay](std::uint64_t seed) {
    Pair p;
    p.ref_params = four_params(seed);
    p.dev_params = four_params(seed);
    p.ref = std::make_unique<Opt>(group_per_param(p.ref_params, weight_decay), o);
    p.dev = std::make_unique<Opt>(tg::optim::default_groups(p.dev_params, weight_decay), o);
    p.base_lr = o.lr;
    return p;
  };
}
Factory sgd(bool nesterov, float momentum, float dampening) {
  return factory<tg::optim::Sgd>(
      tg::optim::SgdOptions{.lr = 0.05f, .momentum = momentum, .dampening = dampening, .nesterov = nesterov,
                            .weight_decay = 0.01f},
      0.01f);
}
Factory lamb() {
  return factory<tg::optim::Lamb>(tg::optim::LambOptions{.lr = 2e-2f, .weight_decay = 0.1f},
                                                                  0.1f);
}
Factory adafactor(float beta1, bool relative_step) {
  tg::optim::AdafactorOptions o;
  o.lr = relative_step ? 1e-2f : 3e-2f;
  o.beta1 = beta1;
  o.relative_step = relative_step;
  o.weight_decay = 0.05f;
  return factory<tg::optim::Adafactor>(o, 0.05f);
}

/// Gradients for step `step` (parameter 3 has none on step 1: it is skipped and its count lags).
void set_grads(Pair& p, int step) {
  for (std::size_t i = 0; i < p.ref_params.size(); ++i) {
    if (step == 1 && i == 3) continue;
    set_grad(p.ref_params[i], random_like(p.ref_params[i], 100 + 10 * step + i));
    set_grad(p.dev_params[i], random_like(p.dev_params[i], 100 + 10 * step + i));
  }
}
void step_both(Pair& p, int step) {
  set_grads(p, step);
  const float lr_scale = (1.f + static_cast<float>(step)) / 4.f;  // a schedule: lr changes every step
  p.ref->set_lr(p.base_lr * lr_scale);
  p.dev->set_lr(p.base_lr * lr_scale);
  p.ref->step();
  p.dev->step();
  p.ref->zero_grad();
  p.dev->zero_grad();
}
void expect_same_params(const Pair& p, const std::string& where) {
  for (std::size_t i = 0; i < p.ref_params.size(); ++i)
    EXPECT_EQ(p.dev_params[i].tensor.to_vector(), p.ref_params[i].tensor.to_vector()) << p.ref_params[i].name << " " << where;
}

void expect_matches_host(const Factory& make, const char* name) {
  Pair p = make(1);
  EXPECT_STREQ(p.dev->name(), name);
  EXPECT_EQ(p.dev->param_weight_decay("h.0.mlp.c_fc.weight"), p.ref->group_weight_decay(0));
  EXPECT_EQ(p.dev->param_weight_decay("h.0.mlp.c_fc.weight"), p.dev->group_weight_decay(0));
  EXPECT_EQ(p.dev->param_weight_decay("h.0.mlp.c_fc.bias"), 0.f);
  std::vector<std::vector<float>> before;
  for (auto& q : p.ref_params) before.push_back(q.tensor.to_vector());
  for (int step = 0; step < 5; ++step) {
    step_both(p, step);
    expect_same_params(p, "step " + std::to_string(step));
  }
  for (std::size_t i = 0; i < p.ref_params.size(); ++i)
    EXPECT_NE(p.ref_params[i].tensor.to_vector(), before[i]) << p.ref_params[i].name << " never moved";
  EXPECT_EQ(p.dev->step_count(), p.ref->step_count());
  EXPECT_EQ(p.dev->param_step_count("h.0.ln_1.weight"), 4);
  EXPECT_EQ(by_name(p.dev->state_tensors()), by_name(p.ref->state_tensors()));
}

TEST(SgdMultiTensor, MatchesPerTensorBitForBit) {
  expect_matches_host(sgd(false, 0.f, 0.f), "Sgd");
  expect_matches_host(sgd(false, 0.9f, 0.1f), "Sgd");
  expect_matches_host(sgd(true, 0.9f, 0.f), "Sgd");
}
TEST(LambMultiTensor, MatchesPerTensorBitForBitWithItsTrustRatios) {
  expect_matches_host(lamb(), "Lamb");
  Pair p = lamb()(2);
  step_both(p, 0);
  const auto& host = static_cast<const tg::optim::Lamb&>(*p.ref);
  const auto& dev = static_cast<const tg::optim::Lamb&>(*p.dev);
  for (const auto& q : p.ref_params) {
    EXPECT_EQ(dev.last_trust_ratio(q.name), host.last_trust_ratio(q.name)) << q.name;
    EXPECT_GT(dev.last_trust_ratio(q.name), 0.0) << q.name;
  }
}
TEST(AdafactorMultiTensor, MatchesPerTensorBitForBit) {
  expect_matches_host(adafactor(0.f, false), "Adafactor");  // factored and full second moments, no first moment
  expect_matches_host(adafactor(0.9f, false), "Adafactor");  // with a first moment
  expect_matches_host(adafactor(0.f, true), "Adafactor");   // relative steps: min(lr, 1/sqrt(t))
}
TEST(AdafactorMultiTensor, KeepsTheSlotNames) {
  Pair p = adafactor(0.9f, false)(3);
  step_both(p, 0);
  const auto s = by_name(p.dev->state_tensors());
  EXPECT_EQ(s.at("h.0.mlp.c_fc.weight.exp_avg_sq_row").size(), 5u);
  EXPECT_EQ(s.at("h.0.mlp.c_fc.weight.exp_avg_sq_col").size(), 7u);
  EXPECT_EQ(s.at("h.0.attn.c_attn.weight.exp_avg_sq_row").size(), 6u);  // [2,3,4] viewed as [6, 4]
  EXPECT_EQ(s.at("h.0.ln_1.weight.exp_avg_sq").size(), 7u);
  EXPECT_EQ(s.at("h.0.ln_1.weight.exp_avg").size(), 7u);
}

// state_tensors -> load_state into fresh optimizers (grouped -> per-parameter -> grouped) continues exactly
// as the uninterrupted one.
void expect_round_trip(const Factory& make) {
  Pair full = make(5), first = make(5);
  for (int step = 0; step < 3; ++step) {
    step_both(full, step);
    step_both(first, step);
  }
  Pair second = make(99);  // other initial values: the weights are copied below, the state is loaded
  for (std::size_t i = 0; i < first.dev_params.size(); ++i) {
    tg::detail::copy_tensor(first.dev_params[i].tensor, second.ref_params[i].tensor);
    tg::detail::copy_tensor(first.dev_params[i].tensor, second.dev_params[i].tensor);
  }
  second.ref->load_state(first.dev->state_tensors());  // into another group layout
  second.dev->load_state(second.ref->state_tensors());  // and back
  EXPECT_EQ(by_name(second.dev->state_tensors()), by_name(first.dev->state_tensors()));
  EXPECT_EQ(second.dev->step_count(), 3);
  for (int step = 3; step < 5; ++step) {
    step_both(full, step);
    step_both(second, step);
    for (std::size_t i = 0; i < full.dev_params.size(); ++i) {
      EXPECT_EQ(second.dev_params[i].tensor.to_vector(), full.dev_params[i].tensor.to_vector()) << full.dev_params[i].name;
      EXPECT_EQ(second.ref_params[i].tensor.to_vector(), full.ref_params[i].tensor.to_vector()) << full.ref_params[i].name;
    }
  }
}
TEST(SgdMultiTensor, StateRoundTripContinuesIdentically) { expect_round_trip(sgd(true, 0.9f, 0.f)); }
TEST(LambMultiTensor, StateRoundTripContinuesIdentically) { expect_round_trip(lamb()); }
TEST(AdafactorMultiTensor, StateRoundTripContinuesIdentically) { expect_round_trip(adafactor(0.9f, false)); }

void expect_bad_state_rejected(const Factory& make, const std::string& slot) {
  Pair p = make(7);
  step_both(p, 0);
  const auto good = p.ref->state_tensors();
  const auto before = by_name(p.dev->state_tensors());

  auto unknown = good;
  unknown.push_back({"h.9.mlp.c_fc.weight." + slot, tg::Tensor<tg::fp32>::zeros({2})});
  EXPECT_NE(error_of([&] { p.dev->load_state(unknown); }).find("unknown entry 'h.9.mlp.c_fc.weight." + slot + "'"),
            std::string::npos);

  auto misshapen = good;
  for (auto& e : misshapen)
    if (e.name == "h.0.mlp.c_fc.bias." + slot) e.tensor = tg::Tensor<tg::fp32>::zeros({4});
  const std::string msg = error_of([&] { p.dev->load_state(misshapen); });
  EXPECT_NE(msg.find("'h.0.mlp.c_fc.bias." + slot + "' has shape [4], expected [5]"), std::string::npos) << msg;
  EXPECT_NE(msg.find(p.dev->name()), std::string::npos) << msg;

  auto missing = good;
  std::erase_if(missing, [&](const auto& e) { return e.name == "h.0.mlp.c_fc.bias." + slot; });
  EXPECT_NE(error_of([&] { p.dev->load_state(missing); }).find("missing entry 'h.0.mlp.c_fc.bias." + slot + "'"),
            std::string::npos);
  EXPECT_EQ(by_name(p.dev->state_tensors()), before) << "a rejected load_state must change nothing";
}
TEST(SgdMultiTensor, BadStateGivesAClearError) { expect_bad_state_rejected(sgd(false, 0.9f, 0.f), "momentum_buffer"); }
TEST(LambMultiTensor, BadStateGivesAClearError) { expect_bad_state_rejected(lamb(), "exp_avg_sq"); }
TEST(AdafactorMultiTensor, BadStateGivesAClearError) { expect_bad_state_rejected(adafactor(0.9f, false), "exp_avg"); }

TEST(OptimizerHierarchy, AdamStateDoesNotLoadIntoSgd) {
  auto a = four_params(1), b = four_params(1);
  tg::optim::AdamW adam(a, {});
  for (auto& q : a) set_grad(q, random_like(q, 3));
  adam.step();
  tg::optim::Sgd sgd_opt(b, {.momentum = 0.9f});
  EXPECT_NE(error_of([&] { sgd_opt.load_state(adam.state_tensors()); }).find("Sgd.load_state: missing entry"), std::string::npos);
}

TEST(OptimizerHierarchy, ConstructorChecksNameTheOptimizer) {
  EXPECT_NE(error_of([] { tg::optim::Sgd(four_params(1), {.momentum = 0.f, .nesterov = true}); })
                .find("Sgd: Nesterov momentum needs momentum > 0"),
            std::string::npos);
  EXPECT_NE(error_of([] { tg::optim::Lamb(four_params(1), {.beta1 = 1.f}); }).find("Lamb: betas must be"),
            std::string::npos);
  tg::optim::AdafactorOptions bad;
  bad.clip_threshold = 0.f;
  EXPECT_NE(error_of([&] { tg::optim::Adafactor(four_params(1), bad); }).find("Adafactor: clip_threshold"),
            std::string::npos);
  auto twice = four_params(1);
  twice.push_back(twice[0]);
  EXPECT_NE(error_of([&] { tg::optim::Lamb(twice, {}); }).find("Lamb: parameter 'h.0.mlp.c_fc.weight' appears twice"),
            std::string::npos);
}

// clip_grad_norm over any optimizer (here through the base class) clips like over another layout's.
TEST(OptimizerHierarchy, ClippingMatchesClipGradNormForEveryOptimizer) {
  for (const Factory& make : {sgd(true, 0.9f, 0.f), lamb(), adafactor(0.f, false)}) {
    Pair p = make(9);
    for (std::size_t i = 0; i < p.ref_params.size(); ++i) {
      set_grad(p.ref_params[i], random_like(p.ref_params[i], 50 + i, 3.f));
      set_grad(p.dev_params[i], random_like(p.dev_params[i], 50 + i, 3.f));
    }
    const tg::optim::Optimizer& dev = *p.dev;
    const double nd = tg::optim::clip_grad_norm(dev, 0.5);
    const double nh = tg::optim::clip_grad_norm(*p.ref, 0.5);
    EXPECT_NEAR(nd, nh, 1e-12 * nh) << p.dev->name();
    EXPECT_GT(nh, 0.5);
    for (std::size_t i = 0; i < p.ref_params.size(); ++i)
      EXPECT_LT(tg::optim::testing::rel_err_inf(p.dev_params[i].tensor.grad(), p.ref_params[i].tensor.grad()), 1e-6)
          << p.dev->name() << " " << p.ref_params[i].name;
  }
}

}  // namespace

}  // namespace test_optimizer_multi_tensor_cpp

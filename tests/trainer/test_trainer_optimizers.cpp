// train_gpt's optimizer factory (examples/gpt/trainer.hpp): for every --optimizer, make_optimizer<D> (here
// D = cpu; the GPU trainer calls the same function with cuda) builds the optimizer of that name with the
// trainer's settings over default_groups: it steps a tiny GPT bit for bit like that optimizer built by hand
// and keeps the same state (Note [training on a GPU]).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "optim/optim_test_util.hpp"
#include "trainer.hpp"

#include <memory>

namespace {

using tg::optim::testing::by_name;

class TrainerOptimizers : public ::testing::TestWithParam<const char*> {};

/// --optimizer built by hand from the trainer's option functions.
std::unique_ptr<tg::optim::Optimizer> by_hand(const train_gpt::Options& o, const std::vector<tg::optim::Param>& ps) {
  auto groups = tg::optim::default_groups(ps, o.weight_decay);
  const std::string n = o.optimizer;
  if (n == "adamw") return std::make_unique<tg::optim::AdamW>(groups, train_gpt::adam_options(o));
  if (n == "adam") {
    const auto a = train_gpt::adam_options(o);
    return std::make_unique<tg::optim::Adam>(groups, tg::optim::AdamOptions{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay});
  }
  if (n == "sgd") return std::make_unique<tg::optim::Sgd>(groups, train_gpt::sgd_options(o));
  if (n == "lamb") return std::make_unique<tg::optim::Lamb>(groups, train_gpt::lamb_options(o));
  return std::make_unique<tg::optim::Adafactor>(groups, train_gpt::adafactor_options(o));
}

TEST_P(TrainerOptimizers, MakeOptimizerStepsLikeTheOptimizerBuiltByHand) {
  train_gpt::Options o;
  o.optimizer = GetParam();
  o.lr = 1e-2f;
  const tg::nn::GPTConfig cfg{64, 16, 2, 2, 32, 0.f};
  tg::Generator g1(3), g2(3);
  const tg::nn::GPT host_model(cfg, g1), dev_model(cfg, g2);
  const auto host_params = host_model.named_parameters(), dev_params = dev_model.named_parameters();
  const auto host_opt = by_hand(o, host_params);
  const auto dev_opt = train_gpt::make_optimizer(o, dev_params);
  EXPECT_STREQ(dev_opt->name(), host_opt->name());
  for (const auto& p : host_params)  // default_groups: group 0 decays, group 1 does not
    EXPECT_EQ(dev_opt->param_weight_decay(p.name), tg::optim::is_no_decay(p) ? 0.f : o.weight_decay) << p.name;

  tg::Generator data(5);
  for (int step = 0; step < 3; ++step) {
    auto x = tg::Tensor<std::int64_t>::empty({2, 16}), y = tg::Tensor<std::int64_t>::empty({2, 16});
    for (std::int64_t i = 0; i < 32; ++i) {
      x.data()[i] = static_cast<std::int64_t>(data.next_u64() % 64);
      y.data()[i] = static_cast<std::int64_t>(data.next_u64() % 64);
    }
    tg::cross_entropy(host_model.forward<tg::fp32>(x), y).backward();
    tg::cross_entropy(dev_model.forward<tg::fp32>(x), y).backward();
    host_opt->set_lr(o.lr / static_cast<float>(step + 1));
    dev_opt->set_lr(o.lr / static_cast<float>(step + 1));
    host_opt->step();
    dev_opt->step();
    host_opt->zero_grad();
    dev_opt->zero_grad();
    for (std::size_t i = 0; i < host_params.size(); ++i)
      ASSERT_EQ(dev_params[i].tensor.to_vector(), host_params[i].tensor.to_vector())
          << o.optimizer << ": " << host_params[i].name << " after step " << step;
  }
  EXPECT_EQ(by_name(dev_opt->state_tensors()), by_name(host_opt->state_tensors())) << o.optimizer;
}

INSTANTIATE_TEST_SUITE_P(EveryOptimizer, TrainerOptimizers,
                         ::testing::Values("adamw", "adam", "sgd", "lamb", "adafactor"),
                         [](const auto& info) { return std::string(info.param); });

TEST(TrainerOptimizers, UnknownOptimizerIsAClearError) {
  train_gpt::Options o;
  o.optimizer = "rmsprop";
  tg::Generator g(1);
  const tg::nn::GPT model(tg::nn::GPTConfig{64, 16, 1, 2, 32, 0.f}, g);
  try {
    train_gpt::make_optimizer(o, model.named_parameters());
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--optimizer: unknown optimizer 'rmsprop'"), std::string::npos) << e.what();
  }
}

}  // namespace

// train_gpt's two optimizer factories (examples/gpt/trainer.hpp): for every --optimizer, the device
// optimizer make_device_optimizer builds (here on the CPU, where it runs the CPU kernels) steps a tiny GPT
// bit for bit like make_optimizer's host optimizer and keeps the same state, so the GPU trainer runs the
// CPU trainer's settings and decay groups and their checkpoints are one format (Note [training on a GPU]).
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "trainer.hpp"

namespace {

std::map<std::string, std::vector<float>> by_name(const std::vector<tg::optim::NamedTensor>& state) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : state) out[e.name] = e.tensor.to_vector();
  return out;
}

class TrainerOptimizers : public ::testing::TestWithParam<const char*> {};

TEST_P(TrainerOptimizers, DeviceOptimizerStepsLikeTheHostOne) {
  train_gpt::Options o;
  o.optimizer = GetParam();
  o.lr = 1e-2f;
  const tg::nn::GPTConfig cfg{64, 16, 2, 2, 32, 0.f};
  tg::Generator g1(3), g2(3);
  const tg::nn::GPT host_model(cfg, g1), dev_model(cfg, g2);
  const auto host_params = host_model.named_parameters(), dev_params = dev_model.named_parameters();
  const auto host_opt = train_gpt::make_optimizer(o, host_params);
  const auto dev_opt = train_gpt::make_device_optimizer<tg::cpu>(o, dev_params);
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
    train_gpt::make_device_optimizer<tg::cpu>(o, model.named_parameters());
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--optimizer: unknown optimizer 'rmsprop'"), std::string::npos) << e.what();
  }
}

}  // namespace

// SGD (momentum, dampening, Nesterov, weight decay), Adam (L2 decay) and AdamW vs torch.optim over 10 steps,
// with per-step lrs and parameters skipped at some steps (goldens by tests/reference/make_optim_goldens.py).
#include <cstdlib>
#include <iostream>
#include <memory>

#include "optim/optim_test_util.hpp"
#include "reference/golden.hpp"

namespace tg::optim::testing {
namespace test_optim_torch_cpp {  // the file's own names (Note [unity test sources])

std::string goldens_dir() {
  if (const char* env = std::getenv("TG_OPTIM_GOLDENS_DIR"); env && *env) return env;
  return TG_OPTIM_GOLDENS_DEFAULT_DIR;
}

constexpr int kSteps = 10;
constexpr int kParams = 3;
constexpr double kTol = 1e-5;

using Factory = std::unique_ptr<Optimizer> (*)(std::vector<Param>, const std::vector<double>& args, float lr);

/// Runs every case of optim_<file>.bin; returns the largest relative error seen.
double run_file(const std::string& file, const std::vector<std::string>& cases, Factory make) {
  const auto g = tg::testing::GoldenFile::load(goldens_dir() + "/optim_" + file + ".bin");
  double worst = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(file + "/" + c);
    const auto args = g.f64(c + "/args");
    const auto lrs = g.f64(c + "/lrs");
    const auto has = g.i64(c + "/has_grad");
    if (has.shape() != Shape{kSteps, kParams}) { ADD_FAILURE() << "has_grad has shape " << has.shape(); return 1.0; }
    std::vector<Param> ps;
    for (int k = 0; k < kParams; ++k) ps.emplace_back("p" + std::to_string(k), g.f32(c + "/init/" + std::to_string(k)));
    auto opt = make(ps, args, static_cast<float>(lrs[0]));
    for (int s = 0; s < kSteps; ++s) {
      opt->set_lr(static_cast<float>(lrs[s]));
      opt->zero_grad();
      for (int k = 0; k < kParams; ++k)
        if (has.at({s, k})) set_grad(ps[k], g.f32(c + "/grad/" + std::to_string(s) + "/" + std::to_string(k)));
      opt->step();
      for (int k = 0; k < kParams; ++k) {
        const double e = rel_err_inf(ps[k].tensor, as_doubles(g.f32(c + "/after/" + std::to_string(s) + "/" + std::to_string(k))));
        EXPECT_LE(e, kTol) << "step " << s << " param " << k;
        worst = std::max(worst, e);
      }
    }
    EXPECT_EQ(opt->step_count(), kSteps);
    EXPECT_EQ(opt->param_step_count("p1"), kSteps - 1);  // skipped once by the goldens
  }
  return worst;
}

TEST(OptimTorchParity, SgdMomentumNesterovWeightDecayMatchesTorch) {
  const double e = run_file("sgd", {"nesterov_wd", "momentum_dampening", "plain_wd"},
                            [](std::vector<Param> ps, const std::vector<double>& a, float lr) -> std::unique_ptr<Optimizer> {
                              return std::make_unique<Sgd>(ps, SgdOptions{.lr = lr, .momentum = float(a[0]), .dampening = float(a[1]),
                                                                          .nesterov = a[2] != 0, .weight_decay = float(a[3])});
                            });
  std::cout << "[ optim ] SGD max relative error vs torch: " << e << "\n";
  RecordProperty("max_rel_err", std::to_string(e));
}

TEST(OptimTorchParity, AdamL2WeightDecayMatchesTorch) {
  const double e = run_file("adam", {"wd", "betas"},
                            [](std::vector<Param> ps, const std::vector<double>& a, float lr) -> std::unique_ptr<Optimizer> {
                              return std::make_unique<Adam>(ps, AdamOptions{.lr = lr, .beta1 = float(a[0]), .beta2 = float(a[1]),
                                                                            .eps = float(a[2]), .weight_decay = float(a[3])});
                            });
  std::cout << "[ optim ] Adam max relative error vs torch: " << e << "\n";
  RecordProperty("max_rel_err", std::to_string(e));
}

TEST(OptimTorchParity, AdamWDecoupledWeightDecayMatchesTorch) {
  const double e = run_file("adamw", {"wd", "gpt"},
                            [](std::vector<Param> ps, const std::vector<double>& a, float lr) -> std::unique_ptr<Optimizer> {
                              return std::make_unique<AdamW>(ps, AdamWOptions{.lr = lr, .beta1 = float(a[0]), .beta2 = float(a[1]),
                                                                              .eps = float(a[2]), .weight_decay = float(a[3])});
                            });
  std::cout << "[ optim ] AdamW max relative error vs torch: " << e << "\n";
  RecordProperty("max_rel_err", std::to_string(e));
}

}  // namespace test_optim_torch_cpp
}  // namespace tg::optim::testing

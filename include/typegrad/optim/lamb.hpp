// LAMB: Adam's direction with decoupled weight decay, scaled per tensor by a trust ratio (You et al. 2019), on
// any device: BasicLamb<D>; Lamb is the CPU's.
//   tg::optim::Lamb opt(tg::optim::default_groups(params, 0.01f), {.lr = 2e-3f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

struct LambOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-6f;
  float weight_decay = 1e-2f;
};

// Note [LAMB update]
// You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2
// (φ = identity). Per parameter tensor p (one "layer") with gradient g, step t = 1, 2, ...:
//   m_t = β1·m_{t−1} + (1 − β1)·g,         v_t = β2·v_{t−1} + (1 − β2)·g²
//   m̂  = m_t / (1 − β1^t),                v̂  = v_t / (1 − β2^t)
//   u   = m̂ / (sqrt(v̂) + ε) + λ·p
//   r   = ‖p‖₂ / ‖u‖₂, or 1 when ‖p‖ = 0 or ‖u‖ = 0      (the trust ratio; norms accumulated in fp64)
//   p   = p − η·r·u
// The kernel makes two passes (the trust ratio needs ‖u‖ before any element moves): the first updates
// m, v and the norms, the second recomputes u and applies it. State: "<name>.exp_avg", "<name>.exp_avg_sq".
/// The state kept for a parameter of `shape`.
inline std::vector<SlotSpec> lamb_slots(const Shape& shape) { return {{"exp_avg", shape}, {"exp_avg_sq", shape}}; }
/// The constructor checks of Lamb.
inline void check_lamb_options(const LambOptions& o, const char* who) {
  TG_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, who, ": betas must be in [0, 1), got ",
           o.beta1, ", ", o.beta2);
}

/// LAMB on device D: one lamb_step_multi call per run of parameters sharing (lr, weight decay, step count)
/// (Note [device optimizers]).
template <Device D>
class BasicLamb final : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  BasicLamb(std::vector<BasicParamGroup<D>> groups, LambOptions o)
      : Base(std::move(groups), o.lr, o.weight_decay, "Lamb"), o_(o) {
    check_lamb_options(o, "Lamb");
  }
  BasicLamb(std::vector<BasicParam<D>> params, LambOptions o) : BasicLamb(Base::one_group(std::move(params)), o) {}
  const char* name() const override { return "Lamb"; }
  /// The trust ratio of the last update of the named parameter (0 before its first update).
  double last_trust_ratio(const std::string& param) const {
    auto it = trust_.find(param);
    return it == trust_.end() ? 0.0 : it->second;
  }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return lamb_slots(shape); }
  void update(std::span<Update> ready) override {
    Base::for_each_run(ready, [](const Update& u) { return std::tuple(u.lr(), u.weight_decay(), u.step()); },
                       [&](std::span<Update> run) {
                         backend::LambScalars s;
                         s.lr = run[0].lr();
                         s.beta1 = o_.beta1;
                         s.beta2 = o_.beta2;
                         s.eps = o_.eps;
                         s.weight_decay = run[0].weight_decay();
                         s.step = run[0].step();
                         tensors_.clear();
                         for (const Update& u : run) tensors_.push_back({u.p(), u.g(), u.slot(0), u.slot(1), u.numel()});
                         ratios_.resize(run.size());
                         TG_BACKEND(D, lamb_step_multi<fp32>(tensors_.data(), static_cast<int>(tensors_.size()), s,
                                                             ratios_.data()));
                         for (std::size_t i = 0; i < run.size(); ++i) {
                           auto it = trust_.find(run[i].param->name);  // exists after the first step: no allocation
                           if (it == trust_.end()) trust_.emplace(run[i].param->name, ratios_[i]);
                           else it->second = ratios_[i];
                         }
                       });
  }

 private:
  LambOptions o_;
  std::vector<backend::LambTensor<fp32>> tensors_;
  std::vector<double> ratios_;
  std::map<std::string, double> trust_;
};

using Lamb = BasicLamb<cpu>;

}  // namespace tg::optim

// Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD), on
// any device: BasicSgd<D>; Sgd is the CPU's.
//   tg::optim::Sgd opt(params, {.lr = 0.1f, .momentum = 0.9f, .nesterov = true, .weight_decay = 1e-4f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

struct SgdOptions {
  float lr = 1e-2f;
  float momentum = 0.f;
  float dampening = 0.f;
  bool nesterov = false;
  float weight_decay = 0.f;  // L2: added to the gradient
};

// Note [SGD update]
// PyTorch's torch.optim.SGD (Sutskever et al. 2013, "On the importance of initialization and momentum in
// deep learning", for the Nesterov form), per parameter p with gradient g, step t = 1, 2, ...:
//   d   = g + λ·p                                   (λ = weight_decay)
//   b_t = d                          if t = 1       (momentum buffer, only when μ ≠ 0)
//   b_t = μ·b_{t-1} + (1 − τ)·d      otherwise      (μ = momentum, τ = dampening)
//   d   = d + μ·b_t  (Nesterov)  or  d = b_t
//   p   = p − η·d                                   (η = lr)
// State: "<name>.momentum_buffer" when μ ≠ 0. Nesterov needs μ > 0 and τ = 0 (checked, as PyTorch does).
/// The state kept for a parameter of `shape`: the momentum buffer when μ ≠ 0.
inline std::vector<SlotSpec> sgd_slots(const SgdOptions& o, const Shape& shape) {
  if (o.momentum == 0.f) return {};
  return {{"momentum_buffer", shape}};
}
/// The constructor checks of Sgd.
inline void check_sgd_options(const SgdOptions& o, const char* who) {
  TG_CHECK(o.lr >= 0, who, ": lr must be >= 0, got ", o.lr);
  TG_CHECK(o.momentum >= 0, who, ": momentum must be >= 0, got ", o.momentum);
  TG_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), who,
           ": Nesterov momentum needs momentum > 0 and dampening = 0, got momentum ", o.momentum, ", dampening ",
           o.dampening);
}

/// torch.optim.SGD on device D: one sgd_step_multi call per run of parameters sharing (lr, weight decay,
/// first step) (Note [device optimizers]).
template <Device D>
class BasicSgd final : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  BasicSgd(std::vector<BasicParamGroup<D>> groups, SgdOptions o)
      : Base(std::move(groups), o.lr, o.weight_decay, "Sgd"), o_(o) {
    check_sgd_options(o, "Sgd");
  }
  BasicSgd(std::vector<BasicParam<D>> params, SgdOptions o) : BasicSgd(Base::one_group(std::move(params)), o) {}
  const char* name() const override { return "Sgd"; }
  bool reads_device_boundary() const override { return true; }
  const SgdOptions& options() const { return o_; }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return sgd_slots(o_, shape); }
  void update(std::span<Update> ready) override {
    // The momentum buffer starts as the first step's d: first steps are their own call.
    Base::for_each_run(ready, [this](const Update& u) { return std::tuple(this->run_lr_key(u), u.weight_decay(), u.step() == 1); },
                       [&](std::span<Update> run) {
                         backend::SgdScalars s;
                         s.lr = this->launch_lr(run[0]);
                         s.momentum = o_.momentum;
                         s.dampening = o_.dampening;
                         s.weight_decay = run[0].weight_decay();
                         s.nesterov = o_.nesterov;
                         s.first_step = run[0].step() == 1;
                         s.boundary = this->boundary();  // Note [the step boundary on the device]: skip and lr from there
                         s.lr_scale = run[0].lr_scale();
                         const bool momentum = o_.momentum != 0.f;
                         tensors_.clear();
                         for (const Update& u : run)
                           tensors_.push_back({u.p(), u.g(), momentum ? u.slot(0) : nullptr, u.numel()});
                         TG_BACKEND(D, sgd_step_multi<fp32>(tensors_.data(), static_cast<int>(tensors_.size()), s));
                       });
  }

 private:
  SgdOptions o_;
  std::vector<backend::SgdTensor<fp32>> tensors_;
};

using Sgd = BasicSgd<cpu>;

}  // namespace tg::optim

// Adam / AdamW over a model's parameters on any device (Note [device optimizers]): one fused multi-tensor
// launch per (decay, step count) on CUDA (backend::cuda::adam_step_multi), the CPU kernel per tensor on the
// CPU; state saved and loaded under optim::Adam's / AdamW's names, so checkpoints do not change.
//   tg::optim::DeviceAdam<tg::cuda> opt(gpu_model.named_parameters(), {.lr = 6e-4f, .weight_decay = 0.1f});
//   loss.backward();  tg::optim::clip_grad_norm(opt, 1.0);  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/optim/adam.hpp"
#include "typegrad/optim/device_optimizer.hpp"

namespace tg::optim {

/// Note [Adam update] on device D: computes what optim::AdamW (decoupled) or optim::Adam (L2 decay folded
/// into the gradient) computes over default_groups(params, o.weight_decay).
template <Device D>
class DeviceAdam final : public DeviceOptimizer<D> {
  using Base = DeviceOptimizer<D>;
  using typename Base::Entry;

 public:
  /// AdamW (decoupled decay) when `decoupled`, else Adam with L2 decay folded into the gradient.
  DeviceAdam(std::vector<BasicParam<D>> params, AdamWOptions o, bool decoupled = true)
      : Base(std::move(params), o.lr, o.weight_decay, decoupled ? "AdamW" : "Adam"), h_(o), decoupled_(decoupled) {
    check_adam_options(o.lr, o.beta1, o.beta2, o.eps, name());
  }
  const char* name() const override { return decoupled_ ? "AdamW" : "Adam"; }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return adam_slots(shape); }
  void update(std::span<Entry* const> ready, float lr) override {
    // Parameters with the same decay and step count share one launch.
    for (auto& [key, list] : Base::group_by(ready, [](const Entry& e) { return std::pair{e.weight_decay, e.step}; })) {
      const auto [wd, t] = key;
      if constexpr (std::is_same_v<D, cpu>) {
        backend::cpu::AdamScalars s;
        s.lr = lr;
        s.beta1 = h_.beta1;
        s.beta2 = h_.beta2;
        s.eps = h_.eps;
        s.weight_decay = wd;
        s.decoupled = decoupled_;
        s.step = t;
        for (Entry* e : list)
          backend::cpu::adam_step<fp32>(e->param.tensor.data(), e->grad.data(), e->slot(0), e->slot(1), e->numel(), s);
      } else {
        std::vector<backend::cuda::AdamTensor> tensors;
        for (Entry* e : list) tensors.push_back({e->param.tensor.data(), e->grad.data(), e->slot(0), e->slot(1), e->numel()});
        backend::cuda::adam_step_multi(tensors.data(), static_cast<int>(tensors.size()), lr, h_.beta1, h_.beta2, h_.eps,
                                       wd, decoupled_, t);
      }
    }
  }

 private:
  AdamWOptions h_;
  bool decoupled_ = true;
};

}  // namespace tg::optim

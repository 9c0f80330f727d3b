// SGD with momentum, dampening, Nesterov and L2 decay over a model's parameters on any device (Note [SGD
// update], Note [device optimizers]): one multi-tensor launch per (decay, first step) group on CUDA
// (backend::cuda::sgd_step_multi), the CPU kernel per tensor on the CPU; state under optim::Sgd's names.
//   tg::optim::DeviceSgd<tg::cuda> opt(gpu_model.named_parameters(), {.lr = 0.1f, .momentum = 0.9f, .nesterov = true});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/optim/device_optimizer.hpp"
#include "typegrad/optim/sgd.hpp"

namespace tg::optim {

/// Computes what optim::Sgd computes over default_groups(params, o.weight_decay): matrices get
/// o.weight_decay as L2 decay, the no-decay parameters 0.
template <Device D>
class DeviceSgd final : public DeviceOptimizer<D> {
  using Base = DeviceOptimizer<D>;
  using typename Base::Entry;

 public:
  DeviceSgd(std::vector<BasicParam<D>> params, SgdOptions o) : Base(std::move(params), o.lr, o.weight_decay, "Sgd"), o_(o) {
    check_sgd_options(o, "Sgd");
  }
  const char* name() const override { return "Sgd"; }
  const SgdOptions& options() const { return o_; }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return sgd_slots(o_, shape); }
  void update(std::span<Entry* const> ready, float lr) override {
    // The momentum buffer starts as the first step's d: the first step is its own launch.
    for (auto& [key, list] : Base::group_by(ready, [](const Entry& e) { return std::pair{e.weight_decay, e.step == 1}; })) {
      backend::cpu::SgdScalars s;
      s.lr = lr;
      s.momentum = o_.momentum;
      s.dampening = o_.dampening;
      s.weight_decay = key.first;
      s.nesterov = o_.nesterov;
      s.first_step = key.second;
      const bool momentum = o_.momentum != 0.f;
      if constexpr (std::is_same_v<D, cpu>) {
        for (Entry* e : list)
          backend::cpu::sgd_step<fp32>(e->param.tensor.data(), e->grad.data(), momentum ? e->slot(0) : nullptr,
                                       e->numel(), s);
      } else {
        std::vector<backend::cuda::SgdTensor> tensors;
        for (Entry* e : list)
          tensors.push_back({e->param.tensor.data(), e->grad.data(), momentum ? e->slot(0) : nullptr, e->numel()});
        backend::cuda::sgd_step_multi(tensors.data(), static_cast<int>(tensors.size()), s);
      }
    }
  }

 private:
  SgdOptions o_;
};

}  // namespace tg::optim

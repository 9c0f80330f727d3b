// LAMB over a model's parameters on any device (Note [LAMB update], Note [device optimizers]): on CUDA one
// multi-tensor moments launch, a read-back of per-tensor fp64 norms, and one multi-tensor apply launch per
// (decay, step count) group (backend::cuda::lamb_step_multi); the CPU kernel per tensor on the CPU; state
// under optim::Lamb's names.
//   tg::optim::DeviceLamb<tg::cuda> opt(gpu_model.named_parameters(), {.lr = 2e-3f, .weight_decay = 0.01f});
//   loss.backward();  opt.step();  opt.zero_grad();  double r = opt.last_trust_ratio("h.0.mlp.c_fc.weight");
#pragma once

#include "typegrad/optim/device_optimizer.hpp"
#include "typegrad/optim/lamb.hpp"

namespace tg::optim {

/// Computes what optim::Lamb computes over default_groups(params, o.weight_decay).
template <Device D>
class DeviceLamb final : public DeviceOptimizer<D> {
  using Base = DeviceOptimizer<D>;
  using typename Base::Entry;

 public:
  DeviceLamb(std::vector<BasicParam<D>> params, LambOptions o) : Base(std::move(params), o.lr, o.weight_decay, "Lamb"), o_(o) {
    check_lamb_options(o, "Lamb");
  }
  const char* name() const override { return "Lamb"; }
  /// The trust ratio of the last update of the named parameter (0 before its first update), as Lamb's.
  double last_trust_ratio(const std::string& param) const {
    auto it = trust_.find(param);
    return it == trust_.end() ? 0.0 : it->second;
  }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return lamb_slots(shape); }
  void update(std::span<Entry* const> ready, float lr) override {
    for (auto& [key, list] : Base::group_by(ready, [](const Entry& e) { return std::pair{e.weight_decay, e.step}; })) {
      backend::cpu::LambScalars s;
      s.lr = lr;
      s.beta1 = o_.beta1;
      s.beta2 = o_.beta2;
      s.eps = o_.eps;
      s.weight_decay = key.first;
      s.step = key.second;
      ratios_.resize(list.size());
      if constexpr (std::is_same_v<D, cpu>) {
        for (std::size_t i = 0; i < list.size(); ++i) {
          Entry* e = list[i];
          ratios_[i] = backend::cpu::lamb_step<fp32>(e->param.tensor.data(), e->grad.data(), e->slot(0), e->slot(1),
                                                     e->numel(), s);
        }
      } else {
        std::vector<backend::cuda::LambTensor> tensors;
        for (Entry* e : list) tensors.push_back({e->param.tensor.data(), e->grad.data(), e->slot(0), e->slot(1), e->numel()});
        backend::cuda::lamb_step_multi(tensors.data(), static_cast<int>(tensors.size()), s, ratios_.data());
      }
      for (std::size_t i = 0; i < list.size(); ++i) trust_[list[i]->param.name] = ratios_[i];
    }
  }

 private:
  LambOptions o_;
  std::vector<double> ratios_;
  std::map<std::string, double> trust_;
};

}  // namespace tg::optim

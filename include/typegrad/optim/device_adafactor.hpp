// Adafactor over a model's parameters on any device (Note [Adafactor update], Note [device optimizers]):
// on CUDA one multi-tensor step per (decay, step count) group (backend::cuda::adafactor_step_multi: six
// launches and one read-back of per-tensor fp64 sums for the group); the CPU kernel per tensor on the CPU;
// state under optim::Adafactor's names.
//   tg::optim::DeviceAdafactor<tg::cuda> opt(gpu_model.named_parameters(), {.lr = 1e-2f, .relative_step = false});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/optim/adafactor.hpp"
#include "typegrad/optim/device_optimizer.hpp"

namespace tg::optim {

/// Computes what optim::Adafactor computes over default_groups(params, o.weight_decay) (decoupled decay
/// for matrices, none for the rest): factored second moments for 2-D and larger parameters, full ones
/// otherwise, relative steps, parameter scaling and update clipping as the options say.
template <Device D>
class DeviceAdafactor final : public DeviceOptimizer<D> {
  using Base = DeviceOptimizer<D>;
  using typename Base::Entry;

 public:
  DeviceAdafactor(std::vector<BasicParam<D>> params, AdafactorOptions o)
      : Base(std::move(params), o.lr, o.weight_decay, "Adafactor"), o_(o) {
    check_adafactor_options(o, "Adafactor");
  }
  const char* name() const override { return "Adafactor"; }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return adafactor_slots(o_, shape); }
  void update(std::span<Entry* const> ready, float lr) override {
    if constexpr (std::is_same_v<D, cpu>) {
      for (Entry* e : ready) {
        if (e->numel() == 0) continue;
        const auto s = adafactor_scalars(o_, lr, e->weight_decay, e->step);
        fp32* p = e->param.tensor.data();
        const fp32* g = e->grad.data();
        fp32* m = o_.beta1 > 0 ? e->slots.back().data() : nullptr;
        const Shape& shape = e->param.tensor.shape();
        if (adafactor_factored(shape))
          backend::cpu::adafactor_step_factored<fp32>(p, g, e->slot(0), e->slot(1), m, adafactor_rows(shape),
                                                      adafactor_cols(shape), s);
        else
          backend::cpu::adafactor_step_full<fp32>(p, g, e->slot(0), m, e->numel(), s);
      }
    } else {
      for (auto& [key, list] : Base::group_by(ready, [](const Entry& e) { return std::pair{e.weight_decay, e.step}; })) {
        const auto s = adafactor_scalars(o_, lr, key.first, key.second);
        std::vector<backend::cuda::AdafactorTensor> tensors;
        for (Entry* e : list) {
          if (e->numel() == 0) continue;
          const Shape& shape = e->param.tensor.shape();
          fp32* m = o_.beta1 > 0 ? e->slots.back().data() : nullptr;
          if (adafactor_factored(shape))
            tensors.push_back({e->param.tensor.data(), e->grad.data(), e->slot(0), e->slot(1), nullptr, m,
                               adafactor_rows(shape), adafactor_cols(shape)});
          else
            tensors.push_back({e->param.tensor.data(), e->grad.data(), nullptr, nullptr, e->slot(0), m, 1, e->numel()});
        }
        backend::cuda::adafactor_step_multi(tensors.data(), static_cast<int>(tensors.size()), s);
      }
    }
  }

 private:
  AdafactorOptions o_;
};

}  // namespace tg::optim

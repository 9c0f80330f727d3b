// Adafactor over a model's parameters on any device (Note [Adafactor update], Note [device optimizers]):
// its per-tensor kernels on either device (backend::cuda's read back a row total and two fp64 sums per
// tensor, so a CUDA step synchronizes once per parameter); state under optim::Adafactor's names.
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
    for (Entry* e : ready) {
      if (e->numel() == 0) continue;
      const auto s = adafactor_scalars(o_, lr, e->weight_decay, e->step);
      fp32* p = e->param.tensor.data();
      const fp32* g = e->grad.data();
      fp32* m = o_.beta1 > 0 ? e->slots.back().data() : nullptr;
      const Shape& shape = e->param.tensor.shape();
      if (adafactor_factored(shape))
        TG_BACKEND(D, adafactor_step_factored<fp32>(p, g, e->slot(0), e->slot(1), m, adafactor_rows(shape),
                                                    adafactor_cols(shape), s));
      else
        TG_BACKEND(D, adafactor_step_full<fp32>(p, g, e->slot(0), m, e->numel(), s));
    }
  }

 private:
  AdafactorOptions o_;
};

}  // namespace tg::optim

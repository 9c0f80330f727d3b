// Stochastic gradient descent with momentum, dampening, Nesterov and L2 weight decay (torch.optim.SGD).
//   tg::optim::Sgd opt(params, {.lr = 0.1f, .momentum = 0.9f, .nesterov = true, .weight_decay = 1e-4f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/detail/cpu/optim_kernels.hpp"
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
/// The state kept for a parameter of `shape` (Sgd and DeviceSgd): the momentum buffer when μ ≠ 0.
inline std::vector<SlotSpec> sgd_slots(const SgdOptions& o, const Shape& shape) {
  if (o.momentum == 0.f) return {};
  return {{"momentum_buffer", shape}};
}
/// The constructor checks shared by Sgd and DeviceSgd.
inline void check_sgd_options(const SgdOptions& o, const char* who) {
  TG_CHECK(o.lr >= 0, who, ": lr must be >= 0, got ", o.lr);
  TG_CHECK(o.momentum >= 0, who, ": momentum must be >= 0, got ", o.momentum);
  TG_CHECK(!o.nesterov || (o.momentum > 0 && o.dampening == 0), who,
           ": Nesterov momentum needs momentum > 0 and dampening = 0, got momentum ", o.momentum, ", dampening ",
           o.dampening);
}

class Sgd final : public Optimizer {
 public:
  Sgd(std::vector<ParamGroup> groups, SgdOptions o) : Optimizer(std::move(groups), o.lr, o.weight_decay), o_(o) {
    check_sgd_options(o, "Sgd");
  }
  Sgd(std::vector<Param> params, SgdOptions o) : Sgd(one_group(std::move(params)), o) {}
  const char* name() const override { return "Sgd"; }
  const SgdOptions& options() const { return o_; }

 protected:
  std::vector<SlotSpec> slots(const Param& p) const override { return sgd_slots(o_, p.tensor.shape()); }
  void update(Group& g, const Param& p, const Tensor<fp32>& grad, State& st) override {
    backend::cpu::SgdScalars s;
    s.lr = g.lr;
    s.momentum = o_.momentum;
    s.dampening = o_.dampening;
    s.weight_decay = g.weight_decay;
    s.nesterov = o_.nesterov;
    s.first_step = st.step == 1;
    backend::cpu::sgd_step<fp32>(p.tensor.data(), grad.data(), st.slots.empty() ? nullptr : st.slots[0].data(),
                                 p.tensor.numel(), s);
  }

 private:
  SgdOptions o_;
};

}  // namespace tg::optim

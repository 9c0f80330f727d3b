// LAMB: Adam's direction with decoupled weight decay, scaled per tensor by a trust ratio (You et al. 2019).
//   tg::optim::Lamb opt(tg::optim::default_groups(params, 0.01f), {.lr = 2e-3f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/detail/cpu/optim_kernels.hpp"
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
/// The state kept for a parameter of `shape` (Lamb and DeviceLamb).
inline std::vector<SlotSpec> lamb_slots(const Shape& shape) { return {{"exp_avg", shape}, {"exp_avg_sq", shape}}; }
/// The constructor checks shared by Lamb and DeviceLamb.
inline void check_lamb_options(const LambOptions& o, const char* who) {
  TG_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, who, ": betas must be in [0, 1), got ",
           o.beta1, ", ", o.beta2);
}

class Lamb final : public Optimizer {
 public:
  Lamb(std::vector<ParamGroup> groups, LambOptions o) : Optimizer(std::move(groups), o.lr, o.weight_decay), o_(o) {
    check_lamb_options(o, "Lamb");
  }
  Lamb(std::vector<Param> params, LambOptions o) : Lamb(one_group(std::move(params)), o) {}
  const char* name() const override { return "Lamb"; }
  /// The trust ratio of the last update of the named parameter (0 before its first update).
  double last_trust_ratio(const std::string& param) const {
    auto it = trust_.find(param);
    return it == trust_.end() ? 0.0 : it->second;
  }

 protected:
  std::vector<SlotSpec> slots(const Param& p) const override { return lamb_slots(p.tensor.shape()); }
  void update(Group& g, const Param& p, const Tensor<fp32>& grad, State& st) override {
    backend::cpu::LambScalars s;
    s.lr = g.lr;
    s.beta1 = o_.beta1;
    s.beta2 = o_.beta2;
    s.eps = o_.eps;
    s.weight_decay = g.weight_decay;
    s.step = st.step;
    const double r = backend::cpu::lamb_step<fp32>(p.tensor.data(), grad.data(), st.slots[0].data(),
                                                   st.slots[1].data(), p.tensor.numel(), s);
    auto it = trust_.find(p.name);  // the node exists after the first step: no allocation afterwards
    if (it == trust_.end()) trust_.emplace(p.name, r);
    else it->second = r;
  }

 private:
  LambOptions o_;
  std::map<std::string, double> trust_;
};

}  // namespace tg::optim

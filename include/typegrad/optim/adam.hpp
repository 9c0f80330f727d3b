// Adam with L2 weight decay (torch.optim.Adam) and AdamW with decoupled weight decay (torch.optim.AdamW).
//   tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 6e-4f, .beta2 = 0.95f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

struct AdamOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.f;
};
struct AdamWOptions {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;  // PyTorch's AdamW default
};

// Note [Adam update]
// Kingma & Ba 2015, "Adam: A Method for Stochastic Optimization", Algorithm 1, in PyTorch's form
// (ε added after the bias-corrected square root). Per parameter p with gradient g, step t = 1, 2, ...:
//   Adam:   g = g + λ·p                                  (L2 decay folded into the gradient)
//   AdamW:  p = p − η·λ·p                                (Loshchilov & Hutter 2019, "Decoupled Weight
//                                                          Decay Regularization", Algorithm 2; before the step)
//   m_t = β1·m_{t−1} + (1 − β1)·g
//   v_t = β2·v_{t−1} + (1 − β2)·g²
//   p   = p − (η / (1 − β1^t)) · m_t / (sqrt(v_t) / sqrt(1 − β2^t) + ε)
// State: "<name>.exp_avg" (m) and "<name>.exp_avg_sq" (v); t is the parameter's own step count.
/// The state kept for a parameter of `shape` (Adam, AdamW and DeviceAdam).
inline std::vector<SlotSpec> adam_slots(const Shape& shape) { return {{"exp_avg", shape}, {"exp_avg_sq", shape}}; }
/// The constructor checks shared by Adam, AdamW and DeviceAdam.
inline void check_adam_options(float lr, float beta1, float beta2, float eps, const char* who) {
  TG_CHECK(lr >= 0, who, ": lr must be >= 0, got ", lr);
  TG_CHECK(beta1 >= 0 && beta1 < 1, who, ": beta1 must be in [0, 1), got ", beta1);
  TG_CHECK(beta2 >= 0 && beta2 < 1, who, ": beta2 must be in [0, 1), got ", beta2);
  TG_CHECK(eps >= 0, who, ": eps must be >= 0, got ", eps);
}

template <bool Decoupled>
class AdamBase : public Optimizer {
 public:
  struct Hyper {
    float lr, beta1, beta2, eps, weight_decay;
  };
  const char* name() const override { return Decoupled ? "AdamW" : "Adam"; }

 protected:
  AdamBase(std::vector<ParamGroup> groups, Hyper h) : Optimizer(std::move(groups), h.lr, h.weight_decay), h_(h) {
    check_adam_options(h.lr, h.beta1, h.beta2, h.eps, name());
  }
  std::vector<SlotSpec> slots(const Param& p) const override { return adam_slots(p.tensor.shape()); }
  void update(Group& g, const Param& p, const Tensor<fp32>& grad, State& st) override {
    backend::cpu::AdamScalars s;
    s.lr = g.lr;
    s.beta1 = h_.beta1;
    s.beta2 = h_.beta2;
    s.eps = h_.eps;
    s.weight_decay = g.weight_decay;
    s.decoupled = Decoupled;
    s.step = st.step;
    backend::cpu::adam_step<fp32>(p.tensor.data(), grad.data(), st.slots[0].data(), st.slots[1].data(),
                                  p.tensor.numel(), s);
  }
  Hyper h_;
};

class Adam final : public AdamBase<false> {
 public:
  Adam(std::vector<ParamGroup> groups, AdamOptions o)
      : AdamBase(std::move(groups), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}) {}
  Adam(std::vector<Param> params, AdamOptions o) : Adam(one_group(std::move(params)), o) {}
};

class AdamW final : public AdamBase<true> {
 public:
  AdamW(std::vector<ParamGroup> groups, AdamWOptions o)
      : AdamBase(std::move(groups), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}) {}
  AdamW(std::vector<Param> params, AdamWOptions o) : AdamW(one_group(std::move(params)), o) {}
};

}  // namespace tg::optim

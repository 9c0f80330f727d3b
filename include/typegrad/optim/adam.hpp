// Adam with L2 weight decay (torch.optim.Adam) and AdamW with decoupled weight decay (torch.optim.AdamW), on
// any device: BasicAdam<D>, BasicAdamW<D>; Adam and AdamW are the CPU's.
//   tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 6e-4f, .beta2 = 0.95f});
//   tg::optim::BasicAdamW<tg::cuda> gpu_opt(tg::optim::default_groups(gpu_params, 0.1f), {.lr = 6e-4f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include "typegrad/detail/math.hpp"
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
/// The state kept for a parameter of `shape` (Adam and AdamW).
inline std::vector<SlotSpec> adam_slots(const Shape& shape) { return {{"exp_avg", shape}, {"exp_avg_sq", shape}}; }
/// The constructor checks of Adam and AdamW.
inline void check_adam_options(float lr, float beta1, float beta2, float eps, const char* who) {
  TG_CHECK(lr >= 0, who, ": lr must be >= 0, got ", lr);
  TG_CHECK(beta1 >= 0 && beta1 < 1, who, ": beta1 must be in [0, 1), got ", beta1);
  TG_CHECK(beta2 >= 0 && beta2 < 1, who, ": beta2 must be in [0, 1), got ", beta2);
  TG_CHECK(eps >= 0, who, ": eps must be >= 0, got ", eps);
}

/// Adam (L2 decay folded into the gradient) and AdamW (decoupled decay) on device D: one adam_step_multi
/// call per run of parameters sharing (lr, weight decay, step count) (Note [device optimizers]).
template <Device D, bool Decoupled>
class BasicAdamRule : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  struct Hyper {
    float lr, beta1, beta2, eps, weight_decay;
  };
  const char* name() const override { return Decoupled ? "AdamW" : "Adam"; }
  bool reads_device_boundary() const override { return true; }
  std::pair<double, double> device_step_constants(std::int64_t t) const override {
    return {math::adam_bias_correction(h_.beta1, t), math::adam_bias_correction(h_.beta2, t)};
  }

 protected:
  BasicAdamRule(std::vector<BasicParamGroup<D>> groups, Hyper h)
      : Base(std::move(groups), h.lr, h.weight_decay, Decoupled ? "AdamW" : "Adam"), h_(h) {
    check_adam_options(h.lr, h.beta1, h.beta2, h.eps, Decoupled ? "AdamW" : "Adam");
  }
  std::vector<SlotSpec> slots(const Shape& shape) const override { return adam_slots(shape); }
  void update(std::span<Update> ready) override {
    Base::for_each_run(ready, [this](const Update& u) { return std::tuple(this->run_lr_key(u), u.weight_decay(), u.step()); },
                       [&](std::span<Update> run) {
                         backend::AdamScalars s;
                         s.lr = this->launch_lr(run[0]);
                         s.beta1 = h_.beta1;
                         s.beta2 = h_.beta2;
                         s.eps = h_.eps;
                         s.weight_decay = run[0].weight_decay();
                         s.decoupled = Decoupled;
                         s.step = this->launch_step(run[0]);
                         // Note [the step boundary on the device]: skip, lr (· the group's scale) and t from the state
                         s.boundary = this->boundary();
                         s.lr_scale = run[0].lr_scale();
                         tensors_.clear();
                         written_.clear();
                         for (const Update& u : run) {
                           backend::AdamTensor<fp32> t{u.p(), u.g(), u.slot(0), u.slot(1), u.numel(), nullptr,
                                                       backend::WeightCopyType::none};
                           if (const AttachedCopy* c = writable_copy(u)) {
                             t.copy = c->data;
                             t.copy_type = c->dtype == DType::bf16 ? backend::WeightCopyType::bf16 : backend::WeightCopyType::fp16;
                             written_.push_back(c);
                           }
                           tensors_.push_back(t);
                         }
                         TG_BACKEND(D, adam_step_multi<fp32>(tensors_.data(), static_cast<int>(tensors_.size()), s));
                         for (const AttachedCopy* c : written_) c->written = true;  // after the kernel ran
                       });
  }

 private:
  /// The 16-bit compute copy attached to u's parameter on D when this step can write it (Note [the optimizer
  /// writes the weight copies]): a bf16 or fp16 copy laid out element for element as the whole parameter.
  static const AttachedCopy* writable_copy(const Update& u) {
    const auto& storage = u.param->tensor.storage();
    const AttachedCopy* c = storage ? storage->attached_copy() : nullptr;
    if (!c || !c->data || c->device != device_traits<D>::kind) return nullptr;
    if (c->dtype != DType::bf16 && c->dtype != DType::f16) return nullptr;
    return c->master_data == u.p() && c->numel == u.numel() ? c : nullptr;
  }

  Hyper h_;
  std::vector<backend::AdamTensor<fp32>> tensors_;  // reused: no allocation in the steady state
  std::vector<const AttachedCopy*> written_;
};

template <Device D>
class BasicAdam final : public BasicAdamRule<D, false> {
 public:
  BasicAdam(std::vector<BasicParamGroup<D>> groups, AdamOptions o)
      : BasicAdamRule<D, false>(std::move(groups), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}) {}
  BasicAdam(std::vector<BasicParam<D>> params, AdamOptions o) : BasicAdam(BasicOptimizer<D>::one_group(std::move(params)), o) {}
};

template <Device D>
class BasicAdamW final : public BasicAdamRule<D, true> {
 public:
  BasicAdamW(std::vector<BasicParamGroup<D>> groups, AdamWOptions o)
      : BasicAdamRule<D, true>(std::move(groups), {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}) {}
  BasicAdamW(std::vector<BasicParam<D>> params, AdamWOptions o) : BasicAdamW(BasicOptimizer<D>::one_group(std::move(params)), o) {}
};

using Adam = BasicAdam<cpu>;
using AdamW = BasicAdamW<cpu>;

}  // namespace tg::optim

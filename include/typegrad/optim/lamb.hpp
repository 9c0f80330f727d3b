// LAMB: Adam's direction with decoupled weight decay, scaled per tensor by a trust ratio (You et al. 2019), on
// any device: BasicLamb<D>; Lamb is the CPU's.
//   tg::optim::Lamb opt(tg::optim::default_groups(params, 0.01f), {.lr = 2e-3f});
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "typegrad/detail/math.hpp"
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
/// The state kept for a parameter of `shape`.
inline std::vector<SlotSpec> lamb_slots(const Shape& shape) { return {{"exp_avg", shape}, {"exp_avg_sq", shape}}; }
/// The constructor checks of Lamb.
inline void check_lamb_options(const LambOptions& o, const char* who) {
  TG_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, who, ": betas must be in [0, 1), got ",
           o.beta1, ", ", o.beta2);
}

// Note [LAMB on the device]
// A LAMB step reads nothing back. The kernels compute each tensor's trust ratio where the sums are (on a GPU:
// per-chunk fp64 sums added per tensor in chunk order by one thread each) and keep the ratios in ratios_, a
// device array with one entry per parameter of the step, in the order the runs take them (layout_). The host
// reads them only when asked (last_trust_ratio: one download, kept until the next step). A step over another
// set of parameters than the last (the first step, a parameter without a gradient) moves the ratios to their
// new places first (one download and one upload), so each parameter keeps the ratio of its last update.
// With a device boundary (step_on_device, Note [the step boundary on the device]) the kernels read skip, lr
// and t from the boundary's state, and the bias corrections 1 - β^t the host wrote there
// (device_step_constants, as Adam's); a skipped step writes nothing, the ratios included.

/// LAMB on device D: one lamb_step_multi call per run of parameters sharing (lr, weight decay, step count)
/// (Note [device optimizers]).
template <Device D>
class BasicLamb final : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  BasicLamb(std::vector<BasicParamGroup<D>> groups, LambOptions o)
      : Base(std::move(groups), o.lr, o.weight_decay, "Lamb"), o_(o) {
    check_lamb_options(o, "Lamb");
  }
  BasicLamb(std::vector<BasicParam<D>> params, LambOptions o) : BasicLamb(Base::one_group(std::move(params)), o) {}
  const char* name() const override { return "Lamb"; }
  bool reads_device_boundary() const override { return true; }
  std::pair<double, double> device_step_constants(std::int64_t t) const override {
    return {math::adam_bias_correction(o_.beta1, t), math::adam_bias_correction(o_.beta2, t)};
  }
  /// The trust ratio of the last update of the named parameter (0 before its first update). Reads the step's
  /// ratios from the device once per step (Note [LAMB on the device]).
  double last_trust_ratio(const std::string& param) const {
    auto it = index_.find(param);
    if (it != index_.end()) return downloaded()[it->second];
    auto old = settled_.find(param);
    return old == settled_.end() ? 0.0 : old->second;
  }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return lamb_slots(shape); }
  void update(std::span<Update> ready) override {
    const auto key = [this](const Update& u) { return std::tuple(this->run_lr_key(u), u.weight_decay(), u.step()); };
    Base::for_each_run(ready, key, [](std::span<Update>) {});  // sorts `ready` into its runs: the ratios' order
    place_ratios(ready);
    Base::for_each_run(ready, key, [&](std::span<Update> run) {
      backend::LambScalars s;
      s.lr = this->launch_lr(run[0]);
      s.beta1 = o_.beta1;
      s.beta2 = o_.beta2;
      s.eps = o_.eps;
      s.weight_decay = run[0].weight_decay();
      s.step = this->launch_step(run[0]);
      s.boundary = this->boundary();  // Note [the step boundary on the device]: skip, lr (· the scale) and t from the state
      s.lr_scale = run[0].lr_scale();
      tensors_.clear();
      for (const Update& u : run) tensors_.push_back({u.p(), u.g(), u.slot(0), u.slot(1), u.numel()});
      fp64* ratios = ratios_.data() + (run.data() - ready.data());
      TG_BACKEND(D, lamb_step_multi<fp32>(tensors_.data(), static_cast<int>(tensors_.size()), s, ratios));
    });
    fresh_ = false;
  }

 private:
  /// Gives every parameter of this step its place in ratios_ (Note [LAMB on the device]): unchanged when the
  /// step updates the same parameters in the same order as the last one.
  void place_ratios(std::span<const Update> ready) {
    bool same = layout_.size() == ready.size();
    for (std::size_t i = 0; same && i < ready.size(); ++i) same = layout_[i] == ready[i].param;
    if (same) return;
    for (const auto& [name, i] : index_) settled_[name] = downloaded()[i];
    layout_.clear();
    index_.clear();
    std::vector<fp64> init(ready.size(), 0.0);
    for (std::size_t i = 0; i < ready.size(); ++i) {
      layout_.push_back(ready[i].param);
      index_[ready[i].param->name] = i;
      auto old = settled_.find(ready[i].param->name);
      if (old != settled_.end()) init[i] = old->second;
    }
    ratios_ = Tensor<fp64, D>::from_vector({static_cast<std::int64_t>(init.size())}, init);
    host_ = init;
    fresh_ = true;
  }
  /// The ratios of ratios_ on the host (one download after each step).
  const std::vector<fp64>& downloaded() const {
    if (!fresh_) {
      host_ = ratios_.defined() ? ratios_.to_vector() : std::vector<fp64>{};
      fresh_ = true;
    }
    return host_;
  }

  LambOptions o_;
  std::vector<backend::LambTensor<fp32>> tensors_;
  Tensor<fp64, D> ratios_;                       // the last step's ratios, in layout_'s order
  std::vector<const BasicParam<D>*> layout_;     // the parameters of the last step, in the runs' order
  std::map<std::string, std::size_t> index_;     // their places in ratios_
  std::map<std::string, double> settled_;        // the last ratios of parameters updated before, by name
  mutable std::vector<fp64> host_;
  mutable bool fresh_ = true;
};

using Lamb = BasicLamb<cpu>;

}  // namespace tg::optim

// Adafactor: factored second moments, relative step sizes and update clipping (Shazeer & Stern 2018), on any
// device: BasicAdafactor<D>; Adafactor is the CPU's.
//   tg::optim::Adafactor opt(params, {});                       // the paper's defaults, no first moment
//   loss.backward();  opt.step();  opt.zero_grad();
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>

#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

struct AdafactorOptions {
  float lr = 1e-2f;              // relative_step: the cap of ρ_t; else ρ_t itself
  float eps1 = 1e-30f;           // ε1, added to G²
  float eps2 = 1e-3f;            // ε2, floor of RMS(X) in the step scale
  float clip_threshold = 1.f;    // d
  float decay_rate = 0.8f;       // c in β̂2_t = 1 − t^(−c)
  float beta1 = 0.f;             // 0: no first moment (the paper's default); else β1
  float weight_decay = 0.f;      // decoupled: X −= α_t·λ·X
  bool relative_step = true;
  bool scale_parameter = true;
};

// Note [Adafactor update]
// Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", Algorithms 4
// (matrices) and 5 (vectors) with the relative step size of section 8 and update clipping of section 6.
// For a parameter X with gradient G at step t = 1, 2, ...:
//   ρ_t  = min(lr, 1/sqrt(t))   (relative_step, lr = 10⁻² as in the paper)      or  ρ_t = lr
//   α_t  = max(ε2, RMS(X_{t−1}))·ρ_t   (scale_parameter)                        or  α_t = ρ_t
//   β̂2_t = 1 − t^(−c)                 (c = decay_rate = 0.8)
//   X ≥ 2-D, viewed as [n, m] = [prod(all dims but the last), last]:
//     R_t = β̂2_t·R_{t−1} + (1 − β̂2_t)·(G² + ε1·1_n 1_mᵀ)·1_m               (row sums, [n])
//     C_t = β̂2_t·C_{t−1} + (1 − β̂2_t)·1_nᵀ·(G² + ε1·1_n 1_mᵀ)              (column sums, [m])
//     V̂_t = R_t·C_t / (1_nᵀ·R_t)
//   X 0-D or 1-D:  V̂_t = β̂2_t·V̂_{t−1} + (1 − β̂2_t)·(G² + ε1)
//   U_t  = G / sqrt(V̂_t),   Û_t = U_t / max(1, RMS(U_t)/d)
//   [β1 > 0:  m_t = β1·m_{t−1} + (1 − β1)·Û_t, and m_t replaces Û_t below]
//   X_t  = X_{t−1} − α_t·λ·X_{t−1} − α_t·Û_t
// RMS(x) = sqrt(mean(x²)), accumulated in fp64. Memory: n + m floats for a matrix instead of n·m.
// State: "<name>.exp_avg_sq_row" [n] and ".exp_avg_sq_col" [m], or ".exp_avg_sq"; ".exp_avg" when β1 > 0.
/// Whether Adafactor factors the second moment of a parameter of `shape` (2-D and up), and its [rows, cols] view.
inline bool adafactor_factored(const Shape& shape) { return shape.size() >= 2; }
inline std::int64_t adafactor_cols(const Shape& shape) { return shape.back(); }
inline std::int64_t adafactor_rows(const Shape& shape) {
  return adafactor_cols(shape) == 0 ? 0 : shape.numel() / adafactor_cols(shape);
}
/// The state kept for a parameter of `shape`.
inline std::vector<SlotSpec> adafactor_slots(const AdafactorOptions& o, const Shape& shape) {
  std::vector<SlotSpec> s;
  if (adafactor_factored(shape)) {
    s.push_back({"exp_avg_sq_row", Shape{adafactor_rows(shape)}});
    s.push_back({"exp_avg_sq_col", Shape{adafactor_cols(shape)}});
  } else {
    s.push_back({"exp_avg_sq", shape});
  }
  if (o.beta1 > 0) s.push_back({"exp_avg", shape});
  return s;
}
/// β̂2_t = 1 − t^(−c) and 1/sqrt(t) of step t >= 1: the step constants a device boundary hands the kernels.
inline std::pair<double, double> adafactor_step_constants(const AdafactorOptions& o, std::int64_t step) {
  const double t = static_cast<double>(step);
  return {1.0 - std::pow(t, -static_cast<double>(o.decay_rate)), 1.0 / std::sqrt(t)};
}
/// The per-step scalars of one parameter at its step t >= 1 with the group's lr and weight decay.
inline backend::AdafactorScalars adafactor_scalars(const AdafactorOptions& o, float lr, float weight_decay,
                                                        std::int64_t step) {
  const auto [beta2, inv_sqrt_t] = adafactor_step_constants(o, step);
  backend::AdafactorScalars s;
  s.rho = o.relative_step ? std::min(static_cast<double>(lr), inv_sqrt_t) : lr;
  s.relative_step = o.relative_step;
  s.scale_parameter = o.scale_parameter;
  s.beta2 = beta2;
  s.eps1 = o.eps1;
  s.eps2 = o.eps2;
  s.clip_threshold = o.clip_threshold;
  s.beta1 = o.beta1;
  s.weight_decay = weight_decay;
  return s;
}
/// The constructor checks of Adafactor.
inline void check_adafactor_options(const AdafactorOptions& o, const char* who) {
  TG_CHECK(o.beta1 >= 0 && o.beta1 < 1, who, ": beta1 must be in [0, 1), got ", o.beta1);
  TG_CHECK(o.clip_threshold > 0, who, ": clip_threshold must be > 0, got ", o.clip_threshold);
}

/// Adafactor on device D: one adafactor_step_multi call per run of parameters sharing (lr, weight decay, step
/// count) (Note [device optimizers]).
template <Device D>
class BasicAdafactor final : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  BasicAdafactor(std::vector<BasicParamGroup<D>> groups, AdafactorOptions o)
      : Base(std::move(groups), o.lr, o.weight_decay, "Adafactor"), o_(o) {
    check_adafactor_options(o, "Adafactor");
  }
  BasicAdafactor(std::vector<BasicParam<D>> params, AdafactorOptions o)
      : BasicAdafactor(Base::one_group(std::move(params)), o) {}
  const char* name() const override { return "Adafactor"; }
  bool reads_device_boundary() const override { return true; }
  std::pair<double, double> device_step_constants(std::int64_t t) const override { return adafactor_step_constants(o_, t); }

 protected:
  std::vector<SlotSpec> slots(const Shape& shape) const override { return adafactor_slots(o_, shape); }
  void update(std::span<Update> ready) override {
    Base::for_each_run(ready, [this](const Update& u) { return std::tuple(this->run_lr_key(u), u.weight_decay(), u.step()); },
                       [&](std::span<Update> run) {
                         // under a device boundary ρ and β̂2 are read there too: the host's are those of lr 0, t 1
                         auto s = adafactor_scalars(o_, this->launch_lr(run[0]), run[0].weight_decay(), this->launch_step(run[0], 1));
                         // Note [the step boundary on the device]: skip, lr (· the scale), β̂2_t and 1/sqrt(t) from the state
                         s.boundary = this->boundary();
                         s.lr_scale = run[0].lr_scale();
                         tensors_.clear();
                         for (const Update& u : run) {
                           if (u.numel() == 0) continue;
                           fp32* m = o_.beta1 > 0 ? u.slot(u.state->slots.size() - 1) : nullptr;
                           if (adafactor_factored(u.shape()))
                             tensors_.push_back({u.p(), u.g(), u.slot(0), u.slot(1), nullptr, m, adafactor_rows(u.shape()),
                                                 adafactor_cols(u.shape())});
                           else
                             tensors_.push_back({u.p(), u.g(), nullptr, nullptr, u.slot(0), m, 1, u.numel()});
                         }
                         if (tensors_.empty()) return;
                         TG_BACKEND(D, adafactor_step_multi<fp32>(tensors_.data(), static_cast<int>(tensors_.size()), s));
                       });
  }

 private:
  AdafactorOptions o_;
  std::vector<backend::AdafactorTensor<fp32>> tensors_;
};

using Adafactor = BasicAdafactor<cpu>;

}  // namespace tg::optim

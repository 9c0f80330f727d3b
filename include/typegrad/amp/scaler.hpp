// Loss scalers: DynamicScaler (torch.cuda.amp.GradScaler semantics), StaticScaler, NoScaler; the default
// scaler of a precision policy; the state (scale, growth tracker, skipped steps) as a plain struct.
//   tg::amp::DynamicScaler scaler;                      // 2^16, x2 after 2000 clean steps, x0.5 on inf/NaN
//   accum.scale(loss, scaler).backward();  accum.micro_step(opt, schedule, 1.0, scaler);  scaler.state();
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "typegrad/amp/precision.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/amp_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::amp {

// Note [loss scaling]
// fp16 has 5 exponent bits: gradient values below 2^-24 round to zero and small activations' gradients
// vanish. Multiplying the loss by S multiplies every gradient by S, moving them into fp16's range; the
// masters' fp32 gradients are divided by S ("unscaled") before anything reads them (clipping, the
// optimizer), so clipping thresholds and learning rates mean what they mean without scaling.
// A scaled gradient can overflow to inf; the optimizer step is then skipped (weights, optimizer state
// and the optimizer's step counts untouched), gradients are dropped, and DynamicScaler halves S.
// DynamicScaler follows PyTorch's GradScaler (torch/amp/grad_scaler.py, _amp_update_scale_):
//   init S = 2^16; on an inf/NaN step: S *= backoff (0.5), growth tracker = 0;
//   on a clean step: tracker += 1, and when it reaches growth_interval (2000): S *= growth (2), tracker = 0.
// StaticScaler keeps S fixed but still skips non-finite steps; NoScaler does nothing (scale 1, no check,
// no skip: a plain fp32 or bf16 run). The learning-rate schedule is NOT advanced by a skipped step
// (optim/grad_accum.hpp, Note [gradient accumulation]): unlike PyTorch, where the user calls
// scheduler.step() every iteration, the schedule here counts applied updates, so the overflow steps fp16
// runs take while the scale settles at the start do not eat the warmup.

/// Everything a checkpoint needs to restore a scaler (hyperparameters included, as PyTorch's state_dict).
struct ScalerState {
  double scale = 1.0;
  std::int64_t growth_tracker = 0;   // consecutive clean steps since the last change of scale
  std::int64_t skipped_steps = 0;    // optimizer steps skipped for inf/NaN gradients (total)
  std::int64_t steps = 0;            // optimizer steps attempted through this scaler (taken + skipped)
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
  bool operator==(const ScalerState&) const = default;
};

namespace detail {
/// Unscales every master gradient of `opt` (an optim::BasicOptimizer<D> on any device) by 1/scale; true
/// when any is inf or NaN. CPU gradients go through the CPU kernel one by one; device gradients through one
/// multi-tensor launch (backend::cuda::unscale_and_check: one flag read back).
template <class Opt>
bool unscale_grads(const Opt& opt, double scale) {
  const float inv = static_cast<float>(1.0 / scale);
  bool found_inf = false;
  std::vector<float*> device_grads;
  std::vector<std::int64_t> device_sizes;
  opt.for_each_param([&](const auto& p) {
    const auto g = p.tensor.grad();
    if (!g.defined()) return;
    if constexpr (std::is_same_v<typename std::decay_t<decltype(g)>::device_type, cpu>) {
      backend::report_launch("unscale_and_check", true, g.data(), g.numel(), inv);  // Note [launch watch]: a read
      found_inf = backend::cpu::unscale_and_check<fp32>(g.data(), g.numel(), inv) || found_inf;
    } else {
      device_grads.push_back(g.data());
      device_sizes.push_back(g.numel());
    }
  });
  if (!device_grads.empty()) {
    backend::report_launch("unscale_and_check_multi", true, device_grads, device_sizes, inv);  // Note [launch watch]: a read
    found_inf = backend::cuda::unscale_and_check(device_grads.data(), device_sizes.data(),
                                                 static_cast<int>(device_grads.size()), inv) || found_inf;
  }
  return found_inf;
}
inline void check_scale(double s, const char* who) {
  TG_CHECK(std::isfinite(s) && s > 0, who, ": scale must be finite and > 0, got ", s);
}
}  // namespace detail

/// No scaling (scale 1), no inf/NaN check, never skips.
class NoScaler {
 public:
  static constexpr bool scales_loss = false;
  static constexpr const char* kind() { return "none"; }
  double scale() const { return 1.0; }
  /// Nothing to unscale; reports no overflow (an fp32/bf16 run steps whatever the gradients hold).
  template <class Opt>
  bool unscale(const Opt&) {
    return false;
  }
  void update(bool found_inf) {
    (void)found_inf;
    ++steps_;
  }
  ScalerState state() const {
    ScalerState s;
    s.steps = steps_;
    s.growth_factor = s.backoff_factor = 1.0;
    return s;
  }
  void load_state(const ScalerState& s) {
    TG_CHECK(s.scale == 1.0 && s.skipped_steps == 0, "NoScaler::load_state: the state is a scaling scaler's (scale ",
             s.scale, ", ", s.skipped_steps, " skipped steps); load it into the scaler that saved it");
    steps_ = s.steps;
  }

 private:
  std::int64_t steps_ = 0;
};

/// A fixed scale; steps with inf/NaN gradients are skipped (the scale does not change).
class StaticScaler {
 public:
  static constexpr bool scales_loss = true;
  static constexpr const char* kind() { return "static"; }
  explicit StaticScaler(double scale = 1024.0) {
    detail::check_scale(scale, "StaticScaler");
    st_.scale = scale;
    st_.growth_factor = st_.backoff_factor = 1.0;
  }
  double scale() const { return st_.scale; }
  template <class Opt>
  bool unscale(const Opt& opt) {
    return detail::unscale_grads(opt, st_.scale);
  }
  void update(bool found_inf) {
    ++st_.steps;
    if (found_inf) ++st_.skipped_steps;
  }
  const ScalerState& state() const { return st_; }
  void load_state(const ScalerState& s) {
    detail::check_scale(s.scale, "StaticScaler::load_state");
    TG_CHECK(s.skipped_steps >= 0 && s.steps >= s.skipped_steps, "StaticScaler::load_state: steps (", s.steps,
             ") must be >= skipped_steps (", s.skipped_steps, ") >= 0");
    st_ = s;
  }

 private:
  ScalerState st_;
};

struct DynamicScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;
};

/// PyTorch GradScaler semantics (Note [loss scaling]).
class DynamicScaler {
 public:
  static constexpr bool scales_loss = true;
  static constexpr const char* kind() { return "dynamic"; }
  DynamicScaler() : DynamicScaler(DynamicScalerOptions{}) {}
  explicit DynamicScaler(DynamicScalerOptions o) {
    detail::check_scale(o.init_scale, "DynamicScaler");
    TG_CHECK(o.growth_factor > 1.0, "DynamicScaler: growth_factor must be > 1, got ", o.growth_factor);
    TG_CHECK(o.backoff_factor > 0.0 && o.backoff_factor < 1.0, "DynamicScaler: backoff_factor must be in (0, 1), got ",
             o.backoff_factor);
    TG_CHECK(o.growth_interval >= 1, "DynamicScaler: growth_interval must be >= 1, got ", o.growth_interval);
    st_.scale = o.init_scale;
    st_.growth_factor = o.growth_factor;
    st_.backoff_factor = o.backoff_factor;
    st_.growth_interval = o.growth_interval;
  }
  double scale() const { return st_.scale; }
  /// Divides every master gradient by the scale (before clipping); true when any was inf or NaN.
  template <class Opt>
  bool unscale(const Opt& opt) {
    return detail::unscale_grads(opt, st_.scale);
  }
  /// Called once per optimizer step with unscale()'s answer: backoff on overflow, growth after
  /// growth_interval clean steps in a row.
  void update(bool found_inf) {
    ++st_.steps;
    if (found_inf) {
      ++st_.skipped_steps;
      st_.scale *= st_.backoff_factor;
      st_.growth_tracker = 0;
      return;
    }
    if (++st_.growth_tracker == st_.growth_interval) {
      const double grown = st_.scale * st_.growth_factor;
      if (std::isfinite(grown) && grown <= std::numeric_limits<float>::max()) st_.scale = grown;  // an fp32 scale, as PyTorch's
      st_.growth_tracker = 0;
    }
  }
  const ScalerState& state() const { return st_; }
  void load_state(const ScalerState& s) {
    detail::check_scale(s.scale, "DynamicScaler::load_state");
    TG_CHECK(s.growth_factor > 1.0 && s.backoff_factor > 0.0 && s.backoff_factor < 1.0 && s.growth_interval >= 1,
             "DynamicScaler::load_state: growth_factor ", s.growth_factor, " (must be > 1), backoff_factor ",
             s.backoff_factor, " (in (0, 1)), growth_interval ", s.growth_interval, " (>= 1)");
    TG_CHECK(s.growth_tracker >= 0 && s.growth_tracker < s.growth_interval, "DynamicScaler::load_state: growth_tracker ",
             s.growth_tracker, " must be in [0, growth_interval = ", s.growth_interval, ")");
    TG_CHECK(s.skipped_steps >= 0 && s.steps >= s.skipped_steps, "DynamicScaler::load_state: steps (", s.steps,
             ") must be >= skipped_steps (", s.skipped_steps, ") >= 0");
    st_ = s;
  }

 private:
  ScalerState st_;
};

template <class S>
concept LossScaler = requires(S s, const S cs, const optim::Optimizer& opt, bool b) {
  { S::scales_loss } -> std::convertible_to<bool>;
  { cs.scale() } -> std::convertible_to<double>;
  { s.unscale(opt) } -> std::same_as<bool>;
  s.update(b);
  { cs.state() } -> std::convertible_to<ScalerState>;
};

/// The scaler a policy gets when none is named: DynamicScaler for fp16 compute, NoScaler otherwise.
template <PrecisionPolicy P>
using default_scaler_t = std::conditional_t<P::requires_loss_scaling, DynamicScaler, NoScaler>;

}  // namespace tg::amp

// Learning-rate schedules counted in optimizer steps: constant, linear warmup, cosine / linear decay to a
// floor, inverse square root; warmup composes with any of them. lr_at(step) is pure; Schedule also steps.
//   tg::optim::Schedule s = tg::optim::Warmup{100}.then(tg::optim::Cosine{.peak = 6e-4f, .steps = 900, .min_lr = 6e-5f});
//   opt.set_lr(s.lr());  opt.step();  s.advance();           // or s.lr_at(k) for any step k
#pragma once

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <numbers>

#include "typegrad/core/error.hpp"

namespace tg::optim {

// Note [schedule steps]
// Steps are counted from 0: lr_at(0) is the lr of the first optimizer step. Each schedule below gives
// lr_at(t) for t >= 0 (negative t is treated as 0) and its peak lr, which warmup ramps up to.
// Warmup{W}.then(D):  lr(t) = D.peak · (t + 1) / W   for t < W   (reaches the peak at t = W − 1)
//                     lr(t) = D.lr_at(t − W)          for t >= W  (D's own clock starts after warmup)

/// lr(t) = lr.
struct Constant {
  float lr = 0.f;
  float peak_lr() const { return lr; }
  float lr_at(std::int64_t) const { return lr; }
  void validate() const {}
};

/// lr(t) = min_lr + (peak − min_lr)·½·(1 + cos(π·min(t, steps)/steps))   (Loshchilov & Hutter 2017, SGDR,
/// one cycle without restarts). min_lr from `steps` on.
struct Cosine {
  float peak = 0.f;
  std::int64_t steps = 0;
  float min_lr = 0.f;
  float peak_lr() const { return peak; }
  float lr_at(std::int64_t t) const {
    const double x = static_cast<double>(std::clamp<std::int64_t>(t, 0, steps)) / static_cast<double>(steps);
    return static_cast<float>(min_lr + (static_cast<double>(peak) - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * x)));
  }
  void validate() const { TG_CHECK(steps > 0, "Cosine: steps must be > 0, got ", steps); }
};

/// lr(t) = peak + (min_lr − peak)·min(t, steps)/steps.
struct LinearDecay {
  float peak = 0.f;
  std::int64_t steps = 0;
  float min_lr = 0.f;
  float peak_lr() const { return peak; }
  float lr_at(std::int64_t t) const {
    const double x = static_cast<double>(std::clamp<std::int64_t>(t, 0, steps)) / static_cast<double>(steps);
    return static_cast<float>(peak + (static_cast<double>(min_lr) - peak) * x);
  }
  void validate() const { TG_CHECK(steps > 0, "LinearDecay: steps must be > 0, got ", steps); }
};

/// lr(t) = peak · sqrt(timescale / (t + timescale))   (Vaswani et al. 2017, section 5.3, after warmup;
/// with Warmup{W}, timescale = W gives the Transformer's peak·sqrt(W)/sqrt(step)).
struct InverseSqrt {
  float peak = 0.f;
  std::int64_t timescale = 1;
  float peak_lr() const { return peak; }
  float lr_at(std::int64_t t) const {
    const double s = static_cast<double>(timescale);
    return static_cast<float>(peak * std::sqrt(s / (static_cast<double>(std::max<std::int64_t>(t, 0)) + s)));
  }
  void validate() const { TG_CHECK(timescale > 0, "InverseSqrt: timescale must be > 0, got ", timescale); }
};

template <class S>
concept LrSchedule = requires(const S& s, std::int64_t t) {
  { s.lr_at(t) } -> std::convertible_to<float>;
  { s.peak_lr() } -> std::convertible_to<float>;
  s.validate();
};


template <LrSchedule D>
struct WarmupThen {
  std::int64_t warmup = 0;
  D decay;
  float peak_lr() const { return decay.peak_lr(); }
  float lr_at(std::int64_t t) const {
    t = std::max<std::int64_t>(t, 0);
    if (t < warmup) return static_cast<float>(static_cast<double>(peak_lr()) * static_cast<double>(t + 1) / static_cast<double>(warmup));
    return decay.lr_at(t - warmup);
  }
  void validate() const {
    TG_CHECK(warmup >= 0, "Warmup: steps must be >= 0, got ", warmup);
    decay.validate();
  }
};

/// Linear warmup over `steps` optimizer steps, to the peak of the schedule given to then().
struct Warmup {
  std::int64_t steps = 0;
  template <LrSchedule D>
  WarmupThen<D> then(D decay) const {
    return {steps, decay};
  }
};

/// A type-erased schedule with a step counter (the stateful stepper). The counter advances once per
/// optimizer step (GradAccum does it for you) and is part of the training state (set_step on resume).
class Schedule {
 public:
  template <LrSchedule S>
  Schedule(S s)  // implicit: any schedule above converts
  {
    s.validate();
    peak_ = s.peak_lr();
    fn_ = [s](std::int64_t t) { return static_cast<float>(s.lr_at(t)); };
  }
  Schedule() : Schedule(Constant{0.f}) {}

  float lr_at(std::int64_t step) const { return fn_(step); }
  float peak_lr() const { return peak_; }
  /// The lr of the current step.
  float lr() const { return fn_(step_); }
  /// Moves to the next step; returns its lr.
  float advance() { return fn_(++step_); }
  std::int64_t step() const { return step_; }
  void set_step(std::int64_t step) {
    TG_CHECK(step >= 0, "Schedule::set_step: step must be >= 0, got ", step);
    step_ = step;
  }

 private:
  std::function<float(std::int64_t)> fn_;
  float peak_ = 0.f;
  std::int64_t step_ = 0;
};

}  // namespace tg::optim

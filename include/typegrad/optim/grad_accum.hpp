// Gradient accumulation as a type: N micro-batches per optimizer step, N fixed at compile time
// (GradAccum<N>) or at run time (GradAccumRuntime{n}, for CLIs); one implementation for both.
//   tg::optim::GradAccum<4> accum;   // for each micro-batch:
//   accum.scale(loss).backward();  if (accum.micro_step(opt, schedule)) log(schedule.step());
//   accum.scale(loss, scaler).backward();  accum.micro_step(opt, schedule, 1.0, scaler);   // with a loss scaler
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "typegrad/ops/binary.hpp"
#include "typegrad/optim/clip.hpp"
#include "typegrad/optim/device_boundary.hpp"
#include "typegrad/optim/schedule.hpp"

namespace tg::optim {

// Note [gradient accumulation]
// With a loss that is a mean over its micro-batch of b samples, backward of loss/N on each of N
// micro-batches sums to the gradient of the mean over all N·b samples, so N micro-steps equal one step on
// the big batch. micro_step() counts calls; on every N-th it (1) optionally clips the accumulated gradients
// by global norm, (2) sets the optimizer's lr from the schedule's current step, (3) steps the optimizer,
// (4) advances the schedule once, (5) zeroes the gradients, and returns true. So the schedule's counter
// always equals the number of optimizer steps it drove. The count policy is the only difference between
// the compile-time and run-time forms.
// With a loss scaler (amp/scaler.hpp, Note [loss scaling]) the loss is scaled by S/N (scale(loss,
// scaler)), and on every N-th call the gradients are first unscaled (divided by S) and checked for
// inf/NaN; then, before (1): the scaler updates, and on overflow the step is skipped: no clipping, no
// optimizer step, no schedule advance (the schedule counts applied updates), gradients dropped,
// skipped_steps() and last_step_skipped() tell it, and micro_step still returns true (a step boundary).
//
// Note [non-finite steps without a scaler]
// A run without a loss scaler (fp32, bf16) has nothing that looks at the gradients, so a NaN or infinite
// loss or gradient would be applied to the weights and every later checkpoint would hold poison. With
// on_non_finite(stop) or (skip), the N-th micro_step measures the global gradient norm first (the same
// pass that clipping makes, so it costs nothing extra when clipping) and looks at the losses the caller
// reported through note_loss(); if either is NaN or infinite, no update is applied: `stop` zeroes the
// gradients and throws NonFiniteStep (the weights, optimizer state and schedule are as after the last good
// step, so a checkpoint taken then is still the newest good one); `skip` drops the gradients and counts a
// skipped step exactly as a loss scaler's overflow does. With a scaler that scales the loss, the scaler's
// own check decides (a skipped fp16 step is routine, not an error).

/// What micro_step does with a non-finite loss or gradient norm when no loss scaler checks for it.
enum class OnNonFinite { apply, stop, skip };

/// Thrown by micro_step under OnNonFinite::stop; nothing was applied for the step.
class NonFiniteStep : public Error {
 public:
  using Error::Error;
};

namespace detail {
template <std::int64_t N>
struct StaticCount {
  static_assert(N >= 1, "GradAccum<N>: N (micro-batches per optimizer step) must be at least 1");
  static constexpr std::int64_t count() { return N; }
};
struct RuntimeCount {
  std::int64_t n = 1;
  constexpr std::int64_t count() const { return n; }
};
}  // namespace detail

template <class CountPolicy>
class GradAccumulator {
 public:
  GradAccumulator() = default;
  explicit GradAccumulator(CountPolicy policy) : policy_(policy) {
    TG_CHECK(policy_.count() >= 1, "GradAccumRuntime: n (micro-batches per optimizer step) must be at least 1, got ",
             policy_.count());
  }

  /// Micro-batches per optimizer step.
  constexpr std::int64_t n() const { return policy_.count(); }
  /// 1/N, to fold into the loss.
  constexpr double loss_scale() const { return 1.0 / static_cast<double>(n()); }
  /// loss · (1/N) (tg::mul, recorded on the tape).
  template <FloatingElement T, Device D>
  Tensor<T, D> scale(const Tensor<T, D>& loss) const {
    return mul(loss, loss_scale());
  }

  /// Call once per micro-batch after its backward; returns true when this call stepped the optimizer
  /// (every N-th call). `max_grad_norm` clips the accumulated gradients first (see last_grad_norm()).
  template <class Opt>
  bool micro_step(Opt& opt, Schedule& schedule, std::optional<double> max_grad_norm = std::nullopt) {
    NoScaling none;
    return micro_step(opt, schedule, max_grad_norm, none);
  }

  /// loss · (S/N) for a loss scaler's scale S (recorded on the tape).
  template <FloatingElement T, Device D, class Scaler>
  Tensor<T, D> scale(const Tensor<T, D>& loss, const Scaler& scaler) const {
    return mul(loss, scaler.scale() * loss_scale());
  }

  /// micro_step with a loss scaler: on every N-th call unscale, check, update the scaler, and skip the
  /// step on inf/NaN (Note [gradient accumulation]).
  template <class Opt, class Scaler>
  bool micro_step(Opt& opt, Schedule& schedule, std::optional<double> max_grad_norm, Scaler& scaler) {
    if (++micro_ < n()) return false;
    micro_ = 0;
    bool found_inf = scaler.unscale(opt);
    bool bad_loss = std::exchange(bad_loss_, false);
    const bool bad_loss_here = bad_loss;
    const double bad_loss_value = bad_loss_value_;
    if (cross_) {  // every rank decides alike (Note [cross-rank step decisions])
      double flags[2] = {found_inf ? 1.0 : 0.0, bad_loss ? 1.0 : 0.0};
      cross_->sum(flags);
      found_inf = flags[0] > 0;
      bad_loss = flags[1] > 0;
    }
    scaler.update(found_inf);
    last_skipped_ = found_inf;
    if (found_inf) {
      opt.zero_grad();
      ++skipped_;
      return true;
    }
    constexpr bool scaler_checks = [] {
      if constexpr (requires { Scaler::scales_loss; }) return static_cast<bool>(Scaler::scales_loss);
      else return false;
    }();
    if (on_non_finite_ != OnNonFinite::apply && !scaler_checks) {
      // Note [non-finite steps without a scaler]: one pass measures (and clips) the global norm.
      last_norm_ = clip_grad_norm(opt, max_grad_norm.value_or(std::numeric_limits<double>::infinity()), cross_);
      if (bad_loss || !std::isfinite(last_norm_)) {
        opt.zero_grad();
        if (on_non_finite_ == OnNonFinite::stop) {
          if (bad_loss && !bad_loss_here) throw NonFiniteStep("another rank's loss is not finite; no update was applied");
          if (bad_loss) throw NonFiniteStep("the loss is ", bad_loss_value, "; no update was applied");
          throw NonFiniteStep("the global gradient norm is ", last_norm_, "; no update was applied");
        }
        last_skipped_ = true;
        ++skipped_;
        return true;
      }
      max_grad_norm.reset();  // clipped above
    }
    if (max_grad_norm) last_norm_ = clip_grad_norm(opt, *max_grad_norm, cross_);
    opt.set_lr(schedule.lr());
    opt.step();
    schedule.advance();
    opt.zero_grad();
    ++steps_;
    return true;
  }

  /// micro_step with the decision on the device (Note [the step boundary on the device]): on every N-th
  /// call the boundary's kernels decide and the optimizer steps from them; nothing is read. The host's
  /// counters advance in finish_device_step, after the step's state is read.
  template <class Opt, class Boundary>
  bool micro_step_on_device(Opt& opt, Boundary& boundary) {
    if (++micro_ < n()) return false;
    micro_ = 0;
    boundary.decide(opt);
    opt.step_on_device(boundary.state());
    opt.zero_grad();
    pending_device_step_ = true;
    return true;
  }
  /// The host's side of a step decided on the device, from its read state: the scaler's update, the step
  /// counts, the schedule and the reported norm, as micro_step leaves them for the same decision. Throws
  /// NonFiniteStep as micro_step does under OnNonFinite::stop (nothing was applied).
  template <class Opt, class Scaler>
  void finish_device_step(Opt& opt, Schedule& schedule, Scaler& scaler, const BoundaryReadout& r) {
    TG_CHECK(pending_device_step_, "GradAccum::finish_device_step: no step was decided on the device");
    pending_device_step_ = false;
    bad_loss_ = false;
    constexpr bool scaler_checks = [] {
      if constexpr (requires { Scaler::scales_loss; }) return static_cast<bool>(Scaler::scales_loss);
      else return false;
    }();
    const bool found_inf = scaler_checks && r.found_inf;
    scaler.update(found_inf);
    last_skipped_ = found_inf;
    if (r.norm_measured) last_norm_ = r.norm;
    if (!r.skipped) {
      schedule.advance();
      ++steps_;
      return;
    }
    opt.undo_step();
    if (!found_inf && on_non_finite_ == OnNonFinite::stop) {
      if (r.bad_loss && !r.bad_loss_here) throw NonFiniteStep("another rank's loss is not finite; no update was applied");
      if (r.bad_loss) throw NonFiniteStep("the loss is ", r.bad_loss_value, "; no update was applied");
      throw NonFiniteStep("the global gradient norm is ", r.norm, "; no update was applied");
    }
    last_skipped_ = true;
    ++skipped_;
  }

  /// Takes back a step decided on the device whose outcome could not be read (an error between its
  /// optimizer step and finish_device_step): the optimizer's step counts as before it. Nothing when none is
  /// pending.
  template <class Opt>
  void abandon_device_step(Opt& opt) {
    if (!pending_device_step_) return;
    pending_device_step_ = false;
    opt.undo_step();
  }

  /// After an error inside a step (a micro-batch's forward, loss or backward threw, or a step decided on the
  /// device could not be read): the step is dropped whole. A pending device step is taken back
  /// (abandon_device_step), the micro-batches' partial gradients are dropped and the count starts again, so the
  /// next call begins a new step at micro-batch 0 instead of finishing this one with the next step's batches.
  /// Nothing happens to a step already taken; harmless between steps.
  template <class Opt>
  void abandon_step(Opt& opt) {
    abandon_device_step(opt);
    micro_ = 0;
    bad_loss_ = false;
    opt.zero_grad();
  }

  /// Note [non-finite steps without a scaler]: what to do with a NaN/inf loss or gradient norm when no
  /// loss scaler checks the gradients (default: apply, as torch does).
  void on_non_finite(OnNonFinite policy) { on_non_finite_ = policy; }
  /// The other ranks of a data-parallel run (Note [cross-rank step decisions]); nullptr: one process. Watched,
  /// not owned.
  void cross_rank(const CrossRank* c) { cross_ = c; }
  OnNonFinite non_finite_policy() const { return on_non_finite_; }
  /// Reports a micro-batch's loss; a non-finite one makes the step boundary stop or skip (per the policy).
  void note_loss(double loss) {
    if (!std::isfinite(loss) && !bad_loss_) {
      bad_loss_ = true;
      bad_loss_value_ = loss;
    }
  }

  /// Micro-batches seen since the last optimizer step (0 .. N-1).
  std::int64_t micro_index() const { return micro_; }
  /// Optimizer steps taken through this accumulator.
  std::int64_t steps() const { return steps_; }
  /// Restores the position saved in a checkpoint (taken between optimizer steps: no micro-batch pending).
  void restore(std::int64_t steps, std::int64_t micro_index = 0) {
    TG_CHECK(steps >= 0 && micro_index == 0, "GradAccum::restore: steps must be >= 0 and micro_index 0 (checkpoints ",
             "are taken between optimizer steps), got steps ", steps, ", micro_index ", micro_index);
    steps_ = steps;
    micro_ = 0;
    bad_loss_ = false;
  }
  /// The global gradient norm measured by the last clipping micro_step (0 before any).
  double last_grad_norm() const { return last_norm_; }
  /// Optimizer steps skipped because a loss scaler found inf/NaN gradients.
  std::int64_t skipped_steps() const { return skipped_; }
  /// Whether the last step boundary was skipped.
  bool last_step_skipped() const { return last_skipped_; }

 private:
  struct NoScaling {  // the plain path: scale 1, no check
    template <class Opt>
    bool unscale(const Opt&) {
      return false;
    }
    void update(bool) {}
  };
  CountPolicy policy_{};
  std::int64_t micro_ = 0;
  std::int64_t steps_ = 0;
  double last_norm_ = 0.0;
  std::int64_t skipped_ = 0;
  bool last_skipped_ = false;
  OnNonFinite on_non_finite_ = OnNonFinite::apply;
  const CrossRank* cross_ = nullptr;
  bool bad_loss_ = false;
  double bad_loss_value_ = 0.0;
  bool pending_device_step_ = false;
};

/// N micro-batches per optimizer step, N known at compile time.
template <std::int64_t N>
using GradAccum = GradAccumulator<detail::StaticCount<N>>;

/// N micro-batches per optimizer step, N chosen at run time (a CLI's --grad-accum).
class GradAccumRuntime : public GradAccumulator<detail::RuntimeCount> {
 public:
  explicit GradAccumRuntime(std::int64_t n) : GradAccumulator(detail::RuntimeCount{n}) {}
};

}  // namespace tg::optim

// The training step as one type: the precision policy, its loss scaler and weight copies, gradient
// accumulation and the activation-checkpointing policy, and the whole step boundary in one place.
//   tg::train::TrainStep<tg::amp::bf16_mixed, tg::SelectiveRecompute> step(params, opt, schedule, {.clip = 1.0});
//   const tg::train::StepResult r = step.run(model, [&] { return sampler.next(); }, dropout_gen);   // r.loss, r.lr, ...
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/amp/fp32_matmul.hpp"
#include "typegrad/amp/mixed_precision.hpp"
#include "typegrad/autodiff/checkpoint.hpp"
#include "typegrad/optim/cross_rank.hpp"
#include "typegrad/optim/device_boundary.hpp"
#include "typegrad/optim/grad_accum.hpp"
#include "typegrad/optim/optimizer.hpp"
#include "typegrad/optim/schedule.hpp"

namespace tg::train {

// Note [the training step]
// TrainStep<Policy, Checkpointing, D, Accum, Scaler> is what one optimizer step of a language model is:
//   for each of the N micro-batches (Accum: GradAccum<N>, or GradAccumRuntime for a CLI's --grad-accum;
//   one class, Note [gradient accumulation]):
//     forward in the policy's compute type, reading the per-step weight copies (Note [master weights
//     and per-step copies]), its blocks under the Checkpointing policy (NoCheckpoint, SelectiveRecompute
//     or RecomputeAll; Note [checkpoint regions]); the loss in fp32 (Note [autocast rules]);
//     backward of loss · S/N (S: the scaler's scale, 1 without one);
//   then the boundary, in this order and nowhere else:
//     unscale (÷S) -> inf/NaN check (the scaler's, or Note [non-finite steps without a scaler]) ->
//     clip the global norm -> optimizer step at the schedule's lr -> advance the schedule ->
//     refresh the weight copies (only when the step was taken).
// The policy's fp32 GEMM mode (TF32 or IEEE, Note [TF32 by policy]) holds for the step's forward and
// backward and is restored after it, so evaluation and sampling outside it run the default.
// run() returns one StepResult: the mean micro-batch loss, the global gradient norm, the lr the update
// used, the scale the backward used and whether the update was skipped. A run that stops on a
// non-finite step (OnNonFinite::stop) gets optim::NonFiniteStep from run(), with nothing applied.

/// What one TrainStep::run did.
struct StepResult {
  double loss = 0;        ///< mean of the micro-batches' losses (fp32 loss, nats per token)
  double grad_norm = 0;   ///< the global gradient norm before clipping (0 when neither clipping nor a check measured it)
  float lr = 0;           ///< the schedule's lr for this step (what the update used, or would have used when skipped)
  double scale = 1;       ///< the loss scale of this step's backward (1 without a scaler)
  bool skipped = false;   ///< no update was applied (inf/NaN gradients under a scaler, or OnNonFinite::skip)
};

/// A data-parallel run's part in each step (dist::DataParallel implements it; Note [data parallelism]): it is
/// told around each micro-batch's backward, so it can reduce gradients while backward runs (on the last
/// micro-batch only), and after each update taken, so it can gather sharded weights; its CrossRank makes the
/// boundary decide alike on every rank (Note [cross-rank step decisions]).
class StepSync : public optim::CrossRank {
 public:
  /// Before micro-batch `micro` (0 .. n-1) of a step runs its backward.
  virtual void before_backward(std::int64_t micro, std::int64_t n) = 0;
  /// After its backward; on the last micro-batch the gradients are reduced over the ranks when this returns.
  virtual void after_backward(std::int64_t micro, std::int64_t n) = 0;
  /// After an optimizer step that was taken, before the weight copies are refreshed.
  virtual void after_update() = 0;
  /// After an exception inside a step, which TrainStep drops whole (GradAccum::abandon_step): the sync ends what
  /// the step started (its reductions in flight), so that the next step starts afresh. Never throws.
  virtual void abandon_step() noexcept {}
  /// Whether after_update() may change the masters (ZeRO's gather of the owners' weights): then every weight
  /// copy is converted again, else the ones the optimizer wrote are kept (Note [the optimizer writes the
  /// weight copies]). A sync that does not say is assumed to.
  virtual bool changes_weights_after_update() const { return true; }
};

/// The settings of a step boundary.
struct StepOptions {
  std::optional<double> clip;                                ///< clip the global gradient norm to this
  optim::OnNonFinite on_non_finite = optim::OnNonFinite::apply;  ///< without a loss scaler (Note [non-finite steps without a scaler])
  /// Called after the last micro-batch's backward, before the boundary (unscale, check, clip, step): the
  /// accumulated gradients are complete (pruning masks them here, Note [pruning masks]).
  std::function<void()> before_update;
  /// Called after an optimizer step that was taken (not on a skipped one), before the 16-bit weight copies
  /// are refreshed from the masters (pruning zeroes the pruned weights here).
  std::function<void()> after_update;
  /// A data-parallel run's synchronisation (dist::DataParallel), watched, not owned; nullptr: one process.
  /// StepResult::loss is then the mean over the ranks.
  StepSync* sync = nullptr;
  /// Decide the boundary on the step's device (Note [the step boundary on the device]): the losses, the
  /// overflow check, the norm and clipping stay on the device, the optimizer reads its step from there, and
  /// run() reads the outcome once, after the step. The same results as the host boundary (bit for bit on the
  /// CPU). Needs an optimizer that reads a device boundary (SGD, Adam, AdamW, LAMB, Adafactor), and one process or a
  /// data-parallel sync, whose ranks then sum their values on the device (Note [the device boundary across
  /// ranks]); a model-parallel run's ranks decide on the host.
  bool device_boundary = false;
};

template <amp::PrecisionPolicy P, ActivationCheckpointing Checkpointing = NoCheckpoint, Device D = cpu,
          class Accum = optim::GradAccumRuntime, amp::LossScaler Scaler = amp::default_scaler_t<P>>
class TrainStep {
 public:
  using policy = P;
  using checkpointing = Checkpointing;
  using device_type = D;
  using precision_type = amp::MixedPrecision<P, Scaler, D>;
  using compute_type = typename precision_type::compute_type;
  using scaler_type = Scaler;
  using accumulation_type = Accum;

  /// `params`: the model's masters on D; `opt` steps them and `schedule` drives its lr (both watched, not
  /// owned: they must outlive this object). The weight copies are converted here, from the masters as they
  /// are now: build the step after loading a checkpoint, or call refresh_weights() after changing them.
  TrainStep(const std::vector<optim::BasicParam<D>>& params, optim::BasicOptimizer<D>& opt, optim::Schedule& schedule, StepOptions options = {},
            Accum accum = one_micro_batch(), Scaler scaler = Scaler{})
      : precision_(params, opt, std::move(scaler)),
        accum_(std::move(accum)),
        schedule_(&schedule),
        options_(options),
        opt_(&opt) {
    accum_.on_non_finite(options_.on_non_finite);
    accum_.cross_rank(options_.sync);
    if (options_.device_boundary) {
      TG_CHECK(!options_.sync || options_.sync->sums_on_device(), "TrainStep: device_boundary takes one process or a data-parallel ",
               "run (dist::DataParallel); this run's ranks (a model-parallel group) decide each step on the host");
      TG_CHECK(opt.reads_device_boundary(), "TrainStep: device_boundary needs an optimizer that reads it (reads_device_boundary(): SGD, Adam, AdamW, LAMB, Adafactor); ", opt.name(),
               " does not");
      backend::BoundaryRule rule;
      rule.scaler_checks = Scaler::scales_loss;
      rule.check_non_finite = options_.on_non_finite != optim::OnNonFinite::apply && !Scaler::scales_loss;
      rule.clip = options_.clip.has_value();
      rule.max_norm = options_.clip.value_or(0.0);
      TG_CHECK(!rule.clip || (rule.max_norm >= 0 && !std::isnan(rule.max_norm)), "clip_grad_norm: max_norm must be >= 0, got ", rule.max_norm);
      boundary_.emplace(rule, options_.sync);  // Note [the device boundary across ranks]
    }
  }
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  /// One optimizer step: accumulation_steps() micro-batches drawn from `next_batch()` (anything with
  /// `.inputs` and `.targets`, e.g. data::Batch), forward with dropout drawn from `dropout_gen`, then the
  /// boundary (Note [the training step]).
  template <class Model, class NextBatch>
  StepResult run(const Model& model, NextBatch&& next_batch, Generator& dropout_gen) {
    return run(model, std::forward<NextBatch>(next_batch), dropout_gen,
               [this](const Tensor<compute_type, D>& logits, const auto& batch) { return precision_.loss(logits, batch.targets); });
  }

  /// run() with the loss computed by `loss_fn(logits, batch)` (logits (B,T,V) in the compute type, the batch
  /// as drawn) instead of the cross-entropy: a distillation loss, say. It returns a scalar of the policy's loss
  /// type (fp32) on D.
  template <class Model, class NextBatch, class LossFn>
  StepResult run(const Model& model, NextBatch&& next_batch, Generator& dropout_gen, LossFn&& loss_fn) {
    const MatmulMode matmul_mode;  // Note [TF32 by policy]
    StepResult r;
    r.scale = precision_.scaler.scale();
    r.lr = schedule_->lr();
    const std::int64_t n = accum_.n(), skipped_before = accum_.skipped_steps();
    if (boundary_) return run_on_device(model, next_batch, dropout_gen, loss_fn, r);
    losses_.clear();
    try {
      for (std::int64_t m = 0; m < n; ++m) {
        const auto batch = next_batch();
        const auto loss = loss_fn(forward(model, batch.inputs, dropout_gen), batch);
        losses_.push_back(loss.detach());  // Note [the loss stays on the device]: read at the boundary
        if (options_.sync) options_.sync->before_backward(m, n);
        accum_.scale(loss, precision_.scaler).backward();
        if (options_.sync) options_.sync->after_backward(m, n);
        if (m + 1 == n) {  // the step's one read of its losses, before the boundary decides on them
          for (const auto& l : losses_) {
            const double value = static_cast<double>(l.item());
            r.loss += value / static_cast<double>(n);
            accum_.note_loss(value);
          }
          losses_.clear();
        }
        if (m + 1 == n && options_.before_update) options_.before_update();
        if (accum_.micro_step(*opt_, *schedule_, options_.clip, precision_.scaler)) {
          if (!accum_.last_step_skipped()) {
            if (options_.sync) options_.sync->after_update();
            if (options_.after_update) options_.after_update();
          }
          precision_.after_step(accum_, copies_to_refresh());
        }
      }
    } catch (...) {  // the step is dropped whole: the next call starts a new one (GradAccum::abandon_step)
      losses_.clear();
      if (options_.sync) options_.sync->abandon_step();
      accum_.abandon_step(*opt_);
      throw;
    }
    if (options_.sync && options_.sync->ranks() > 1) {  // the mean over the ranks (equal micro-batches)
      double total = r.loss;  // summed, then divided: the device boundary's order (the same bits)
      options_.sync->sum(std::span<double>(&total, 1));
      r.loss = total / options_.sync->ranks();
    }
    r.skipped = accum_.skipped_steps() != skipped_before;
    r.grad_norm = accum_.last_grad_norm();
    return r;
  }

  /// The model's logits in the compute type (training mode), its blocks under the checkpointing policy,
  /// reading the weight copies: the forward run() makes, for callers that compute their own loss.
  template <class Model>
  Tensor<compute_type, D> forward(const Model& model, const Tensor<std::int64_t>& idx, Generator& dropout_gen) const {
    return precision_.forward(WithCheckpointing<Model>{&model}, idx, dropout_gen, true);
  }

  /// Micro-batches per optimizer step.
  std::int64_t accumulation_steps() const { return accum_.n(); }
  /// Optimizer steps taken (skipped ones not counted), for checkpoints.
  std::int64_t steps_taken() const { return accum_.steps(); }
  /// Steps skipped for inf/NaN (by the scaler or under OnNonFinite::skip).
  std::int64_t steps_skipped() const { return accum_.skipped_steps(); }
  /// Steps whose boundary the device decided (StepOptions::device_boundary; 0 without it).
  std::int64_t steps_decided_on_device() const { return boundary_ ? boundary_->reads() : 0; }
  /// Restores the accumulation position of a checkpoint (between optimizer steps).
  void restore_steps(std::int64_t steps_taken) { accum_.restore(steps_taken, 0); }
  /// Re-converts the weight copies from the masters (after loading weights outside an optimizer step).
  void refresh_weights() { precision_.refresh_weights(); }

  Scaler& scaler() { return precision_.scaler; }
  const Scaler& scaler() const { return precision_.scaler; }
  const precision_type& precision() const { return precision_; }
  const StepOptions& options() const { return options_; }

 private:
  /// run() with the boundary on the device (Note [the step boundary on the device]): no read until the
  /// step's kernels are all queued, then one.
  template <class Model, class NextBatch, class LossFn>
  StepResult run_on_device(const Model& model, NextBatch& next_batch, Generator& dropout_gen, LossFn& loss_fn, StepResult r) {
    const std::int64_t n = accum_.n(), skipped_before = accum_.skipped_steps();
    const float lr_before = opt_->lr();
    StepSync* const sync = options_.sync;
    const std::int64_t updates =  // ZeRO: the parameters this rank updates (the others have no state here)
        sync ? opt_->uniform_param_step([sync](const std::string& name) { return sync->updates_here(name); }) : opt_->uniform_param_step();
    // Note [the Philox base in memory]: the step's dropouts draw relative to a base in the step inputs
    const PhiloxBaseScope philox(dropout_gen, device_traits<D>::kind, boundary_->philox_cell());
    boundary_->begin(r.lr, updates, opt_->device_step_constants(updates + 1), r.scale, n, philox.base());
    try {
      bool stepped = false;
      for (std::int64_t m = 0; m < n; ++m) {
        auto batch = next_batch();
        stage(batch, m);
        const auto loss = loss_fn(forward(model, batch.inputs, dropout_gen), batch);
        boundary_->note_loss(loss, n);
        if (sync) sync->before_backward(m, n);
        mul(loss, boundary_->loss_factor()).backward();  // accum.scale(loss, scaler) with the factor on the device
        if (sync) sync->after_backward(m, n);
        if (m + 1 == n && options_.before_update) options_.before_update();
        if (m + 1 == n) opt_->set_lr(r.lr);
        stepped = accum_.micro_step_on_device(*opt_, *boundary_) || stepped;
      }
      TG_CHECK(stepped, "TrainStep: the step ended between micro-batches (restore_steps mid-step?)");
      const optim::BoundaryReadout out = boundary_->read();  // the step's one read
      r.loss = sync && sync->ranks() > 1 ? out.loss / sync->ranks() : out.loss;  // summed over the ranks: their mean
      accum_.finish_device_step(*opt_, *schedule_, precision_.scaler, out);
    } catch (...) {  // nothing counted for a step that did not finish (NonFiniteStep: nothing was applied)
      if (sync) sync->abandon_step();  // its reductions in flight end before the next step reuses their buffers
      accum_.abandon_step(*opt_);  // and no micro-batch of it carried into the next call
      opt_->set_lr(lr_before);
      throw;
    }
    if (accum_.last_step_skipped()) {
      opt_->set_lr(lr_before);  // a skipped step leaves the optimizer's lr as it was
    } else {
      if (sync) sync->after_update();  // ZeRO: every rank gathers the owners' weights
      if (options_.after_update) options_.after_update();
    }
    // The weight copies are refreshed whether or not the device skipped the step (Note [graph blockers]): a
    // skipped step leaves the masters, which convert to the copies they have (bit for bit), so a taken and a
    // skipped step launch the same kernels.
    precision_.refresh_copies(copies_to_refresh());
    r.skipped = accum_.skipped_steps() != skipped_before;
    r.grad_norm = accum_.last_grad_norm();
    return r;
  }

  // Note [the optimizer writes the weight copies]: the copies the optimizer wrote are kept unless something
  // after the update may have changed the masters (the after_update hook, ZeRO's gather of the owners' weights).
  amp::CopyRefresh copies_to_refresh() const {
    const bool masters_changed = options_.after_update || (options_.sync && options_.sync->changes_weights_after_update());
    return masters_changed ? amp::CopyRefresh::all : amp::CopyRefresh::unwritten;
  }

  // Note [graph blockers]: a step decided on the device reads micro-batch m's token ids and targets from buffers
  // of its own, the same every step, which the host writes from the batch it was given (a graph's prelude: not
  // watched), so that the step's kernels see the same addresses every step whatever memory the batch came in.
  template <class Batch>
  void stage(Batch& batch, std::int64_t m) {
    const auto at = static_cast<std::size_t>(2 * m);
    if (staged_.size() < at + 2) staged_.resize(at + 2);
    const backend::LaunchWatchScope prelude(nullptr);
    for (auto [t, buffer] : {std::pair{&batch.inputs, &staged_[at]}, std::pair{&batch.targets, &staged_[at + 1]}}) {
      if (!buffer->defined() || buffer->shape() != t->shape()) *buffer = Tensor<std::int64_t>::empty(t->shape());
      detail::copy_tensor(*t, *buffer);
      *t = *buffer;
    }
  }

  // The model seen through the checkpointing policy: forward<T>(...) is model.forward<T, Checkpointing>(...).
  template <class Model>
  struct WithCheckpointing {
    const Model* model;
    template <FloatingElement T>
    Tensor<T, D> forward(const Tensor<std::int64_t>& idx, Generator& gen, bool training) const {
      return model->template forward<T, Checkpointing>(idx, gen, training);
    }
  };
  // The policy's fp32 GEMM mode for the step, on a GPU (the CPU's GEMMs have one mode).
  struct NoMatmulMode {};
  using MatmulMode = std::conditional_t<std::is_same_v<D, cuda>, amp::Fp32MatmulScope<P>, NoMatmulMode>;
  static Accum one_micro_batch() {
    if constexpr (std::is_default_constructible_v<Accum>) return Accum{};
    else return Accum(1);
  }
  precision_type precision_;
  std::vector<Tensor<fp32, D>> losses_;  // this step's micro-batch losses, on D until the boundary reads them
  Accum accum_;
  optim::Schedule* schedule_;
  StepOptions options_;
  optim::BasicOptimizer<D>* opt_;
  std::optional<optim::DeviceBoundary<D>> boundary_;  // Note [the step boundary on the device]
  std::vector<Tensor<std::int64_t>> staged_;           // micro-batch m's ids (2m) and targets (2m + 1) (stage)
};

}  // namespace tg::train

// A mixed-precision training setup as one type: a precision policy, its loss scaler (the policy's
// default unless named) and the per-step weight copies, on the CPU or on a device D (the masters' device).
// fp16 compute without a scaler does not compile.
//   tg::amp::MixedPrecision<tg::amp::bf16_mixed> amp(model.named_parameters(), opt);   // CPU, optim::Optimizer
//   tg::amp::MixedPrecision<tg::amp::bf16_mixed, tg::amp::NoScaler, tg::cuda> gpu(gpu_model.named_parameters(), dev_opt);
//   auto loss = amp.loss(amp.forward(model, x, gen), y);  accum.scale(loss, amp.scaler).backward();
//   if (accum.micro_step(opt, schedule, 1.0, amp.scaler)) amp.after_step(accum);   // refreshes the copies
#pragma once

#include <optional>
#include <vector>

#include "typegrad/amp/autocast.hpp"
#include "typegrad/amp/precision.hpp"
#include "typegrad/amp/scaler.hpp"
#include "typegrad/amp/weights.hpp"
#include "typegrad/ops/cross_entropy.hpp"

namespace tg::amp {

/// Which weight copies MixedPrecision::after_step converts: all of them, or those the optimizer did not write
/// in its step (Note [the optimizer writes the weight copies]; right only when nothing changed the masters
/// after the optimizer's update).
enum class CopyRefresh { all, unwritten };

/// The fp32 policy's stand-in for WeightCopies: the forward reads the masters, nothing to refresh or attach.
template <Device D = cpu>
struct NoCopies {
  explicit NoCopies(const std::vector<optim::BasicParam<D>>&, OptimizerSteps = {}) {}
  void refresh() {}
  void refresh_unwritten() {}
  std::int64_t refreshes() const { return 0; }
  bool stale() const { return false; }
  void check_fresh() const {}
  std::int64_t nbytes() const { return 0; }
};

template <PrecisionPolicy P, LossScaler Scaler = default_scaler_t<P>, Device D = cpu>
class MixedPrecision {
  static_assert(!P::requires_loss_scaling || Scaler::scales_loss,
                "tg::amp::MixedPrecision: fp16 compute (fp16_mixed) needs a loss scaler: gradients below 2^-24 "
                "flush to zero in fp16. Fix: use tg::amp::DynamicScaler (the default for fp16_mixed: omit the "
                "Scaler argument) or tg::amp::StaticScaler instead of tg::amp::NoScaler, or train in bf16_mixed");

 public:
  using policy = P;
  using scaler_type = Scaler;
  using compute_type = storage_t<op::linear, P>;
  using loss_type = storage_t<op::cross_entropy, P>;
  using device_type = D;

  /// `params`: the model's masters on D; `opt`: the optimizer that steps them (watched, not owned: it
  /// must outlive this object), so a forward after a step without after_step() is an error.
  template <StepCountingOptimizer Opt>
  MixedPrecision(const std::vector<optim::BasicParam<D>>& params, const Opt& opt, Scaler s = Scaler{})
      : scaler(std::move(s)), weights(params, &opt) {}

  /// model.forward<compute_type>(idx, gen, training), reading the per-step weight copies (attached to the
  /// masters: param_as finds them). Stale copies are an error here, before anything is recorded.
  template <class Model>
  Tensor<compute_type, D> forward(const Model& model, const Tensor<std::int64_t>& idx, Generator& gen,
                                  bool training = true) const {
    if constexpr (P::uses_weight_copies) weights.check_fresh();
    return model.template forward<compute_type>(idx, gen, training);
  }
  /// Mean cross-entropy stored in fp32 (the loss is an fp32_math op; Note [autocast rules]).
  template <FloatingElement T>
  Tensor<loss_type, D> loss(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets) const {
    return cross_entropy_as<loss_type>(logits, targets);
  }
  /// After a step boundary (micro_step returned true): refreshes the weight copies when the step was taken.
  /// Returns whether the step was taken (and so the copies refreshed, under a policy that has them).
  /// CopyRefresh::unwritten keeps the copies that Adam / AdamW wrote in the step (Note [the optimizer writes
  /// the weight copies]): pass it only when nothing changed the masters since the optimizer's update.
  template <class Accum>
  bool after_step(const Accum& accum, CopyRefresh which = CopyRefresh::all) {
    if (accum.last_step_skipped()) return false;
    refresh_copies(which);
    return true;
  }
  /// Converts the weight copies `which` says from the masters, whether or not a step was taken (a step decided
  /// on the device refreshes them either way: a skipped step's masters convert to the copies they have).
  void refresh_copies(CopyRefresh which) {
    if (which == CopyRefresh::unwritten) weights.refresh_unwritten();
    else weights.refresh();
  }

  /// Re-converts the copies from the masters now: after code that changed the masters outside an optimizer
  /// step (loading a checkpoint or weights into the model). A no-op under a policy without copies.
  void refresh_weights() { weights.refresh(); }

  Scaler scaler;
  std::conditional_t<P::uses_weight_copies, WeightCopies<compute_type, D>, NoCopies<D>> weights;
};

}  // namespace tg::amp

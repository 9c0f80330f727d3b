// train_gpt's compression (issue 26; docs/compression.md): pruning during training (--prune, masks kept in
// checkpoints), distillation from a trained teacher (--distill-from), and --eval-only with int8 quantization
// (--quantize), which prints the float and int8 validation losses side by side and the speed of one forward.
//   train_gpt --init-from small.safetensors --model small --prune unstructured:0.5 --prune-start 0 --prune-end 300
//   train_gpt --model tiny --distill-from runs/small/ckpt-00002000.safetensors --distill-alpha 0.5 --distill-temperature 2
//   train_gpt --model small --eval-only --init-from runs/small/ckpt-00002000.safetensors --quantize int8
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <typegrad/amp/weights.hpp>
#include <typegrad/detail/cpu/cpu_features.hpp>
#include <typegrad/detail/cpu/gemm_int8.hpp>
#include <typegrad/io/model_config.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/quant/distill.hpp>
#include <typegrad/quant/int8.hpp>
#include <typegrad/quant/prune.hpp>

#include "options.hpp"

namespace train_gpt {

// Note [pruning in the trainer]
// --prune SPEC makes a quant::Pruner over the prunable weights (the blocks' linear layers) and a gradual
// schedule (Zhu & Gupta 2017): sparsity 0 at --prune-start rising as a cubic to SPEC's target at --prune-end,
// the masks recomputed from the weights' magnitudes every --prune-every steps (and at the end step); with
// --prune-start == --prune-end the target is reached at once at that step (0: before the first step, the
// one-shot pruning of a trained model that is then fine-tuned; 2:4 is always one-shot). Between updates the masks hold: the
// training step zeroes the pruned gradients after backward (so clipping and the optimizer's moments never
// see them) and the pruned weights after each optimizer step, before the 16-bit copies are refreshed, so
// no forward ever reads a pruned weight. The masks are saved in every checkpoint ("prune.mask.<param>") and
// restored on --resume, so a resumed run continues with the same masks, bit for bit.

/// A run's pruning: the masks and the schedule of Note [pruning in the trainer].
template <tg::Device D>
struct PruneRun {
  PruneRun(const Options& o, const std::vector<tg::optim::BasicParam<D>>& params)
      : pruner(params, tg::quant::parse_prune_spec(o.prune)) {
    schedule.start = o.prune_start;
    schedule.end = o.prune_end;
    schedule.every = o.prune_every;
    schedule.initial = 0.0;
    schedule.final_sparsity = pruner.spec().sparsity;
  }
  /// After step k (0: before the first): recompute the masks when the schedule says so, and report whether it did.
  bool update(std::int64_t k) {
    if (!schedule.updates_at(k)) return false;
    pruner.prune_to(schedule.sparsity_at(k));
    pruner.apply_to_weights();
    return true;
  }
  std::string describe() const {
    char buf[200];
    const auto& s = pruner.spec();
    std::snprintf(buf, sizeof buf, "%s to %.0f%%%s, steps %lld..%lld every %lld (Zhu & Gupta cubic)",
                  s.pattern == tg::quant::SparsityPattern::two_four ? "2:4" : "unstructured", 100 * s.sparsity,
                  s.pattern == tg::quant::SparsityPattern::two_four ? ""
                  : s.scope == tg::quant::PruneScope::global  ? " globally"
                                                             : " per layer",
                  (long long)schedule.start, (long long)schedule.end, (long long)schedule.every);
    return buf;
  }

  tg::quant::Pruner<D> pruner;
  tg::quant::GradualSchedule schedule;
};

/// A GPT rebuilt from a training checkpoint's recorded shape (TrainStateRecord::model_json) and weights, on the
/// host; `what` names the flag in errors.
inline tg::nn::GPT model_from_checkpoint(const std::string& path, const char* what) {
  const tg::io::TrainStateRecord r = tg::io::read_train_state_record(path);
  TG_CHECK(!r.model_json.empty(), what, ": ", path, " does not record its model's shape (a checkpoint written by an older train_gpt)");
  tg::Generator unused(0);
  tg::nn::GPT model(tg::io::gpt_config_from_json(r.model_json, path), unused);
  tg::io::load_weights(path, model.named_parameters());
  return model;
}

// Note [the teacher]
// --distill-from loads a trained model (any preset, from a training checkpoint, which records its shape and
// tokenizer) as the teacher. Its tokenizer must be the student's (the two distributions are over the same
// vocabulary). It runs without a tape, in bf16 with its own weight copies where the CPU has avx512_bf16 (and
// always on a GPU), else in fp32; its logits are converted to the student's compute type. The loss is
// quant::distillation_loss: alpha · tau² · KL(teacher_tau ‖ student_tau) + (1 − alpha) · cross-entropy.

/// The teacher of Note [the teacher], on device D.
template <tg::Device D>
class Teacher {
 public:
  Teacher(const Options& o, const std::string& student_tokenizer_json) {
    const tg::io::TrainStateRecord r = tg::io::read_train_state_record(o.distill_from);
    if (!r.tokenizer_json.empty() && r.tokenizer_json != student_tokenizer_json)
      throw tg::Error("--distill-from: ", o.distill_from, " was trained with another tokenizer than this run's (",
                      tg::data::AnyTokenizer::from_json(r.tokenizer_json).describe(),
                      "); the teacher and the student must share their vocabulary");
    const tg::nn::GPT host = model_from_checkpoint(o.distill_from, "--distill-from");
    if constexpr (std::is_same_v<D, tg::cpu>) model_ = std::make_unique<tg::nn::GPT>(host);
    else model_ = std::make_unique<tg::nn::BasicGPT<D>>(host);
    params_ = model_->named_parameters();
    bf16_ = !std::is_same_v<D, tg::cpu> || tg::backend::cpu::cpu_features().avx512_bf16;
    if (bf16_) copies_.emplace(params_);
  }
  /// The teacher's logits (B,T,V) for `idx`, in T, without a tape.
  template <tg::FloatingElement T>
  tg::Tensor<T, D> logits(const tg::Tensor<std::int64_t>& idx) const {
    tg::NoGrad no_grad;
    if (bf16_) return model_->template forward<tg::bf16>(idx).template to<T>();
    return model_->template forward<tg::fp32>(idx).template to<T>();
  }
  const tg::nn::GPTConfig& config() const { return model_->config(); }
  const char* precision() const { return bf16_ ? "bf16" : "fp32"; }

 private:
  std::unique_ptr<tg::nn::BasicGPT<D>> model_;
  std::vector<tg::optim::BasicParam<D>> params_;
  bool bf16_ = false;
  std::optional<tg::amp::WeightCopies<tg::bf16, D>> copies_;
};

/// Median wall time of `reps` calls of f (after one warm-up call), in milliseconds.
template <class F>
double median_ms(int reps, F&& f) {
  f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// Zeros among the prunable weights of `params` (the blocks' linear layers) over their count.
inline double prunable_sparsity(const std::vector<tg::optim::BasicParam<tg::cpu>>& params) {
  std::int64_t zeros = 0, total = 0;
  for (const auto& p : params) {
    if (!tg::quant::is_prunable(p.name, p.tensor.shape())) continue;
    const tg::Tensor<float> w = p.tensor.detach().contiguous();
    for (std::int64_t i = 0; i < w.numel(); ++i) zeros += w.data()[i] == 0.f;
    total += w.numel();
  }
  return total > 0 ? static_cast<double>(zeros) / static_cast<double>(total) : 0.0;
}

}  // namespace train_gpt

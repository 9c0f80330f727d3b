// A small, complete training run (tiny GPT, AdamW, warmup+cosine, gradient accumulation, dropout) with
// checkpoint save / resume, shared by test_resume and the kill-test child tg_ckpt_child.
//   tg::testing::TinyRun run({.precision = "bf16"});  run.train_step();  run.save(dir);  run.resume(path);
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "typegrad/amp/amp.hpp"
#include "typegrad/data/dataset.hpp"
#include "typegrad/data/sampler.hpp"
#include "typegrad/io/scaler_state.hpp"
#include "typegrad/io/train_state.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/ops/cross_entropy.hpp"
#include "typegrad/optim/optim.hpp"
#include "typegrad/typegrad.hpp"

namespace tg::testing {

struct TinyRunConfig {
  std::string precision = "fp32";  // compute type of the forward: fp32, bf16, or fp16 (amp::fp16_mixed with its
                                   // dynamic loss scaler); masters stay fp32
  std::int64_t steps = 6;          // for the schedule
  std::int64_t grad_accum = 2;
  std::int64_t batch = 2;
  std::int64_t seq = 32;
  float dropout = 0.1f;
  std::uint64_t seed = 7;
};

/// A synthetic token stream with some structure (so the loss moves): 20000 tokens over 256 ids.
inline std::vector<std::int32_t> tiny_stream() {
  std::vector<std::int32_t> s(20000);
  std::uint32_t x = 12345;
  for (std::size_t i = 0; i < s.size(); ++i) {
    x = x * 1103515245u + 12345u;
    s[i] = static_cast<std::int32_t>((i % 3 == 0) ? (x >> 16) % 256 : (s[i - 1] * 5 + 3) % 256);
  }
  return s;
}

class TinyRun {
 public:
  /// `init_seed` overrides the initialization seed (a resumed run must not depend on it).
  explicit TinyRun(TinyRunConfig c, std::uint64_t init_seed = 0)
      : c_(c),
        ds_(tiny_stream(), 0.1, c.seq),
        init_gen_(init_seed ? init_seed : c.seed),
        dropout_gen_(c.seed + 1),
        model_(model_config(c), init_gen_),
        params_(model_.named_parameters()),
        opt_(optim::default_groups(params_, 0.1f), optim::AdamWOptions{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}),
        schedule_(optim::Warmup{2}.then(optim::Cosine{3e-3f, std::max<std::int64_t>(1, c.steps - 2), 3e-4f})),
        accum_(c.grad_accum),
        sampler_(ds_.train(), c.batch, c.seq, c.seed + 3) {
    TG_CHECK(c.precision == "fp32" || c.precision == "bf16" || c.precision == "fp16",
             "TinyRun: precision must be fp32, bf16 or fp16, got '", c.precision, "'");
    if (c.precision == "fp16") fp16_.emplace(params_, opt_, amp::DynamicScaler(fp16_scaler_options()));
  }

  /// fp16's scaler: PyTorch's defaults but a growth interval of 2 steps, so a short run both backs off and
  /// grows, and a resume that lost the scaler's state would show.
  static amp::DynamicScalerOptions fp16_scaler_options() {
    amp::DynamicScalerOptions o;
    o.growth_interval = 2;
    return o;
  }

  static nn::GPTConfig model_config(const TinyRunConfig& c) {
    nn::GPTConfig m = nn::GPTConfig::preset("tiny", 256);
    m.block_size = c.seq;
    m.dropout = c.dropout;
    return m;
  }

  /// One optimizer step (grad_accum micro-batches); returns the mean micro-batch loss.
  double train_step() {
    double loss_sum = 0;
    for (std::int64_t m = 0; m < c_.grad_accum; ++m) {
      const data::Batch b = sampler_.next();
      Tensor<fp32> loss;
      if (fp16_) {
        loss = fp16_->loss(fp16_->forward(model_, b.inputs, dropout_gen_, true), b.targets);
        loss_sum += static_cast<double>(loss.item());
        accum_.scale(loss, fp16_->scaler).backward();
        if (accum_.micro_step(opt_, schedule_, 1.0, fp16_->scaler)) fp16_->after_step(accum_);
        continue;
      }
      if (c_.precision == "bf16") {
        loss = cross_entropy(model_.forward<bf16>(b.inputs, dropout_gen_, true).to<fp32>(), b.targets);  // loss in fp32
      } else {
        loss = cross_entropy(model_.forward<fp32>(b.inputs, dropout_gen_, true), b.targets);
      }
      loss_sum += static_cast<double>(loss.item());
      accum_.scale(loss).backward();
      accum_.micro_step(opt_, schedule_, 1.0);
    }
    ++step_;
    return loss_sum / static_cast<double>(c_.grad_accum);
  }

  io::TrainStateRecord record() const {
    io::TrainStateRecord r;
    r.step = step_;
    r.schedule_step = schedule_.step();
    r.sampler = sampler_.position();
    r.generators["init"] = io::record_of(init_gen_);
    r.generators["dropout"] = io::record_of(dropout_gen_);
    r.grad_accum = io::GradAccumRecord{accum_.n(), accum_.micro_index(), accum_.steps()};
    if (fp16_) r.scaler = io::scaler_record(fp16_->scaler);
    r.config_json = "{\"precision\":\"" + c_.precision + "\",\"grad_accum\":" + std::to_string(c_.grad_accum) + "}";
    return r;
  }
  std::string save(io::CheckpointDir& dir) const { return dir.save(params_, opt_, record()); }
  /// Loads a checkpoint and restores every position; returns its step.
  std::int64_t resume(const std::string& path) {
    const io::TrainStateRecord r = io::load_train_state(path, params_, opt_);
    step_ = r.step;
    schedule_.set_step(r.schedule_step);
    sampler_.set_position(r.sampler);
    io::restore(init_gen_, r.generators.at("init"));
    io::restore(dropout_gen_, r.generators.at("dropout"));
    TG_CHECK(r.grad_accum && r.grad_accum->n == c_.grad_accum, "TinyRun::resume: grad_accum differs");
    accum_.restore(r.grad_accum->steps, r.grad_accum->micro_index);
    if (fp16_) {
      TG_CHECK(r.scaler.has_value(), "TinyRun::resume: an fp16 run needs the checkpoint's loss-scaler state");
      io::restore_scaler(fp16_->scaler, r.scaler);
      fp16_->weights.refresh();  // the loaded masters invalidate the fp16 copies
    }
    return r.step;
  }

  std::int64_t step() const { return step_; }
  const std::vector<optim::Param>& params() const { return params_; }
  const optim::AdamW& optimizer() const { return opt_; }
  optim::AdamW& optimizer() { return opt_; }
  const optim::Schedule& schedule() const { return schedule_; }
  const data::BatchSampler& sampler() const { return sampler_; }
  const Generator& dropout_generator() const { return dropout_gen_; }
  /// Re-converts the fp16 weight copies after the masters were changed from outside (a bare
  /// io::load_train_state); a no-op for fp32 and bf16.
  void refresh_weight_copies() {
    if (fp16_) fp16_->weights.refresh();
  }
  /// The fp16 run's loss-scaler state (the defaults of a fresh ScalerState for fp32/bf16).
  amp::ScalerState scaler_state() const { return fp16_ ? fp16_->scaler.state() : amp::ScalerState{}; }

 private:
  TinyRunConfig c_;
  data::TextDataset ds_;
  Generator init_gen_, dropout_gen_;
  nn::GPT model_;
  std::vector<optim::Param> params_;
  optim::AdamW opt_;
  optim::Schedule schedule_;
  optim::GradAccumRuntime accum_;
  data::BatchSampler sampler_;
  std::int64_t step_ = 0;
  std::optional<amp::MixedPrecision<amp::fp16_mixed>> fp16_;  // fp16 only: fp16 weight copies and the scaler
};

/// The bits of a double, for exact comparisons and for logs that round-trip.
inline std::uint64_t bits_of(double d) {
  std::uint64_t u;
  std::memcpy(&u, &d, sizeof u);
  return u;
}

}  // namespace tg::testing

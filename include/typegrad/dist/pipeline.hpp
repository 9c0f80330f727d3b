// Pipeline parallelism: a GPT's blocks split into stages over the ranks of a group, trained micro-batch by
// micro-batch on the 1F1B schedule (PipeDream-Flush / Megatron-LM), activations and their gradients sent
// between neighbouring stages.
//   auto pp = tg::dist::world().split(0, rank);  tg::dist::PipelineGPT<> stage(full_model, *pp);
//   tg::dist::PipelineStep<tg::amp::bf16_mixed> step(stage, opt, schedule, {.clip = 1.0}, /*micro_batches=*/4);  step.run(next_batch, gen);
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "typegrad/amp/mixed_precision.hpp"
#include "typegrad/autodiff/checkpoint.hpp"
#include "typegrad/dist/comm.hpp"
#include "typegrad/dist/data_parallel.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/cross_entropy.hpp"
#include "typegrad/ops/dropout.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/optim/grad_accum.hpp"
#include "typegrad/optim/optimizer.hpp"
#include "typegrad/train/step.hpp"

namespace tg::dist {

// Note [pipeline parallelism]
// With p stages (the ranks of the pipeline group, stage s = rank s) the blocks are cut into p contiguous
// runs as even as the count allows (more stages than blocks is an error). Stage 0 also holds wte and wpe,
// the last stage ln_f and the LM head: a copy of wte (the head is tied to the embedding), whose gradient is
// summed between the first and the last stage after each step's backward, so both copies take the same
// update and stay equal (Megatron's embedding group). A step of m micro-batches runs the 1F1B schedule:
// stage s first runs w = min(p - s - 1, m) forwards (warm-up), then alternates one forward and one backward
// (steady state), then runs the w backwards left (cool-down); at most p - s micro-batches' activations are
// alive on stage s, where a schedule of all forwards first would keep m. Between stages the activations
// (B,T,C) in the compute type go forward and their gradients backward; in the steady state each stage posts
// its send and its receive together (send-forward-receive-backward, send-backward-receive-forward), so
// neighbours never wait on each other's sends. The last stage computes each micro-batch's loss, scaled by
// S/m (the loss scale over the micro-batch count) as TrainStep does; after the schedule the step boundary
// (unscale, inf/NaN check, clip, update, schedule) runs on every stage with the flags and squared norms
// summed over the group (the wte copy counted once), and the mean loss is broadcast from the last stage.
// The bubble, the fraction of a step a stage idles while the pipeline fills and drains, is (p-1)/(m+p-1)
// for equal stages.
// Dropout draws the one-process run's numbers: a micro-batch of the whole model draws from the generator in
// a fixed order (the embedding's dropout, then two per block, each over ceil(B·T·C / 4) counters), so stage s knows
// where its draws begin (dropout_counters) and sets the generator there before each micro-batch's forward,
// whatever the schedule's order; after the step every stage's generator stands where the one-process run's
// does (m micro-batches further), so a checkpoint's generator state is the same on every rank and a resumed
// run continues the same stream.

/// Where a pipeline stage's dropout draws lie within one micro-batch (Note [pipeline parallelism]), in the
/// generator's counters: before the stage's first draw, the stage's own draws, and the whole model's.
struct DropoutCounters {
  std::uint64_t before = 0, mine = 0, per_micro = 0;
};
/// The counters of blocks [first, last) of a GPT with `config` (and its embedding's dropout when `embeds`) on
/// a (B, T) micro-batch, when training with dropout (otherwise none).
inline DropoutCounters gpt_dropout_counters(const nn::GPTConfig& config, std::int64_t first, std::int64_t last, bool embeds, std::int64_t B,
                                            std::int64_t T) {
  if (config.dropout == 0.f) return {};
  const auto n = tg::detail::dropout_counters(static_cast<std::uint64_t>(B * T * config.n_embd));  // per dropout call
  const auto draws_before = static_cast<std::uint64_t>(first == 0 && embeds ? 0 : 1 + 2 * first);
  return {n * draws_before, n * static_cast<std::uint64_t>((embeds ? 1 : 0) + 2 * (last - first)),
          n * static_cast<std::uint64_t>(1 + 2 * config.n_layer)};
}

/// One stage of a GPT split into pipeline stages (Note [pipeline parallelism]).
template <Device D = cpu>
class PipelineGPT {
 public:
  PipelineGPT(const nn::BasicGPT<cpu>& full, Communicator& pp) : config_(full.config()), pp_(&pp) {
    const int p = pp.size(), s = pp.rank();
    const std::int64_t L = config_.n_layer;
    TG_CHECK(p <= L, "pipeline parallelism: ", p, " stages for ", L, " blocks (each stage needs at least one block)");
    first_ = s * L / p;
    last_ = (s + 1) * L / p;
    for (std::int64_t i = first_; i < last_; ++i) blocks_.emplace_back(full.blocks()[static_cast<std::size_t>(i)]);
    if (s == 0) {
      wte_ = nn::BasicEmbedding<D>(full.wte());
      wpe_ = nn::BasicEmbedding<D>(full.wpe());
    }
    if (s == p - 1) {
      ln_f_ = nn::BasicLayerNorm<D>(full.ln_f());
      if (s != 0) head_ = nn::BasicEmbedding<D>(full.wte());  // the tied head's copy
    }
  }

  /// The shape of the activations sent between stages for a (B, T) batch.
  Shape activation_shape(std::int64_t B, std::int64_t T) const { return {B, T, config_.n_embd}; }
  /// Where this stage's dropout draws lie in a (B, T) micro-batch (Note [pipeline parallelism]).
  DropoutCounters dropout_counters(std::int64_t B, std::int64_t T) const { return gpt_dropout_counters(config_, first_, last_, is_first(), B, T); }
  bool is_first() const { return pp_->rank() == 0; }
  bool is_last() const { return pp_->rank() == pp_->size() - 1; }
  /// The pipeline's group (stage s = rank s).
  Communicator& pipeline() const { return *pp_; }
  /// The ranks that hold different parts of one model replica (here: the pipeline).
  Communicator& model_group() const { return *pp_; }
  /// Whether this stage counts `name`'s squared gradient in the global norm (the last stage's wte copy: no).
  bool counts_in_norm(const std::string& name) const { return is_first() || name != "wte.weight"; }
  /// The mean cross-entropy of the last stage's logits (fp32).
  template <FloatingElement T>
  Tensor<fp32, D> stage_loss(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets) const {
    return cross_entropy_as<fp32>(logits, targets);
  }
  const nn::GPTConfig& config() const { return config_; }
  /// This stage's blocks [first, last).
  std::int64_t first_block() const { return first_; }
  std::int64_t last_block() const { return last_; }

  /// This stage's parameters, GPT-2 names (the last stage's copy of wte is "wte.weight" too).
  std::vector<optim::BasicParam<D>> named_parameters() const {
    std::vector<optim::BasicParam<D>> out;
    if (is_first()) {
      wte_.collect_parameters("wte", out);
      wpe_.collect_parameters("wpe", out);
    }
    for (std::size_t i = 0; i < blocks_.size(); ++i) blocks_[i].collect_parameters("h." + std::to_string(first_ + static_cast<std::int64_t>(i)), out);
    if (is_last()) {
      if (!is_first()) head_.collect_parameters("wte", out);
      ln_f_.collect_parameters("ln_f", out);
    }
    return out;
  }

  /// Stage 0's input: embeddings of idx (B,T) -> (B,T,C).
  template <FloatingElement T>
  Tensor<T, D> embed(const Tensor<std::int64_t>& idx, Generator& gen, bool training) const {
    const Tensor<std::int64_t> pos = Tensor<std::int64_t>::arange(idx.size(1));
    return dropout(add(wte_.template forward<T>(idx), wpe_.template forward<T>(pos)), config_.dropout, gen, training);
  }
  /// This stage's blocks on x (B,T,C), under the checkpointing policy C.
  template <FloatingElement T, ActivationCheckpointing C = NoCheckpoint>
  Tensor<T, D> blocks(Tensor<T, D> x, Generator& gen, bool training) const {
    for (const auto& b : blocks_) x = checkpointed<C>(b, x, gen, training);
    return x;
  }
  /// The last stage's output: logits (B,T,V).
  template <FloatingElement T>
  Tensor<T, D> head(const Tensor<T, D>& x) const {
    const Tensor<T, D> h = ln_f_.forward(x);
    return linear(h, amp::param_as<T>((is_first() ? wte_ : head_).weight()));
  }
  /// The tied embedding's weight on this stage (stage 0's wte, or the last stage's copy); undefined elsewhere.
  Tensor<fp32, D> tied_weight() const { return is_first() ? wte_.weight() : is_last() ? head_.weight() : Tensor<fp32, D>(); }

 private:
  nn::GPTConfig config_;
  Communicator* pp_;
  std::int64_t first_ = 0, last_ = 0;
  std::vector<nn::BasicBlock<D>> blocks_;
  nn::BasicEmbedding<D> wte_, wpe_, head_;
  nn::BasicLayerNorm<D> ln_f_{1};
};

/// What one pipeline step measured besides train::StepResult.
struct PipelineStats {
  std::int64_t activations_sent = 0, bytes_sent = 0;  ///< this stage's sends (activations and gradients), this step
  int max_alive = 0;                                  ///< the most micro-batches whose activations were alive at once
  double wait_seconds = 0;                            ///< time blocked on the neighbours' sends and receives, this step
  /// The most memory (device allocator bytes in use) above the step's start that the forwards left alive: the
  /// activations kept for backward of up to max_alive micro-batches (and their received inputs), this step.
  std::int64_t activation_bytes = 0;
};

/// The training step of a pipeline stage: the 1F1B schedule over m micro-batches, then the one step boundary
/// (Note [pipeline parallelism], Note [the training step]).
template <amp::PrecisionPolicy P, ActivationCheckpointing Ckpt = NoCheckpoint, Device D = cpu,
          amp::LossScaler Scaler = amp::default_scaler_t<P>, class Stage = PipelineGPT<D>>
class PipelineStep {
 public:
  using precision_type = amp::MixedPrecision<P, Scaler, D>;
  using compute_type = typename precision_type::compute_type;

  /// `stage`: this rank's stage (PipelineGPT, or a tensor-parallel TensorParallelGPT stage of a process grid).
  /// `dp`: the data-parallel group of this stage's replicas, or nullptr: their gradients are reduced after the
  /// schedule by a DataParallel (`sharding`: DDP, ZeRO-1 or ZeRO-2; in buckets, not overlapped with the
  /// schedule's backward). `world`: every rank of the run (the boundary's flags are summed over it), or
  /// nullptr: the stage's model group.
  PipelineStep(const Stage& stage, optim::BasicOptimizer<D>& opt, optim::Schedule& schedule, train::StepOptions options,
               std::int64_t micro_batches, Scaler scaler = Scaler{}, Communicator* dp = nullptr, Communicator* world = nullptr,
               DataParallelOptions dp_options = {})
      : stage_(&stage), params_(stage.named_parameters()), precision_(params_, opt, std::move(scaler)),
        accum_(micro_batches), schedule_(&schedule), options_(std::move(options)), opt_(&opt),
        cross_(stage, world ? *world : stage.model_group(), dp && dp->size() > 1 && dp_options.sharding != Sharding::none), dp_(dp) {
    if (dp_ && dp_->size() > 1) {
      dp_options.overlap = false;  // a bucket is complete only after every micro-batch's backward
      replicas_ = std::make_unique<DataParallel<D>>(*dp_, params_, dp_options);
    }
    accum_.on_non_finite(options_.on_non_finite);
    accum_.cross_rank(&cross_);
    Communicator& pp = stage.pipeline();
    // The tied embedding's group: the first and the last stage.
    const bool ends = stage.is_first() || stage.is_last();
    tied_ = pp.split(ends ? 0 : 1, pp.rank());
    if (!ends) tied_.reset();
  }

  /// One optimizer step: micro_batches() micro-batches from next_batch() (every stage draws each batch, so
  /// the samplers stay together; stage 0 reads its inputs, the last stage its targets).
  template <class NextBatch>
  train::StepResult run(NextBatch&& next_batch, Generator& dropout_gen) {
    const Stage& st = *stage_;
    Communicator& pp = st.pipeline();
    const int s = pp.rank(), p = pp.size();
    const std::int64_t m = accum_.n();
    train::StepResult r;
    r.scale = precision_.scaler.scale();
    r.lr = schedule_->lr();
    stats_ = {};
    if constexpr (P::uses_weight_copies) precision_.weights.check_fresh();
    if (replicas_) replicas_->before_backward(0, 1);  // the buckets become the gradients' storage (DDP, ZeRO-1)
    std::vector<decltype(next_batch())> batches;
    for (std::int64_t i = 0; i < m; ++i) batches.push_back(next_batch());
    const std::int64_t B = batches[0].inputs.size(0), T_ = batches[0].inputs.size(1);
    std::vector<Tensor<compute_type, D>> inputs(static_cast<std::size_t>(m)), outputs(static_cast<std::size_t>(m));
    std::vector<Tensor<fp32, D>> losses(static_cast<std::size_t>(m));
    double loss_sum = 0;
    int alive = 0;
    // Note [pipeline parallelism]: micro-batch i's draws at the one-process run's counters.
    const DropoutCounters drawn = st.dropout_counters(B, T_);
    const std::uint64_t seed = dropout_gen.seed(), base = dropout_gen.offset();
    const std::int64_t bytes_at_start = allocator<D>().stats().bytes_in_use;
    auto forward = [&](std::int64_t i, Tensor<compute_type, D> x) {
      const auto& b = batches[static_cast<std::size_t>(i)];
      const std::uint64_t first_draw = base + static_cast<std::uint64_t>(i) * drawn.per_micro + drawn.before;
      dropout_gen.set_state(seed, first_draw);
      if (st.is_first()) x = st.template embed<compute_type>(b.inputs, dropout_gen, true);
      else inputs[static_cast<std::size_t>(i)] = x;
      Tensor<compute_type, D> y = st.template blocks<compute_type, Ckpt>(x, dropout_gen, true);
      TG_CHECK(dropout_gen.offset() - first_draw == drawn.mine, "PipelineStep: stage ", s, " drew ", dropout_gen.offset() - first_draw,
               " dropout counters in micro-batch ", i, ", its dropout_counters() says ", drawn.mine);
      if (st.is_last()) {
        const Tensor<fp32, D> loss = st.stage_loss(st.template head<compute_type>(y), b.targets);
        const double v = static_cast<double>(loss.item());
        loss_sum += v;
        accum_.note_loss(v);
        losses[static_cast<std::size_t>(i)] = accum_.scale(loss, precision_.scaler);
      } else {
        outputs[static_cast<std::size_t>(i)] = y;
      }
      stats_.max_alive = std::max(stats_.max_alive, ++alive);
      stats_.activation_bytes = std::max(stats_.activation_bytes, allocator<D>().stats().bytes_in_use - bytes_at_start);
    };
    // Backward of micro-batch i from the gradient of its output (the last stage: from its loss); returns the
    // gradient of its input (stage 0: none).
    auto backward = [&](std::int64_t i, const Tensor<compute_type, D>& g) {
      if (st.is_last()) losses[static_cast<std::size_t>(i)].backward();
      else outputs[static_cast<std::size_t>(i)].backward(g);
      losses[static_cast<std::size_t>(i)] = Tensor<fp32, D>();
      outputs[static_cast<std::size_t>(i)] = Tensor<compute_type, D>();
      --alive;
      Tensor<compute_type, D> dx;
      if (!st.is_first()) {
        dx = inputs[static_cast<std::size_t>(i)].grad();
        inputs[static_cast<std::size_t>(i)] = Tensor<compute_type, D>();
      }
      return dx;
    };
    auto fresh = [&] {  // a received activation: a leaf whose gradient backward fills
      Tensor<compute_type, D> x = Tensor<compute_type, D>::empty(st.activation_shape(B, T_));
      return x;
    };
    auto leaf = [](Tensor<compute_type, D> x) {
      x.requires_grad_(true);
      return x;
    };
    const int prev = s - 1, next = s + 1;
    auto timed = [&](auto&& f) {  // time blocked on the neighbours (the bubble and the transfers)
      const auto t0 = std::chrono::steady_clock::now();
      f();
      stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    auto count_send = [&](const Tensor<compute_type, D>& t) {
      ++stats_.activations_sent;
      stats_.bytes_sent += static_cast<std::int64_t>(t.nbytes());
    };
    // 1F1B (Note [pipeline parallelism]); tag 0: activations, tag 1: gradients.
    const std::int64_t warm = std::min<std::int64_t>(p - s - 1, m);
    for (std::int64_t i = 0; i < warm; ++i) {
      Tensor<compute_type, D> x;
      if (!st.is_first()) {
        x = fresh();
        timed([&] { pp.recv(buffer_of(x), prev, 0); });
      }
      forward(i, st.is_first() ? x : leaf(x));
      if (!st.is_last()) {
        timed([&] { pp.send(buffer_of(outputs[static_cast<std::size_t>(i)].detach()), next, 0); });
        count_send(outputs[static_cast<std::size_t>(i)]);
      }
    }
    Tensor<compute_type, D> x;
    if (warm < m && !st.is_first()) {
      x = fresh();
      timed([&] { pp.recv(buffer_of(x), prev, 0); });
    }
    for (std::int64_t j = 0; j < m - warm; ++j) {
      const std::int64_t i = warm + j;
      forward(i, st.is_first() ? x : leaf(x));
      Tensor<compute_type, D> g;
      if (!st.is_last()) {  // send forward, receive backward, together
        g = fresh();
        auto ex = pp.exchange_async(buffer_of(outputs[static_cast<std::size_t>(i)].detach()), next, 0, buffer_of(g), next, 1);
        count_send(outputs[static_cast<std::size_t>(i)]);
        timed([&] {
          ex.sent.wait();
          ex.received.wait();
        });
      }
      const Tensor<compute_type, D> dx = backward(j, g);
      if (st.is_first()) continue;
      if (j + 1 < m - warm) {  // send backward, receive forward, together
        x = fresh();
        auto ex = pp.exchange_async(buffer_of(dx), prev, 1, buffer_of(x), prev, 0);
        count_send(dx);
        timed([&] {
          ex.sent.wait();
          ex.received.wait();
        });
      } else {
        timed([&] { pp.send(buffer_of(dx), prev, 1); });
        count_send(dx);
      }
    }
    for (std::int64_t i = m - warm; i < m; ++i) {
      Tensor<compute_type, D> g;
      if (!st.is_last()) {
        g = fresh();
        timed([&] { pp.recv(buffer_of(g), next, 1); });
      }
      const Tensor<compute_type, D> dx = backward(i, g);
      if (!st.is_first()) {
        timed([&] { pp.send(buffer_of(dx), prev, 1); });
        count_send(dx);
      }
    }
    dropout_gen.set_state(seed, base + static_cast<std::uint64_t>(m) * drawn.per_micro);
    // The tied embedding's two copies take the summed gradient.
    if (tied_ && tied_->size() > 1) {
      const Tensor<fp32, D> g = st.tied_weight().grad();
      TG_CHECK(g.defined(), "PipelineStep: the tied embedding has no gradient on stage ", s);
      tied_->all_reduce(g, ReduceOp::sum);
    }
    if (replicas_) replicas_->after_backward(0, 1);  // the replicas' gradients averaged (ZeRO: each keeps its shard)
    if (options_.before_update) options_.before_update();
    for (std::int64_t i = 0; i < m; ++i)
      if (accum_.micro_step(*opt_, *schedule_, options_.clip, precision_.scaler)) {
        if (!accum_.last_step_skipped()) {
          if (replicas_) replicas_->after_update();  // ZeRO: the owners' weights gathered
          if (options_.after_update) options_.after_update();
        }
        precision_.after_step(accum_);
      }
    double mean = st.is_last() ? loss_sum / static_cast<double>(m) : 0.0;
    pp.broadcast(Buffer{&mean, 1, DType::f64}, p - 1);
    if (dp_ && dp_->size() > 1) dp_->all_reduce(std::span<double>(&mean, 1), ReduceOp::avg);
    r.loss = mean;
    r.skipped = accum_.last_step_skipped();
    r.grad_norm = accum_.last_grad_norm();
    return r;
  }

  std::int64_t micro_batches() const { return accum_.n(); }
  /// The replicas' reduction (nullptr without data-parallel replicas): its state consolidation for checkpoints.
  DataParallel<D>* data_parallel() { return replicas_.get(); }
  const PipelineStats& stats() const { return stats_; }
  std::int64_t steps_taken() const { return accum_.steps(); }
  /// (p-1)/(m+p-1): the idle fraction of 1F1B with equal stages.
  double bubble_fraction() const {
    const double p = stage_->pipeline().size(), m = static_cast<double>(accum_.n());
    return (p - 1) / (m + p - 1);
  }

 private:
  // The boundary's decisions over the whole pipeline: each stage holds its own parameters, the last stage's wte
  // copy is not counted again.
  class Cross final : public optim::CrossRank {
   public:
    Cross(const Stage& st, Communicator& everyone, bool zero) : st_(&st), everyone_(&everyone), zero_(zero) {}
    void sum(std::span<double> v) const override { everyone_->all_reduce(v, ReduceOp::sum); }
    void sum_norms(std::span<double> v) const override { (zero_ ? *everyone_ : st_->model_group()).all_reduce(v, ReduceOp::sum); }
    bool sharded_grads() const override { return st_->model_group().size() > 1 || zero_; }
    int ranks() const override { return everyone_->size(); }
    bool counts_in_norm(const std::string& name) const override { return st_->counts_in_norm(name); }

   private:
    const Stage* st_;
    Communicator* everyone_;
    bool zero_;  // ZeRO over the replicas: each holds a shard of the gradients, norms summed over everyone
  };

  const Stage* stage_;
  std::vector<optim::BasicParam<D>> params_;
  precision_type precision_;
  optim::GradAccumRuntime accum_;
  optim::Schedule* schedule_;
  train::StepOptions options_;
  optim::BasicOptimizer<D>* opt_;
  Cross cross_;
  Communicator* dp_;
  std::unique_ptr<DataParallel<D>> replicas_;
  std::unique_ptr<Communicator> tied_;
  PipelineStats stats_;
};

}  // namespace tg::dist

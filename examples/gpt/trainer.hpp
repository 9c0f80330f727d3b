// train_gpt's run, everything but the loop: the model, optimizer, schedule and sampler built from the
// options, --init-from and --resume, checkpoints, the header, progress line and summary it prints, and
// --plot. Generic over the device the run trains on (train_gpt.cpp holds the loop).
//   train_gpt::Session<tg::cpu> s(o);   // data, tokenizer, model, optimizer, ...;  s.resume(step) restores --resume
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/data/prefetch.hpp>
#include <typegrad/data/sampler.hpp>
#include <typegrad/detail/cuda/runtime.hpp>
#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/data_parallel.hpp>
#include <typegrad/dist/nccl.hpp>
#include <typegrad/io/model_config.hpp>
#include <typegrad/io/scaler_state.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/generate.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/evaluate.hpp>
#include <typegrad/train/log.hpp>
#include <typegrad/train/run.hpp>
#include <typegrad/train/step.hpp>
#include <typegrad/typegrad.hpp>

#include "compress.hpp"
#include "data.hpp"
#include "guards.hpp"
#include "options.hpp"

namespace train_gpt {

using tg::train::human_bytes;
using tg::train::human_time;

inline tg::optim::Schedule make_schedule(const Options& o, std::int64_t steps) {
  using namespace tg::optim;
  const float min_lr = o.min_lr >= 0 ? o.min_lr : o.lr / 10;
  const std::int64_t decay_steps = std::max<std::int64_t>(1, steps - o.warmup);
  auto with_warmup = [&](auto decay) -> Schedule {
    if (o.warmup > 0) return Warmup{o.warmup}.then(decay);
    return decay;
  };
  if (o.schedule == "cosine") return with_warmup(Cosine{o.lr, decay_steps, min_lr});
  if (o.schedule == "linear") return with_warmup(LinearDecay{o.lr, decay_steps, min_lr});
  if (o.schedule == "constant") return with_warmup(Constant{o.lr});
  if (o.schedule == "invsqrt") return with_warmup(InverseSqrt{o.lr, std::max<std::int64_t>(1, o.warmup)});
  throw tg::Error("--schedule: unknown schedule '", o.schedule, "' (expected cosine, linear, constant or invsqrt)");
}

// The settings of each --optimizer. `weight_decay` is what the matrices get: default_groups gives it to the
// decay group and 0 to the rest (Note [which parameters decay]).
inline tg::optim::AdamWOptions adam_options(const Options& o) {
  return {.lr = o.lr, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = o.weight_decay};
}
inline tg::optim::SgdOptions sgd_options(const Options& o) {
  return {.lr = o.lr, .momentum = 0.9f, .dampening = 0.f, .nesterov = true, .weight_decay = o.weight_decay};
}
inline tg::optim::LambOptions lamb_options(const Options& o) {
  return {.lr = o.lr, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-6f, .weight_decay = o.weight_decay};
}
inline tg::optim::AdafactorOptions adafactor_options(const Options& o) {
  tg::optim::AdafactorOptions a;  // the paper's defaults, with --lr as the step size and decoupled decay
  a.lr = o.lr;
  a.relative_step = false;
  a.weight_decay = o.weight_decay;
  return a;
}
[[noreturn]] inline void unknown_optimizer(const Options& o) {
  throw tg::Error("--optimizer: unknown optimizer '", o.optimizer, "' (expected adamw, adam, sgd, lamb or adafactor)");
}

/// The optimizer of --optimizer over `groups` on device D (one class per optimizer on every device, Note
/// [optimizer state]).
template <tg::Device D>
std::unique_ptr<tg::optim::BasicOptimizer<D>> make_optimizer_over(const Options& o, std::vector<tg::optim::BasicParamGroup<D>> groups) {
  using namespace tg::optim;
  if (o.optimizer == "adamw") return std::make_unique<BasicAdamW<D>>(std::move(groups), adam_options(o));
  if (o.optimizer == "adam") {
    const AdamWOptions a = adam_options(o);  // L2 decay (Adam's) with the same numbers
    return std::make_unique<BasicAdam<D>>(std::move(groups), AdamOptions{a.lr, a.beta1, a.beta2, a.eps, a.weight_decay});
  }
  if (o.optimizer == "sgd") return std::make_unique<BasicSgd<D>>(std::move(groups), sgd_options(o));
  if (o.optimizer == "lamb") return std::make_unique<BasicLamb<D>>(std::move(groups), lamb_options(o));
  if (o.optimizer == "adafactor") return std::make_unique<BasicAdafactor<D>>(std::move(groups), adafactor_options(o));
  unknown_optimizer(o);
}

/// The optimizer of --optimizer over `params` on device D, with default_groups' decay (Note [which parameters
/// decay]); with --offload, its state and update on the host (Note [optimizer offload]).
template <tg::Device D>
std::unique_ptr<tg::optim::BasicOptimizer<D>> make_optimizer(const Options& o, const std::vector<tg::optim::BasicParam<D>>& params) {
  auto groups = tg::optim::default_groups(params, o.weight_decay);
  if (o.offload)
    return tg::optim::offload<D>(std::move(groups), [&o](std::vector<tg::optim::ParamGroup> host_groups) {
      return make_optimizer_over<tg::cpu>(o, std::move(host_groups));
    });
  return make_optimizer_over<D>(o, std::move(groups));
}

/// The model of --model over a vocabulary of `vocab`, with --layers / --width / --heads overriding the preset,
/// at least --seq positions, and --dropout.
inline tg::nn::GPTConfig model_config(const Options& o, std::int64_t vocab) {
  tg::nn::GPTConfig config = tg::nn::GPTConfig::preset(o.model, vocab);
  if (o.layers > 0) config.n_layer = o.layers;
  if (o.width > 0) config.n_embd = o.width;
  if (o.heads > 0) config.n_head = o.heads;
  config.block_size = std::max(config.block_size, o.seq);
  config.dropout = o.dropout;
  return config;
}

// The settings that decide what a run computes (not where it writes), as JSON for the checkpoint.
inline std::string run_config_json(const Options& o) {
  auto str = [](const std::string& v) {
    std::string out = "\"";
    for (char c : v) {
      if (c == '"' || c == '\\') out += '\\';
      if (static_cast<unsigned char>(c) < 0x20) {
        char buf[8];
        std::snprintf(buf, sizeof buf, "\\u%04x", c);
        out += buf;
      } else {
        out += c;
      }
    }
    return out + "\"";
  };
  auto num = [](double v) {
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  std::ostringstream j;
  j << "{\"data\":" << str(o.data) << ",\"tokenizer\":" << str(o.tokenizer) << ",\"model\":" << str(o.model) << ",\"batch\":" << o.global_batch() << ",\"seq\":" << o.seq
    << ",\"grad_accum\":" << o.grad_accum << ",\"steps\":" << o.steps << ",\"lr\":" << num(o.lr) << ",\"min_lr\":" << num(o.min_lr)
    << ",\"warmup\":" << o.warmup << ",\"schedule\":" << str(o.schedule) << ",\"optimizer\":" << str(o.optimizer)
    << ",\"weight_decay\":" << num(o.weight_decay) << ",\"clip\":" << num(o.clip) << ",\"seed\":" << o.seed
    << ",\"dropout\":" << num(o.dropout) << ",\"val_fraction\":" << num(o.val_fraction)
    << ",\"precision\":" << str(o.precision);
  if (o.layers > 0 || o.width > 0 || o.heads > 0)  // only when set, so a checkpoint of a preset run compares as before
    j << ",\"layers\":" << o.layers << ",\"width\":" << o.width << ",\"heads\":" << o.heads;
  if (!o.prune.empty())  // only when set, so a checkpoint of a run without them compares as before
    j << ",\"prune\":" << str(o.prune) << ",\"prune_start\":" << o.prune_start << ",\"prune_end\":" << o.prune_end
      << ",\"prune_every\":" << o.prune_every;
  if (!o.distill_from.empty())
    j << ",\"distill_from\":" << str(o.distill_from) << ",\"distill_alpha\":" << num(o.distill_alpha)
      << ",\"distill_temperature\":" << num(o.distill_temperature);
  j << "}";
  return j.str();
}

/// A whole non-negative number below 2^53 (a count saved as a double), or an error naming the field.
inline std::int64_t count_field(const std::string& path, const char* name, double v) {
  if (!(std::isfinite(v) && v >= 0 && v < 9007199254740992.0 && v == std::floor(v)))
    throw tg::Error("--resume: ", path, ": state field '", name, "' must be a whole number from 0 to 2^53, got ", v);
  return static_cast<std::int64_t>(v);
}

/// Checks a checkpoint's positions against each other and against this run before anything is restored
/// (Note [the trainer's guards]): a record that passed its checksums can still hold numbers no run of these
/// settings reaches (a hand-edited or foreign file).
inline void validate_resume_record(const Options& o, const std::string& path, const tg::io::TrainStateRecord& r,
                                   std::uint64_t init_offset) {
  auto bad = [&](auto&&... parts) { throw tg::Error("--resume: ", path, ": ", parts...); };
  if (r.step > o.steps)
    bad("the checkpoint is at step ", r.step, ", beyond --steps ", o.steps, " (raise --steps to continue that run)");
  if (!r.grad_accum || r.grad_accum->n != o.grad_accum)
    bad("saved with --grad-accum ", r.grad_accum ? r.grad_accum->n : 0, ", this run uses ", o.grad_accum);
  if (r.grad_accum->micro_index != 0) bad("saved in the middle of an accumulation (micro_index ", r.grad_accum->micro_index, ")");
  // Steps taken and skipped add up to the step counter; the schedule and the accumulator count the taken ones.
  const std::int64_t skipped_scaler = r.scaler ? r.scaler->skipped_steps : 0;
  if (r.schedule_step > r.step || r.grad_accum->steps != r.schedule_step)
    bad("inconsistent counters: step ", r.step, ", schedule step ", r.schedule_step, ", accumulator steps ", r.grad_accum->steps);
  if (r.scaler && (r.scaler->steps != r.step || skipped_scaler > r.step || !(std::isfinite(r.scaler->scale) && r.scaler->scale > 0)))
    bad("inconsistent loss-scaler state: step ", r.step, ", scaler steps ", r.scaler->steps, ", skipped ", skipped_scaler,
        ", scale ", r.scaler->scale);
  std::uint64_t batches = 0;
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(r.step), static_cast<std::uint64_t>(o.grad_accum), &batches) ||
      r.sampler.counter != batches)
    bad("the sampler has drawn ", r.sampler.counter, " batches, but ", r.step, " steps of ", o.grad_accum, " micro-batches draw ",
        r.step * o.grad_accum);
  for (const auto& [name, g] : r.generators) {
    if (name == "init" && g.offset != init_offset)
      bad("generator 'init' is at offset ", g.offset, ", a model built from the seed draws ", init_offset);
    if (g.offset > (std::uint64_t{1} << 62)) bad("generator '", name, "' is at offset ", g.offset, ", beyond any run's draws");
  }
  const auto scalar = [&](const char* name) -> std::optional<double> {
    auto it = r.scalars.find(name);
    return it == r.scalars.end() ? std::nullopt : std::optional<double>(it->second);
  };
  if (auto v = scalar("tokens_done")) {
    const std::int64_t tokens = count_field(path, "tokens_done", *v), per_step = o.global_batch() * o.seq * o.grad_accum;
    // With the same settings every step (taken or skipped) consumed per_step tokens.
    if (tg::io::config_differences(r.config_json, run_config_json(o)).empty() && tokens != r.step * per_step)
      bad("state field 'tokens_done' is ", tokens, ", but ", r.step, " steps of ", per_step, " tokens make ", r.step * per_step);
  }
  const std::int64_t skipped_nonfinite = count_field(path, "nonfinite_skipped", scalar("nonfinite_skipped").value_or(0));
  if (r.schedule_step + skipped_scaler + skipped_nonfinite != r.step)
    bad("inconsistent counters: step ", r.step, " is not the ", r.schedule_step, " steps taken plus the ",
        skipped_scaler + skipped_nonfinite, " skipped");
  if (auto v = scalar("loss_ema"); v && !std::isfinite(*v)) bad("state field 'loss_ema' is ", *v);
  if (auto v = scalar("trained_positions")) count_field(path, "trained_positions", *v);
}

/// --resume's checkpoint (a file, or a directory's newest; Note [runs own their checkpoints]) and its record,
/// read before the data (the record fixes the tokenizer) and the model.
inline tg::io::ResumeChoice choose_checkpoint(const Options& o) {
  tg::io::ResumeChoice choice;
  try {
    choice = tg::io::choose_resume(o.resume, o.resume_fallback);
  } catch (const tg::Error& e) {
    if (o.resume_fallback || std::string(e.what()).find("is damaged") == std::string::npos) throw;
    throw tg::Error(e.what(), " (--resume-fallback resumes from the newest intact checkpoint instead)");
  }
  for (const auto& [bad_path, why] : choice.skipped)
    std::printf("warning: --resume-fallback: passing over the damaged %s: %s\n", bad_path.c_str(), why.c_str());
  if (!choice.record) choice.record = tg::io::read_train_state_record(choice.path);
  return choice;
}

// Note [trained positions]
// A model is built with block_size = max(the preset's, --seq) positions, but a run trains only positions
// 0 .. --seq - 1: the rest keep their random initial embeddings, and a sample whose window reaches them
// degrades into noise there (a tiny GPT trained at --seq 64 sampled with its 128-position window did, past
// character 64). So the trainer counts the positions training reached (the largest --seq of the run,
// across resumes: "trained_positions" in the checkpoint's state), prints it in the header, and samples
// over a sliding window of at most that many positions.

/// The save directory's checks before step 1 (Note [runs own their checkpoints]): another run's checkpoints
/// there stop a fresh run unless --share-save-dir, and even then none may sit at a step this run saves.
inline void check_save_dir(const Options& o, const tg::io::CheckpointDir& dir, std::int64_t start_step) {
  const auto others = dir.other_runs(o.run_id);
  if (others.empty()) return;
  std::string names;
  for (std::size_t i = 0; i < others.size() && i < 4; ++i) names += (i ? ", " : "") + others[i].second;
  if (others.size() > 4) names += " and " + std::to_string(others.size() - 4) + " more";
  if (!o.share_save_dir)
    throw tg::Error("--save-dir: '", dir.dir(), "' holds checkpoints of another run (", names,
                    "); continue that run with --resume ", dir.dir(), ", choose another --save-dir, or pass --share-save-dir to write "
                    "beside them (this run then deletes only its own checkpoints)");
  for (const auto& [step, path] : others)
    if (step > start_step && step <= o.steps && (step == o.steps || (o.save_every > 0 && step % o.save_every == 0)))
      throw tg::Error("--save-dir: this run would save step ", step, " where another run's checkpoint is (", path,
                      "); choose another --save-dir");
}

// Note [training on a GPU]
// A run trains where --device says, with one code path: the model (nn::BasicGPT<D>), its parameters, their
// gradients, the optimizer and its state (optim::BasicOptimizer<D>, Note [optimizer state]) and the
// per-step 16-bit weight copies all live on D. The model is drawn on the host from the seed and copied to
// D, so a seed gives the same initial weights on every device. --init-from and --resume load straight into
// the objects on D, and checkpoints are written from them (io::ParamsView reads a device tensor into host
// memory), with the same names on both devices: a GPU checkpoint resumes on the CPU and the other way round,
// for every optimizer. The generators, sampler, schedule and step counters are host objects on both devices.

/// Everything a run is made of before its first step (Note [training on a GPU]): the data and tokenizer,
/// the model and optimizer on D, the schedule, the batches, the generators, the counters a checkpoint
/// keeps, and the save directory; resume() loads --resume into them and into the training step.
template <tg::Device D>
class Session {
 public:
  explicit Session(Options options) : o(std::move(options)) {
    if (o.threads > 0) tg::backend::cpu::set_num_threads(o.threads);
    // --resume's record first: it fixes the tokenizer (Note [the trainer's data and tokenizer]).
    if (!o.resume.empty()) {
      resume_choice = choose_checkpoint(o);
      if (!o.tokenizer_given) o.tokenizer = tokenizer_setting(resume_choice->record->config_json);
    }
    data = load_training_data(o, resume_choice ? resume_choice->record : std::nullopt);
    config = model_config(o, data.tok.vocab_size());
    o.model_json = tg::io::gpt_config_json(config);
    o.tokenizer_json = data.tok.to_json();
    token_bytes_ = data.tok.token_byte_lengths();
    check_memory(o, config);  // before the model is allocated
    if (!o.save_dir.empty() && o.rank == 0) {  // a save directory that cannot be written is found now, not at the first save
      ckpts.emplace(o.save_dir, o.keep);      // under --dist rank 0 writes (Note [data parallelism in the trainer])
      ckpts->check_writable();
    }
    if (!o.plot.empty()) {  // the plot is written at the end: a path that cannot take it is found now
      const bool existed = ::access(o.plot.c_str(), F_OK) == 0;
      FILE* f = std::fopen(o.plot.c_str(), "a");
      if (!f) throw tg::Error("--plot: cannot write '", o.plot, "': ", std::strerror(errno));
      std::fclose(f);
      if (!existed) std::remove(o.plot.c_str());
    }
    {  // drawn on the host from the seed, then copied to D (the same weights on every device)
      const tg::nn::GPT host(config, init_gen);
      if constexpr (std::is_same_v<D, tg::cpu>) model = std::make_unique<tg::nn::GPT>(host);
      else model = std::make_unique<tg::nn::BasicGPT<D>>(host);
    }
    params = model->named_parameters();
    if (!o.prune.empty()) prune = std::make_unique<PruneRun<D>>(o, params);  // Note [pruning in the trainer]
    if (!o.distill_from.empty()) teacher = std::make_unique<Teacher<D>>(o, o.tokenizer_json);  // Note [the teacher]
    opt = make_optimizer<D>(o, params);
    schedule = make_schedule(o, o.steps);
    // Note [prefetching batches]; a data-parallel rank draws its own rows of each global batch.
    sampler.emplace(tg::data::BatchSampler(data.ds->train(), o.batch, o.seq, o.seed + 3, tg::data::SampleMode::random, o.rank * o.batch));
    if (!o.init_from.empty()) {
      try {
        tg::io::load_weights(o.init_from, params, {.allow_non_finite = o.allow_nonfinite_weights});
      } catch (const tg::io::NonFiniteTensor& e) {
        throw tg::io::NonFiniteTensor("--init-from: ", e.what(), " (--allow-nonfinite-weights loads it anyway)");
      }
      std::printf("initialized the weights from %s\n", o.init_from.c_str());
    }
    o.run_id = tg::train::new_run_id();
    if (!o.dist.empty()) make_data_parallel();  // after every change to the weights: rank 0's are broadcast
  }

  /// Loads --resume (if given) into the model, the optimizer, the schedule, the sampler, the generators, the
  /// counters and `step` (its accumulation position and loss scaler), then checks the save directory. Call
  /// once, after `step` was built over params and *opt.
  template <class Step>
  void resume(Step& step) {
    if (resume_choice) start_step = resume_from(*resume_choice, step);
    if (dp && resume_choice) dp->shard_loaded_state(*opt);  // ZeRO: each rank keeps its shard of the loaded state
    if (ckpts) {
      check_save_dir(o, *ckpts, start_step);
      std::printf("run %s saves to %s\n", o.run_id.empty() ? "(no id, continued from an older checkpoint)" : o.run_id.c_str(),
                  ckpts->dir().c_str());
    }
  }

  /// Accounts for a finished step: tokens, the loss average, non-finite skips (without a loss scaler).
  template <class Step>
  void count(std::int64_t k, const tg::train::StepResult& r, const Step&) {
    tokens_done += o.global_batch() * o.seq * o.grad_accum;
    if (dp) {
      comm_wait_step = dp->stats().wait_seconds - comm_wait_total;
      comm_wait_total = dp->stats().wait_seconds;
    }
    loss_ema = k == 1 ? r.loss : 0.9 * loss_ema + 0.1 * r.loss;
    if constexpr (!Step::scaler_type::scales_loss) nonfinite_skipped += r.skipped ? 1 : 0;
  }

  /// Validation loss and bits per byte (the fp32 forward, no tape).
  tg::train::Evaluation evaluate() const {
    return tg::train::evaluate(*model, *data.ds, o.batch, o.seq, o.eval_batches, token_bytes_);
  }
  /// Note [trained positions]: samples never use a position that no training step reached.
  std::int64_t window() const { return std::min(config.block_size, trained_positions); }
  /// `tokens` tokens after --prompt, with the sampling flags.
  std::string sample(std::int64_t tokens) {
    return tg::nn::generate_text(*model, data.tok, o.prompt, tokens,
                                 {std::max(o.temperature, 1e-4f), o.top_k, o.top_p}, sample_gen, window());
  }

  /// Writes a checkpoint of step `k` when --save-every or the last step asks for one.
  template <class Step>
  void maybe_save(std::int64_t k, const Step& step) {
    if (o.save_dir.empty() || !((o.save_every > 0 && k % o.save_every == 0) || k == o.steps)) return;
    // Under --dist every rank takes part in gathering the optimizer state; rank 0 writes it, consolidated.
    std::optional<tg::dist::ConsolidatedState> consolidated;
    if (dp) consolidated.emplace(*opt, dp->gather_optimizer_state(*opt));
    if (!ckpts) return;
    tg::io::TrainStateRecord r;
    r.step = k;
    r.schedule_step = schedule.step();
    r.sampler = sampler->position();
    r.generators = {{"init", tg::io::record_of(init_gen)}, {"dropout", tg::io::record_of(dropout_gen)},
                    {"sample", tg::io::record_of(sample_gen)}};
    r.grad_accum = tg::io::GradAccumRecord{step.accumulation_steps(), 0, step.steps_taken()};
    r.scalars = {{"loss_ema", loss_ema}, {"tokens_done", static_cast<double>(tokens_done)},
                 {"nonfinite_skipped", static_cast<double>(nonfinite_skipped)},
                 {"trained_positions", static_cast<double>(trained_positions)}};
    r.scaler = tg::io::scaler_record(step.scaler());
    r.config_json = run_config_json(o);
    r.run_id = o.run_id;
    r.model_json = o.model_json;
    r.tokenizer_json = o.tokenizer_json;
    const auto t0 = Clock::now();
    const tg::optim::AnyOptimizer& state = consolidated ? static_cast<const tg::optim::AnyOptimizer&>(*consolidated) : *opt;
    const std::string path = ckpts->save(params, state, r, prune ? prune->pruner.mask_tensors() : tg::io::AuxTensors{});
    std::printf("%ssaved %s (%.0f ms)\n", isatty(fileno(stdout)) ? "\n" : "", path.c_str(), seconds_since(t0) * 1e3);
  }

  /// The error a non-finite step stops the run with (Note [non-finite steps without a scaler]).
  tg::optim::NonFiniteStep stopped_at(std::int64_t k, const tg::optim::NonFiniteStep& e) const {
    const auto newest = ckpts ? ckpts->latest() : std::nullopt;
    return tg::optim::NonFiniteStep("step ", k, ": ", e.what(), "; training stopped, nothing was saved after step ", k - 1,
                                    newest ? " (the newest checkpoint is " + *newest + ")" : std::string(),
                                    ". Lower --lr, or pass --on-nonfinite skip to skip such steps");
  }

  /// The run's header: data, tokenizer, model, device, checkpointing, precision, the uniform baseline.
  template <class Step>
  void print_header() const;
  /// The progress line of step `k` (in place on a terminal, every 10th step otherwise).
  template <class Step>
  void report(std::int64_t k, const tg::train::StepResult& r, double seconds, const tg::train::RunClock& clock,
              const Step& step) const;
  /// Step `k`'s line of --log (with the validation made at this step, if any).
  template <class Step>
  void log_step(std::int64_t k, const tg::train::StepResult& r, double seconds, const tg::train::RunClock& clock,
                const Step& step, const std::optional<tg::train::Evaluation>& eval, tg::train::JsonLinesLog& log) const;
  /// Validation now, printed, and kept for the summary.
  tg::train::Evaluation validate(std::int64_t k);
  /// The final sample and the summary (and --plot).
  void finish(const tg::train::RunClock& clock, tg::train::Clock::time_point started);

  Options o;
  std::optional<tg::io::ResumeChoice> resume_choice;
  TrainingData data;
  tg::nn::GPTConfig config;
  std::optional<tg::io::CheckpointDir> ckpts;
  tg::Generator init_gen{o.seed}, dropout_gen{o.seed + 1}, sample_gen{o.seed + 2};
  std::unique_ptr<tg::nn::BasicGPT<D>> model;
  std::vector<tg::optim::BasicParam<D>> params;
  std::unique_ptr<tg::optim::BasicOptimizer<D>> opt;
  std::unique_ptr<PruneRun<D>> prune;   // --prune (Note [pruning in the trainer])
  std::unique_ptr<Teacher<D>> teacher;  // --distill-from (Note [the teacher])
  tg::optim::Schedule schedule = tg::optim::Constant{0.f};
  std::optional<tg::data::PrefetchingSampler> sampler;
  std::unique_ptr<tg::dist::Communicator> device_comm;  // --dist on a GPU: NCCL over the MPI world
  std::unique_ptr<tg::dist::DataParallel<D>> dp;        // --dist (Note [data parallelism in the trainer])
  // What a checkpoint keeps besides the model, optimizer and step (Note [training-state checkpoints]).
  double loss_ema = 0;
  std::int64_t tokens_done = 0, nonfinite_skipped = 0;  // steps skipped under --on-nonfinite skip (the run's total)
  std::int64_t trained_positions = o.seq;               // Note [trained positions]
  std::int64_t start_step = 0;
  std::int64_t earlier_peak = 0;  // the allocator's peak before a reset_peak() (--compile measures each step)
  double comm_wait_total = 0, comm_wait_step = 0;  // --dist: seconds blocked on communication (run, last step)

 private:
  void make_data_parallel();
  template <class Step>
  std::int64_t resume_from(const tg::io::ResumeChoice& choice, Step& step);

  std::vector<std::int32_t> token_bytes_;  // each token's bytes, for bits per byte
  std::optional<tg::train::Evaluation> first_, last_, best_;  // validation at step 0, the latest, the best
};

// Note [data parallelism in the trainer]
// `mpirun -np N train_gpt --dist ddp|zero1|zero2 ...` trains one model on N ranks (Note [data parallelism]):
// --batch is per rank, so a step sees N·batch sequences; rank k draws rows k·batch .. k·batch + batch - 1 of
// each global batch (the rows one process with --batch N·batch draws), and checkpoints record the global
// batch, so a run saved on N ranks resumes on any number with the same global batch. Every rank must be
// started with the same settings: rank 0's are compared with each rank's at start-up and a difference stops
// every rank naming it. Rank 0 prints, logs and writes checkpoints (the optimizer state gathered from its
// owners under ZeRO; every rank reads --resume and keeps its shard); the other ranks print nothing but
// errors, which end the whole run (MPI_Abort). OpenMP threads default to the CPUs divided among the ranks
// of a machine. On a GPU (--device cuda) the gradients travel over NCCL, its id sent over MPI.
template <tg::Device D>
void Session<D>::make_data_parallel() {
  tg::dist::Communicator& world = tg::dist::world();
  world.set_timeout(std::chrono::seconds(o.dist_timeout));
  const std::string mine = run_config_json(o) + "\n" + o.model_json;
  const std::vector<std::string> all = world.all_gather_strings(mine);
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    std::string diffs;
    const auto a = nlohmann::json::parse(all[0].substr(0, all[0].find('\n')), nullptr, false);
    const auto b = nlohmann::json::parse(all[r].substr(0, all[r].find('\n')), nullptr, false);
    if (a.is_object() && b.is_object())
      for (auto it = a.begin(); it != a.end(); ++it)
        if (!b.contains(it.key()) || b[it.key()] != it.value())
          diffs += (diffs.empty() ? "" : "; ") + it.key() + ": rank 0 " + it.value().dump() + ", rank " + std::to_string(r) + " " +
                   (b.contains(it.key()) ? b[it.key()].dump() : std::string("unset"));
    throw tg::Error("--dist: rank ", r, " was started with other settings than rank 0 (", diffs.empty() ? "the model differs" : diffs,
                    "); start every rank with the same flags");
  }
  tg::dist::Communicator* comm = &world;
  if constexpr (std::is_same_v<D, tg::cuda>) {
    device_comm = tg::dist::make_nccl_communicator(world);
    device_comm->set_timeout(std::chrono::seconds(o.dist_timeout));
    comm = device_comm.get();
  }
  const tg::dist::Sharding sharding = o.dist == "zero2"   ? tg::dist::Sharding::gradients
                                      : o.dist == "zero1" ? tg::dist::Sharding::optimizer
                                                          : tg::dist::Sharding::none;
  dp = std::make_unique<tg::dist::DataParallel<D>>(
      *comm, params,
      tg::dist::DataParallelOptions{.sharding = sharding,
                                    .bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * (1 << 20)),
                                    .reduce_bf16 = o.reduce_dtype == "bf16",
                                    .overlap = o.dist_overlap});
}

/// Loads the checkpoint `choice` into the model, the optimizer and `step` (its accumulation position, its loss
/// scaler, then fresh weight copies), restores the loop's positions; returns the step reached. Takes the
/// resumed run's id.
template <tg::Device D>
template <class Step>
std::int64_t Session<D>::resume_from(const tg::io::ResumeChoice& choice, Step& step) {
  Session& s = *this;
  const std::string& path = choice.path;
  validate_resume_record(o, path, *choice.record, init_gen.offset());  // before anything changes
  tg::io::TrainStateRecord r;
  tg::io::AuxTensors masks;
  if (prune) {  // the masks are checked (names, shapes, 0/1, the pattern) before anything changes
    if (const tg::io::AuxTensors saved = tg::io::read_aux_tensors(path); !saved.empty()) {
      try {
        prune->pruner.load_masks(saved);
      } catch (const tg::Error& e) {
        throw tg::Error("--resume: ", path, ": its pruning masks do not fit this run's --prune ", o.prune, ": ", e.what());
      }
    }
  }
  try {
    r = tg::io::load_train_state(path, params, *opt, {.allow_non_finite = o.allow_nonfinite_weights}, prune ? &masks : nullptr);
  } catch (const tg::io::NonFiniteTensor& e) {
    throw tg::io::NonFiniteTensor(e.what(), " (--allow-nonfinite-weights loads it anyway)");
  }
  if (prune && masks.empty() && r.step > 0)
    std::printf("note: %s holds no pruning masks; pruning starts from dense weights\n", path.c_str());
  if (prune && !masks.empty() && !prune->pruner.weights_respect_masks())
    throw tg::Error("--resume: ", path, ": weights are non-zero where its pruning masks prune them (the file's tensors disagree)");
  for (const auto& d : tg::io::config_differences(r.config_json, run_config_json(o)))
    std::printf("warning: resuming with a different setting, the run will not repeat the original: %s\n", d.c_str());
  s.schedule.set_step(r.schedule_step);
  s.sampler->set_position(r.sampler);
  for (auto [name, gen] : {std::pair{"init", &s.init_gen}, {"dropout", &s.dropout_gen}, {"sample", &s.sample_gen}}) {
    auto it = r.generators.find(name);
    TG_CHECK(it != r.generators.end(), "--resume: ", path, " has no state for the '", name, "' generator");
    tg::io::restore(*gen, it->second);
  }
  step.restore_steps(r.grad_accum->steps);
  step.refresh_weights();  // the copies of the loaded masters (Note [master weights and per-step copies])
  if (auto it = r.scalars.find("loss_ema"); it != r.scalars.end()) s.loss_ema = it->second;
  if (auto it = r.scalars.find("tokens_done"); it != r.scalars.end()) s.tokens_done = static_cast<std::int64_t>(it->second);
  if (auto it = r.scalars.find("nonfinite_skipped"); it != r.scalars.end()) s.nonfinite_skipped = static_cast<std::int64_t>(it->second);
  if (auto it = r.scalars.find("trained_positions"); it != r.scalars.end())  // positions an earlier --seq reached
    s.trained_positions = std::max(s.trained_positions, static_cast<std::int64_t>(it->second));
  o.run_id = r.run_id;  // "" for a checkpoint saved before run ids: the run goes on owning the files without one
  std::printf("resumed from %s at step %lld of %lld (run %s)\n", path.c_str(), static_cast<long long>(r.step),
              static_cast<long long>(o.steps), r.run_id.empty() ? "without an id, saved before run ids" : r.run_id.c_str());
  if (std::filesystem::is_directory(o.resume))
    if (const auto others = tg::io::CheckpointDir(o.resume).other_runs(r.run_id); !others.empty())
      std::printf("note: %s also holds %zu checkpoint(s) of other runs (the newest: %s); this run is %s\n", o.resume.c_str(),
                  others.size(), others.back().second.c_str(), r.run_id.empty() ? "the one without an id" : r.run_id.c_str());
  if (r.step == o.steps) std::printf("note: the checkpoint is at the last step (--steps %lld): nothing left to train\n", static_cast<long long>(o.steps));
  if (!tg::io::restore_scaler(step.scaler(), r.scaler))
    std::printf("warning: the checkpoint has a loss scaler's state; this run's precision uses none\n");
  return r.step;
}

/// scripts/plot_log.py's path: $TG_PLOT_SCRIPT, else the source tree's (compiled in).
inline std::string plot_script() {
  if (const char* env = std::getenv("TG_PLOT_SCRIPT"); env && *env) return env;
#ifdef TG_PLOT_SCRIPT_DEFAULT
  return TG_PLOT_SCRIPT_DEFAULT;
#else
  return "scripts/plot_log.py";
#endif
}

/// Draws --log into --plot with matplotlib (scripts/plot_log.py, run with /usr/bin/python3); throws with the
/// tool's message when it fails.
inline void draw_plot(const Options& o, std::int64_t tokens_per_step) {
  const std::string script = plot_script(), title = "train_gpt --model " + o.model + " (" + o.precision + ", run " + o.run_id + ")";
  const std::string tps = std::to_string(tokens_per_step);
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid < 0) throw tg::Error("--plot: cannot start the plotting tool: ", std::strerror(errno));
  if (pid == 0) {
    const char* argv[] = {"/usr/bin/python3", script.c_str(), o.log.c_str(), o.plot.c_str(), "--title", title.c_str(),
                          "--tokens-per-step", tps.c_str(), nullptr};
    ::execv(argv[0], const_cast<char* const*>(argv));
    std::fprintf(stderr, "plot_log: error: cannot run /usr/bin/python3: %s\n", std::strerror(errno));
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw tg::Error("--plot: drawing '", o.plot, "' from '", o.log, "' failed (", script, ", exit ",
                    WIFEXITED(status) ? WEXITSTATUS(status) : -1, "; its message is above; it needs Debian's python3-matplotlib)");
}

template <tg::Device D>
template <class Step>
void Session<D>::print_header() const {
  const auto& ds = *data.ds;
  std::printf("typegrad %s | data: %s (%lld train / %lld val tokens)\n", TG_VERSION_STRING, ds.source().c_str(),
              static_cast<long long>(ds.train_size()), static_cast<long long>(ds.val_size()));
  std::printf("tokenizer: %s\n", data.tok.describe().c_str());
  const std::string where = std::is_same_v<D, tg::cuda> ? "GPU: " + tg::backend::cuda::device_description()
                                                         : std::to_string(tg::backend::cpu::num_threads()) + " threads";
  std::printf("model %s: L=%lld H=%lld C=%lld T=%lld V=%lld, %.2fM parameters | %s, %s schedule, lr %.2g, batch %lldx%lld x%lld accum, %s\n",
              o.model.c_str(), (long long)config.n_layer, (long long)config.n_head, (long long)config.n_embd,
              (long long)config.block_size, (long long)config.vocab_size, tg::nn::count_parameters(params) / 1e6,
              o.optimizer.c_str(), o.schedule.c_str(), o.lr, (long long)o.batch, (long long)o.seq, (long long)o.grad_accum,
              where.c_str());
  std::printf("device %s | activation checkpointing: %s | positions trained: %lld of %lld (samples use a window of %lld)\n",
              o.device.c_str(), Step::checkpointing::name, (long long)trained_positions, (long long)config.block_size,
              (long long)window());
  std::printf("precision %s (Note [precision policies]; loss scaler: %s)\n", o.precision.c_str(), Step::scaler_type::kind());
  if (o.device_boundary)
    std::printf("step boundary on the device (Note [the step boundary on the device]): one read of its outcome per step\n");
  if (o.offload) std::printf("optimizer offload: the %s state and update on the host (CPU kernels); the device keeps weights and gradients\n", opt->name());
  if (dp)
    std::printf("data parallel: %s over %d ranks (%s), %zu buckets of <= %.0f MiB, %s reduction, overlap %s; global batch %lld x %lld\n",
                o.dist.c_str(), o.world, dp->communicator().backend().c_str(), dp->num_buckets(), o.bucket_mb, o.reduce_dtype.c_str(),
                o.dist_overlap ? "on" : "off", (long long)o.global_batch(), (long long)o.seq);
  if (prune) std::printf("pruning: %s; sparsity now %.1f%%\n", prune->describe().c_str(), 100 * prune->pruner.sparsity());
  if (teacher)
    std::printf("distillation: teacher %s (L=%lld H=%lld C=%lld, %s, no tape), loss %.2f x tau^2 x KL at tau %.2f + %.2f x cross-entropy\n",
                o.distill_from.c_str(), (long long)teacher->config().n_layer, (long long)teacher->config().n_head,
                (long long)teacher->config().n_embd, teacher->precision(), o.distill_alpha, o.distill_temperature, 1 - o.distill_alpha);
  std::printf("baseline: a uniform guess over %lld tokens costs ln %lld = %.3f nats/token (loss: nats/token; bpb: bits per byte of text)\n",
              (long long)config.vocab_size, (long long)config.vocab_size, std::log(static_cast<double>(config.vocab_size)));
  std::fflush(stdout);  // the header before the first evaluation, which takes a while on a large model
}

template <tg::Device D>
tg::train::Evaluation Session<D>::validate(std::int64_t k) {
  const tg::train::Evaluation e = evaluate();
  if (!first_) {
    first_ = last_ = best_ = e;
    std::printf("step %lld: val loss %.4f (%.3f bpb)\n", (long long)k, e.loss, e.bits_per_byte);
    return e;
  }
  last_ = e;
  best_->loss = std::min(best_->loss, e.loss);
  best_->bits_per_byte = std::min(best_->bits_per_byte, e.bits_per_byte);
  std::printf("%sstep %lld: val loss %.4f (%.3f bpb) (train loss ema %.4f)\n", isatty(fileno(stdout)) ? "\n" : "", (long long)k,
              e.loss, e.bits_per_byte, loss_ema);
  return e;
}

template <tg::Device D>
template <class Step>
void Session<D>::report(std::int64_t k, const tg::train::StepResult& r, double seconds, const tg::train::RunClock& clock,
                        const Step& step) const {
  const auto mem = tg::allocator<D>().stats();
  const std::int64_t scaler_skipped = step.scaler().state().skipped_steps;  // the run's total, across resumes
  char line[320];
  std::snprintf(line, sizeof line, "step %5lld/%lld | loss %.4f | lr %.2e | norm %6.3f | %6.1f ms | %7.0f tok/s | mem %s | left %s",
                (long long)k, (long long)o.steps, r.loss, r.lr, r.grad_norm, seconds * 1e3, clock.tokens_per_second(),
                human_bytes(mem.bytes_in_use).c_str(), human_time(clock.seconds_left()).c_str());
  if constexpr (Step::scaler_type::scales_loss)  // fp16: the loss scale and the steps skipped for inf/NaN
    std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | scale %g | skipped %lld", step.scaler().scale(),
                  (long long)scaler_skipped);
  else if (nonfinite_skipped > 0)  // --on-nonfinite skip
    std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | skipped %lld (non-finite)", (long long)nonfinite_skipped);
  if (prune) std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | sparsity %.1f%%", 100 * prune->pruner.sparsity());
  if (dp)
    std::snprintf(line + std::strlen(line), sizeof line - std::strlen(line), " | %d ranks, comm wait %.1f ms", o.world, comm_wait_step * 1e3);
  const bool tty = isatty(fileno(stdout));
  if (tty) std::printf("\r%s\x1b[K", line);
  if (!tty && (k % 10 == 0 || k == 1 || k == o.steps)) std::printf("%s\n", line);
}

template <tg::Device D>
template <class Step>
void Session<D>::log_step(std::int64_t k, const tg::train::StepResult& r, double seconds, const tg::train::RunClock& clock,
                          const Step& step, const std::optional<tg::train::Evaluation>& eval, tg::train::JsonLinesLog& log) const {
  if (!log.is_open()) return;
  const std::int64_t scaler_skipped = step.scaler().state().skipped_steps;
  tg::train::LogRecord rec;
  rec.add("step", k).add("loss", r.loss).add("lr", r.lr).add("grad_norm", r.grad_norm).add("ms", seconds * 1e3);
  rec.add("tokens_per_s", clock.tokens_per_second()).add("bytes_in_use", tg::allocator<D>().stats().bytes_in_use);
  rec.add("loss_scale", step.scaler().scale()).add("skipped_steps", scaler_skipped + nonfinite_skipped);
  if (eval) rec.add("val_loss", eval->loss).add("val_bpb", eval->bits_per_byte);
  if (prune) rec.add("sparsity", prune->pruner.sparsity());
  if (dp) rec.add("ranks", o.world).add("comm_wait_ms", comm_wait_step * 1e3);
  log.write(k, rec);
}

template <tg::Device D>
void Session<D>::finish(const tg::train::RunClock& clock, tg::train::Clock::time_point started) {
  if (isatty(fileno(stdout))) std::printf("\n");
  const auto t_sample = Clock::now();
  const std::string text = sample(o.sample_tokens);
  const double sample_s = seconds_since(t_sample);
  std::printf("\n--- sample (temperature %.2f, top-k %lld, top-p %.2f, window %lld positions; %.0f tokens/s with a KV cache) ---\n%s\n---\n",
              o.temperature, (long long)o.top_k, o.top_p, (long long)window(), static_cast<double>(o.sample_tokens) / std::max(sample_s, 1e-9),
              text.c_str());
  const auto mem = tg::allocator<D>().stats();
  std::printf("\nsummary\n");
  std::printf("  steps             %lld (%lld tokens)\n", (long long)o.steps, (long long)tokens_done);
  std::printf("  train loss (ema)  %.4f\n", loss_ema);
  std::printf("  val loss          %.4f at the end, %.4f best, %.4f at step 0 (ln %lld = %.4f)\n", last_->loss, best_->loss,
              first_->loss, (long long)config.vocab_size, std::log(static_cast<double>(config.vocab_size)));
  std::printf("  val bits/byte     %.4f at the end, %.4f best, %.4f at step 0 (%s)\n", last_->bits_per_byte, best_->bits_per_byte,
              first_->bits_per_byte, data.tok.describe().c_str());
  const std::int64_t steps_run = std::max<std::int64_t>(1, o.steps - start_step);  // in this process (after --resume)
  const double train_time = clock.train_seconds();
  std::printf("  speed             %.1f ms/step, %.0f tokens/s\n", train_time / static_cast<double>(steps_run) * 1e3,
              static_cast<double>(o.global_batch() * o.seq * o.grad_accum * steps_run) / std::max(train_time, 1e-9));
  if (dp)
    std::printf("  communication     %d ranks (%s), %.1f ms/step waited on reductions and gathers (%.1f%% of the step time)\n", o.world,
                o.dist.c_str(), comm_wait_total / static_cast<double>(steps_run) * 1e3, 100 * comm_wait_total / std::max(train_time, 1e-9));
  std::printf("  memory            peak %s, reserved %s, %lld system allocations\n", human_bytes(std::max(mem.peak_bytes, earlier_peak)).c_str(),
              human_bytes(mem.bytes_reserved).c_str(), (long long)mem.system_allocations);
  std::printf("  wall time         %s\n", human_time(seconds_since(started)).c_str());
  if (!o.log.empty()) std::printf("  log               %s\n", o.log.c_str());
  if (!o.plot.empty()) {
    draw_plot(o, o.global_batch() * o.seq * o.grad_accum);
    std::printf("  plot              %s\n", o.plot.c_str());
  }
}

}  // namespace train_gpt

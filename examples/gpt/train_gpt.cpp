// train_gpt: trains a GPT on a text file (by default the English fortunes of Debian's `fortunes` package)
// with live progress, periodic validation, generated samples and a closing summary.
//   train_gpt                                         # the README's first command: tiny GPT, 2000 steps
//   train_gpt --data book.txt --model small --batch 8 --seq 256 --grad-accum 4 --log run.jsonl --precision bf16
//   train_gpt --device cuda --model gpt2 --precision bf16 --batch 16 --seq 1024   # on a GPU (Note [training on a GPU])
#include <CLI/CLI.hpp>

#include "trainer.hpp"

namespace train_gpt {
namespace {

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

template <class Policy>  // tg::amp::fp32_policy, bf16_mixed or fp16_mixed
int run_policy(Options o) {
  if (o.threads > 0) tg::backend::cpu::set_num_threads(o.threads);
  // --resume's record first: it fixes the tokenizer (Note [the trainer's data and tokenizer]).
  std::optional<tg::io::ResumeChoice> resume_choice;
  if (!o.resume.empty() && o.data_export.empty()) {
    resume_choice = choose_checkpoint(o);
    if (!o.tokenizer_given) o.tokenizer = tokenizer_setting(resume_choice->record->config_json);
  }
  const TrainingData data = load_training_data(o, resume_choice ? resume_choice->record : std::nullopt);
  if (!o.data_export.empty()) return export_tokens(o, data);
  const tg::data::AnyTokenizer& tok = data.tok;
  const tg::data::TextDataset& ds = *data.ds;
  auto config = tg::nn::GPTConfig::preset(o.model, tok.vocab_size());
  config.block_size = std::max(config.block_size, o.seq);
  config.dropout = o.dropout;
  o.model_json = tg::io::gpt_config_json(config);
  o.tokenizer_json = tok.to_json();
  check_memory(o, config);  // before the model is allocated
  std::optional<tg::io::CheckpointDir> ckpts;
  if (!o.save_dir.empty()) {  // a save directory that cannot be written is found now, not at the first save
    ckpts.emplace(o.save_dir, o.keep);
    ckpts->check_writable();
  }
  if (!o.plot.empty()) {  // the plot is written at the end: a path that cannot take it is found now
    const bool existed = ::access(o.plot.c_str(), F_OK) == 0;
    FILE* f = std::fopen(o.plot.c_str(), "a");
    if (!f) throw tg::Error("--plot: cannot write '", o.plot, "': ", std::strerror(errno));
    std::fclose(f);
    if (!existed) std::remove(o.plot.c_str());
  }

  tg::Generator init_gen(o.seed), dropout_gen(o.seed + 1), sample_gen(o.seed + 2);
  tg::nn::GPT model(config, init_gen);
  model.set_checkpoint(tg::parse_checkpoint_mode(o.checkpoint));
  const auto params = model.named_parameters();
  auto opt = make_optimizer(o, params);
  auto schedule = make_schedule(o, o.steps);
  tg::optim::GradAccumRuntime accum(o.grad_accum);
  tg::data::PrefetchingSampler sampler(tg::data::BatchSampler(ds.train(), o.batch, o.seq, o.seed + 3));  // Note [prefetching batches]
  double loss_ema = 0;
  std::int64_t tokens_done = 0, nonfinite_skipped = 0, trained_positions = o.seq;  // Note [trained positions]
  const LoopState loop_state{schedule,    sampler,     init_gen,          dropout_gen,      sample_gen,
                             accum,       loss_ema,    tokens_done,       nonfinite_skipped, trained_positions};
  if (!o.init_from.empty()) {
    try {
      tg::io::load_weights(o.init_from, params, {.allow_non_finite = o.allow_nonfinite_weights});
    } catch (const tg::io::NonFiniteTensor& e) {
      throw tg::io::NonFiniteTensor("--init-from: ", e.what(), " (--allow-nonfinite-weights loads it anyway)");
    }
    std::printf("initialized the weights from %s\n", o.init_from.c_str());
  }
  std::optional<tg::io::ScalerStateRecord> saved_scaler;
  o.run_id = new_run_id();
  const std::int64_t start_step =
      resume_choice ? resume_from(o, *resume_choice, params, *opt, loop_state, saved_scaler, o.run_id) : 0;
  if (ckpts) {
    check_save_dir(o, *ckpts, start_step);
    std::printf("run %s saves to %s\n", o.run_id.empty() ? "(no id, continued from an older checkpoint)" : o.run_id.c_str(),
                ckpts->dir().c_str());
  }

  Run r{o, tok, ds, config, params, *opt, schedule, accum, sampler, dropout_gen, sample_gen, loop_state, ckpts,
        loss_ema, tokens_done, nonfinite_skipped, trained_positions, start_step};
  if (o.device == "cuda") return train_on_cuda<Policy>(r, model, saved_scaler);
  tg::amp::MixedPrecision<Policy> amp(params, *opt);  // policy, its default loss scaler, per-step weight copies (of the loaded masters)
  restore_scaler_or_warn(amp.scaler, saved_scaler);
  return train<tg::cpu>(r, model, *opt, amp, [] {});
}

template <class Policy>  // --precision: tg::amp::fp32_policy, tf32_policy, bf16_mixed or fp16_mixed
int run(const Options& o) {
  if constexpr (Policy::fp32_matmul == tg::amp::Fp32Matmul::tf32) {
    // The fp32 run, with the GPU's fp32 GEMMs on TF32 tensor cores (Note [TF32 by policy]).
    if (o.device != "cuda") {
      std::printf("note: --precision tf32 changes only GPU GEMMs; on the CPU this is the fp32 run\n");
      return run_policy<tg::amp::fp32_policy>(o);
    }
    const tg::amp::Fp32MatmulScope<Policy> tf32;
    return run_policy<tg::amp::fp32_policy>(o);
  } else {
    return run_policy<Policy>(o);
  }
}

}  // namespace
}  // namespace train_gpt

int main(int argc, char** argv) {
  train_gpt::Options o;
  std::string seed_text = std::to_string(o.seed);
  CLI::App app{"train_gpt: train a GPT language model on a text file with typegrad"};
  // Numbers are range-checked after parsing, by validate_options (Note [the trainer's guards]).
  app.add_option("--data", o.data, "a text file, a directory of text files, or a token file (--data-export) to train on "
                                   "(default: the English fortunes under /usr/share/games/fortunes)");
  CLI::Option* tokenizer_flag = app.add_option("--tokenizer", o.tokenizer, "byte; bpe:N (a byte-level BPE of N tokens trained on --data, cached); "
                                               "or gpt2:DIR (GPT-2's DIR/vocab.json and DIR/merges.txt). A resumed run keeps its own");
  app.add_option("--data-export", o.data_export, "write --data's tokens (with --tokenizer) to this token file and exit");
  app.add_option("--model", o.model, "model preset")->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--batch", o.batch, "sequences per micro-batch");
  app.add_option("--seq", o.seq, "tokens per sequence");
  app.add_option("--grad-accum", o.grad_accum, "micro-batches per optimizer step");
  app.add_option("--steps", o.steps, "optimizer steps");
  app.add_option("--lr", o.lr, "peak learning rate");
  CLI::Option* min_lr_flag = app.add_option("--min-lr", o.min_lr, "final learning rate of the decay (default lr/10; at most --lr)");
  CLI::Option* warmup_flag = app.add_option("--warmup", o.warmup, "linear warmup steps (default: 50, at most a tenth of --steps)");
  app.add_option("--schedule", o.schedule, "learning-rate decay")->check(CLI::IsMember({"cosine", "linear", "constant", "invsqrt"}));
  app.add_option("--optimizer", o.optimizer, "optimizer")->check(CLI::IsMember({"adamw", "adam", "sgd", "lamb", "adafactor"}));
  app.add_option("--weight-decay", o.weight_decay, "decoupled weight decay (matrices only)");
  app.add_option("--clip", o.clip, "clip the global gradient norm to this (0: off)");
  app.add_option("--seed", seed_text, "seed for initialization, sampling and data order (0 to 2^64-1)");
  app.add_option("--threads", o.threads, "OpenMP threads (0: every CPU this process may use, within its cgroup's CPU quota)");
  app.add_option("--eval-every", o.eval_every, "validation every N steps (0: only at the end)");
  app.add_option("--eval-batches", o.eval_batches, "validation batches per evaluation");
  app.add_option("--sample-every", o.sample_every, "print a generated sample every N steps (0: only at the end)");
  app.add_option("--sample-tokens", o.sample_tokens, "tokens to generate in the final sample");
  app.add_option("--temperature", o.temperature, "sampling temperature");
  app.add_option("--top-k", o.top_k, "sample from the k most likely tokens (0: all)");
  app.add_option("--top-p", o.top_p, "sample from the smallest set of likeliest tokens holding this probability (1: all)");
  app.add_option("--dropout", o.dropout, "dropout probability, in [0, 1)");
  app.add_option("--val-fraction", o.val_fraction, "fraction of the corpus held out for validation, in [0.001, 0.5]");
  app.add_option("--prompt", o.prompt, "text the samples start from");
  app.add_option("--checkpoint", o.checkpoint, "activation checkpointing of the blocks: none, selective (keep GEMM outputs) or blocks (recompute each block)")
      ->check(CLI::IsMember({"none", "selective", "blocks"}));
  app.add_option("--log", o.log, "write one JSON line per step to this file (a resumed run continues it)");
  app.add_option("--plot", o.plot, "at the end, draw --log into this .png or .svg (train/validation loss, lr, tokens/s; needs python3-matplotlib)");
  app.add_option("--log-errors", o.log_errors, "a failed log write: stop the run (default) or warn and train on")
      ->check(CLI::IsMember({"stop", "warn"}));
  app.add_option("--save-dir", o.save_dir, "write training checkpoints (ckpt-<step>.safetensors) to this directory");
  app.add_option("--save-every", o.save_every, "checkpoint every N steps (0: only at the end; needs --save-dir)");
  app.add_option("--keep", o.keep, "keep this run's newest N checkpoints (0: all)");
  app.add_flag("--share-save-dir", o.share_save_dir, "let a fresh run write into a --save-dir that holds another run's checkpoints (never deleted)");
  app.add_option("--resume", o.resume, "continue from a checkpoint file, or from the newest in a directory");
  app.add_flag("--resume-fallback", o.resume_fallback, "--resume DIR: when the newest checkpoint is damaged, resume from the newest intact one");
  app.add_option("--init-from", o.init_from, "initialize the weights from a safetensors file (weights only)");
  app.add_flag("--allow-nonfinite-weights", o.allow_nonfinite_weights, "load --init-from / --resume weights that hold NaN or inf");
  app.add_option("--on-nonfinite", o.on_nonfinite, "a NaN/inf loss or gradient norm without a loss scaler: stop the run (default) or skip the step")
      ->check(CLI::IsMember({"stop", "skip"}));
  app.add_option("--precision", o.precision, "fp32; tf32 (fp32 with TF32 tensor cores for GPU GEMMs); or mixed precision with bf16 / fp16 compute (fp32 master weights)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_option("--device", o.device, "where to train: cpu, or cuda (the first GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {  // every input error is one line and exit code 2
    std::fprintf(stderr, "train_gpt: error: %s (--help lists the flags)\n", e.what());
    return 2;
  }
  try {
    o.seed = train_gpt::parse_seed(seed_text);
    o.tokenizer_given = tokenizer_flag->count() > 0;
    // The default warmup fits short runs (train_gpt --steps 20 just works); an explicit --warmup is checked as given.
    if (warmup_flag->count() == 0 && o.steps > 0) o.warmup = std::min<std::int64_t>(o.warmup, o.steps / 10);
    if (min_lr_flag->count() > 0 && !(o.min_lr >= 0)) throw tg::Error("--min-lr must be a non-negative number, got ", o.min_lr);
    train_gpt::validate_options(o);
    tg::data::parse_tokenizer_spec(o.tokenizer);  // a malformed spec before any data is read
    if (!(o.top_p > 0 && o.top_p <= 1)) throw tg::Error("--top-p must be in (0, 1], got ", o.top_p);
    if (o.device == "cuda") {  // before any work (Note [training on a GPU])
      TG_CHECK(tg::backend::cuda::device_count() > 0, "--device cuda: no usable CUDA device (",
               tg::backend::cuda::device_description(), "); train on the CPU with --device cpu");
    }
    return tg::amp::with_precision(o.precision, [&]<class Policy>() { return train_gpt::run<Policy>(o); });
  } catch (const tg::optim::NonFiniteStep& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ntrain_gpt: error: %s\n", e.what());
    return 3;
  } catch (const tg::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: out of memory (an allocation failed; lower --batch or --seq, or use a smaller --model)\n");
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 2;
  }
}

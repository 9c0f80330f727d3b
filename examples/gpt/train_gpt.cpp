// train_gpt: trains a GPT on a text file (by default the English fortunes of Debian's `fortunes` package)
// with live progress, periodic validation, generated samples and a closing summary.
//   train_gpt                                         # the README's first command: tiny GPT, 2000 steps
//   train_gpt --data book.txt --model small --batch 8 --seq 256 --grad-accum 4 --log run.jsonl --precision bf16
//   train_gpt --device cuda --model gpt2 --precision bf16 --batch 16 --seq 1024   # on a GPU (Note [training on a GPU])
#include <CLI/CLI.hpp>

#include "trainer.hpp"

namespace train_gpt {
namespace {

template <class Policy>  // tg::amp::fp32_policy, bf16_mixed or fp16_mixed
int run_policy(const Options& o) {
  if (o.threads > 0) tg::backend::cpu::set_num_threads(o.threads);
  TG_CHECK(o.batch > 0 && o.seq > 0 && o.steps > 0 && o.grad_accum > 0, "--batch, --seq, --steps and --grad-accum must be positive");
  TG_CHECK(o.warmup >= 0 && o.warmup < o.steps, "--warmup must be in [0, --steps), got ", o.warmup);
  const tg::data::ByteTokenizer tok;
  const auto ds = o.data.empty() ? tg::data::TextDataset::fortunes(tok, o.val_fraction, o.seq)
                                 : tg::data::TextDataset::from_file(o.data, tok, o.val_fraction, o.seq);

  auto config = tg::nn::GPTConfig::preset(o.model, tok.vocab_size());
  config.block_size = std::max(config.block_size, o.seq);
  config.dropout = o.dropout;
  tg::Generator init_gen(o.seed), dropout_gen(o.seed + 1), sample_gen(o.seed + 2);
  tg::nn::GPT model(config, init_gen);
  model.set_checkpoint(tg::parse_checkpoint_mode(o.checkpoint));
  const auto params = model.named_parameters();
  auto opt = make_optimizer(o, params);
  auto schedule = make_schedule(o, o.steps);
  tg::optim::GradAccumRuntime accum(o.grad_accum);
  tg::data::BatchSampler sampler(ds.train(), o.batch, o.seq, o.seed + 3);
  double loss_ema = 0;
  std::int64_t tokens_done = 0;
  const LoopState loop_state{schedule, sampler, init_gen, dropout_gen, sample_gen, accum, loss_ema, tokens_done};
  TG_CHECK(o.save_every == 0 || !o.save_dir.empty(), "--save-every needs --save-dir");
  TG_CHECK(o.init_from.empty() || o.resume.empty(), "--init-from and --resume exclude each other (a checkpoint holds the weights)");
  if (!o.init_from.empty()) {
    tg::io::load_weights(o.init_from, params);
    std::printf("initialized the weights from %s\n", o.init_from.c_str());
  }
  std::optional<tg::io::ScalerStateRecord> saved_scaler;
  const std::int64_t start_step = o.resume.empty() ? 0 : resume_from(o, params, *opt, loop_state, saved_scaler);
  std::optional<tg::io::CheckpointDir> ckpts;
  if (!o.save_dir.empty()) ckpts.emplace(o.save_dir, o.keep);

  Run r{o, tok, ds, config, params, *opt, schedule, accum, sampler, dropout_gen, sample_gen, loop_state, ckpts,
        loss_ema, tokens_done, start_step};
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
  CLI::App app{"train_gpt: train a GPT language model on a text file with typegrad"};
  app.add_option("--data", o.data, "text file to train on (default: the English fortunes under /usr/share/games/fortunes)");
  app.add_option("--model", o.model, "model preset")->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--batch", o.batch, "sequences per micro-batch")->check(CLI::PositiveNumber);
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::PositiveNumber);
  app.add_option("--grad-accum", o.grad_accum, "micro-batches per optimizer step")->check(CLI::PositiveNumber);
  app.add_option("--steps", o.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--lr", o.lr, "peak learning rate")->check(CLI::PositiveNumber);
  app.add_option("--min-lr", o.min_lr, "final learning rate of the decay (default lr/10)")->check(CLI::NonNegativeNumber);
  CLI::Option* warmup_flag = app.add_option("--warmup", o.warmup, "linear warmup steps (default: 50, at most a tenth of --steps)")
                                ->check(CLI::NonNegativeNumber);
  app.add_option("--schedule", o.schedule, "learning-rate decay")->check(CLI::IsMember({"cosine", "linear", "constant", "invsqrt"}));
  app.add_option("--optimizer", o.optimizer, "optimizer")->check(CLI::IsMember({"adamw", "adam", "sgd", "lamb", "adafactor"}));
  app.add_option("--weight-decay", o.weight_decay, "decoupled weight decay (matrices only)")->check(CLI::NonNegativeNumber);
  app.add_option("--clip", o.clip, "clip the global gradient norm to this (0: off)")->check(CLI::NonNegativeNumber);
  app.add_option("--seed", o.seed, "seed for initialization, sampling and data order");
  app.add_option("--threads", o.threads, "OpenMP threads (0: all cores)")->check(CLI::NonNegativeNumber);
  app.add_option("--eval-every", o.eval_every, "validation every N steps (0: only at the end)")->check(CLI::NonNegativeNumber);
  app.add_option("--eval-batches", o.eval_batches, "validation batches per evaluation")->check(CLI::PositiveNumber);
  app.add_option("--sample-every", o.sample_every, "print a generated sample every N steps (0: only at the end)")->check(CLI::NonNegativeNumber);
  app.add_option("--sample-tokens", o.sample_tokens, "tokens to generate in the final sample")->check(CLI::PositiveNumber);
  app.add_option("--temperature", o.temperature, "sampling temperature")->check(CLI::PositiveNumber);
  app.add_option("--top-k", o.top_k, "sample from the k most likely tokens (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--dropout", o.dropout, "dropout probability")->check(CLI::Range(0.0, 0.99));
  app.add_option("--val-fraction", o.val_fraction, "fraction of the corpus held out for validation")->check(CLI::Range(0.001, 0.5));
  app.add_option("--prompt", o.prompt, "text the samples start from");
  app.add_option("--checkpoint", o.checkpoint, "activation checkpointing of the blocks: none, selective (keep GEMM outputs) or blocks (recompute each block)")
      ->check(CLI::IsMember({"none", "selective", "blocks"}));
  app.add_option("--log", o.log, "write one JSON line per step to this file");
  app.add_option("--save-dir", o.save_dir, "write training checkpoints (ckpt-<step>.safetensors) to this directory");
  app.add_option("--save-every", o.save_every, "checkpoint every N steps (0: only at the end; needs --save-dir)")->check(CLI::NonNegativeNumber);
  app.add_option("--keep", o.keep, "keep the newest N checkpoints (0: all)")->check(CLI::NonNegativeNumber);
  app.add_option("--resume", o.resume, "continue from a checkpoint file, or from the latest in a directory");
  app.add_option("--init-from", o.init_from, "initialize the weights from a safetensors file (weights only)");
  app.add_option("--precision", o.precision, "fp32; tf32 (fp32 with TF32 tensor cores for GPU GEMMs); or mixed precision with bf16 / fp16 compute (fp32 master weights)")
      ->check(CLI::IsMember({"fp32", "tf32", "bf16", "fp16"}));
  app.add_option("--device", o.device, "where to train: cpu, or cuda (the first GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  // The default warmup fits short runs (train_gpt --steps 20 just works); an explicit --warmup is checked as given.
  if (warmup_flag->count() == 0) o.warmup = std::min<std::int64_t>(o.warmup, o.steps / 10);
  try {
    if (o.device == "cuda") {  // before any work (Note [training on a GPU])
      TG_CHECK(tg::backend::cuda::device_count() > 0, "--device cuda: no usable CUDA device (",
               tg::backend::cuda::device_description(), "); train on the CPU with --device cpu");
    }
    return tg::amp::with_precision(o.precision, [&]<class Policy>() { return train_gpt::run<Policy>(o); });
  } catch (const tg::Error& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 2;
  }
}

// train_gpt's command line: the options of a run, their flags, and the checks made before anything is read
// or allocated (Note [the trainer's guards]).
//   train_gpt::Options o;  if (auto code = train_gpt::parse_command_line(argc, argv, o)) return *code;
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include <CLI/CLI.hpp>

#include <typegrad/data/tokenizer.hpp>
#include <typegrad/detail/cuda/runtime.hpp>
#include <typegrad/quant/prune.hpp>

#include "guards.hpp"

namespace train_gpt {

struct Options {
  std::string data;         // a text file, a directory of text files or a token file (docs/data.md); "": fortunes
  std::string tokenizer = "byte";  // byte | bpe:N | gpt2:DIR (docs/tokenizers.md)
  bool tokenizer_given = false;    // --tokenizer was on the command line (a resumed run otherwise keeps its own)
  std::string data_export;         // write --data's tokens to this token file and exit
  std::string model = "tiny";
  std::int64_t layers = 0, width = 0, heads = 0;  // override the preset's (0: keep it)
  std::int64_t batch = 16;
  std::int64_t seq = 64;
  std::int64_t grad_accum = 1;
  std::int64_t steps = 2000;
  float lr = 2e-3f;
  float min_lr = -1.f;  // default: lr / 10
  std::int64_t warmup = 50;
  std::string schedule = "cosine";
  std::string optimizer = "adamw";
  float weight_decay = 0.1f;
  double clip = 1.0;
  std::uint64_t seed = 1337;
  int threads = 0;
  std::int64_t eval_every = 250;
  std::int64_t eval_batches = 8;
  std::int64_t sample_every = 0;
  std::int64_t sample_tokens = 200;
  float temperature = 0.8f;
  std::int64_t top_k = 40;
  double top_p = 1.0;
  float dropout = 0.0f;
  double val_fraction = 0.1;
  std::string log;
  std::string prompt = "\n";
  // checkpoints (docs/checkpoints.md)
  std::string save_dir;
  std::int64_t save_every = 0;  // 0: only at the end
  std::int64_t keep = 3;
  std::string resume;     // a checkpoint file, or a directory (its latest)
  std::string init_from;  // weights only (safetensors)
  std::string checkpoint = "none";
  std::string precision = "fp32";
  std::string device = "cpu";
  // guards (Note [the trainer's guards])
  bool share_save_dir = false;           // a fresh run may write beside another run's checkpoints
  bool resume_fallback = false;          // --resume DIR: fall back to the newest intact checkpoint
  bool allow_nonfinite_weights = false;  // load weights holding NaN / inf
  std::string on_nonfinite = "stop";     // stop | skip (Note [non-finite steps without a scaler])
  std::string log_errors = "stop";       // stop | warn
  std::string run_id;                    // filled by run_policy (Note [runs own their checkpoints])
  std::string model_json;                // filled by run_policy: the model's shape, saved in checkpoints (generate reads it)
  std::string tokenizer_json;            // filled by run_policy: the tokenizer, saved in checkpoints
  std::string plot;                      // a .png or .svg drawn from --log at the end (scripts/plot_log.py)
  // compression (compress.hpp, docs/compression.md)
  std::string prune;                 // "": none; unstructured:S[:per-layer] | 2:4 (Note [pruning in the trainer])
  std::int64_t prune_start = 0;      // the gradual schedule's first step (0: before step 1)
  std::int64_t prune_end = 0;        // its last step, where the target is reached (== start: at once)
  std::int64_t prune_every = 10;     // steps between mask updates within [start, end]
  std::string distill_from;          // a teacher's training checkpoint (Note [the teacher])
  float distill_alpha = 0.5f;        // weight of the KL term (1 - alpha: cross-entropy)
  float distill_temperature = 2.0f;  // softmax temperature of both distributions in the KL term
  bool eval_only = false;            // evaluate the model (--init-from) and exit
  bool compile = false;              // run each step through tg::compile (Note [compiled steps in the trainer])
  bool no_fuse = false;              // --compile without the fusion rewrite (Note [fusion rewrites])
  bool device_boundary = false;      // decide the step boundary on the device (Note [the step boundary on the device])
  bool plan = false;                 // print the step's memory plan (and --memory-budget's choice) and exit
  bool graph_report = false;         // --compile: report what a CUDA graph of the step could not repeat
  bool cuda_graphs = false;          // --compile --device cuda: the replays run as CUDA graphs (Note [CUDA graphs of a step])
  std::int64_t graph_chunk = 64;     // --cuda-graphs: the most launches one graph takes (0: a whole stretch between reads)
  bool graph_chunk_given = false;    // --graph-chunk was on the command line
  std::string memory_budget;         // --memory-budget as given ("" : none)
  std::int64_t memory_budget_bytes = 0;
  bool checkpoint_given = false;     // --checkpoint was on the command line
  std::string quantize;              // "": none; int8 | int8-static (with --eval-only)
  std::int64_t calibration_batches = 8;  // training batches for int8-static's activation scales
  bool quantize_lm_head = false;     // quantize the LM head too
  std::string quantize_save;         // write the int8 model to this safetensors file
  // data parallelism (docs/distributed.md, Note [data parallelism in the trainer])
  std::string dist;                  // "": one process; ddp | zero1 | zero2
  double bucket_mb = 25;             // gradient bucket size in MiB
  std::string reduce_dtype = "fp32"; // fp32 | bf16: the gradients' precision on the wire
  bool dist_overlap = true;          // start bucket reductions during backward
  std::int64_t dist_timeout = 300;   // seconds a rank waits for the others before it ends the run
  int world = 1, rank = 0;           // filled by main from the MPI world
  std::int64_t tp = 1, pp = 1;       // tensor- and pipeline-parallel sizes (Note [model parallelism in the trainer])
  bool grid = false;                 // --tp or --pp was given: the process-grid run (even 1 x 1)
  bool sequence_parallel = false;    // --tp's LayerNorm/dropout regions split along the sequence (Note [sequence parallelism])
  bool offload = false;              // the optimizer's state and update on the host (Note [optimizer offload])
  /// Sequences per optimizer micro-step over every rank (--batch is per data-parallel replica).
  std::int64_t global_batch() const { return batch * (world / std::max<std::int64_t>(1, tp * pp)); }
};

/// Parses and checks the command line into `o`. Returns the exit code when the process should end now (--help:
/// 0; a bad flag or value: 2, after one line on stderr), nothing when the run should start.
inline std::optional<int> parse_command_line(int argc, char** argv, Options& o) {
  std::string seed_text = std::to_string(o.seed);
  CLI::App app{"train_gpt: train a GPT language model on a text file with typegrad"};
  // Numbers are range-checked after parsing, by validate_options (Note [the trainer's guards]).
  app.add_option("--data", o.data, "a text file, a directory of text files, or a token file (--data-export) to train on "
                                   "(default: the English fortunes under /usr/share/games/fortunes)");
  CLI::Option* tokenizer_flag = app.add_option("--tokenizer", o.tokenizer, "byte; bpe:N (a byte-level BPE of N tokens trained on --data, cached); "
                                               "or gpt2:DIR (GPT-2's DIR/vocab.json and DIR/merges.txt). A resumed run keeps its own");
  app.add_option("--data-export", o.data_export, "write --data's tokens (with --tokenizer) to this token file and exit");
  app.add_option("--model", o.model, "model preset")->check(CLI::IsMember({"tiny", "small", "gpt2"}));
  app.add_option("--layers", o.layers, "blocks of the model (default: the preset's)");
  app.add_option("--width", o.width, "embedding width of the model (default: the preset's; a multiple of --heads)");
  app.add_option("--heads", o.heads, "attention heads (default: the preset's)");
  app.add_option("--batch", o.batch, "sequences per micro-batch");
  app.add_option("--seq", o.seq, "tokens per sequence");
  app.add_option("--grad-accum", o.grad_accum, "micro-batches per optimizer step");
  app.add_option("--dist", o.dist, "data parallelism over the ranks mpirun starts: ddp, zero1 (optimizer state sharded) or zero2 "
                                   "(gradients too); --batch is per rank")->check(CLI::IsMember({"ddp", "zero1", "zero2"}));
  app.add_option("--bucket-mb", o.bucket_mb, "--dist: gradient bucket size in MiB (reduced while backward runs)");
  app.add_option("--reduce-dtype", o.reduce_dtype, "--dist: the gradients' precision on the wire")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--dist-overlap", o.dist_overlap, "--dist: start each bucket's reduction during backward (0: after it)");
  app.add_option("--dist-timeout", o.dist_timeout, "--dist: seconds a rank waits for the others before it ends the run");
  CLI::Option* tp_flag = app.add_option("--tp", o.tp, "tensor-parallel ranks per model (heads, MLP and vocabulary split; CPU)");
  app.add_flag("--sequence-parallel", o.sequence_parallel, "with --tp: split the LayerNorm, dropout and residual regions along the "
                                                           "sequence (their activations divided by --tp; --seq a multiple of --tp)");
  CLI::Option* pp_flag = app.add_option("--pp", o.pp, "pipeline stages per model (the blocks split; --grad-accum micro-batches on the 1F1B schedule)");
  app.add_flag("--offload", o.offload, "keep the optimizer's state and update on the host, run by the CPU's kernels (a GPU keeps the "
                                       "weights and gradients: larger models fit; on the CPU it changes nothing but the path)");
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
  app.add_option("--prune", o.prune, "prune while training: unstructured:S (a fraction S of the blocks' linear weights, "
                                     "smallest magnitudes first, globally; unstructured:S:per-layer for each layer), or 2:4");
  app.add_option("--prune-start", o.prune_start, "step where gradual pruning starts (sparsity 0 there; 0: before the first step)");
  CLI::Option* prune_end_flag = app.add_option("--prune-end", o.prune_end, "step where the target sparsity is reached (a cubic ramp from --prune-start; equal: at once)");
  app.add_option("--prune-every", o.prune_every, "steps between mask updates during the ramp");
  app.add_option("--distill-from", o.distill_from, "distil from this teacher (a training checkpoint of any preset, same tokenizer)");
  app.add_option("--distill-alpha", o.distill_alpha, "weight of the teacher's KL term in [0, 1] (the rest: cross-entropy)");
  app.add_option("--distill-temperature", o.distill_temperature, "softmax temperature of the KL term (> 0)");
  app.add_flag("--compile", o.compile, "capture the training step once and replay it: its ops guarded, its memory planned into one "
                                       "arena (no allocator calls after step 1)");
  app.add_flag("--no-fuse", o.no_fuse, "with --compile: keep chains of separate elementwise ops as written (the fusion rewrite "
                                       "off; results are the eager run's bit for bit)");
  app.add_flag("--device-boundary", o.device_boundary,
               "decide the step boundary (unscale, inf/NaN check, clipping, the optimizer's step) on the training device: the "
               "step's losses, overflow flag and norm are read once, after it (the same results; every --optimizer; with --dist "
               "the ranks sum them on the device)");
  app.add_flag("--graph-report", o.graph_report,
               "with --compile: compare each replayed step's kernel launches with the last one's and report, at the "
               "end, the launches whose arguments changed or that read a value back: what one CUDA graph of the step could not "
               "repeat (none with --device-boundary)");
  app.add_flag("--cuda-graphs", o.cuda_graphs,
               "with --compile --device cuda: capture each replayed step's kernels as CUDA graphs (one per stretch between the "
               "host's reads, cut into graphs of --graph-chunk launches) and launch those instead of each kernel (the same results)");
  app.add_option("--graph-chunk", o.graph_chunk,
                 "with --cuda-graphs: the most kernel launches one graph takes, so that the GPU runs one graph while the host "
                 "captures the next (default 64; 0: one graph per stretch between the host's reads)");
  app.add_flag("--plan", o.plan, "print the step's memory plan (weights, optimizer state, activations, temporaries, peak) and the "
                                 "--memory-budget choice, then exit (one step is run to capture it; nothing is written)");
  app.add_option("--memory-budget", o.memory_budget, "the most memory a step may use, bytes (or with K, M, G, KiB, MiB, GiB): chooses the "
                                                      "activation checkpointing with the least recompute that fits, before step 1");
  app.add_flag("--eval-only", o.eval_only, "evaluate the model (--init-from) on the validation batches and exit");
  app.add_option("--quantize", o.quantize, "with --eval-only: also evaluate the int8 model (int8: per-token activation scales; "
                                           "int8-static: scales calibrated on training batches) and time one forward")
      ->check(CLI::IsMember({"int8", "int8-static"}));
  app.add_option("--calibration-batches", o.calibration_batches, "training batches that calibrate int8-static's activation scales");
  app.add_flag("--quantize-lm-head", o.quantize_lm_head, "quantize the LM head too (kept in fp32 by default)");
  app.add_option("--quantize-save", o.quantize_save, "write the int8 model to this safetensors file");
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
    o.seed = parse_seed(seed_text);
    o.tokenizer_given = tokenizer_flag->count() > 0;
    o.grid = tp_flag->count() + pp_flag->count() > 0;
    o.checkpoint_given = app.get_option("--checkpoint")->count() > 0;
    o.graph_chunk_given = app.get_option("--graph-chunk")->count() > 0;
    if (!o.memory_budget.empty()) o.memory_budget_bytes = parse_bytes("--memory-budget", o.memory_budget);
    // The default warmup fits short runs (train_gpt --steps 20 just works); an explicit --warmup is checked as given.
    if (warmup_flag->count() == 0 && o.steps > 0) o.warmup = std::min<std::int64_t>(o.warmup, o.steps / 10);
    if (prune_end_flag->count() == 0) o.prune_end = std::max(o.prune_end, o.prune_start);  // one-shot at --prune-start
    if (min_lr_flag->count() > 0 && !(o.min_lr >= 0)) throw tg::Error("--min-lr must be a non-negative number, got ", o.min_lr);
    validate_options(o);
    tg::data::parse_tokenizer_spec(o.tokenizer);  // a malformed spec before any data is read
    if (!o.prune.empty()) tg::quant::parse_prune_spec(o.prune);
    if (!(o.top_p > 0 && o.top_p <= 1)) throw tg::Error("--top-p must be in (0, 1], got ", o.top_p);
    if (o.device == "cuda") {  // before any work (Note [training on a GPU])
      TG_CHECK(tg::backend::cuda::device_count() > 0, "--device cuda: no usable CUDA device (",
               tg::backend::cuda::device_description(), "); train on the CPU with --device cpu");
    }
  } catch (const tg::Error& e) {
    std::fprintf(stderr, "train_gpt: error: %s\n", e.what());
    return 2;
  }
  return std::nullopt;
}

}  // namespace train_gpt

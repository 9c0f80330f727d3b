// The trainer's guards against bad input (Note [the trainer's guards]): every flag checked before any
// allocation, and a memory estimate against the machine.
//   train_gpt::validate_options(o);  train_gpt::check_memory(o, config);
#pragma once

#include <sched.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <typegrad/core/error.hpp>
#include <typegrad/nn/gpt.hpp>

namespace train_gpt {

// Note [the trainer's guards]
// A flag value is checked, products included, before the data is read or anything is allocated, and a bad
// one is one line naming the flag, the rule and the value, exit code 2 (main). The largest sizes are
// bounded twice: by fixed limits that keep every product inside int64 (tokens per micro-batch ≤ 2^31, so
// int32 token indices never wrap), and by a lower bound of the run's memory (weights, gradients and Adam
// state, the logits and their gradient, a few activations per layer) against the memory this process may
// use (physical memory, or a cgroup's memory.max when lower), so a run that cannot fit stops at once instead
// of swapping or failing half an hour in. An allocation that fails later still becomes a tg::Error.

/// a·b, or an error naming `what` when the product overflows int64.
inline std::int64_t checked_mul(std::int64_t a, std::int64_t b, const std::string& what) {
  std::int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) throw tg::Error(what, " overflows a 64-bit integer (", a, " x ", b, ")");
  return r;
}

/// Parses --seed: a decimal integer in [0, 2^64); "-1" and "1e3" are errors, not wrapped or truncated.
/// A byte count: digits with an optional unit K, M, G, T (powers of 1024; KiB, MiB, GiB, TiB and KB, MB, GB, TB
/// read the same), e.g. 8G or 512MiB. `flag` names the flag in errors.
inline std::int64_t parse_bytes(const char* flag, const std::string& text) {
  std::size_t i = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) ++i;
  if (i == 0 || i > 15) throw tg::Error(flag, " must be a byte count such as 8G, 512MiB or 1073741824, got '", text, "'");
  const std::int64_t n = std::stoll(text.substr(0, i));
  std::string unit = text.substr(i);
  if (unit.size() == 3 && unit[1] == 'i' && unit[2] == 'B') unit = unit.substr(0, 1);
  else if (unit.size() == 2 && unit[1] == 'B') unit = unit.substr(0, 1);
  int shift = -1;
  if (unit.empty() || unit == "B") shift = 0;
  else if (unit == "K" || unit == "k") shift = 10;
  else if (unit == "M") shift = 20;
  else if (unit == "G") shift = 30;
  else if (unit == "T") shift = 40;
  if (shift < 0) throw tg::Error(flag, ": unknown unit '", text.substr(i), "' in '", text, "' (use K, M, G or T: powers of 1024)");
  if (n > (std::numeric_limits<std::int64_t>::max() >> shift)) throw tg::Error(flag, " '", text, "' is too large");
  if (n <= 0) throw tg::Error(flag, " must be positive, got '", text, "'");
  return n << shift;
}

inline std::uint64_t parse_seed(const std::string& text) {
  std::uint64_t v = 0;
  const char* end = text.data() + text.size();
  auto [p, ec] = std::from_chars(text.data(), end, v);
  if (text.empty() || ec != std::errc() || p != end)
    throw tg::Error("--seed must be an integer from 0 to 18446744073709551615, got '", text, "'");
  return v;
}

/// CPUs this process may run on (its affinity mask).
inline int available_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return static_cast<int>(std::max(1L, sysconf(_SC_NPROCESSORS_ONLN)));
}

/// Bytes of memory this process may use: physical memory, or the cgroup's memory.max when that is lower.
inline std::int64_t usable_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  std::int64_t limit = pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : std::numeric_limits<std::int64_t>::max();
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream f(path);
    std::string v;
    if (f >> v && !v.empty() && v != "max") {
      std::int64_t x = 0;
      auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
      if (ec == std::errc() && x > 0 && x < limit) limit = x;
    }
  }
  return limit;
}

/// Checks every numeric flag (and the pairs that must agree); throws naming the flag. `o` is complete
/// (defaults applied).
template <class Options>
void validate_options(const Options& o) {
  auto positive = [](const char* flag, std::int64_t v, std::int64_t max) {
    if (v <= 0) throw tg::Error(flag, " must be a positive integer, got ", v);
    if (v > max) throw tg::Error(flag, " must be at most ", max, ", got ", v);
  };
  auto non_negative = [](const char* flag, std::int64_t v, std::int64_t max) {
    if (v < 0) throw tg::Error(flag, " must be a non-negative integer, got ", v);
    if (v > max) throw tg::Error(flag, " must be at most ", max, ", got ", v);
  };
  constexpr std::int64_t kMaxTokensPerBatch = std::int64_t{1} << 31;  // token indices stay inside int32
  constexpr std::int64_t kMaxSteps = std::int64_t{1} << 40;
  positive("--batch", o.batch, kMaxTokensPerBatch);
  positive("--seq", o.seq, std::int64_t{1} << 20);
  positive("--grad-accum", o.grad_accum, std::int64_t{1} << 20);
  positive("--steps", o.steps, kMaxSteps);
  const std::int64_t tokens = checked_mul(o.batch, o.seq, "--batch x --seq");
  if (tokens > kMaxTokensPerBatch)
    throw tg::Error("--batch x --seq must be at most ", kMaxTokensPerBatch, " tokens per micro-batch, got ", o.batch, " x ", o.seq,
                    " = ", tokens);
  // Tokens over the whole run (the progress line's count) must fit too.
  checked_mul(checked_mul(tokens, o.grad_accum, "--batch x --seq x --grad-accum"), o.steps,
              "the run's token count (--batch x --seq x --grad-accum x --steps)");
  if (o.warmup < 0 || o.warmup >= o.steps)
    throw tg::Error("--warmup must be from 0 to below --steps (", o.steps, "), got ", o.warmup);
  non_negative("--eval-every", o.eval_every, kMaxSteps);
  positive("--eval-batches", o.eval_batches, std::int64_t{1} << 20);
  non_negative("--sample-every", o.sample_every, kMaxSteps);
  positive("--sample-tokens", o.sample_tokens, std::int64_t{1} << 20);
  non_negative("--top-k", o.top_k, std::int64_t{1} << 31);
  non_negative("--save-every", o.save_every, kMaxSteps);
  non_negative("--keep", o.keep, std::int64_t{1} << 20);
  const int max_threads = std::max(4, 4 * available_cpus());
  if (o.threads < 0 || o.threads > max_threads)
    throw tg::Error("--threads must be from 0 (every CPU this process may use) to ", max_threads,
                    " (4x the CPUs it may use), got ", o.threads);
  auto finite_positive = [](const char* flag, double v) {
    if (!(std::isfinite(v) && v > 0)) throw tg::Error(flag, " must be a positive number, got ", v);
  };
  finite_positive("--lr", o.lr);
  if (o.min_lr >= 0 || !std::isfinite(o.min_lr)) {  // -1 (the default) means lr / 10
    if (!std::isfinite(o.min_lr)) throw tg::Error("--min-lr must be a non-negative number, got ", o.min_lr);
    if (o.min_lr > o.lr)
      throw tg::Error("--min-lr (", o.min_lr, ") must not exceed --lr (", o.lr, "): the learning rate would rise during the decay");
  }
  if (!(std::isfinite(o.weight_decay) && o.weight_decay >= 0))
    throw tg::Error("--weight-decay must be a non-negative number, got ", o.weight_decay);
  if (!(std::isfinite(o.clip) && o.clip >= 0)) throw tg::Error("--clip must be a non-negative number (0: off), got ", o.clip);
  finite_positive("--temperature", o.temperature);
  if (!(o.dropout >= 0 && o.dropout < 1)) throw tg::Error("--dropout must be in [0, 1), got ", o.dropout);
  if (!(o.val_fraction >= 0.001 && o.val_fraction <= 0.5))
    throw tg::Error("--val-fraction must be in [0.001, 0.5], got ", o.val_fraction);
  if (o.save_every > 0 && o.save_dir.empty()) throw tg::Error("--save-every needs --save-dir");
  if (!o.plot.empty()) {
    if (o.log.empty()) throw tg::Error("--plot needs --log (the plot is drawn from the log)");
    if (!(o.plot.ends_with(".png") || o.plot.ends_with(".svg")))
      throw tg::Error("--plot must name a .png or .svg file, got '", o.plot, "'");
  }
  if (!o.init_from.empty() && !o.resume.empty())
    throw tg::Error("--init-from and --resume exclude each other (a checkpoint holds the weights)");
  // Compression (compress.hpp).
  if (!o.prune.empty()) {
    non_negative("--prune-start", o.prune_start, o.steps);
    if (o.prune_end < o.prune_start || o.prune_end > o.steps)
      throw tg::Error("--prune-end must be from --prune-start (", o.prune_start, ") to --steps (", o.steps, "), got ", o.prune_end);
    positive("--prune-every", o.prune_every, kMaxSteps);
    if (o.prune == "2:4" && o.prune_end != o.prune_start)
      throw tg::Error("--prune 2:4 chooses its masks at once: --prune-end (", o.prune_end, ") must equal --prune-start (",
                      o.prune_start, ")");
  }
  if (!o.distill_from.empty()) {
    if (!(o.distill_alpha >= 0 && o.distill_alpha <= 1))
      throw tg::Error("--distill-alpha must be in [0, 1], got ", o.distill_alpha);
    finite_positive("--distill-temperature", o.distill_temperature);
  }
  if (!o.quantize.empty() && !o.eval_only)
    throw tg::Error("--quantize needs --eval-only (post-training quantization evaluates a trained model: --eval-only --init-from CKPT)");
  if (!o.quantize_save.empty() && o.quantize.empty()) throw tg::Error("--quantize-save needs --quantize");
  if (o.quantize_lm_head && o.quantize.empty()) throw tg::Error("--quantize-lm-head needs --quantize");
  positive("--calibration-batches", o.calibration_batches, std::int64_t{1} << 20);
  non_negative("--layers", o.layers, 4096);
  non_negative("--width", o.width, std::int64_t{1} << 16);
  non_negative("--heads", o.heads, 1024);
  if (o.layers > 0 || o.width > 0 || o.heads > 0) {
    const auto preset = tg::nn::GPTConfig::preset(o.model);
    const std::int64_t width = o.width > 0 ? o.width : preset.n_embd, heads = o.heads > 0 ? o.heads : preset.n_head;
    if (width % heads != 0)
      throw tg::Error("--width ", width, " is not a multiple of --heads ", heads, " (each head gets width / heads)");
  }
  positive("--tp", o.tp, 4096);
  positive("--pp", o.pp, 4096);
  // tg::compile in the trainer (Note [compiled steps in the trainer])
  if (o.no_fuse && !o.compile && !o.plan && o.memory_budget.empty())
    throw tg::Error("--no-fuse turns off the fusion rewrite of --compile (and of --plan, --memory-budget): give it with one of them");
  if (o.graph_report && !o.compile)
    throw tg::Error("--graph-report watches the kernel launches of a compiled step: give it with --compile");
  if (o.graph_chunk_given && !o.cuda_graphs)
    throw tg::Error("--graph-chunk sizes the graphs of --cuda-graphs: give it with --cuda-graphs (and --compile --device cuda)");
  if (o.graph_chunk < 0) throw tg::Error("--graph-chunk must be 0 (one graph per stretch) or a count of launches, got ", o.graph_chunk);
  if (o.cuda_graphs && (!o.compile || o.device != "cuda"))
    throw tg::Error("--cuda-graphs runs a compiled GPU step as CUDA graphs: give it with --compile and --device cuda");
  if (o.cuda_graphs && (!o.dist.empty() || o.grid))
    throw tg::Error("--cuda-graphs captures a step on one stream; --dist, --tp and --pp communicate on streams of their own, which ",
                    "the capture would not order: give it without them");
  if ((o.compile || o.plan || !o.memory_budget.empty()) && o.eval_only)
    throw tg::Error("--compile, --plan and --memory-budget plan a training step: --eval-only trains nothing");
  if (!o.memory_budget.empty() && o.checkpoint_given)
    throw tg::Error("--memory-budget chooses the activation checkpointing: give it without --checkpoint");
  if (o.sequence_parallel && (!o.grid || o.tp < 2))
    throw tg::Error("--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs --tp 2 or more");
  if (o.sequence_parallel && o.seq % o.tp != 0)
    throw tg::Error("--sequence-parallel: --seq ", o.seq, " is not a multiple of --tp ", o.tp, " (each tensor-parallel rank takes seq / tp positions)");
  if (o.grid) {  // Note [model parallelism in the trainer]: what the grid run does not combine with yet
    const auto preset = tg::nn::GPTConfig::preset(o.model);
    const std::int64_t heads = o.heads > 0 ? o.heads : preset.n_head, layers = o.layers > 0 ? o.layers : preset.n_layer;
    if (heads % o.tp != 0) throw tg::Error("--tp ", o.tp, ": the model's ", heads, " attention heads do not split over ", o.tp, " ranks");
    if (o.pp > layers) throw tg::Error("--pp ", o.pp, ": more pipeline stages than the model's ", layers, " blocks");
    if (o.device != "cpu") throw tg::Error("--tp/--pp train on the CPU only so far (the vocabulary-parallel cross-entropy computes on the host)");
    if (!o.prune.empty() || !o.distill_from.empty() || o.offload || o.eval_only)
      throw tg::Error("--tp/--pp: --prune, --distill-from, --offload and --eval-only are not combined with the grid run yet");
    if (!o.init_from.empty()) throw tg::Error("--tp/--pp: start from a checkpoint with --resume (--init-from is not combined yet)");
    if (!o.plot.empty() || o.sample_every > 0 || o.log_errors != "stop" || o.allow_nonfinite_weights)
      throw tg::Error("--tp/--pp: --plot, --sample-every, --log-errors warn and --allow-nonfinite-weights are not combined with the grid run yet");
    if (o.device_boundary) throw tg::Error("--device-boundary is not combined with --tp/--pp (their ranks decide each step together, on the host)");
  }
  if (o.device_boundary && o.offload) throw tg::Error("--device-boundary is not combined with --offload (the update runs on the host)");
  if (!o.dist.empty()) {
    if (!(std::isfinite(o.bucket_mb) && o.bucket_mb > 0 && o.bucket_mb <= 4096))
      throw tg::Error("--bucket-mb must be a positive number of MiB up to 4096, got ", o.bucket_mb);
    positive("--dist-timeout", o.dist_timeout, 86400);
    if (o.eval_only) throw tg::Error("--eval-only trains nothing: --dist is a training flag");
    if (!o.data_export.empty()) throw tg::Error("--data-export writes a file and exits: run it without --dist");
  }
  if (o.eval_only && !o.resume.empty())
    throw tg::Error("--eval-only evaluates weights: give the checkpoint with --init-from, not --resume");
  if (o.eval_only && (!o.prune.empty() || !o.distill_from.empty()))
    throw tg::Error("--eval-only trains nothing: --prune and --distill-from are training flags");
}

/// A lower bound of the bytes a training step of `config` at `o`'s sizes needs on the CPU (Note [the
/// trainer's guards]); the true figure is larger (attention scores, GEMM workspaces, the allocator's slack).
template <class Options>
std::int64_t training_bytes_lower_bound(const Options& o, const tg::nn::GPTConfig& c) {
  const std::int64_t C = c.n_embd, V = c.vocab_size, L = c.n_layer;
  const std::int64_t params = checked_mul(V + c.block_size, C, "the embedding size") + L * (12 * C * C + 13 * C) + 2 * C;
  const std::int64_t state = checked_mul(params, 16, "the weight memory");  // weights, gradients, two Adam moments (fp32)
  const std::int64_t tokens = checked_mul(o.batch, o.seq, "--batch x --seq");
  const std::int64_t per_token = checked_mul(8, V, "the logits") + checked_mul(64, checked_mul(L, C, "the layer width"), "the activations");
  const std::int64_t acts = checked_mul(tokens, per_token, "the activation memory (--batch x --seq)");
  std::int64_t total = 0;
  if (__builtin_add_overflow(state, acts, &total)) throw tg::Error("the run's memory overflows a 64-bit integer");
  return total;
}

inline std::string gib(std::int64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1ll << 30));
  return buf;
}

/// Throws before anything is allocated when the run cannot fit in the memory this process may use.
template <class Options>
void check_memory(const Options& o, const tg::nn::GPTConfig& c) {
  if (o.device != "cpu") return;  // the GPU's own allocator reports a failed allocation with its size
  const std::int64_t need = training_bytes_lower_bound(o, c), have = usable_memory_bytes();
  if (need > have)
    throw tg::Error("the run needs at least ", gib(need), " of memory (model ", o.model, ", --batch ", o.batch, " x --seq ", o.seq,
                    ": weights, optimizer state, logits and activations), more than the ", gib(have),
                    " this process may use; lower --batch or --seq");
}

}  // namespace train_gpt

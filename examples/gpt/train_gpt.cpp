// train_gpt: trains a GPT on a text file (by default the English fortunes of Debian's `fortunes` package)
// with live progress, periodic validation, generated samples and a closing summary. This file is the
// training loop; options.hpp holds the flags, data.hpp the data and tokenizer, trainer.hpp the rest of a run
// (model, optimizer, --resume, checkpoints, what it prints), compress.hpp --prune and --distill-from,
// eval_only.hpp --eval-only (with --quantize), and parallel.hpp the --tp/--pp run on a process grid.
//   train_gpt                                         # the README's first command: tiny GPT, 2000 steps
//   train_gpt --data book.txt --model small --batch 8 --seq 256 --grad-accum 4 --log run.jsonl --precision bf16
//   train_gpt --device cuda --model gpt2 --precision bf16 --batch 16 --seq 1024   # on a GPU (Note [training on a GPU])
#include <typegrad/compile/compile.hpp>

#include "eval_only.hpp"
#include "parallel.hpp"
#include "trainer.hpp"

namespace train_gpt {

// Note [compiled steps in the trainer]
// --compile runs each optimizer step (its micro-batches' forwards and backwards and the boundary) through
// tg::compile (Note [compiled steps]): step 1 captures it and plans its memory (step 2 where step 1 found
// chains or pairs to fuse: it captures the fused step), which is printed; the next steps replay it from the
// arena, so they make no allocator call on the device (the batch prefetcher's thread allocates its batches as
// before). Validation, samples and checkpoints run between steps, eagerly. Results are the eager run's bit for
// bit where the fusion rewrite finds no chain of separate elementwise ops (the GPT blocks call fused ops; the
// pairs they make without dropout run as add_layernorm, bit for bit; the --tp blocks' bias and residual adds
// make chains, fused in fp32 without changing a bit of their sums) and with --no-fuse always. --plan builds the
// run, captures one step (two when chains or pairs are fused: the second is the fused step; on the run's own
// model and optimizer: nothing is written),
// prints the plan and exits. --memory-budget B does the same for each
// activation checkpointing from the least recompute (none, selective, blocks) before the run starts, and
// trains with the first whose planned peak fits B; none fitting is an error naming the smallest peak. On a
// --tp/--pp grid every rank captures its own step (collectives included) and the largest peak over the ranks
// decides, so the ranks choose alike.

/// One run with the precision policy P (--precision), the activation checkpointing C (--checkpoint) on the
/// device D (--device): the types the command line chose, at one boundary (main). With `probe`, the run only
/// captures one compiled step and returns its memory plan there (--plan, --memory-budget).
template <class P, class C, tg::Device D>
int train(const Options& options, tg::capture::MemoryPlan* probe = nullptr) {
  Session<D> s(options);  // data, tokenizer, model, optimizer, schedule, batches (trainer.hpp)
  const Options& o = s.o;
  // One optimizer step: forward in P's compute type with C's checkpointing, backward, then unscale ->
  // inf/NaN check -> clip -> optimizer step -> schedule -> weight copies (Note [the training step]).
  tg::train::StepOptions step_options{.clip = o.clip > 0 ? std::optional<double>(o.clip) : std::nullopt,
                                      .on_non_finite = o.on_nonfinite == "skip" ? tg::optim::OnNonFinite::skip
                                                                                : tg::optim::OnNonFinite::stop};
  if (s.prune) {  // --prune: pruned gradients and weights stay zero (Note [pruning in the trainer])
    step_options.before_update = [&] { s.prune->pruner.apply_to_grads(); };
    step_options.after_update = [&] { s.prune->pruner.apply_to_weights(); };
  }
  step_options.sync = s.dp.get();  // --dist: reduce gradients over the ranks (Note [data parallelism in the trainer])
  step_options.device_boundary = o.device_boundary;  // Note [the step boundary on the device]
  tg::train::TrainStep<P, C, D> step(s.params, *s.opt, s.schedule, step_options, tg::optim::GradAccumRuntime(o.grad_accum));
  if (!probe) s.resume(step);  // --resume: weights, optimizer, positions, loss scaler (and pruning masks)
  if (s.prune && s.start_step == 0 && s.prune->update(0)) step.refresh_weights();  // one-shot pruning before step 1
  // --distill-from: the teacher's KL term joins the cross-entropy (Note [the teacher]).
  using Compute = typename decltype(step)::compute_type;
  auto distill_loss = [&](const tg::Tensor<Compute, D>& logits, const tg::data::Batch& b) {
    return tg::quant::distillation_loss(logits, s.teacher->template logits<Compute>(b.inputs), b.targets, o.distill_alpha,
                                        o.distill_temperature);
  };
  auto run_step = [&]() -> tg::train::StepResult {
    if (s.teacher) return step.run(*s.model, [&] { return s.sampler->next(); }, s.dropout_gen, distill_loss);
    return step.run(*s.model, [&] { return s.sampler->next(); }, s.dropout_gen);
  };
  auto compiled = tg::compile<D>(run_step, tg::CompileOptions{.fuse = !o.no_fuse, .watch_launches = o.graph_report,  // Note [compiled steps in the trainer]
                                                              .cuda_graphs = o.cuda_graphs,
                                                              .graph_chunk = static_cast<std::size_t>(o.graph_chunk)});
  compiled.set_parameters(s.params);
  if (probe) {
    compiled();
    if (!compiled.fused_chains().empty() || !compiled.fused_pairs().empty()) compiled();  // the fused step's plan (Note [fusion rewrites])
    *probe = compiled.memory_plan();
    return 0;
  }
  tg::train::JsonLinesLog log(o.log, s.start_step, o.log_errors == "warn" ? tg::train::OnLogError::warn : tg::train::OnLogError::stop);
  tg::train::RunClock clock(o.global_batch() * o.seq * o.grad_accum, s.start_step, o.steps);
  s.template print_header<decltype(step)>();
  s.validate(0);
  const auto started = tg::train::Clock::now();
  std::int64_t compiled_peak = 0;  // --compile: the most device memory a replayed step used (its allocator's peak)
  std::int64_t settled_at = 0;     // --compile: the step whose capture the later steps replay
  for (std::int64_t k = s.start_step + 1; k <= o.steps; ++k) {
    const auto t0 = tg::train::Clock::now();
    if (o.compile) {  // the step's own peak (the run's is kept for the summary)
      s.earlier_peak = std::max(s.earlier_peak, tg::allocator<D>().stats().peak_bytes);
      tg::allocator<D>().reset_peak();
    }
    tg::train::StepResult r;
    try {
      r = o.compile ? compiled() : run_step();
    } catch (const tg::optim::NonFiniteStep& e) {
      throw s.stopped_at(k, e);  // nothing applied; --on-nonfinite skip would have skipped the step
    }
    if (o.compile && settled_at) compiled_peak = std::max(compiled_peak, tg::allocator<D>().stats().peak_bytes);
    if (o.compile) s.earlier_peak = std::max(s.earlier_peak, tg::allocator<D>().stats().peak_bytes);
    if (o.compile && !settled_at && compiled.settled()) {  // step 1, or step 2 where step 1 found fusions
      settled_at = k;
      if (o.rank == 0)
        std::printf("compiled step: captured at step %lld; its memory plan:\n%s", (long long)k, compiled.memory_plan().describe().c_str());
    }
    if (s.prune && s.prune->update(k)) step.refresh_weights();  // the schedule's mask update after step k
    // On a GPU the step's last kernels (the update, the weight copies' refresh) may still be queued: the step's time
    // waits for them, so it is not charged to the next step, or to nothing before an evaluation and after the last.
    if constexpr (std::is_same_v<D, tg::cuda>) tg::backend::cuda::synchronize_stream();
    const double seconds = tg::train::seconds_since(t0);
    clock.step_done(k, seconds);
    s.count(k, r, step);
    s.report(k, r, seconds, clock, step);
    std::optional<tg::train::Evaluation> eval;
    if (k == o.steps || (o.eval_every > 0 && k % o.eval_every == 0)) eval = s.validate(k);  // --eval-every 0: at the end only
    if (o.sample_every > 0 && k % o.sample_every == 0 && k != o.steps)
      std::printf("%s--- sample at step %lld ---\n%s\n---\n", isatty(fileno(stdout)) ? "\n" : "", (long long)k,
                  s.sample(o.sample_tokens / 2).c_str());
    s.log_step(k, r, seconds, clock, step, eval, log);
    s.maybe_save(k, step);
    std::fflush(stdout);
  }
  s.finish(clock, started);  // the final sample, the summary, --plot
  if (o.compile) {
    std::printf("  compile           %lld capture(s), %lld replays, %zu fused chains, %zu fused pairs%s; planned peak %s, measured peak of the replayed steps %s\n",
                (long long)compiled.captures(), (long long)compiled.replays(), compiled.fused_chains().size(), compiled.fused_pairs().size(),
                compiled.eager() ? " (then eager: the step's allocations kept leaving the plan)" : "",
                tg::train::human_bytes(compiled.memory_plan().peak_bytes()).c_str(), tg::train::human_bytes(compiled_peak).c_str());
    if (o.cuda_graphs) {  // Note [CUDA graphs of a step]
      const auto g = compiled.graph_stats();
      std::printf("  cuda graphs       %lld steps as graphs: %lld graph launches (%lld nodes), %lld updated in place, %lld instantiated, "
                  "%lld uploads from their pinned blocks\n",
                  (long long)g.calls, (long long)g.launches, (long long)g.nodes, (long long)g.updated, (long long)g.instantiated,
                  (long long)g.uploads);
    }
    if (o.graph_report) {  // Note [graph blockers]: the headline and the first launches it names
      const std::string report = compiled.graph_report().describe();
      std::size_t end = 0;
      for (int line = 0; line < 6 && end != std::string::npos; ++line) end = report.find('\n', end + (line ? 1 : 0));
      std::printf("  %s%s\n", report.substr(0, end).c_str(), end == std::string::npos ? "" : "\n  ...");
    }
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace train_gpt

// The GPU runs: every precision with every checkpointing, compiled in train_gpt_cuda.cpp.
#define TRAIN_GPT_RUNS(X)                                                                                        \
  X(tg::amp::fp32_policy, tg::NoCheckpoint) X(tg::amp::fp32_policy, tg::SelectiveRecompute)                      \
  X(tg::amp::fp32_policy, tg::RecomputeAll) X(tg::amp::tf32_policy, tg::NoCheckpoint)                            \
  X(tg::amp::tf32_policy, tg::SelectiveRecompute) X(tg::amp::tf32_policy, tg::RecomputeAll)                      \
  X(tg::amp::bf16_mixed, tg::NoCheckpoint) X(tg::amp::bf16_mixed, tg::SelectiveRecompute)                        \
  X(tg::amp::bf16_mixed, tg::RecomputeAll) X(tg::amp::fp16_mixed, tg::NoCheckpoint)                              \
  X(tg::amp::fp16_mixed, tg::SelectiveRecompute) X(tg::amp::fp16_mixed, tg::RecomputeAll)
#ifndef TRAIN_GPT_LOOP_ONLY  // train_gpt_cuda.cpp includes this file for the loop and compiles its GPU runs
namespace train_gpt {
/// "rank 2 of 4: " in a --dist run's error messages, "" otherwise.
inline std::string rank_prefix(const Options& o) {
  return o.world > 1 ? "rank " + std::to_string(o.rank) + " of " + std::to_string(o.world) + ": " : std::string();
}
}  // namespace train_gpt
#if TRAIN_GPT_CUDA
#define TRAIN_GPT_GPU_RUN(P, C) extern template int train_gpt::train<P, C, tg::cuda>(const train_gpt::Options&, tg::capture::MemoryPlan*);
TRAIN_GPT_RUNS(TRAIN_GPT_GPU_RUN)
#endif

namespace train_gpt {
/// train<P, C, D> on the device --device names. The GPU runs exist in builds with the CUDA backend
/// (TRAIN_GPT_CUDA, examples/gpt/CMakeLists.txt); a build without it compiles none of them (--device cuda stops
/// at the device check before this is reached, and here with the same cause).
template <class P, class C>
int train_on_device(const Options& o, tg::capture::MemoryPlan* probe = nullptr) {
  if (o.device == "cuda") {
#if TRAIN_GPT_CUDA
    return train<P, C, tg::cuda>(o, probe);
#else
    throw tg::Error("--device cuda: this train_gpt was built without the CUDA backend; train on the CPU with --device cpu");
#endif
  }
  return train<P, C, tg::cpu>(o, probe);
}

/// --plan and --memory-budget (Note [compiled steps in the trainer]): captures one step of the run under each
/// candidate checkpointing, prints the plans, and sets o.checkpoint to the choice (a budget that nothing fits
/// is an error before any training). On a --tp/--pp grid every rank captures its own step and the peak that
/// counts is the largest over the ranks, so all of them choose the same checkpointing (rank 0 prints its
/// plan and that largest peak).
inline void plan_memory(Options& o) {
  Options q = o;  // a probe writes nothing
  q.log.clear();
  q.save_dir.clear();
  q.plot.clear();
  const std::vector<std::string> candidates =
      o.memory_budget.empty() ? std::vector<std::string>{o.checkpoint} : std::vector<std::string>{"none", "selective", "blocks"};
  std::string chosen, report;
  std::int64_t smallest = std::numeric_limits<std::int64_t>::max();
  std::string smallest_name, smallest_where;
  for (const auto& name : candidates) {
    q.checkpoint = name;
    tg::capture::MemoryPlan plan;
    tg::amp::with_precision(q.precision, [&]<class P>() {
      return tg::with_checkpointing(q.checkpoint, [&]<class C>() {
        if (q.grid) return train_parallel<P, C>(q, &plan);
        return train_on_device<P, C>(q, &plan);
      });
    });
    std::int64_t peak = plan.peak_bytes();
    std::string where;
    if (q.grid) {  // the largest peak over the ranks: every rank then chooses alike
      tg::dist::Communicator& world = tg::dist::world();
      std::vector<double> peaks(static_cast<std::size_t>(world.size()), 0.0);
      peaks[static_cast<std::size_t>(world.rank())] = static_cast<double>(peak);
      world.all_reduce(std::span<double>(peaks), tg::dist::ReduceOp::sum);
      const auto most = std::max_element(peaks.begin(), peaks.end());
      peak = static_cast<std::int64_t>(*most);
      where = " on rank " + std::to_string(most - peaks.begin()) + " of " + std::to_string(world.size());
    }
    if (o.plan) {
      std::printf("memory plan of one step (--checkpoint %s%s):\n%s", name.c_str(), q.grid ? ", rank 0" : "", plan.describe().c_str());
      if (q.grid) std::printf("largest planned peak over the ranks: %s%s\n", tg::train::human_bytes(peak).c_str(), where.c_str());
    }
    report += (report.empty() ? "" : ", ") + name + " " + tg::train::human_bytes(peak) + where;
    if (peak < smallest) smallest = peak, smallest_name = name, smallest_where = where;
    if (o.memory_budget.empty() || peak <= o.memory_budget_bytes) {
      chosen = name;
      break;
    }
  }
  if (!o.memory_budget.empty()) {
    if (chosen.empty())
      throw tg::Error("--memory-budget ", o.memory_budget, " (", tg::train::human_bytes(o.memory_budget_bytes),
                      "): no activation checkpointing fits it; the smallest planned peak is ", tg::train::human_bytes(smallest),
                      smallest_where, " (--checkpoint ", smallest_name, "); raise the budget or lower --batch or --seq");
    std::printf("memory budget %s: planned peaks %s: training with --checkpoint %s\n", tg::train::human_bytes(o.memory_budget_bytes).c_str(),
                report.c_str(), chosen.c_str());
    std::fflush(stdout);
  }
  o.checkpoint = chosen;
}

}  // namespace train_gpt

int main(int argc, char** argv) {
  train_gpt::Options o;
  if (const auto code = train_gpt::parse_command_line(argc, argv, o)) return *code;  // options.hpp
  // An error on one rank of a --dist run ends every rank (they would wait for it otherwise).
  const auto fail = [&](int code) {
    if (o.world > 1) tg::dist::abort_world(code);
    return code;
  };
  try {
    const bool grid = o.grid;  // --tp / --pp: Note [model parallelism in the trainer]
    if (!o.dist.empty() || grid || tg::dist::launched_by_mpi()) {  // Note [data parallelism in the trainer]
      tg::dist::Communicator& world = tg::dist::world();
      o.world = world.size();
      o.rank = world.rank();
      if (o.dist.empty() && !grid && o.world > 1)
        throw tg::Error("this process is one of ", o.world, " ranks started by an MPI launcher: pass --dist ddp, zero1 or zero2, "
                        "or --tp/--pp (or start one process)");
      if (grid && o.world % (o.tp * o.pp) != 0)
        throw tg::Error("--tp ", o.tp, " x --pp ", o.pp, " = ", o.tp * o.pp, " does not divide the ", o.world, " ranks started");
      const char* local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
      const char* local_rank = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
      if (o.threads == 0 && o.world > 1) {  // the machine's CPUs shared among its ranks
        const int per_node = local_size ? std::max(1, std::atoi(local_size)) : o.world;
        o.threads = std::max(1, train_gpt::available_cpus() / per_node);
      }
      if (o.device == "cuda" && tg::backend::cuda::device_count() > 1)  // one GPU per rank of a machine, before any allocation
        tg::backend::cuda::set_device((local_rank ? std::atoi(local_rank) : o.rank) % tg::backend::cuda::device_count());
      if (o.rank != 0) {  // rank 0 prints and logs; the others only report errors
        o.log.clear();
        o.plot.clear();
        if (!std::freopen("/dev/null", "w", stdout)) throw tg::Error("--dist: rank ", o.rank, " cannot silence its output");
      }
    }
    if (!o.data_export.empty()) return train_gpt::export_tokens(o, train_gpt::load_training_data(o, std::nullopt));
    if (o.eval_only) return o.device == "cuda" ? train_gpt::eval_only<tg::cuda>(o) : train_gpt::eval_only<tg::cpu>(o);
    if (o.precision == "tf32" && o.device != "cuda")
      std::printf("note: --precision tf32 changes only GPU GEMMs; on the CPU this is the fp32 run\n");
    if (o.plan && o.world > 1 && !grid) throw tg::Error("--plan runs alone or on a --tp/--pp grid: start one process");
    if (o.plan || !o.memory_budget.empty()) {  // Note [compiled steps in the trainer]
      train_gpt::plan_memory(o);
      if (o.plan) return 0;
    }
    if (grid)
      return tg::amp::with_precision(o.precision, [&]<class P>() {
        return tg::with_checkpointing(o.checkpoint, [&]<class C>() { return train_gpt::train_parallel<P, C>(o); });
      });
    // The run-time choices become types here, once: precision policy, checkpointing, device.
    return tg::amp::with_precision(o.precision, [&]<class P>() {
      return tg::with_checkpointing(o.checkpoint, [&]<class C>() {
        return train_gpt::train_on_device<P, C>(o);
      });
    });
  } catch (const tg::optim::NonFiniteStep& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "\ntrain_gpt: error: %s%s\n", train_gpt::rank_prefix(o).c_str(), e.what());
    return fail(3);
  } catch (const tg::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %s%s\n", train_gpt::rank_prefix(o).c_str(), e.what());
    return fail(2);
  } catch (const std::bad_alloc&) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %sout of memory (an allocation failed; lower --batch or --seq, or use a smaller --model)\n",
                 train_gpt::rank_prefix(o).c_str());
    return fail(2);
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "train_gpt: error: %s%s\n", train_gpt::rank_prefix(o).c_str(), e.what());
    return fail(2);
  }
}
#endif  // TRAIN_GPT_LOOP_ONLY

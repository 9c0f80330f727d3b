// train_gpt --tp N --pp M: the run on a process grid (Note [model parallelism in the trainer]): tensor-parallel
// stages of a 1F1B pipeline, data-parallel replicas of them over the rest of the world.
//   mpirun -np 4 train_gpt --model tiny --tp 2 --pp 2 --grad-accum 4      # 4 micro-batches through 2 stages of 2 ranks
#pragma once

#include <unistd.h>

#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/dist/grid.hpp>
#include <typegrad/dist/pipeline.hpp>
#include <typegrad/dist/tensor_parallel.hpp>

#include "trainer.hpp"

namespace train_gpt {

// Note [model parallelism in the trainer]
// --tp N --pp M arrange the world as dp x pp x tp (Note [process grid]; dp = world / (N·M)): each replica's
// model is split into M pipeline stages (Note [pipeline parallelism]) of N tensor-parallel ranks (Note
// [tensor parallelism]), and the replicas average their gradients (DDP, or --dist zero1|zero2 over the
// replicas of each slice; with a pipeline the reduction runs after the schedule, not overlapped). --batch is per replica, --grad-accum gives the micro-batches (with a
// pipeline, the 1F1B schedule runs them through the stages). The full model is drawn from the seed on every
// rank and sliced, so a grid starts from the one-process run's weights. Checkpoints are gathered into the
// one-process layout (Note [checkpoints of a process grid]) and written by rank 0; --resume loads any run's
// checkpoint (one process, --dist, any grid) into the grid. Rank 0 prints, logs and evaluates: validation
// and the final sample run on the full model gathered onto it. The tensor-parallel cross-entropy runs on the
// CPU, so --tp/--pp train on the CPU only. --checkpoint recomputes each block, its all-reduces included.
// --compile captures each rank's step and replays it (Note [compiled steps in the trainer]).
// Bad grids stop before any work: heads or width not divisible by --tp, more stages than blocks, a world
// that is not a multiple of --tp x --pp.

/// The full model assembled from one-process-layout tensors (host).
inline std::unique_ptr<tg::nn::GPT> full_model_of(const tg::nn::GPTConfig& config, const std::vector<tg::optim::NamedTensor>& params) {
  tg::Generator unused(0);
  auto m = std::make_unique<tg::nn::GPT>(config, unused);
  std::map<std::string, const tg::Tensor<float>*> by_name;
  for (const auto& e : params) by_name[e.name] = &e.tensor;
  for (const auto& p : m->named_parameters()) tg::detail::copy_tensor(*by_name.at(p.name), p.tensor.detach());
  return m;
}

/// The grid run of --tp / --pp with policy P and the blocks' checkpointing C (Note [model parallelism in the
/// trainer]).
/// With `probe` (--plan, --memory-budget), the run only captures one compiled step on every rank (the
/// collectives included) and returns this rank's memory plan there: nothing is printed, validated or written.
template <class P, class C>
int train_parallel(Options o, tg::capture::MemoryPlan* probe = nullptr) {
  tg::dist::Communicator& world = tg::dist::world();
  world.set_timeout(std::chrono::seconds(o.dist_timeout));
  tg::dist::ProcessGrid grid(world, static_cast<int>(o.tp), static_cast<int>(o.pp));
  if (o.threads > 0) tg::backend::cpu::set_num_threads(o.threads);
  std::optional<tg::io::ResumeChoice> resume;
  if (!o.resume.empty()) {
    resume = choose_checkpoint(o);
    if (!o.tokenizer_given) o.tokenizer = tokenizer_setting(resume->record->config_json);
  }
  TrainingData data = load_training_data(o, resume ? resume->record : std::nullopt);
  const tg::nn::GPTConfig config = model_config(o, data.tok.vocab_size());
  o.model_json = tg::io::gpt_config_json(config);
  o.tokenizer_json = data.tok.to_json();
  // Every rank must run the same settings (as under --dist).
  const auto all = world.all_gather_strings(run_config_json(o));
  for (std::size_t r = 1; r < all.size(); ++r)
    TG_CHECK(all[r] == all[0], "--tp/--pp: rank ", r, " was started with other settings than rank 0; start every rank with the same flags");
  tg::Generator init_gen{o.seed}, dropout_gen{o.seed + 1}, sample_gen{o.seed + 2};
  const tg::nn::GPT full(config, init_gen);
  const std::string layout = "--tp " + std::to_string(o.tp) + " --pp " + std::to_string(o.pp) + (o.sequence_parallel ? " --sequence-parallel" : "");
  const auto layouts = world.all_gather_strings(layout);
  for (std::size_t r = 1; r < layouts.size(); ++r)
    TG_CHECK(layouts[r] == layouts[0], "--tp/--pp: rank ", r, " was started with '", layouts[r], "', rank 0 with '", layouts[0],
             "'; start every rank with the same flags");
  tg::dist::TensorParallelGPT<tg::cpu> model(full, grid, {.sequence_parallel = o.sequence_parallel});
  const auto params = model.named_parameters();
  auto opt = make_optimizer<tg::cpu>(o, params);
  tg::optim::Schedule schedule = make_schedule(o, o.steps);
  tg::data::BatchSampler sampler(data.ds->train(), o.batch, o.seq, o.seed + 3, tg::data::SampleMode::random, grid.dp_rank * o.batch);
  std::int64_t start_step = 0;
  if (resume) {  // any run's checkpoint, in the one-process layout: every rank reads it and takes its slices
    tg::nn::GPT host(config, init_gen);
    const auto host_params = host.named_parameters();
    auto host_opt = make_optimizer<tg::cpu>(o, host_params);
    const tg::io::TrainStateRecord r = tg::io::load_train_state(resume->path, host_params, *host_opt);
    std::vector<tg::optim::NamedTensor> named;
    for (const auto& p : host_params) named.push_back({p.name, p.tensor.detach()});
    tg::dist::load_one_process_state(model, *opt, named, host_opt->state_tensors());
    schedule.set_step(r.schedule_step);
    sampler.set_position(r.sampler);
    if (auto it = r.generators.find("dropout"); it != r.generators.end()) tg::io::restore(dropout_gen, it->second);
    if (auto it = r.generators.find("sample"); it != r.generators.end()) tg::io::restore(sample_gen, it->second);
    start_step = r.step;
    if (world.rank() == 0 && !probe)
      std::printf("resumed from %s at step %lld of %lld\n", resume->path.c_str(), (long long)r.step, (long long)o.steps);
  }
  const bool root = world.rank() == 0;
  std::optional<tg::io::CheckpointDir> ckpts;
  if (!o.save_dir.empty() && root) {
    ckpts.emplace(o.save_dir, o.keep);
    ckpts->check_writable();
  }
  if (o.run_id.empty()) o.run_id = tg::train::new_run_id();
  tg::train::StepOptions step_options{.clip = o.clip > 0 ? std::optional<double>(o.clip) : std::nullopt,
                                      .on_non_finite = o.on_nonfinite == "skip" ? tg::optim::OnNonFinite::skip : tg::optim::OnNonFinite::stop};
  using Pipe = tg::dist::PipelineStep<P, C, tg::cpu, tg::amp::default_scaler_t<P>, tg::dist::TensorParallelGPT<tg::cpu>>;
  std::unique_ptr<Pipe> pipe;
  std::unique_ptr<tg::dist::GridSync<tg::cpu>> sync;
  std::unique_ptr<tg::train::TrainStep<P, C>> step;
  const tg::dist::DataParallelOptions replicas{.sharding = o.dist == "zero2"   ? tg::dist::Sharding::gradients
                                                         : o.dist == "zero1" ? tg::dist::Sharding::optimizer
                                                                             : tg::dist::Sharding::none,
                                                .bucket_bytes = static_cast<std::int64_t>(o.bucket_mb * (1 << 20))};
  if (o.pp > 1) {
    pipe = std::make_unique<Pipe>(model, *opt, schedule, step_options, o.grad_accum, tg::amp::default_scaler_t<P>{}, grid.dp.get(), &world,
                                  replicas);
    if (resume && pipe->data_parallel()) pipe->data_parallel()->shard_loaded_state(*opt);  // ZeRO: each replica keeps its shard
  } else {
    sync = std::make_unique<tg::dist::GridSync<tg::cpu>>(model, grid, replicas);
    if (resume) sync->data_parallel().shard_loaded_state(*opt);  // ZeRO: each replica keeps its shard of the loaded state
    step_options.sync = sync.get();
    step = std::make_unique<tg::train::TrainStep<P, C>>(params, *opt, schedule, step_options, tg::optim::GradAccumRuntime(o.grad_accum));
    step->restore_steps(schedule.step());
  }
  if (root && !probe) {
    std::printf("typegrad %s | data: %s | tokenizer: %s\n", TG_VERSION_STRING, data.ds->source().c_str(), data.tok.describe().c_str());
    std::printf("model %s: L=%lld H=%lld C=%lld V=%lld, %.2fM parameters | grid: dp %d x pp %d x tp %d = %d ranks (mpi), %lld micro-batches of %lldx%lld per replica%s%s\n",
                o.model.c_str(), (long long)config.n_layer, (long long)config.n_head, (long long)config.n_embd, (long long)config.vocab_size,
                tg::nn::count_parameters(full.named_parameters()) / 1e6, grid.dp_size, grid.pp_size, grid.tp_size, world.size(),
                (long long)o.grad_accum, (long long)o.batch, (long long)o.seq, o.pp > 1 ? ", 1F1B" : "",
                o.dist.empty() || grid.dp_size == 1 ? "" : (", replicas: " + o.dist).c_str());
    if (o.pp > 1)
      std::printf("pipeline bubble: (p-1)/(m+p-1) = %.3f of each step\n", pipe->bubble_fraction());
    std::int64_t mine = 0;
    for (const auto& p : params) mine += p.tensor.numel();
    std::printf("rank 0 (stage 0, tensor rank 0): blocks %lld-%lld, %.3fM parameters, %s of fp32 weights\n", (long long)model.first_block(),
                (long long)model.last_block() - 1, static_cast<double>(mine) / 1e6, tg::train::human_bytes(mine * 4).c_str());
    std::printf("precision %s | optimizer %s, lr %.2g, %s schedule | activation checkpointing: %s%s\n", o.precision.c_str(), o.optimizer.c_str(),
                o.lr, o.schedule.c_str(), C::name, o.sequence_parallel ? " | sequence parallelism" : "");
    std::fflush(stdout);
  }
  const std::vector<std::int32_t> token_bytes = data.tok.token_byte_lengths();
  // The replica's state in the one-process layout, on rank 0 (ZeRO: consolidated over the replicas first).
  auto gather = [&] {
    std::optional<tg::dist::ConsolidatedState> consolidated;
    tg::dist::DataParallel<tg::cpu>* dp = sync ? &sync->data_parallel() : pipe ? pipe->data_parallel() : nullptr;
    if (dp) consolidated.emplace(*opt, dp->gather_optimizer_state(*opt));
    const tg::optim::AnyOptimizer& state = consolidated ? static_cast<const tg::optim::AnyOptimizer&>(*consolidated) : *opt;
    return tg::dist::gather_one_process_state(model, state);
  };
  // Validation and samples on the full model gathered onto rank 0 (the others wait at the next collective).
  auto on_full_model = [&](auto&& use) {
    auto gathered = gather();
    if (root) use(*full_model_of(config, gathered.params));
  };
  auto validate = [&](std::int64_t k) {
    on_full_model([&](const tg::nn::GPT& m) {
      const auto e = tg::train::evaluate(m, *data.ds, o.batch, o.seq, o.eval_batches, token_bytes);
      std::printf("step %lld: val loss %.4f (%.3f bpb)\n", (long long)k, e.loss, e.bits_per_byte);
    });
  };
  auto save = [&](std::int64_t k) {
    auto gathered = gather();
    if (!ckpts) return;
    std::vector<tg::optim::Param> host;
    for (auto& e : gathered.params) host.emplace_back(e.name, e.tensor);
    tg::io::TrainStateRecord r;
    r.step = k;
    r.schedule_step = schedule.step();
    r.sampler = sampler.position();
    r.generators = {{"init", tg::io::record_of(init_gen)}, {"dropout", tg::io::record_of(dropout_gen)}, {"sample", tg::io::record_of(sample_gen)}};
    r.grad_accum = tg::io::GradAccumRecord{o.grad_accum, 0, schedule.step()};
    r.scalars = {{"tokens_done", static_cast<double>(k * o.global_batch() * o.seq * o.grad_accum)}};
    r.config_json = run_config_json(o);
    r.run_id = o.run_id;
    r.model_json = o.model_json;
    r.tokenizer_json = o.tokenizer_json;
    const std::string path = ckpts->save(host, tg::dist::ConsolidatedState(*opt, std::move(gathered.state)), r);
    std::printf("saved %s\n", path.c_str());
  };
  if (start_step == 0 && !probe) validate(0);
  tg::train::JsonLinesLog log(root ? o.log : std::string(), start_step, tg::train::OnLogError::stop);
  tg::train::RunClock clock(o.global_batch() * o.seq * o.grad_accum, start_step, o.steps);
  auto next = [&] { return sampler.next(); };
  // What the summary reports (rank 0): the step's memory above what stays between steps, the bytes each kind
  // of model parallelism moved and the time a stage waited on its neighbours.
  std::int64_t step_peak = 0, tp_bytes = 0, pp_bytes = 0, activations = 0, resident = 0;
  double pp_wait = 0;
  auto run_step = [&]() -> tg::train::StepResult {
    if (pipe) return pipe->run(next, dropout_gen);
    return step->run(model, next, dropout_gen, [&](const auto& logits, const tg::data::Batch& b) {
      auto loss = model.loss(logits, b.targets);  // the forward's memory, kept for backward, measured here
      activations = std::max(activations, tg::allocator<tg::cpu>().stats().bytes_in_use - resident);
      return loss;
    });
  };
  // --compile: each rank's step captured once and replayed (Note [compiled steps in the trainer]); the
  // collectives run inside it as in the eager step.
  auto compiled = tg::compile(run_step, tg::CompileOptions{.fuse = !o.no_fuse, .watch_launches = o.graph_report});
  compiled.set_parameters(params);
  if (probe) {  // --plan, --memory-budget: every rank captures one step (Note [compiled steps in the trainer])
    compiled();
    compiled();  // the fused step's plan where a rank fused chains or pairs; every rank alike (its collectives)
    *probe = compiled.memory_plan();
    return 0;
  }
  for (std::int64_t k = start_step + 1; k <= o.steps; ++k) {
    resident = tg::allocator<tg::cpu>().stats().bytes_in_use;
    tg::allocator<tg::cpu>().reset_peak();
    model.reset_tensor_parallel_bytes();
    const auto t0 = tg::train::Clock::now();
    const tg::train::StepResult r = o.compile ? compiled() : run_step();
    const double seconds = tg::train::seconds_since(t0);
    clock.step_done(k, seconds);
    step_peak = std::max(step_peak, tg::allocator<tg::cpu>().stats().peak_bytes - resident);
    tp_bytes += model.tensor_parallel_bytes();
    if (pipe) {
      pp_bytes += pipe->stats().bytes_sent;
      pp_wait += pipe->stats().wait_seconds;
      activations = std::max(activations, pipe->stats().activation_bytes);
    }
    if (root && (k % 10 == 0 || k == 1 || k == o.steps))
      std::printf("step %5lld/%lld | loss %.4f | lr %.2e | norm %6.3f | %6.1f ms | %7.0f tok/s | mem %s\n", (long long)k, (long long)o.steps,
                  r.loss, r.lr, r.grad_norm, seconds * 1e3, clock.tokens_per_second(),
                  tg::train::human_bytes(tg::allocator<tg::cpu>().stats().bytes_in_use).c_str());
    if (log.is_open()) {
      tg::train::LogRecord rec;
      rec.add("step", k).add("loss", r.loss).add("lr", r.lr).add("grad_norm", r.grad_norm).add("ms", seconds * 1e3);
      rec.add("tokens_per_s", clock.tokens_per_second()).add("bytes_in_use", tg::allocator<tg::cpu>().stats().bytes_in_use);
      log.write(k, rec);
    }
    if (k == o.steps || (o.eval_every > 0 && k % o.eval_every == 0)) validate(k);
    if (!o.save_dir.empty() && (k == o.steps || (o.save_every > 0 && k % o.save_every == 0))) save(k);
    std::fflush(stdout);
  }
  on_full_model([&](const tg::nn::GPT& m) {
    const std::string text = tg::nn::generate_text(m, data.tok, o.prompt, o.sample_tokens,
                                                   {std::max(o.temperature, 1e-4f), o.top_k, o.top_p}, sample_gen, std::min(config.block_size, o.seq));
    std::printf("\n--- sample ---\n%s\n---\n", text.c_str());
    const auto mem = tg::allocator<tg::cpu>().stats();
    std::printf("\nsummary\n  steps             %lld\n  speed             %.1f ms/step, %.0f tokens/s\n  memory            peak %s (rank 0)\n",
                (long long)o.steps, clock.ms_per_step(), clock.tokens_per_second(), tg::train::human_bytes(mem.peak_bytes).c_str());
    // Rank 0's figures against Note [tensor parallelism] / Note [pipeline parallelism]: per micro-batch, 4
    // all-reduces of (B,T,C) per block and 1 for the embedding (stage 0), 1 for the head (last stage), each
    // sending 2(n-1)/n of its bytes from a rank (the ring); under sequence parallelism as many all-gathers and
    // reduce-scatters, (n-1)/n each, twice as many, plus the all-reduce of the replicated parameters' fp32
    // gradients (6C per block, T·C of wpe on stage 0, 2C of ln_f on the last stage); the stage sends m
    // activations forward (unless last) and m gradients backward (unless first), (B,T/n,C) under sequence
    // parallelism.
    const double steps_run = static_cast<double>(std::max<std::int64_t>(1, clock.steps_run()));
    const double act = static_cast<double>(o.batch * o.seq * config.n_embd * static_cast<std::int64_t>(sizeof(typename tg::amp::MixedPrecision<P>::compute_type)));
    const double blocks = static_cast<double>(model.last_block() - model.first_block());
    const double micro = static_cast<double>(o.grad_accum);
    const double ring = static_cast<double>(o.tp - 1) / static_cast<double>(o.tp), width = static_cast<double>(config.n_embd);
    const double replicated_grads = o.sequence_parallel ? (6 * width * blocks + (model.is_first() ? static_cast<double>(o.seq) * width : 0) +
                                                           (model.is_last() ? 2 * width : 0)) * 4
                                                        : 0;
    const double tp_formula = (4 * blocks + (model.is_first() ? 1 : 0) + (model.is_last() ? 1 : 0)) * micro * act * 2 * ring +
                              micro * replicated_grads * 2 * ring;
    const double sent = o.sequence_parallel ? act / static_cast<double>(o.tp) : act;
    const double pp_formula = o.pp > 1 ? ((model.is_last() ? 0 : 1) + (model.is_first() ? 0 : 1)) * micro * sent : 0;
    std::printf("  model parallel    rank 0: activations kept for backward %s, step memory above the state kept between steps %s; "
                "tensor-parallel sends %.2f MiB/step "
                "(formula %.2f); pipeline sends %.2f MiB/step (formula %.2f)\n",
                tg::train::human_bytes(activations).c_str(), tg::train::human_bytes(step_peak).c_str(), static_cast<double>(tp_bytes) / steps_run / (1 << 20), tp_formula / (1 << 20),
                static_cast<double>(pp_bytes) / steps_run / (1 << 20), pp_formula / (1 << 20));
    if (o.compile)
      std::printf("  compile           %lld capture(s), %lld replays, %zu fused chains, %zu fused pairs on rank 0; planned peak %s\n",
                  (long long)compiled.captures(), (long long)compiled.replays(), compiled.fused_chains().size(), compiled.fused_pairs().size(),
                  tg::train::human_bytes(compiled.memory_plan().peak_bytes()).c_str());
    if (o.compile && o.graph_report) std::printf("  rank 0's %s\n", compiled.graph_report().describe().c_str());  // Note [graph blockers]
    if (pipe)
      std::printf("  pipeline          rank 0 waited on its neighbours %.1f%% of the step time (the 1F1B bubble (p-1)/(m+p-1) = %.1f%%)\n",
                  100 * pp_wait / std::max(clock.train_seconds(), 1e-9), 100 * pipe->bubble_fraction());
  });
  return 0;
}

}  // namespace train_gpt

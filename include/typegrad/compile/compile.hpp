// tg::compile: a training step captured once and replayed: its op sequence guarded, its memory planned into
// one arena (no allocator calls in the steady state), recompiled for a new input signature.
//   auto compiled = tg::compile([&](const tg::data::Batch& b) { return step.run(model, [&] { return b; }, gen); });
//   for (...) { auto r = compiled(sampler.next()); }        // the first call captures, the next ones replay
//   std::puts(compiled.memory_plan().describe().c_str());   // weights, activations, temporaries, peak
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/compile/fusion.hpp"
#include "typegrad/compile/step_memory.hpp"
#include "typegrad/core/allocator.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cuda/own_stream_call.hpp"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"
#include "typegrad/optim/param.hpp"

namespace tg {

// Note [compiled steps]
// compile(fn) wraps a step function (forward, loss, backward and the optimizer's boundary, as
// train::TrainStep::run does them) into a CompiledStep. Each call computes the input signature from its
// arguments (each tensor's dtype, shape and device; a batch's inputs and targets; vectors element by element;
// anything else, such as a number, a generator or a callable, is not part of it) and keeps
// one variant per signature (a small cache; a new signature is reported on stderr once).
//   * Capture: a variant's first call runs fn eagerly under a tracer: every op that records itself (the
//     forward, the backward formulas, checkpoint recomputes) is kept with its output's shape and dtype, and
//     every allocation on the device is traced and planned (Note [step memory plan]).
//   * Replay: later calls run fn with the op sequence checked op by op against the captured one (a step
//     whose ops depend on data, an `if` on loss.item(), is an error naming the first op that differs, raised
//     before that op runs) and every allocation served from the plan's arena: in the steady state a step
//     makes no allocator call, and its peak is the plan's. A replay whose allocations leave the plan (an
//     fp16 step the scaler skips makes no optimizer temporaries) is still served safely (by the device's
//     allocator) and the next call captures again; after kMaxRetraces such replays in a row the variant
//     runs eagerly, said once on stderr.
//   * The parameters given to set_parameters() are part of the guard: a parameter replaced or reshaped
//     captures every variant again.
// With CompileOptions{.fuse = false}, a replay runs the same kernels in the same order as the eager step, so its
// results are the eager step's bit for bit. By default the capture also looks for chains of unfused elementwise
// ops and the next calls run each as one op (Note [fusion rewrites], compile/fusion.hpp): a signature with chains
// is captured twice (found, then fused) before it replays. A GPU step with CompileOptions{.cuda_graphs = true}
// runs its replays as CUDA graphs (Note [CUDA graphs of a step], detail/cuda/runtime.hpp).
// Streams (a GPU step): a replay hands out the same arena addresses on every call, which the stream's issue order
// makes safe from one call to the next. A call on another stream or device than the variant's last (a
// StreamGuard, set_device) first waits for the last call's device (its kernels may still read the arena on the
// other stream) and takes a new arena on the new stream and device (StepMemory::renew_arena), so no two streams
// share an arena's addresses unordered. The backend's scratch memory (Workspace) is planned like storages.

namespace capture {
/// One op the capture saw: its name, its output's shape and dtype.
struct OpRecord {
  std::string op;
  Shape shape;
  DType dtype;
};

/// The op observer of a capture (records) or a replay (checks against the record).
class OpSequence final : public autodiff::OpObserver {
 public:
  OpSequence(std::vector<OpRecord>& ops, bool record, StepMemory* memory) : ops_(&ops), record_(record), memory_(memory) {
    if (record_) ops_->clear();
  }
  /// The fusion rewrite that follows the ops of this call (either, or none).
  void set_fusion(FusionScout* scout, FusionApply* apply) {
    scout_ = scout;
    apply_ = apply;
  }
  void on_op(const char* op, const Shape& output, DType dtype) override {
    if (scout_) scout_->on_recorded();
    if (apply_) apply_->on_recorded(op);
    if (record_) {
      ops_->push_back({op, output, dtype});
      return;
    }
    if (at_ >= ops_->size())
      throw Error("tg::compile: the step ran more ops than the captured step (", ops_->size(), "); op ", at_, " is '", op, "' ", output,
                  ": its ops depend on its data (an if on a tensor's value?), so it cannot be replayed; run it without compile");
    const OpRecord& r = (*ops_)[at_];
    if (r.op != op || r.shape != output || r.dtype != dtype)
      throw Error("tg::compile: op ", at_, " of the step is '", op, "' ", output, " ", dtype_name(dtype), " where the captured step ran '", r.op,
                  "' ", r.shape, " ", dtype_name(r.dtype),
                  ": its ops depend on its data (an if on a tensor's value?), so it cannot be replayed; run it without compile");
    ++at_;
  }
  void on_io(const std::shared_ptr<Storage>& output, const void* output_meta, std::initializer_list<const Storage*> inputs) override {
    if (scout_) scout_->on_io(output, output_meta, inputs);
  }
  void on_backward() override {
    if (record_ && memory_) memory_->mark_backward();
  }
  /// Checks, after a replay, that the step ran every captured op.
  void finish() const {
    if (!record_ && at_ != ops_->size())
      throw Error("tg::compile: the step ran ", at_, " ops, the captured step ", ops_->size(), " (the next one was '", (*ops_)[at_].op,
                  "'): its ops depend on its data, so it cannot be replayed; run it without compile");
  }

 private:
  std::vector<OpRecord>* ops_;
  bool record_;
  StepMemory* memory_;
  std::size_t at_ = 0;
  FusionScout* scout_ = nullptr;
  FusionApply* apply_ = nullptr;
};

/// Installs an op observer on the calling thread for the scope (restoring the previous one).
class ObserverScope {
 public:
  explicit ObserverScope(autodiff::OpObserver& o) : previous_(autodiff::op_observer()) { autodiff::op_observer() = &o; }
  ~ObserverScope() { autodiff::op_observer() = previous_; }
  ObserverScope(const ObserverScope&) = delete;
  ObserverScope& operator=(const ObserverScope&) = delete;

 private:
  autodiff::OpObserver* previous_;
};

// Note [graph blockers]
// What stands between a compiled step and one CUDA graph, measured: with CompileOptions::watch_launches, each
// replay of a step records its kernel launches (Note [launch watch]: each kernel with one hash per argument; on
// either device) and compares them with the previous replay's. A graph captured from one replay would run the next
// correctly only if the two launched the same kernels in the same order with the same arguments: a launch
// whose arguments changed is a blocker (the value must reach the kernel through memory written before the
// launch, or its node be updated), and so is a kernel that hands the host a value (on a GPU, a read the graph
// cannot make). CompiledStep::graph_report() lists them, each with the kernel, its position in the step and the
// arguments that changed. A GPU step launches the same kernels as the CPU step from the same op code (the
// backends' signatures are one list, Note [kernels declared once]), so the CPU report is the GPU step's,
// except for what a backend does inside a kernel call: the CUDA launchers upload host data at each launch
// through recycled staging blocks (the multi-tensor pointer tables, the same every step; the token ids and
// targets, which train::TrainStep keeps at fixed host addresses under a device boundary, and which the embedding
// backward uploads again to sort on the device: Note [embedding rows sorted on the device]), which a graph would
// have to own. A GPU step's report shows them: the CUDA runtime reports each upload with the staging block it
// reads (a graph's copy node bakes its address in), an upload that waits for its copy and every download as
// reads. The step inputs a device boundary uploads at its start and the one read at its end are a graph's
// prelude and epilogue, not watched. train::TrainStep with StepOptions::device_boundary has no blocker on the
// CPU (tests/train/test_device_boundary.cpp, train_gpt --graph-report).

/// One kernel launch of a replay: the kernel and a hash of each argument (Note [launch watch]).
struct LaunchRecord {
  const char* kernel = "";
  std::vector<std::uint64_t> args;
  bool returns_value = false;
};

/// The launches of one call, in order (a LaunchWatcher).
class LaunchLog final : public backend::LaunchWatcher {
 public:
  void on_launch(const backend::Launch& l) override {
    if (size_ == launches_.size()) launches_.emplace_back();
    LaunchRecord& r = launches_[size_++];
    r.kernel = l.kernel;
    r.args.assign(l.args, l.args + l.arity);
    r.returns_value = l.returns_value;
  }
  void clear() { size_ = 0; }  // keeps the records' memory for the next call
  std::span<const LaunchRecord> launches() const { return {launches_.data(), size_}; }

 private:
  std::vector<LaunchRecord> launches_;
  std::size_t size_ = 0;
};

/// A launch a graph captured from one replay could not repeat for the next (Note [graph blockers]).
struct GraphBlocker {
  std::size_t launch = 0;     ///< its position among the step's launches
  std::string kernel;
  std::vector<int> changed;   ///< the arguments (0-based) whose values differ between the two replays
  bool returns_value = false; ///< the kernel hands the host a value
  std::string describe() const {
    std::ostringstream s;
    s << kernel << " (launch " << launch << ")";
    if (!changed.empty()) {
      s << ": argument" << (changed.size() > 1 ? "s " : " ");
      for (std::size_t i = 0; i < changed.size(); ++i) s << (i ? ", " : "") << changed[i];
      s << " changed";
    }
    if (returns_value) s << (changed.empty() ? ": " : "; ") << "returns a value to the host";
    return s.str();
  }
};

/// Two replays' launches compared (Note [graph blockers]).
struct GraphReport {
  bool compared = false;          ///< two replays of the signature were watched
  bool same_sequence = false;     ///< they launched the same kernels in the same order
  std::string difference;         ///< else: the first launch that differs
  std::size_t launches = 0;       ///< launches per step
  std::vector<GraphBlocker> blockers;
  /// Whether a graph captured from one replay would repeat the next: the same kernels, arguments and no reads.
  bool graph_ready() const { return compared && same_sequence && blockers.empty(); }
  /// The blockers' kernels and how many launches of each: "dropout_forward x12, boundary_begin x1".
  std::string summary() const {
    std::vector<std::pair<std::string, int>> count;
    for (const auto& b : blockers) {
      auto it = std::find_if(count.begin(), count.end(), [&](const auto& c) { return c.first == b.kernel; });
      if (it == count.end()) count.emplace_back(b.kernel, 1);
      else ++it->second;
    }
    std::ostringstream s;
    for (std::size_t i = 0; i < count.size(); ++i) s << (i ? ", " : "") << count[i].first << " x" << count[i].second;
    return s.str();
  }
  std::string describe() const {
    std::ostringstream s;
    if (!compared) return "graph report: fewer than two replays watched (CompileOptions::watch_launches)";
    if (!same_sequence) return "graph report: the replays launched different kernels: " + difference;
    s << "graph report: " << launches << " launches per step, " << blockers.size() << " that a graph could not repeat";
    if (!blockers.empty()) s << " (" << summary() << ")";
    for (const auto& b : blockers) s << "\n  " << b.describe();
    return s.str();
  }
};

/// Compares the launches of two replays of one step (Note [graph blockers]).
inline GraphReport compare_launches(std::span<const LaunchRecord> before, std::span<const LaunchRecord> after) {
  GraphReport r;
  r.compared = true;
  r.launches = after.size();
  for (std::size_t i = 0; i < std::max(before.size(), after.size()); ++i) {
    if (i >= before.size() || i >= after.size() || std::strcmp(before[i].kernel, after[i].kernel) != 0 ||
        before[i].args.size() != after[i].args.size()) {
      std::ostringstream s;
      s << "launch " << i << " is " << (i < after.size() ? after[i].kernel : "(none)") << ", before "
        << (i < before.size() ? before[i].kernel : "(none)");
      r.difference = s.str();
      r.blockers.clear();
      return r;
    }
    GraphBlocker b;
    for (std::size_t a = 0; a < after[i].args.size(); ++a)
      if (before[i].args[a] != after[i].args[a]) b.changed.push_back(static_cast<int>(a));
    b.returns_value = after[i].returns_value;
    if (b.changed.empty() && !b.returns_value) continue;
    b.launch = i;
    b.kernel = after[i].kernel;
    r.blockers.push_back(std::move(b));
  }
  r.same_sequence = true;
  return r;
}

// ---- the input signature (Note [compiled steps]) ------------------------------------------------------
template <class X>
void signature(std::ostringstream&, const X&) {}  // not part of the signature (generators, callables, models)
template <Element T, Device D>
void signature(std::ostringstream& s, const Tensor<T, D>& t) {
  s << dtype_traits<T>::name << t.shape() << device_traits<D>::name << ';';
}
template <class B>
  requires requires(const B& b) {
    b.inputs.shape();
    b.targets.shape();
  }
void signature(std::ostringstream& s, const B& b) {
  s << "batch(";
  signature(s, b.inputs);
  signature(s, b.targets);
  s << ");";
}
template <class X>
void signature(std::ostringstream& s, const std::vector<X>& v) {
  s << '[' << v.size() << ':';
  for (const auto& x : v) signature(s, x);
  s << ']';
}
}  // namespace capture

/// Options of compile().
struct CompileOptions {
  std::size_t cache_size = 8;  ///< signatures kept (the least recently used is dropped)
  bool verbose = true;         ///< report new signatures, fused chains and eager fallbacks on stderr
  bool fuse = true;            ///< rewrite chains of elementwise ops into one op each (Note [fusion rewrites])
  /// Record each replay's kernel launches and compare them with the previous replay's (Note [graph
  /// blockers]): graph_report(). Costs a hash of each launch's arguments.
  bool watch_launches = false;
  /// A GPU step (compile<tg::cuda>): every call runs on a stream of the signature's own, joined to the caller's
  /// stream at both ends, and each replay's work is captured and launched as CUDA graphs, one per stretch
  /// between host reads (Note [CUDA graphs of a step]). Not for a step that runs work on other streams (a
  /// data-parallel run's communication).
  bool cuda_graphs = false;
  /// With cuda_graphs: the most launches one graph takes; a longer stretch between reads is cut into graphs of this
  /// many, so that the GPU runs one while the host captures the next (0: one graph per stretch).
  std::size_t graph_chunk = 64;
};

/// A step function captured and replayed (Note [compiled steps]); made by compile(). D: the device whose
/// allocations are planned.
template <class Fn, Device D = cpu>
class CompiledStep {
 public:
  static constexpr int kMaxRetraces = 3;

  explicit CompiledStep(Fn fn, CompileOptions options = {}) : fn_(std::move(fn)), options_(options) {
    TG_CHECK(!options_.cuda_graphs || (std::is_same_v<D, cuda>),
             "tg::compile: cuda_graphs is for a GPU step (compile<tg::cuda>(...)); a CPU step has no CUDA graphs");
  }
  ~CompiledStep() {
    for (auto& v : variants_) release(*v);
  }
  CompiledStep(const CompiledStep&) = delete;
  CompiledStep& operator=(const CompiledStep&) = delete;

  /// The parameters whose identity (storage and shape) is part of the guard, and whose bytes the plan
  /// reports as weights.
  void set_parameters(const std::vector<optim::BasicParam<D>>& params) {
    params_.clear();
    weight_bytes_ = 0;
    for (const auto& p : params) {
      params_.emplace_back(static_cast<const void*>(p.tensor.data()), p.tensor.shape());
      weight_bytes_ += static_cast<std::int64_t>(p.tensor.nbytes());
    }
    for (auto& v : variants_) v->memory->set_weight_bytes(weight_bytes_);
    parameters_ = params;
  }

  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    check_parameters();
    std::ostringstream sig;
    (capture::signature(sig, args), ...);
    if (options_.fuse && !autodiff::grad_enabled()) sig << "no_grad;";  // no chain is rewritten without gradients
    Variant& v = variant_for(sig.str());
    last_ = &v;
    using R = std::invoke_result_t<Fn&, Args&&...>;
    if (v.eager) return fn_(std::forward<Args>(args)...);
    const bool capture = !v.memory->has_plan() || v.retrace;
    capture::OpSequence ops(v.ops, capture, v.memory);
    std::optional<capture::FusionScout> scout;
    std::optional<capture::FusionApply> apply;
    if (options_.fuse) {
      if (!v.scouted) scout.emplace();
      else if (!v.fusion.empty()) apply.emplace(v.fusion);
    }
    ops.set_fusion(scout ? &*scout : nullptr, apply ? &*apply : nullptr);
    fusion::Rewriter* rewriter = scout ? static_cast<fusion::Rewriter*>(&*scout) : apply ? static_cast<fusion::Rewriter*>(&*apply) : nullptr;
    auto after = [&] {  // the rewrite's checks and, after a first call, its plan
      if (apply) apply->finish();
      if (!scout) return;
      v.fusion = scout->plan();
      v.scouted = true;
      if (v.fusion.empty()) return;
      v.retrace = true;  // the next call captures the fused step
      if (options_.verbose) {
        if (!v.fusion.pairs.empty())
          std::fprintf(stderr, "tg::compile: fusing %zu pairs of ops into fused ops (the first: %s)\n", v.fusion.pairs.size(),
                       v.fusion.pairs.front().describe().c_str());
        if (!v.fusion.chains.empty()) {
          std::size_t links = 0;
          for (const auto& c : v.fusion.chains) links += c.links.size();
          std::fprintf(stderr, "tg::compile: fusing %zu chains of elementwise ops (%zu ops; the first: %s)\n", v.fusion.chains.size(),
                       links, v.fusion.chains.front().describe().c_str());
        }
      }
    };
    if constexpr (!std::is_same_v<D, cpu>) {  // Note [compiled steps]: streams and devices
      const int device = backend::cuda::current_device();
      void* const stream = backend::cuda::current_stream();
      if (v.has_stream && (v.device != device || v.stream != stream)) {
        if (v.device != device) {  // the last call's device finishes its work
          backend::cuda::set_device(v.device);
          try {
            backend::cuda::synchronize();
            // Note [CUDA graphs of a step]: the own stream, its events and graphs belong to that device
            v.graphs.reset();
            v.own_stream.reset();
            v.join_in.reset();
            v.join_out.reset();
          } catch (...) {
            backend::cuda::set_device(device);
            throw;
          }
          backend::cuda::set_device(device);
        } else {
          backend::cuda::synchronize();
        }
        v.memory->renew_arena();
      }
      v.device = device;
      v.stream = stream;
      v.has_stream = true;
    }
    if (capture) v.memory->begin_trace();
    else v.memory->begin_replay();
    // Note [graph blockers]: a replay's launches, compared with the previous replay's
    const bool watching = options_.watch_launches && !capture;
    if (capture) v.watched = false;  // a new capture plans new addresses
    std::optional<backend::LaunchWatchScope> watch;
    if (watching) {
      v.launches_now.clear();
      watch.emplace(&v.launches_now);
    }
    auto compare = [&] {
      if (!watching) return;
      watch.reset();
      if (!last_replay_.ok) {  // served outside the plan: not a replay to compare
        v.watched = false;
        return;
      }
      if (v.watched) v.report = capture::compare_launches(v.launches_before.launches(), v.launches_now.launches());
      std::swap(v.launches_before, v.launches_now);
      v.watched = true;
    };
    auto finish = [&](bool threw) {
      if (capture) {
        v.plan = v.memory->end_trace();
        v.retrace = false;
        ++traces_;
        return;
      }
      last_replay_ = v.memory->end_replay();
      ++replays_;
      if (threw) return;
      if (!last_replay_.ok) {
        v.retrace = true;
        if (++v.divergences >= kMaxRetraces) {
          v.eager = true;
          if (options_.verbose)
            std::fprintf(stderr, "tg::compile: the step's allocations left the plan %d times in a row (%s): it runs eagerly from now on\n",
                         kMaxRetraces, last_replay_.divergence.c_str());
        }
      } else {
        v.divergences = 0;
      }
    };
    // Note [CUDA graphs of a step]: every call on the signature's own stream; a replay captured as graphs
    std::optional<backend::cuda::OwnStreamCall> own;
    try {
      if constexpr (std::is_same_v<D, cuda>) {  // inside the try: a failed start ends the trace or replay begun above
        if (options_.cuda_graphs) {
          if (!v.own_stream) {
            v.own_stream = std::make_unique<backend::cuda::Stream>();
            v.join_in = std::make_unique<backend::cuda::Event>();
            v.join_out = std::make_unique<backend::cuda::Event>();
          }
          if (!capture && !v.graphs) {
            v.graphs = std::make_unique<backend::cuda::StepGraphs>();
            v.graphs->set_chunk(options_.graph_chunk);
          }
          own.emplace(*v.own_stream, *v.join_in, *v.join_out, capture ? nullptr : v.graphs.get());
        }
      }
      if constexpr (std::is_void_v<R>) {
        {
          capture::StepMemoryScope mem(*v.memory, device_traits<D>::kind);
          capture::ObserverScope obs(ops);
          capture::RewriterScope rw(rewriter);
          fn_(std::forward<Args>(args)...);
          if (own) own->finish();
        }
        finish(false);
        compare();
        ops.finish();
        after();
      } else {
        R r = [&]() -> R {
          capture::StepMemoryScope mem(*v.memory, device_traits<D>::kind);
          capture::ObserverScope obs(ops);
          capture::RewriterScope rw(rewriter);
          R result = fn_(std::forward<Args>(args)...);
          if (own) own->finish();
          return result;
        }();
        finish(false);
        compare();
        ops.finish();
        after();
        return r;
      }
    } catch (const std::exception& e) {
      if (v.memory->tracing_or_replaying()) finish(true);
      v.retrace = true;
      if (apply) {  // a fused call failed: the signature runs its ops as written from now on, said once
        v.fusion = {};
        if (options_.verbose)
          std::fprintf(stderr, "tg::compile: a step with fused ops failed (%s): this signature is captured again without fusion\n", e.what());
      }
      throw;
    } catch (...) {
      if (v.memory->tracing_or_replaying()) finish(true);
      v.retrace = true;
      if (apply) v.fusion = {};
      throw;
    }
  }

  /// The memory plan of the signature used last (Note [step memory plan]); empty before the first call.
  const capture::MemoryPlan& memory_plan() const {
    static const capture::MemoryPlan none{};
    return last_ ? last_->plan : none;
  }
  /// How the last replay went (ok, requests served, the first divergence).
  const capture::ReplayResult& last_replay() const { return last_replay_; }
  std::int64_t captures() const { return traces_; }
  std::int64_t replays() const { return replays_; }
  std::size_t variants() const { return variants_.size(); }
  /// Whether the signature used last replays its capture from the next call on: captured, with no fused capture
  /// or retrace pending (a signature with fused chains or pairs settles on its second call).
  bool settled() const { return last_ && !last_->eager && !last_->retrace && last_->memory->has_plan(); }
  /// Whether the signature used last runs eagerly (its allocations kept leaving the plan).
  bool eager() const { return last_ && last_->eager; }
  /// The chains of elementwise ops the signature used last runs fused (Note [fusion rewrites]).
  const std::vector<capture::FusedChain>& fused_chains() const {
    static const std::vector<capture::FusedChain> none;
    return last_ ? last_->fusion.chains : none;
  }
  /// The pairs of ops the signature used last runs as one fused op each (Note [pair rewrites]).
  const std::vector<capture::FusedPair>& fused_pairs() const {
    static const std::vector<capture::FusedPair> none;
    return last_ ? last_->fusion.pairs : none;
  }
  /// The signature used last's launches in its last two replays compared (Note [graph blockers]; with
  /// CompileOptions::watch_launches).
  const capture::GraphReport& graph_report() const {
    static const capture::GraphReport none{};
    return last_ ? last_->report : none;
  }
  /// What the CUDA graphs of the signature used last did (Note [CUDA graphs of a step]; zeros without them).
  backend::cuda::GraphStats graph_stats() const {
    return last_ && last_->graphs ? last_->graphs->stats() : backend::cuda::GraphStats{};
  }
  /// The ops the signature used last captured.
  const std::vector<capture::OpRecord>& ops() const {
    static const std::vector<capture::OpRecord> none;
    return last_ ? last_->ops : none;
  }

 private:
  struct Variant {
    std::string signature;
    capture::StepMemory* memory = nullptr;
    capture::MemoryPlan plan;
    std::vector<capture::OpRecord> ops;
    capture::FusionPlan fusion;  // Note [fusion rewrites], Note [pair rewrites]
    bool scouted = false;        // chains and pairs looked for
    bool retrace = false, eager = false;
    int divergences = 0;
    int device = 0;          // a GPU step's device and stream at its last call (Note [compiled steps]: streams)
    void* stream = nullptr;
    bool has_stream = false;
    capture::LaunchLog launches_before, launches_now;  // Note [graph blockers]
    bool watched = false;                              // launches_before holds the last replay's
    capture::GraphReport report;
    // Note [CUDA graphs of a step] (CompileOptions::cuda_graphs): the own stream, the joins with the caller's,
    // the graphs (declared last: destroyed first, after their last launches finish)
    std::unique_ptr<backend::cuda::Stream> own_stream;
    std::unique_ptr<backend::cuda::Event> join_in, join_out;
    std::unique_ptr<backend::cuda::StepGraphs> graphs;
  };
  Variant& variant_for(const std::string& sig) {
    for (std::size_t i = 0; i < variants_.size(); ++i)
      if (variants_[i]->signature == sig) {
        std::rotate(variants_.begin(), variants_.begin() + static_cast<std::ptrdiff_t>(i), variants_.begin() + static_cast<std::ptrdiff_t>(i) + 1);
        return *variants_.front();
      }
    if (!variants_.empty() && options_.verbose)
      std::fprintf(stderr, "tg::compile: a new input signature (%s): capturing it (%zu signatures compiled before)\n", sig.c_str(), variants_.size());
    if (variants_.size() >= std::max<std::size_t>(1, options_.cache_size)) {
      release(*variants_.back());
      variants_.pop_back();
    }
    auto v = std::make_unique<Variant>();
    v->signature = sig;
    v->memory = capture::StepMemory::create(allocator<D>(), device_traits<D>::kind);
    v->memory->set_weight_bytes(weight_bytes_);
    variants_.insert(variants_.begin(), std::move(v));
    last_ = nullptr;
    return *variants_.front();
  }
  /// Gives a signature's arena back; with its own stream (Note [CUDA graphs of a step]) after that stream's work.
  static void release(Variant& v) noexcept {
    v.graphs.reset();  // waits for its last graphs
    if (v.own_stream) {
      try {
        v.own_stream->synchronize();
      } catch (...) {  // a broken CUDA context: the arena is not handed out again on this stream
      }
    }
    v.memory->retire();
  }
  void check_parameters() {
    if (params_.empty()) return;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& t = parameters_[i].tensor;
      if (static_cast<const void*>(t.data()) != params_[i].first || t.shape() != params_[i].second) {
        if (options_.verbose)
          std::fprintf(stderr, "tg::compile: parameter '%s' was replaced or reshaped: capturing again\n", parameters_[i].name.c_str());
        for (auto& v : variants_) v->retrace = true;
        set_parameters(parameters_);
        return;
      }
    }
  }

  Fn fn_;
  CompileOptions options_;
  std::vector<std::unique_ptr<Variant>> variants_;  // most recently used first
  Variant* last_ = nullptr;
  capture::ReplayResult last_replay_;
  std::int64_t traces_ = 0, replays_ = 0, weight_bytes_ = 0;
  std::vector<std::pair<const void*, Shape>> params_;
  std::vector<optim::BasicParam<D>> parameters_;
};

/// Captures `fn` on its first call and replays it on the next ones (Note [compiled steps]).
template <Device D = cpu, class Fn>
CompiledStep<std::decay_t<Fn>, D> compile(Fn&& fn, CompileOptions options = {}) {
  return CompiledStep<std::decay_t<Fn>, D>(std::forward<Fn>(fn), options);
}

}  // namespace tg

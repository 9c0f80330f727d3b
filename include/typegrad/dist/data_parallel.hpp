// Data-parallel training: gradients reduced over the ranks in buckets while backward runs (DDP), optionally
// with the optimizer state (ZeRO-1) and the gradients (ZeRO-2) sharded across the ranks.
//   tg::dist::DataParallel<tg::cpu> dp(tg::dist::world(), params, {.sharding = tg::dist::Sharding::zero1});
//   tg::train::TrainStep<P> step(params, opt, schedule, {.clip = 1.0, .sync = &dp});   // each rank its own batches
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/dist/comm.hpp"
#include "typegrad/optim/optimizer.hpp"
#include "typegrad/optim/param.hpp"
#include "typegrad/train/step.hpp"

namespace tg::dist {

// Note [data parallelism]
// Every rank holds the whole model, draws its own rows of each global batch (BatchSampler's row offset) and
// runs forward and backward alone; the gradients are then averaged over the ranks, so each rank's update is
// the one-process update on the global batch (up to the order of fp32 sums). DataParallel does the averaging.
//   * Buckets. The parameters, in reverse order (the order backward finishes them), are grouped into buckets
//     of about bucket_bytes. Under DDP and ZeRO-1 each bucket is one flat fp32 buffer and the parameters'
//     gradients are views into it (set before the first micro-batch's backward; backward accumulates into
//     them), so reducing a bucket is one all-reduce over the buffer with no copies.
//   * Overlap. A leaf's grad-ready hook fires at each gradient it receives. On the first step DataParallel
//     counts the calls per parameter; from then on a parameter is ready when its count is reached, a bucket
//     when all its parameters are, and a ready bucket's reduction starts at once (non-blocking), in bucket
//     order (every rank issues the same collectives in the same order). Each hook call also progresses the
//     reductions in flight. after_backward() starts what is left and waits. A gradient that arrives after its
//     bucket's reduction started is an error (the graph changed between steps). With overlap off, every
//     reduction starts after backward (the baseline the overlap benchmark compares with).
//   * Accumulation. Only the last micro-batch of a step communicates; the others accumulate locally.
//   * A step that throws (TrainStep drops it whole): abandon_step() waits for its reductions in flight before the
//     next step reuses their buffers, and the buckets start afresh.
//   * Reduction precision: fp32 by default; bf16 halves the bytes (the bucket is rounded to bf16, summed in
//     fp32 pairwise, rounded, and widened back).
//   * ZeRO (Rajbhandari et al., 2020). Each parameter has one owner rank: the parameters in bucket order are
//     cut into size() contiguous runs of about equal size, so inside every bucket each rank's parameters are
//     one contiguous range. ZeRO-1: the buckets are all-reduced as under DDP, then the gradients of the
//     parameters a rank does not own are dropped, so its optimizer updates (and keeps state for) its own
//     parameters only. ZeRO-2: gradients are not bucket views; a ready bucket is copied into a transient flat
//     buffer, the rank's gradients of that bucket are freed, and a reduce-scatter leaves each rank the mean of
//     its own range, which becomes its parameters' gradients: a rank holds only its shard of the gradients
//     after the reduction. Under both, after an update every bucket's weights are all-gathered from their
//     owners (fp32 masters; the 16-bit copies are then refreshed from them on every rank), and the step
//     boundary sums squared norms and inf flags over the ranks (Note [cross-rank step decisions]).
//   * Weights start equal: the constructor broadcasts rank 0's. A checkpoint is written consolidated:
//     gather_optimizer_state() collects every owner's state on rank 0, so any world size resumes it.

/// An optimizer's consolidated state as an optim::AnyOptimizer for io::save_train_state (rank 0 writes what
/// DataParallel::gather_optimizer_state collected); loading into it is an error.
class ConsolidatedState final : public optim::AnyOptimizer {
 public:
  ConsolidatedState(const optim::AnyOptimizer& opt, std::vector<optim::NamedTensor> state)
      : name_(opt.name()), steps_(opt.step_count()), state_(std::move(state)) {}
  const char* name() const override { return name_; }
  std::int64_t step_count() const override { return steps_; }
  std::vector<optim::NamedTensor> state_tensors() const override { return state_; }
  void load_state(const std::vector<optim::NamedTensor>&) override {
    throw Error("dist::ConsolidatedState: a snapshot for saving; load into the optimizer itself");
  }

 private:
  const char* name_;
  std::int64_t steps_;
  std::vector<optim::NamedTensor> state_;
};

/// The union of every rank's named host tensors (a collective over `comm`, host buffers): each rank's list,
/// in rank order, a name already taken by a lower rank skipped (the same entry held by several ranks, such as
/// "optimizer.step" or a tied weight's copy, is taken from the first). The result is returned on `root`
/// (an empty list elsewhere), or on every rank when root is -1.
inline std::vector<optim::NamedTensor> gather_named_tensors(std::vector<optim::NamedTensor> mine, Communicator& comm, int root) {
  // A manifest of each rank's entries (name and shape), then each entry broadcast from its rank.
  std::ostringstream manifest;
  for (auto& e : mine) {
    manifest << e.name << '\t' << e.tensor.dim();
    for (int d = 0; d < e.tensor.dim(); ++d) manifest << ' ' << e.tensor.shape()[d];
    manifest << '\n';
  }
  const std::vector<std::string> all = comm.all_gather_strings(manifest.str());
  std::map<std::string, const Tensor<fp32>*> by_name;
  for (auto& e : mine) by_name[e.name] = &e.tensor;
  std::vector<optim::NamedTensor> out;
  std::set<std::string> taken;
  const bool keep = root < 0 || comm.rank() == root;
  for (int r = 0; r < comm.size(); ++r) {
    std::istringstream in(all[static_cast<std::size_t>(r)]);
    std::string line;
    while (std::getline(in, line)) {
      const auto tab = line.find('\t');
      const std::string name = line.substr(0, tab);
      if (!taken.insert(name).second) continue;  // a lower rank's copy was taken
      std::istringstream dims(line.substr(tab + 1));
      int nd = 0;
      dims >> nd;
      std::vector<std::int64_t> shape(static_cast<std::size_t>(nd));
      for (auto& d : shape) dims >> d;
      Tensor<fp32> t = r == comm.rank() ? by_name.at(name)->contiguous_raw() : Tensor<fp32>::empty(Shape(shape));
      if (comm.size() > 1) comm.broadcast(t, r);
      if (keep) out.push_back({name, t});
    }
  }
  return out;
}

enum class Sharding {
  none,       ///< DDP: every rank keeps all gradients and optimizer state
  optimizer,  ///< ZeRO-1: optimizer state sharded
  gradients   ///< ZeRO-2: optimizer state and gradients sharded
};
inline const char* sharding_name(Sharding s) { return s == Sharding::none ? "ddp" : s == Sharding::optimizer ? "zero1" : "zero2"; }

struct DataParallelOptions {
  Sharding sharding = Sharding::none;
  std::int64_t bucket_bytes = 25 << 20;  ///< fp32 bytes per bucket (a parameter larger than this gets its own)
  bool reduce_bf16 = false;              ///< reduce in bf16 instead of fp32
  bool overlap = true;                   ///< start reductions from the grad-ready hooks (false: after backward)
};

/// What the communication cost, for the progress line and the benchmarks.
struct CommStats {
  double wait_seconds = 0;    ///< time spent blocked on reductions and gathers (not hidden behind backward)
  std::int64_t bytes = 0;     ///< bytes this rank handed to collectives
  std::int64_t collectives = 0;
};

template <Device D>
class DataParallel final : public train::StepSync {
 public:
  /// `params`: every trainable parameter, in the model's order, the same on every rank (checked by name and
  /// shape). Broadcasts rank 0's weights to every rank.
  DataParallel(Communicator& comm, std::vector<optim::BasicParam<D>> params, DataParallelOptions options = {})
      : comm_(comm), params_(std::move(params)), options_(options) {
    TG_CHECK(comm_.device() == device_traits<D>::kind, "DataParallel: the communicator moves ",
             comm_.device() == DeviceKind::cpu ? "host" : "CUDA", " buffers, the parameters are on the other device");
    TG_CHECK(options_.bucket_bytes > 0, "DataParallel: bucket_bytes must be > 0, got ", options_.bucket_bytes);
    // Host values (step decisions, checks) go over world() when the communicator moves CUDA buffers.
    TG_CHECK(comm_.device() == DeviceKind::cpu || (comm_.size() == world().size() && comm_.rank() == world().rank()),
             "DataParallel: a CUDA communicator must span the MPI world (rank ", comm_.rank(), " of ", comm_.size(),
             ", world rank ", world().rank(), " of ", world().size(), ")");
    check_same_parameters();
    for (std::size_t i = 0; i < params_.size(); ++i) index_.emplace(params_[i].name, i);
    build_buckets();
    assign_owners();
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& meta = autodiff::ensure_meta(params_[i].tensor);
      hook_index_.push_back(meta->grad_ready_hooks.size());
      meta->grad_ready_hooks.push_back([this, i](const Tensor<fp32, D>&) { on_grad(i); });
    }
    for (auto& p : params_) comm_.broadcast(p.tensor.detach(), 0);  // weights start equal
  }
  ~DataParallel() override {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& hooks = params_[i].tensor.autograd_meta()->grad_ready_hooks;
      if (hook_index_[i] < hooks.size()) hooks.erase(hooks.begin() + static_cast<std::ptrdiff_t>(hook_index_[i]));
    }
  }
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  Communicator& communicator() const { return comm_; }
  const DataParallelOptions& options() const { return options_; }
  Sharding sharding() const { return options_.sharding; }
  std::size_t num_buckets() const { return buckets_.size(); }
  /// The rank that updates parameter `name` (every rank under DDP: returns this rank).
  int owner(const std::string& name) const {
    const auto it = index_.find(name);
    if (it == index_.end()) throw Error("DataParallel: no parameter named '", name, "'");
    return options_.sharding == Sharding::none ? comm_.rank() : owner_[it->second];
  }
  bool owns(const std::string& name) const { return owner(name) == comm_.rank(); }
  const CommStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

  // ---- train::StepSync --------------------------------------------------------------------------------
  /// Host values (the step boundary's flags, norms and losses): over MPI also when the gradients go through
  /// NCCL, whose communicator moves CUDA buffers only (it was made over world(), so the ranks are the same).
  void sum(std::span<double> values) const override { host_comm().all_reduce(values, ReduceOp::sum); }
  bool sharded_grads() const override { return options_.sharding != Sharding::none && comm_.size() > 1; }
  int ranks() const override { return comm_.size(); }
  bool updates_here(const std::string& name) const override { return owns(name); }
  /// The device boundary's sums (Note [the device boundary across ranks]): over the gradients' communicator,
  /// on their device (NCCL on a GPU: queued on the stream, the host waits for it as for a bucket).
  bool sums_on_device() const override { return true; }
  void sum_on_device(double* values, std::int64_t count) const override {
    if (comm_.size() == 1) return;
    const auto t0 = std::chrono::steady_clock::now();
    Work w = comm_.all_reduce_async(Buffer{values, count, DType::f64, device_traits<D>::kind}, ReduceOp::sum);
    await(w);
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  void defer_host_waits() const override { deferring_ = true; }
  void settle() const override {
    deferring_ = false;
    if (deferred_.empty()) return;
    const auto t0 = std::chrono::steady_clock::now();
    for (Work& w : deferred_) w.wait();
    deferred_.clear();
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  /// Collectives deferred to settle() and not yet waited for on the host (Note [device-ordered waits]).
  std::size_t deferred_waits() const { return deferred_.size(); }

  void before_backward(std::int64_t micro, std::int64_t n) override {
    if (micro == 0 && options_.sharding != Sharding::gradients) install_views();
    syncing_ = micro + 1 == n;
    if (!syncing_) return;
    std::fill(seen_.begin(), seen_.end(), 0);
    for (auto& b : buckets_) b.launched = false;
    next_launch_ = 0;
  }

  void after_backward(std::int64_t /*micro*/, std::int64_t /*n*/) override {
    if (!syncing_) return;
    syncing_ = false;
    if (!counted_) {  // the first step taught each parameter's number of gradient deliveries
      expected_ = seen_;
      counted_ = true;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t b = next_launch_; b < buckets_.size(); ++b) launch(b);
    next_launch_ = buckets_.size();
    for (std::size_t b = 0; b < buckets_.size(); ++b) finish(b);
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  void after_update() override {
    if (options_.sharding == Sharding::none || comm_.size() == 1) return;
    gather_weights();
  }
  /// A step that threw (TrainStep drops it whole): its reductions in flight are waited for and dropped, before the
  /// next step zeroes or frees the buffers they write (a reduction finishing later would write this step's partial
  /// sums into the next step's gradients), and the bucket state starts afresh. Every rank must drop the same step
  /// (an exception on some ranks only leaves the others waiting in a collective, as any divergence does).
  void abandon_step() noexcept override {
    for (Bucket& b : buckets_) {
      try {
        b.work.wait();
      } catch (...) {  // a failed collective: the run's communicator reports it on its next use
      }
      b.work = Work();
      b.launched = false;
      b.low = Tensor<bf16, D>();
      b.low_shard = Tensor<bf16, D>();
      b.shard = Tensor<fp32, D>();
      if (options_.sharding == Sharding::gradients) b.flat = Tensor<fp32, D>();  // ZeRO-2: transient
    }
    for (Work& w : deferred_) {
      try {
        w.wait();
      } catch (...) {
      }
    }
    deferred_.clear();
    deferring_ = false;
    syncing_ = false;
    next_launch_ = 0;
    std::fill(seen_.begin(), seen_.end(), 0);
  }
  bool changes_weights_after_update() const override { return options_.sharding != Sharding::none && comm_.size() > 1; }

  /// Broadcasts every parameter from its owner (ZeRO) so all ranks hold the same weights; a no-op under DDP.
  void gather_weights() {
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& b : buckets_) {
      Tensor<fp32, D> flat = Tensor<fp32, D>::empty({b.numel});
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const std::size_t i = b.params[k];
        if (owner_[i] == comm_.rank()) tg::detail::copy_tensor(params_[i].tensor.detach(), flat_view(flat, b.offsets[k], params_[i].tensor.shape()));
      }
      const std::int64_t mine = b.rank_counts[static_cast<std::size_t>(comm_.rank())];
      comm_.all_gather(Buffer{flat.data() + b.rank_offsets[static_cast<std::size_t>(comm_.rank())], mine, DType::f32, device_traits<D>::kind},
                       buffer_of(flat), b.rank_counts);
      count_bytes(b.numel * 4);
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const std::size_t i = b.params[k];
        if (owner_[i] != comm_.rank()) tg::detail::copy_tensor(flat_view(flat, b.offsets[k], params_[i].tensor.shape()), params_[i].tensor.detach());
      }
    }
    stats_.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  /// Every rank's optimizer state on rank 0, in one list (consolidated: any world size loads it); other ranks
  /// get an empty list. Under DDP every rank already holds all of it: rank 0's own. A collective.
  std::vector<optim::NamedTensor> gather_optimizer_state(const optim::AnyOptimizer& opt) {
    std::vector<optim::NamedTensor> mine = opt.state_tensors();
    if (options_.sharding == Sharding::none || comm_.size() == 1) return comm_.rank() == 0 ? mine : std::vector<optim::NamedTensor>{};
    return gather_named_tensors(std::move(mine), host_comm(), /*root=*/0);
  }

  /// After loading a consolidated state into `opt` (every parameter's), drops the state of the parameters this
  /// rank does not own (ZeRO), so each rank keeps its shard only.
  void shard_loaded_state(optim::BasicOptimizer<D>& opt) const {
    if (options_.sharding == Sharding::none || comm_.size() == 1) return;
    opt.keep_state_only([&](const std::string& name) { return owns(name); });
  }

 private:
  struct Bucket {
    std::vector<std::size_t> params;   // indices into params_, in bucket (reverse) order
    std::vector<std::int64_t> offsets; // each parameter's offset in the flat buffer
    std::int64_t numel = 0;
    std::vector<std::int64_t> rank_counts, rank_offsets;  // ZeRO: each rank's range
    Tensor<fp32, D> flat;              // DDP / ZeRO-1: the gradients' storage; ZeRO-2: transient
    Tensor<bf16, D> low;               // reduce_bf16: the bf16 copy in flight
    Tensor<fp32, D> shard;             // ZeRO-2: this rank's reduced range
    Tensor<bf16, D> low_shard;         // ZeRO-2 with reduce_bf16: its bf16 form in flight
    bool launched = false;
    Work work;
  };

  static Tensor<fp32, D> flat_view(const Tensor<fp32, D>& flat, std::int64_t offset, const Shape& shape) {
    return flat.as_strided_raw(shape, contiguous_strides(shape), flat.storage_offset() + offset);
  }

  Communicator& host_comm() const { return comm_.device() == DeviceKind::cpu ? comm_ : world(); }

  void count_bytes(std::int64_t bytes) {
    stats_.bytes += bytes;
    ++stats_.collectives;
  }

  void check_same_parameters() {
    std::ostringstream sig;
    for (auto& p : params_) sig << p.name << ' ' << p.tensor.shape() << ';';
    const std::string mine = sig.str();
    const auto all = host_comm().all_gather_strings(mine);
    for (std::size_t r = 0; r < all.size(); ++r)
      TG_CHECK(all[r] == mine, "DataParallel: rank ", r, " has other parameters than rank ", comm_.rank(),
               " (names or shapes differ): every rank must build the same model");
  }

  void build_buckets() {
    Bucket cur;
    for (std::size_t k = params_.size(); k-- > 0;) {
      const std::int64_t n = params_[k].tensor.numel();
      if (!cur.params.empty() && (cur.numel + n) * 4 > options_.bucket_bytes) {
        buckets_.push_back(std::move(cur));
        cur = Bucket{};
      }
      cur.offsets.push_back(cur.numel);
      cur.params.push_back(k);
      cur.numel += n;
    }
    if (!cur.params.empty()) buckets_.push_back(std::move(cur));
    bucket_of_.assign(params_.size(), 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      for (auto i : buckets_[b].params) bucket_of_[i] = b;
    seen_.assign(params_.size(), 0);
    expected_.assign(params_.size(), 0);
  }

  void assign_owners() {
    const int n = comm_.size();
    std::int64_t total = 0;
    for (auto& p : params_) total += p.tensor.numel();
    owner_.assign(params_.size(), 0);
    std::int64_t at = 0;
    for (auto& b : buckets_) {
      b.rank_counts.assign(static_cast<std::size_t>(n), 0);
      b.rank_offsets.assign(static_cast<std::size_t>(n), 0);
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const std::size_t i = b.params[k];
        const std::int64_t numel = params_[i].tensor.numel();
        const auto mid = static_cast<long double>(at) + static_cast<long double>(numel) / 2;
        const int r = std::min(n - 1, static_cast<int>(mid * n / std::max<std::int64_t>(1, total)));
        owner_[i] = r;
        b.rank_counts[static_cast<std::size_t>(r)] += numel;
        at += numel;
      }
      for (int r = 1; r < n; ++r)
        b.rank_offsets[static_cast<std::size_t>(r)] = b.rank_offsets[static_cast<std::size_t>(r - 1)] + b.rank_counts[static_cast<std::size_t>(r - 1)];
    }
  }

  // DDP / ZeRO-1: zeroed buckets become the gradients' storage for this step.
  void install_views() {
    for (auto& b : buckets_) {
      if (!b.flat.defined()) b.flat = Tensor<fp32, D>::empty({b.numel});
      TG_BACKEND(D, fill<fp32>(b.flat.data(), b.numel, 0.f));
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        auto& p = params_[b.params[k]].tensor;
        p.autograd_meta()->grad = flat_view(b.flat, b.offsets[k], p.shape());
      }
    }
  }

  void on_grad(std::size_t i) {
    if (!syncing_) return;
    ++seen_[i];
    if (counted_ && options_.overlap) {
      TG_CHECK(seen_[i] <= expected_[i], "DataParallel: '", params_[i].name, "' received a gradient after its bucket's reduction ",
               "started (", seen_[i], " gradients this step, ", expected_[i], " on the first): the graph changed between steps");
      if (seen_[i] == expected_[i] && bucket_of_[i] == next_launch_)
        while (next_launch_ < buckets_.size() && all_ready(next_launch_)) launch(next_launch_++);
    }
    for (std::size_t b = 0; b < next_launch_; ++b) buckets_[b].work.test();  // progress what is in flight
  }

  bool all_ready(std::size_t b) const {
    for (auto i : buckets_[b].params)
      if (seen_[i] < expected_[i]) return false;
    return true;
  }

  void launch(std::size_t bi) {
    Bucket& b = buckets_[bi];
    if (b.launched) return;
    b.launched = true;
    if (comm_.size() == 1 && options_.sharding != Sharding::gradients) return;
    if (options_.sharding == Sharding::gradients) {
      // ZeRO-2: gather the bucket's gradients into a transient buffer and free them.
      b.flat = Tensor<fp32, D>::empty({b.numel});
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        auto& p = params_[b.params[k]].tensor;
        const Tensor<fp32, D> g = p.grad();
        const Tensor<fp32, D> dst = flat_view(b.flat, b.offsets[k], p.shape());
        if (g.defined()) tg::detail::copy_tensor(g, dst);
        else TG_BACKEND(D, fill<fp32>(dst.data(), dst.numel(), 0.f));
        p.zero_grad();
      }
      const std::int64_t mine = b.rank_counts[static_cast<std::size_t>(comm_.rank())];
      if (options_.reduce_bf16) {
        b.low = b.flat.detach().template to<bf16>();
        b.flat = Tensor<fp32, D>();
        Tensor<bf16, D> low_shard = Tensor<bf16, D>::empty({mine});
        b.work = comm_.reduce_scatter_async(buffer_of(b.low), buffer_of(low_shard), b.rank_counts, ReduceOp::avg);
        b.low_shard = low_shard;
      } else {
        b.shard = Tensor<fp32, D>::empty({mine});
        b.work = comm_.reduce_scatter_async(buffer_of(b.flat), buffer_of(b.shard), b.rank_counts, ReduceOp::avg);
      }
      count_bytes(b.numel * (options_.reduce_bf16 ? 2 : 4));
      return;
    }
    if (options_.reduce_bf16) {
      b.low = b.flat.detach().template to<bf16>();
      b.work = comm_.all_reduce_async(buffer_of(b.low), ReduceOp::avg);
    } else {
      b.work = comm_.all_reduce_async(buffer_of(b.flat), ReduceOp::avg);
    }
    count_bytes(b.numel * (options_.reduce_bf16 ? 2 : 4));
  }

  /// Waits for w: on the host, or, while a device boundary defers the step's host waits, on the device, the
  /// host wait kept for settle() (Note [device-ordered waits]).
  void await(Work& w) const {
    if (!deferring_) return w.wait();
    w.order_on_device();
    if (w.pending()) deferred_.push_back(std::move(w));
  }

  void finish(std::size_t bi) {
    Bucket& b = buckets_[bi];
    await(b.work);
    if (options_.sharding == Sharding::gradients) {
      if (options_.reduce_bf16) {
        b.shard = b.low_shard.detach().template to<fp32>();
        b.low = Tensor<bf16, D>();
        b.low_shard = Tensor<bf16, D>();
      }
      b.flat = Tensor<fp32, D>();
      // This rank's parameters of the bucket take their gradients from the shard (views into it).
      const std::int64_t base = b.rank_offsets[static_cast<std::size_t>(comm_.rank())];
      for (std::size_t k = 0; k < b.params.size(); ++k) {
        const std::size_t i = b.params[k];
        if (owner_[i] != comm_.rank()) continue;
        params_[i].tensor.autograd_meta()->grad = flat_view(b.shard, b.offsets[k] - base, params_[i].tensor.shape());
      }
      b.shard = Tensor<fp32, D>();  // the views keep it alive
      return;
    }
    if (options_.reduce_bf16 && b.low.defined()) {
      tg::detail::copy_tensor(b.low.detach().template to<fp32>(), b.flat);
      b.low = Tensor<bf16, D>();
    }
    if (options_.sharding == Sharding::optimizer && comm_.size() > 1)
      for (auto i : b.params)
        if (owner_[i] != comm_.rank()) params_[i].tensor.zero_grad();  // the owner updates it
  }

  Communicator& comm_;
  std::vector<optim::BasicParam<D>> params_;
  DataParallelOptions options_;
  std::vector<Bucket> buckets_;
  std::vector<std::size_t> bucket_of_, hook_index_;
  std::vector<int> owner_;
  std::unordered_map<std::string, std::size_t> index_;  // parameter name -> index into params_
  std::vector<std::int64_t> seen_, expected_;
  std::size_t next_launch_ = 0;
  bool syncing_ = false, counted_ = false;
  mutable CommStats stats_;  // sum_on_device (a const CrossRank call) counts its wait too
  mutable bool deferring_ = false;     // Note [device-ordered waits]
  mutable std::vector<Work> deferred_;
};

}  // namespace tg::dist

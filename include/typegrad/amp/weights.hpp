// fp32 master weights with low-precision compute copies refreshed once per optimizer step, on any device.
// Each copy is attached to its master, so param_as<T>(master) -- how layers read a parameter in the compute
// type -- finds it in O(1): the attached T copy when there is one, else a to<T>().
//   tg::amp::WeightCopies<tg::bf16, tg::cuda> copies(model.named_parameters(), &opt);   // converts, attaches
//   loss = ...model.forward<tg::bf16>(idx)...;  loss.backward();  opt.step();  copies.refresh();
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/storage.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cpu/amp_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"
#include "typegrad/ops/padded_rows.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/optimizer.hpp"
#include "typegrad/optim/param.hpp"

namespace tg::amp {

// Note [master weights and per-step copies]
// Parameters are fp32 leaves (the masters; the optimizer updates them in place). A forward in a 16-bit
// compute type T reads, for each parameter, a T copy that WeightCopies<T, D> converts once per optimizer
// step: refresh() rewrites every copy in place (no allocation after the constructor) and is an explicit
// call the training loop makes after each optimizer step that was taken (GradAccumulator::micro_step
// returning true with !last_step_skipped(); a skipped step changed no master, so a refresh then is
// harmless but unneeded). Micro-batches and forwards between two steps share the copies.
//
// A parameter holds its own compute copy. The master's Storage (shared by every handle and view of it:
// the module's member, named_parameters()'s copy, a detach()) has one slot, an AttachedCopy pointer
// (core/storage.hpp); the WeightCopies constructor attaches each master's copy there, its destructor
// detaches them. param_as<T>(master) reads that slot -- one load, no map, no thread-local, no scope to
// open -- and uses the copy when it is a T copy on D made from this very tensor (same data pointer and
// shape: a view of a master gets a fresh conversion). Copies are therefore used whenever they are
// attached; fp32 forwards (evaluation, sampling, the fp32 policy) still read the masters, since
// param_as<fp32> is the identity, and a forward in another 16-bit type converts (master.to<T>()).
// In a forward, param_as<T>(master) returns a new handle on the copy's storage, recorded on the tape as
// a "to" node whose input is the master: backward converts the T gradient to fp32 and accumulates it into
// the master's fp32 grad (so accumulation over micro-batches and over tied uses is in fp32, never in T).
//
// One copy per master: a model trains in one compute type. A second WeightCopies over a master that
// already holds a copy (of any type, on any device) is an error naming the parameter and the attached
// type, and a constructor that fails detaches what it had attached. The slot is atomic, so two threads
// building copies over the same masters at once (in the same parameter order) get one success and one
// clean error, never two half-attached sets. refresh(), destroying a WeightCopies and the forwards that
// read its copies must not run concurrently (as for the optimizer's update of the masters).
//
// A stale copy is an error, not a silent use of old weights: when constructed with the optimizer (any
// with step_count(): optim::BasicOptimizer<D> on any device; OptimizerSteps), param_as
// checks, each time it is about to return a copy, that the optimizer has not stepped since the last
// refresh() (one call of step_count()); MixedPrecision::forward checks once before the forward, so the
// error comes before anything is recorded. Code that changes the masters another way (loading a
// checkpoint, copy_parameter_values) must call refresh() itself, or build the copies after loading, as
// train_gpt does.
// On the GPU (D = cuda) the masters, the copies and the conversion all live on the device: refresh() is
// one conversion launch per parameter (backend::cuda::copy_strided, the kernel Tensor::to<T>() runs, so a
// copy equals master.to<T>() bit for bit, and the CPU's convert_contiguous: both round to nearest even)
// on the current stream, writing into the copies' storage; it does not synchronize, and stream order puts
// it after the optimizer's update and before the next forward. A 16-bit forward then reads each weight in
// T once per use instead of reading the fp32 master and writing a fresh T conversion on every use.
// Without an attached WeightCopies<T, D> (none built, or destroyed), param_as<T> is master.to<T>(): the
// identity for fp32 and a fresh differentiable conversion otherwise.

// Note [regions see the copies]
// A checkpoint region's forward runs in the training loop's forward, its recompute inside backward().
// Both read the parameters through param_as, and the copies hang on the parameters themselves, so the
// recompute reads the very copies the forward read: no conversion of any weight per region per backward,
// and nothing for the region to capture or re-activate (autodiff/checkpoint.hpp knows nothing of mixed
// precision). The copies are refreshed only after an optimizer step, never between a forward and its
// backward. If the WeightCopies is destroyed before the backward, the recompute converts the masters
// (the same values); if the optimizer stepped in between, the recompute is the stale-copy error.

// Note [the optimizer writes the weight copies]
// Adam and AdamW (optim/adam.hpp) look up the compute copy attached to each parameter they update: a bf16 or
// fp16 AttachedCopy on their device, laid out element for element as the whole parameter (its data,
// master_data and numel: core/storage.hpp). They pass it to adam_step_multi, which writes copy[i] = the
// updated p[i] converted as refresh() converts it (scalar_cast, round to nearest even) in the same pass over
// the parameter. The refresh's own pass (a read of every master, a write of every copy; on the GPU one launch
// per parameter) then has nothing left to do for that parameter. The optimizer marks each copy it wrote.
// refresh_unwritten() converts only the unmarked ones (parameters without a gradient in the step, parameters
// of an optimizer that does not write copies) and clears the marks; refresh() converts every copy and clears
// them. Keeping a written copy is right only when the master did not change after the update:
// MixedPrecision::after_step(accum, CopyRefresh::unwritten) is for callers that know this. TrainStep passes
// it unless an after_update hook (pruning's apply_to_weights) or a replica sync (ZeRO's gather of the
// owners' weights) ran after the update. Either way the copies are bit for bit those of refresh()
// (tests/amp: AmpWeights.AdamWWritesTheCopiesInItsUpdate). Stale-copy detection is unchanged: a copy the
// optimizer wrote still counts as stale until the refresh that follows the step.

/// An optimizer whose steps weight copies can watch: optim::BasicOptimizer<D> (any device), or anything
/// else with step_count().
template <class Opt>
concept StepCountingOptimizer = requires(const Opt& o) {
  { o.step_count() } -> std::convertible_to<std::int64_t>;
};

/// The step count of the optimizer that updates the masters, for stale-copy detection: a non-owning
/// handle on any optimizer with step_count() (optim::BasicOptimizer<D> and its subclasses), or none
/// (never stale). The optimizer must outlive the handle.
class OptimizerSteps {
 public:
  OptimizerSteps() = default;
  OptimizerSteps(std::nullptr_t) {}  // NOLINT(google-explicit-constructor): "no optimizer"
  template <StepCountingOptimizer Opt>
  OptimizerSteps(const Opt* opt)  // NOLINT(google-explicit-constructor): WeightCopies(params, &opt)
      : opt_(opt), count_(opt ? &count_of<Opt> : nullptr) {}

  /// Whether an optimizer is attached.
  explicit operator bool() const { return count_ != nullptr; }
  /// Its step count now (0 without one).
  std::int64_t operator()() const { return count_ ? count_(opt_) : 0; }

 private:
  template <class Opt>
  static std::int64_t count_of(const void* opt) {
    return static_cast<std::int64_t>(static_cast<const Opt*>(opt)->step_count());
  }
  const void* opt_ = nullptr;
  std::int64_t (*count_)(const void*) = nullptr;
};

namespace detail {

/// What a WeightCopies shares with the copies it attached: the optimizer it watches and its last refresh.
struct CopiesState {
  OptimizerSteps steps;
  std::int64_t refreshes = 0;
  std::int64_t refreshed_at = 0;  // the optimizer's step count at the last refresh()
  bool stale() const { return steps && steps() != refreshed_at; }
};

template <FloatingElement T, Device D>
[[noreturn]] void throw_stale(const CopiesState& s) {
  throw Error("amp::WeightCopies: the ", dtype_traits<T>::name, " weight copies are stale on ", device_traits<D>::name,
              ": the optimizer stepped (step ", s.steps(), ") after the last refresh() (step ", s.refreshed_at,
              "); call refresh() after every optimizer step");
}

/// One master's T copy on D, attached to the master's storage while its WeightCopies lives. (Within amp,
/// an AttachedCopy of dtype T on D is always a CopyEntry<T, D>: nothing else attaches copies.)
template <FloatingElement T, Device D>
struct CopyEntry final : AttachedCopy {
  CopyEntry(std::string n, const Tensor<fp32, D>& m, const CopiesState* s)
      : AttachedCopy(dtype_traits<T>::dtype, device_traits<D>::kind, s), name(std::move(n)), master(m),
        copy(copy_like(m)), state(s) {
    data = copy.data();
    master_data = master.data();
    numel = master.numel();
  }
  std::string name;
  Tensor<fp32, D> master;  // keeps the master's storage (and so this slot) alive
  Tensor<T, D> copy;
  const CopiesState* state;

  /// An uninitialized T tensor shaped as `m`. A matrix stored with rows past its own (a padded parameter,
  /// Note [padded vocabulary]) gets a copy stored the same way, its extra rows zero and never written, so
  /// padded_rows(copy, stored rows, true) reads it in place instead of building a zero-padded copy per forward.
  static Tensor<T, D> copy_like(const Tensor<fp32, D>& m) {
    if (const std::int64_t stored = stored_rows(m); m.dim() == 2 && stored > m.size(0))
      return Tensor<T, D>::zeros({stored, m.size(1)}).narrow(0, 0, m.size(0)).detach();
    return Tensor<T, D>::empty(m.shape());
  }
};

/// The T copy on D attached to `master` and made from it (same data, same shape), or null. O(1).
template <FloatingElement T, Device D>
const CopyEntry<T, D>* attached_entry(const Tensor<fp32, D>& master) noexcept {
  const auto& storage = master.storage();
  if (!storage) return nullptr;
  const AttachedCopy* a = storage->attached_copy();
  if (!a || a->dtype != dtype_traits<T>::dtype || a->device != device_traits<D>::kind) return nullptr;
  const auto* e = static_cast<const CopyEntry<T, D>*>(a);
  if (e->master.data() != master.data() || e->master.shape() != master.shape()) return nullptr;
  return e;
}

inline std::string_view device_kind_name(DeviceKind k) {
  return k == DeviceKind::cpu ? device_traits<cpu>::name : device_traits<cuda>::name;
}

}  // namespace detail

/// The T copies of a set of fp32 masters on D, attached to the masters while this object lives (Note
/// [master weights and per-step copies]). Movable (the copies stay attached), not copyable.
template <FloatingElement T, Device D = cpu>
class WeightCopies {
  static_assert(!std::is_same_v<T, fp32> && !std::is_same_v<T, fp64>,
                "tg::amp::WeightCopies: copies are for a 16-bit compute type (bf16 or fp16); an fp32 forward reads "
                "the masters themselves (param_as<fp32> is the identity)");

 public:
  using value_type = T;
  using device_type = D;

  /// Converts every parameter once and attaches each copy to its master. `steps` (optional: the optimizer,
  /// e.g. `&opt`) lets param_as and check_fresh() detect a missing refresh(). A parameter that already
  /// holds a copy (another WeightCopies's, of any type) is an error; nothing stays attached then.
  explicit WeightCopies(const std::vector<optim::BasicParam<D>>& params, OptimizerSteps steps = {})
      : state_(std::make_unique<detail::CopiesState>()) {
    state_->steps = steps;
    entries_.reserve(params.size());  // no reallocation below: push_back cannot throw after an attach
    try {
      for (const auto& p : params) attach(p);
    } catch (...) {
      detach_all();
      throw;
    }
    refresh();
  }
  /// Detaches the copies: param_as then converts (master.to<T>()) again.
  ~WeightCopies() { detach_all(); }
  WeightCopies(const WeightCopies&) = delete;
  WeightCopies& operator=(const WeightCopies&) = delete;
  WeightCopies(WeightCopies&& other) noexcept : entries_(std::move(other.entries_)), state_(std::move(other.state_)) {
    other.entries_.clear();
  }
  WeightCopies& operator=(WeightCopies&& other) noexcept {
    if (this != &other) {
      detach_all();
      entries_ = std::move(other.entries_);
      state_ = std::move(other.state_);
      other.entries_.clear();
    }
    return *this;
  }

  /// Re-converts every master into its copy (in place, on D). Call once after each optimizer step.
  void refresh() { refresh_where([](const detail::CopyEntry<T, D>&) { return true; }); }
  /// refresh() for the copies the optimizer did not write in its step (Note [the optimizer writes the weight
  /// copies]): a copy that Adam / AdamW wrote since the last refresh is kept, the others are converted. Only
  /// right when nothing changed the masters after the optimizer's step (no pruning of the weights, no
  /// gather of ZeRO's shards, no hook): after such a change, refresh().
  void refresh_unwritten() { refresh_where([](const detail::CopyEntry<T, D>& e) { return !e.written; }); }
  /// Copies converted by the last refresh (the others were written by the optimizer).
  std::int64_t last_converted() const { return last_converted_; }

 private:
  template <class Pred>
  void refresh_where(Pred convert) {
    last_converted_ = 0;
    for (auto& e : entries_) {
      const bool c = convert(*e);
      e->written = false;
      if (!c) continue;
      ++last_converted_;
      if constexpr (std::is_same_v<D, cpu>) {
        backend::report_launch("convert_contiguous", false, e->master.data(), e->copy.data(), e->master.numel());  // Note [launch watch]
        backend::cpu::convert_contiguous<fp32, T>(e->master.data(), e->copy.data(), e->master.numel());
      } else {
        static_assert(std::is_same_v<D, cuda>, "amp::WeightCopies::refresh: no conversion for this device");
        backend::watched_cuda::copy_strided<fp32, T>(e->master.data(), e->master.strides(), e->copy.data(),
                                                     e->copy.strides(), e->master.shape());
      }
    }
    ++state_->refreshes;
    state_->refreshed_at = state_->steps();
  }

 public:
  /// refresh() calls so far, the constructor's included.
  std::int64_t refreshes() const { return state_->refreshes; }
  /// Whether the optimizer stepped since the last refresh() (always false without an optimizer).
  bool stale() const { return state_->stale(); }
  std::size_t size() const { return entries_.size(); }
  /// Bytes held by the copies.
  std::int64_t nbytes() const {
    std::int64_t n = 0;
    for (auto& e : entries_) n += static_cast<std::int64_t>(e->copy.nbytes());
    return n;
  }
  /// The copy of `master` (undefined tensor when it is not one of this object's parameters). O(1): read from
  /// the master's own slot.
  Tensor<T, D> copy_of(const Tensor<fp32, D>& master) const {
    const detail::CopyEntry<T, D>* e = detail::attached_entry<T, D>(master);
    if (!e || e->state != state_.get()) return Tensor<T, D>();
    return e->copy;
  }
  /// Throws the stale-copy error when the optimizer stepped since the last refresh().
  void check_fresh() const {
    if (stale()) detail::throw_stale<T, D>(*state_);
  }

 private:
  void attach(const optim::BasicParam<D>& p) {
    TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), "amp::WeightCopies: parameter '", p.name,
             "' must be a defined, contiguous fp32 tensor");
    auto e = std::make_unique<detail::CopyEntry<T, D>>(p.name, p.tensor, state_.get());
    const AttachedCopy* now = p.tensor.storage()->attach_copy(e.get());
    if (now != e.get()) {
      TG_CHECK(now->owner != state_.get(), "amp::WeightCopies: parameter '", p.name,
               "' is listed twice (or shares storage with another)");
      throw Error("amp::WeightCopies: parameter '", p.name, "' already holds ", dtype_name(now->dtype),
                  " compute copies on ", detail::device_kind_name(now->device),
                  " attached by another amp::WeightCopies (a parameter holds one compute copy: a model trains in "
                  "one compute type); destroy that WeightCopies (or the MixedPrecision holding it) before making ",
                  dtype_traits<T>::name, " copies of the same parameters");
    }
    entries_.push_back(std::move(e));
  }
  void detach_all() noexcept {
    for (auto& e : entries_) e->master.storage()->detach_copy(e.get());
    entries_.clear();
  }

  std::vector<std::unique_ptr<detail::CopyEntry<T, D>>> entries_;
  std::unique_ptr<detail::CopiesState> state_;  // on the heap: the attached copies point at it across moves
  std::int64_t last_converted_ = 0;
};

/// `master` in the compute type T: the master itself for fp32; the T copy attached to it (recorded as a "to"
/// from the master, so the gradient reaches it in fp32; an error when stale); else master.to<T>().
template <FloatingElement T, Device D>
Tensor<T, D> param_as(const Tensor<fp32, D>& master) {
  if constexpr (std::is_same_v<T, fp32> || std::is_same_v<T, fp64>) {
    return master.template to<T>();  // fp32: the master itself
  } else {
    const detail::CopyEntry<T, D>* e = detail::attached_entry<T, D>(master);
    if (!e) return master.template to<T>();
    if (e->state->stale()) detail::throw_stale<T, D>(*e->state);
    Tensor<T, D> out = e->copy.detach();  // a fresh handle: each use gets its own tape node
    autodiff::record("to", out, tg::detail::NoSaved{},
                     [](tg::detail::NoSaved&, const Tensor<T, D>& dout, auto) {
                       return std::tuple{dout.template to<fp32>()};
                     },
                     master);
    return out;
  }
}

}  // namespace tg::amp

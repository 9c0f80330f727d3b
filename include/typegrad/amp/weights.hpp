// fp32 master weights with low-precision copies refreshed once per optimizer step, on any device;
// param_as<T>() is how layers read a parameter in the compute type (the cached copy when one is active,
// else a to<T>()).
//   tg::amp::WeightCopies<tg::bf16, tg::cuda> copies(model.named_parameters(), &opt);   // converts once here
//   { tg::amp::UseCopies use(copies); loss = ...model.forward<tg::bf16>(idx)...; }  opt.step(); copies.refresh();
#pragma once

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "typegrad/amp/active_copies.hpp"
#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cpu/amp_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
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
// In a forward, param_as<T>(master) returns a new handle on the copy's storage, recorded on the tape as
// a "to" node whose input is the master: backward converts the T gradient to fp32 and accumulates it into
// the master's fp32 grad (so accumulation over micro-batches and over tied uses is in fp32, never in T).
// A stale copy is an error, not a silent use of old weights: when constructed with the optimizer (any
// with step_count(): optim::Optimizer on the CPU, optim::DeviceOptimizer<D>; OptimizerSteps), UseCopies
// checks that the optimizer has not stepped since the last refresh(). Code that changes the masters
// another way (loading a checkpoint, copy_parameter_values) must call refresh() itself, or build the
// copies after loading, as train_gpt does.
// On the GPU (D = cuda) the masters, the copies and the conversion all live on the device: refresh() is
// one conversion launch per parameter (backend::cuda::copy_strided, the kernel Tensor::to<T>() runs, so a
// copy equals master.to<T>() bit for bit, and the CPU's convert_contiguous: both round to nearest even)
// on the current stream, writing into the copies' storage; it does not synchronize, and stream order puts
// it after the optimizer's update and before the next forward. A 16-bit forward then reads each weight in
// T once per use instead of reading the fp32 master and writing a fresh T conversion on every use.
// Without an active WeightCopies<T, D> (evaluation, sampling, fp32 policy), param_as<T> is master.to<T>():
// the identity for fp32 and a fresh differentiable conversion otherwise.

/// An optimizer whose steps weight copies can watch: optim::Optimizer on the CPU, optim::DeviceOptimizer<D>
/// on a device, or anything else with step_count().
template <class Opt>
concept StepCountingOptimizer = requires(const Opt& o) {
  { o.step_count() } -> std::convertible_to<std::int64_t>;
};

/// The step count of the optimizer that updates the masters, for stale-copy detection: a non-owning
/// handle on any optimizer with step_count() (optim::Optimizer, optim::DeviceOptimizer<D> and their
/// subclasses), or none (never stale). The optimizer must outlive the handle.
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

template <FloatingElement T, Device D>
class WeightCopies {
  static_assert(!std::is_same_v<T, fp32> && !std::is_same_v<T, fp64>,
                "tg::amp::WeightCopies: copies are for a 16-bit compute type (bf16 or fp16); an fp32 forward reads "
                "the masters themselves (param_as<fp32> is the identity)");

 public:
  using value_type = T;
  using device_type = D;

  /// Converts every parameter once. `steps` (optional: the optimizer, e.g. `&opt`) lets UseCopies detect
  /// a missing refresh().
  explicit WeightCopies(const std::vector<optim::BasicParam<D>>& params, OptimizerSteps steps = {})
      : steps_(steps) {
    entries_.reserve(params.size());
    for (const auto& p : params) {
      TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), "amp::WeightCopies: parameter '", p.name,
               "' must be a defined, contiguous fp32 tensor");
      TG_CHECK(index_.emplace(p.tensor.data(), entries_.size()).second, "amp::WeightCopies: parameter '", p.name,
               "' is listed twice (or shares storage with another)");
      entries_.push_back({p.name, p.tensor, Tensor<T, D>::empty(p.tensor.shape())});
    }
    refresh();
  }

  /// Re-converts every master into its copy (in place, on D). Call once after each optimizer step.
  void refresh() {
    for (auto& e : entries_) {
      if constexpr (std::is_same_v<D, cpu>) {
        backend::cpu::convert_contiguous<fp32, T>(e.master.data(), e.copy.data(), e.master.numel());
      } else {
        static_assert(std::is_same_v<D, cuda>, "amp::WeightCopies::refresh: no conversion for this device");
        backend::cuda::copy_strided<fp32, T>(e.master.data(), e.master.strides(), e.copy.data(), e.copy.strides(),
                                             e.master.shape());
      }
    }
    ++refreshes_;
    refreshed_at_ = steps_();
  }
  /// refresh() calls so far, the constructor's included.
  std::int64_t refreshes() const { return refreshes_; }
  /// Whether the optimizer stepped since the last refresh() (always false without an optimizer).
  bool stale() const { return steps_ && steps_() != refreshed_at_; }
  std::size_t size() const { return entries_.size(); }
  /// Bytes held by the copies.
  std::int64_t nbytes() const {
    std::int64_t n = 0;
    for (auto& e : entries_) n += static_cast<std::int64_t>(e.copy.nbytes());
    return n;
  }
  /// The copy of `master` (undefined tensor when it is not one of this object's parameters).
  Tensor<T, D> copy_of(const Tensor<fp32, D>& master) const {
    auto it = index_.find(master.data());
    if (it == index_.end()) return Tensor<T, D>();
    const Entry& e = entries_[it->second];
    if (e.master.shape() != master.shape()) return Tensor<T, D>();
    return e.copy;
  }
  void check_fresh() const {
    TG_CHECK(!stale(), "amp::WeightCopies: the ", dtype_traits<T>::name, " weight copies are stale on ",
             device_traits<D>::name, ": the optimizer stepped (step ", steps_(), ") after the last refresh() (step ", refreshed_at_,
             "); call refresh() after every optimizer step");
  }

 private:
  struct Entry {
    std::string name;
    Tensor<fp32, D> master;
    Tensor<T, D> copy;
  };
  std::vector<Entry> entries_;
  std::unordered_map<const void*, std::size_t> index_;
  OptimizerSteps steps_;
  std::int64_t refreshes_ = 0;
  std::int64_t refreshed_at_ = 0;
};

/// While alive, param_as<T> on this thread reads `copies` for masters on D (scopes nest; the previous one
/// is restored).
template <FloatingElement T, Device D = cpu>
class UseCopies {
 public:
  explicit UseCopies(const WeightCopies<T, D>& copies) : prev_(detail::active_copies<T, D>) {
    copies.check_fresh();
    detail::active_copies<T, D> = &copies;
  }
  ~UseCopies() { detail::active_copies<T, D> = prev_; }
  UseCopies(const UseCopies&) = delete;
  UseCopies& operator=(const UseCopies&) = delete;

 private:
  const WeightCopies<T, D>* prev_;
};

/// `master` in the compute type T: the master itself for fp32; the active WeightCopies<T, D>'s copy
/// (recorded as a "to" from the master, so the gradient reaches it in fp32); else master.to<T>().
template <FloatingElement T, Device D>
Tensor<T, D> param_as(const Tensor<fp32, D>& master) {
  if constexpr (std::is_same_v<T, fp32> || std::is_same_v<T, fp64>) {
    return master.template to<T>();  // fp32: the master itself
  } else {
    const WeightCopies<T, D>* active = detail::active_copies<T, D>;
    if (!active) return master.template to<T>();
    const Tensor<T, D> copy = active->copy_of(master);
    if (!copy.defined()) return master.template to<T>();
    Tensor<T, D> out = copy.detach();  // a fresh handle: each use gets its own tape node
    autodiff::record("to", out, tg::detail::NoSaved{},
                     [](tg::detail::NoSaved&, const Tensor<T, D>& dout, auto) {
                       return std::tuple{dout.template to<fp32>()};
                     },
                     master);
    return out;
  }
}

}  // namespace tg::amp

// fp32 master weights with low-precision copies refreshed once per optimizer step; param_as<T>() is how
// layers read a parameter in the compute type (the cached copy when one is active, else a to<T>()).
//   tg::amp::WeightCopies<tg::bf16> copies(model.named_parameters(), &opt);   // converts once here
//   { tg::amp::UseCopies use(copies); loss = ...model.forward<tg::bf16>(idx)...; }  opt.step(); copies.refresh();
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "typegrad/amp/active_copies.hpp"
#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cpu/amp_kernels.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::amp {

// Note [master weights and per-step copies]
// Parameters are fp32 leaves (the masters; the optimizer updates them in place). A forward in a 16-bit
// compute type T reads, for each parameter, a T copy that WeightCopies<T> converts once per optimizer
// step: refresh() rewrites every copy in place (no allocation after the constructor) and is an explicit
// call the training loop makes after each optimizer step that was taken (GradAccumulator::micro_step
// returning true with !last_step_skipped(); a skipped step changed no master, so a refresh then is
// harmless but unneeded). Micro-batches and forwards between two steps share the copies.
// In a forward, param_as<T>(master) returns a new handle on the copy's storage, recorded on the tape as
// a "to" node whose input is the master: backward converts the T gradient to fp32 and accumulates it into
// the master's fp32 grad (so accumulation over micro-batches and over tied uses is in fp32, never in T).
// A stale copy is an error, not a silent use of old weights: when constructed with the optimizer,
// UseCopies checks that the optimizer has not stepped since the last refresh(). Code that changes the
// masters another way (loading a checkpoint) must call refresh() itself.
// Without an active WeightCopies<T> (evaluation, sampling, fp32 policy), param_as<T> is master.to<T>():
// the identity for fp32 and a fresh differentiable conversion otherwise.

template <FloatingElement T>
class WeightCopies {
 public:
  /// Converts every parameter once. `opt` (optional) lets UseCopies detect a missing refresh().
  explicit WeightCopies(const std::vector<optim::Param>& params, const optim::Optimizer* opt = nullptr) : opt_(opt) {
    entries_.reserve(params.size());
    for (const auto& p : params) {
      TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), "amp::WeightCopies: parameter '", p.name,
               "' must be a defined, contiguous fp32 tensor");
      TG_CHECK(index_.emplace(p.tensor.data(), entries_.size()).second, "amp::WeightCopies: parameter '", p.name,
               "' is listed twice (or shares storage with another)");
      entries_.push_back({p.name, p.tensor, Tensor<T>::empty(p.tensor.shape())});
    }
    refresh();
  }

  /// Re-converts every master into its copy (in place). Call once after each optimizer step.
  void refresh() {
    for (auto& e : entries_) backend::cpu::convert_contiguous<fp32, T>(e.master.data(), e.copy.data(), e.master.numel());
    ++refreshes_;
    if (opt_) refreshed_at_ = opt_->step_count();
  }
  /// refresh() calls so far, the constructor's included.
  std::int64_t refreshes() const { return refreshes_; }
  /// Whether the optimizer stepped since the last refresh() (always false without an optimizer).
  bool stale() const { return opt_ && opt_->step_count() != refreshed_at_; }
  std::size_t size() const { return entries_.size(); }
  /// Bytes held by the copies.
  std::int64_t nbytes() const {
    std::int64_t n = 0;
    for (auto& e : entries_) n += static_cast<std::int64_t>(e.copy.nbytes());
    return n;
  }
  /// The copy of `master` (undefined tensor when it is not one of this object's parameters).
  Tensor<T> copy_of(const Tensor<fp32>& master) const {
    auto it = index_.find(master.data());
    if (it == index_.end()) return Tensor<T>();
    const Entry& e = entries_[it->second];
    if (e.master.shape() != master.shape()) return Tensor<T>();
    return e.copy;
  }
  void check_fresh() const {
    TG_CHECK(!stale(), "amp::WeightCopies: the ", dtype_traits<T>::name, " weight copies are stale: the optimizer "
             "stepped (step ", opt_ ? opt_->step_count() : 0, ") after the last refresh() (step ", refreshed_at_,
             "); call refresh() after every optimizer step");
  }

 private:
  struct Entry {
    std::string name;
    Tensor<fp32> master;
    Tensor<T> copy;
  };
  std::vector<Entry> entries_;
  std::unordered_map<const void*, std::size_t> index_;
  const optim::Optimizer* opt_ = nullptr;
  std::int64_t refreshes_ = 0;
  std::int64_t refreshed_at_ = 0;
};

/// While alive, param_as<T> on this thread reads `copies` (scopes nest; the previous one is restored).
template <FloatingElement T>
class UseCopies {
 public:
  explicit UseCopies(const WeightCopies<T>& copies) : prev_(detail::active_copies<T>) {
    copies.check_fresh();
    detail::active_copies<T> = &copies;
  }
  ~UseCopies() { detail::active_copies<T> = prev_; }
  UseCopies(const UseCopies&) = delete;
  UseCopies& operator=(const UseCopies&) = delete;

 private:
  const WeightCopies<T>* prev_;
};

/// `master` in the compute type T: the master itself for fp32; the active WeightCopies<T>'s copy (recorded
/// as a "to" from the master, so the gradient reaches it in fp32); else master.to<T>().
/// On a device other than the CPU there are no per-step copies yet: a 16-bit forward converts each master
/// once per use (a differentiable to<T>() on the device; the gradient still reaches the master in fp32).
template <FloatingElement T, Device D>
Tensor<T, D> param_as(const Tensor<fp32, D>& master) {
  if constexpr (std::is_same_v<T, fp32>) {
    return master;
  } else if constexpr (!std::is_same_v<D, cpu>) {
    return master.template to<T>();
  } else {
    const WeightCopies<T>* active = detail::active_copies<T>;
    if (!active) return master.template to<T>();
    const Tensor<T> copy = active->copy_of(master);
    if (!copy.defined()) return master.template to<T>();
    Tensor<T> out = copy.detach();  // a fresh handle: each use gets its own tape node
    autodiff::record("to", out, tg::detail::NoSaved{},
                     [](tg::detail::NoSaved&, const Tensor<T>& dout, auto) { return std::tuple{dout.template to<fp32>()}; },
                     master);
    return out;
  }
}

}  // namespace tg::amp

// Optimizer offload: a device's optimizer whose state and update live on the host, run by the CPU backend's
// vectorized optimizer kernels; the device keeps the weights it computes with and their gradients.
//   auto opt = tg::optim::offload<tg::cuda>(tg::optim::default_groups(gpu_params, 0.1f),
//       [](std::vector<tg::optim::ParamGroup> g) { return std::make_unique<tg::optim::AdamW>(std::move(g), tg::optim::AdamWOptions{}); });
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

// Note [optimizer offload]
// OffloadedOptimizer<D> is a BasicOptimizer<D> (so TrainStep, clipping, the loss scaler and checkpoints use it
// as any other) that keeps no state on D. It owns a host optimizer of the same kind over fp32 host copies of
// the parameters (the masters of the update), with the same groups. At each step, for the parameters with a
// gradient: the gradient is copied D -> host, the host master is refreshed from the device weight (a copy of
// equal bits unless something outside the optimizer changed the weight: a checkpoint load, pruning masks, a
// ZeRO gather), the host optimizer steps with the device group's lr, and the new master is copied host -> D.
// The 16-bit compute copies are then refreshed on D as without offload. The update is the host optimizer's, so
// an offloaded run computes what a CPU run of that optimizer computes (on the CPU, bit for bit what it
// computes without offload). Device memory saved: the optimizer state (8 bytes per parameter for Adam and
// AdamW); the device keeps its fp32 weights (4) and gradients (4). Host memory: the masters, a gradient copy
// and the state. Its name() and state_tensors() are the host optimizer's, so checkpoints are interchangeable
// with runs without offload.
template <Device D>
class OffloadedOptimizer final : public BasicOptimizer<D> {
  using Base = BasicOptimizer<D>;
  using typename Base::Update;

 public:
  using MakeHost = std::function<std::unique_ptr<BasicOptimizer<cpu>>(std::vector<ParamGroup>)>;

  /// `groups`: the device parameters; `make_host` builds the host optimizer over host groups mirroring them.
  OffloadedOptimizer(std::vector<BasicParamGroup<D>> groups, const MakeHost& make_host)
      : Base(groups, 0.f, 0.f, "OffloadedOptimizer") {
    std::vector<ParamGroup> host_groups;
    for (std::size_t gi = 0; gi < groups.size(); ++gi) {
      ParamGroup hg{{}, groups[gi].lr_scale, groups[gi].weight_decay};
      for (const auto& p : groups[gi].params) {
        Tensor<fp32> master = Tensor<fp32>::empty(p.tensor.shape());
        tg::detail::copy_tensor(p.tensor.detach().template to<cpu>(), master);
        hg.params.emplace_back(p.name, master);
        index_[p.name] = {gi, masters_.size()};
        masters_.push_back(hg.params.back());
      }
      host_groups.push_back(std::move(hg));
    }
    host_ = make_host(std::move(host_groups));
    TG_CHECK(host_ != nullptr, "OffloadedOptimizer: make_host returned no optimizer");
    Base::set_lr(host_->lr());
  }

  const char* name() const override { return host_->name(); }
  std::vector<NamedTensor> state_tensors() const override { return host_->state_tensors(); }
  void load_state(const std::vector<NamedTensor>& state) override { host_->load_state(state); }
  /// The host optimizer's state is the one a ZeRO rank shards (dist::DataParallel::shard_loaded_state).
  void keep_state_only(const std::function<bool(const std::string&)>& keep) override { host_->keep_state_only(keep); }
  /// The host optimizer (its state, its per-parameter step counts).
  const BasicOptimizer<cpu>& host() const { return *host_; }

 protected:
  std::vector<SlotSpec> slots(const Shape&) const override { return {}; }  // nothing on D

  void update(std::span<Update> ready) override {
    if constexpr (!std::is_same_v<D, cpu>) {  // checked before anything changes
      for (const Update& u : ready)
        TG_CHECK(u.param->tensor.is_contiguous(), "OffloadedOptimizer: the weight '", u.param->name,
                 "' is not contiguous (the new weights are uploaded into it as one block)");
    }
    for (const Update& u : ready) {
      const auto [gi, mi] = index_.at(u.param->name);
      Param& master = masters_[mi];
      tg::detail::copy_tensor(u.param->tensor.detach().template to<cpu>(), master.tensor);  // equal bits unless changed outside
      master.tensor.autograd_meta()->grad = u.grad.detach().template to<cpu>();  // read only by the update
      host_->set_group_lr(gi, u.lr());
    }
    host_->step();
    for (const Update& u : ready) {  // straight into the weight: no device temporary whose allocation could fail here
      const Param& master = masters_[index_.at(u.param->name).second];
      if constexpr (std::is_same_v<D, cpu>) {
        tg::detail::copy_tensor(master.tensor, u.param->tensor.detach());
      } else {
        backend::cuda::copy_host_to_device(u.param->tensor.data(), master.tensor.data(),
                                           static_cast<std::size_t>(master.tensor.numel()) * sizeof(fp32));
      }
    }
    host_->zero_grad();
  }

 private:
  std::unique_ptr<BasicOptimizer<cpu>> host_;
  std::vector<Param> masters_;                                     // host fp32 copies, the host optimizer's parameters
  std::map<std::string, std::pair<std::size_t, std::size_t>> index_;  // name -> (group, master)
};

/// An OffloadedOptimizer<D> over `groups` whose host optimizer `make_host` builds.
template <Device D>
std::unique_ptr<BasicOptimizer<D>> offload(std::vector<BasicParamGroup<D>> groups,
                                           const typename OffloadedOptimizer<D>::MakeHost& make_host) {
  return std::make_unique<OffloadedOptimizer<D>>(std::move(groups), make_host);
}

}  // namespace tg::optim

// The machinery every device optimizer shares (DeviceAdam, DeviceSgd, DeviceLamb, DeviceAdafactor): named
// parameters on device D with their decay, state slots, step counts, lr, zero_grad, state_tensors /
// load_state under optim::Optimizer's names, and global-norm clipping. A subclass is its update rule.
//   std::unique_ptr<tg::optim::DeviceOptimizer<tg::cuda>> opt = std::make_unique<tg::optim::DeviceSgd<tg::cuda>>(ps, o);
//   loss.backward();  tg::optim::clip_grad_norm(*opt, 1.0);  opt->step();  opt->zero_grad();
#pragma once

#include <cmath>
#include <map>
#include <set>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/reduce.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

// Note [device optimizers]
// optim::Optimizer and its subclasses hold CPU tensors. A model trained on the GPU keeps its parameters,
// gradients and optimizer state there and steps with a DeviceOptimizer<cuda>: DeviceAdam, DeviceSgd,
// DeviceLamb or DeviceAdafactor. Each computes what its host optimizer computes (the same element
// functions of detail/math.hpp, or the same kernels' formulas, run in both backends), with the same
// parameter groups (Note [which parameters decay]: matrices decay with `weight_decay`, the rest with 0,
// as default_groups makes them), per-parameter step counts and optimizer step count. The state travels
// as the host optimizer's NamedTensors ("<param>.<slot>" with the host class's slot names, "<param>.step",
// "optimizer.step"): the slot lists are one function per optimizer (sgd_slots, adam_slots, lamb_slots,
// adafactor_slots) that the host class and its device twin both call. So a trainer saves a GPU run by
// copying weights and state into its host model and host optimizer and writing those, and a checkpoint
// resumes on either device. DeviceOptimizer<cpu> runs the CPU kernels per tensor (bit for bit the host
// optimizer; the tests run everywhere); on CUDA, Adam, SGD and LAMB run multi-tensor launches and
// Adafactor its per-tensor kernels (backend::cuda, detail/cuda/kernels.hpp).
template <Device D>
class DeviceOptimizer {
 public:
  virtual ~DeviceOptimizer() = default;
  DeviceOptimizer(const DeviceOptimizer&) = delete;
  DeviceOptimizer& operator=(const DeviceOptimizer&) = delete;

  virtual const char* name() const = 0;

  /// Updates every parameter that has a gradient (optim::Optimizer::step's rules: a parameter without a
  /// gradient is skipped and keeps its step count; state is created, zero-filled, at the first update).
  void step() {
    ++step_;
    ready_.clear();
    for (auto& e : entries_) {
      e.grad = e.param.tensor.grad();
      if (!e.grad.defined()) continue;
      TG_CHECK(e.grad.shape() == e.param.tensor.shape() && e.grad.is_contiguous(), name(), ": the gradient of '",
               e.param.name, "' has shape ", e.grad.shape(), ", the parameter has shape ", e.param.tensor.shape());
      if (e.step == 0 && e.slots.empty())
        for (auto& s : slots(e.param.tensor.shape())) e.slots.push_back(Tensor<fp32, D>::zeros(s.shape));
      ++e.step;
      ready_.push_back(&e);
    }
    if (!ready_.empty()) update(ready_, lr_);
    for (Entry* e : ready_) e->grad = Tensor<fp32, D>();
  }
  /// Drops every gradient.
  void zero_grad() {
    for (auto& e : entries_) e.param.tensor.zero_grad();
  }
  void set_lr(float lr) { lr_ = lr; }
  float lr() const { return lr_; }
  /// Number of step() calls so far.
  std::int64_t step_count() const { return step_; }
  /// Updates applied to the named parameter (0 before its first gradient).
  std::int64_t param_step_count(const std::string& param) const {
    for (auto& e : entries_)
      if (e.param.name == param) return e.step;
    throw Error(name(), ": no parameter named '", param, "'");
  }
  /// The weight decay the named parameter gets (0 for the no-decay parameters).
  float param_weight_decay(const std::string& param) const {
    for (auto& e : entries_)
      if (e.param.name == param) return e.weight_decay;
    throw Error(name(), ": no parameter named '", param, "'");
  }
  /// Calls f(const BasicParam<D>&) for every parameter, in construction order (no allocation).
  template <class F>
  void for_each_param(F&& f) const {
    for (auto& e : entries_) f(e.param);
  }

  /// Host copies of the state under the host optimizer's names (Note [device optimizers]).
  std::vector<NamedTensor> state_tensors() const {
    std::vector<NamedTensor> out;
    for (auto& e : entries_) {
      if (e.step == 0) continue;
      const auto specs = slots(e.param.tensor.shape());
      for (std::size_t k = 0; k < specs.size(); ++k)
        out.push_back({e.param.name + "." + specs[k].suffix, to_host(e.slots[k])});
      out.push_back({e.param.name + ".step", Tensor<fp32>::full({}, static_cast<double>(e.step))});
    }
    out.push_back({"optimizer.step", Tensor<fp32>::full({}, static_cast<double>(step_))});
    return out;
  }
  /// Restores state from state_tensors() of this class or of its host optimizer over the same parameters
  /// (a missing "<param>.step" resets that parameter's state, as Optimizer::load_state does). A missing,
  /// misshapen or unknown entry is an error naming it, and leaves the optimizer as it was.
  void load_state(const std::vector<NamedTensor>& state) {
    StateEntries entries(state, name());
    std::vector<std::pair<std::int64_t, std::vector<Tensor<fp32, D>>>> loaded(entries_.size());
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      const std::string& pn = e.param.name;
      const auto specs = slots(e.param.tensor.shape());
      const Tensor<fp32>* t = entries.take(pn + ".step");
      if (!t) {
        for (auto& s : specs)
          TG_CHECK(!entries.has(pn + "." + s.suffix), name(), ".load_state: '", pn, ".", s.suffix,
                   "' is given without '", pn, ".step'");
        continue;
      }
      loaded[i].first = entries.whole(*t, pn + ".step");
      for (auto& s : specs) {
        const std::string key = pn + "." + s.suffix;
        const Tensor<fp32>* v = entries.take(key);
        TG_CHECK(v != nullptr, name(), ".load_state: missing entry '", key, "'");
        TG_CHECK(v->shape() == s.shape, name(), ".load_state: '", key, "' has shape ", v->shape(), ", expected ",
                 s.shape);
        loaded[i].second.push_back(to_device(*v));
      }
    }
    std::int64_t step = step_;
    if (const Tensor<fp32>* t = entries.take("optimizer.step")) step = entries.whole(*t, "optimizer.step");
    entries.finish();
    for (std::size_t i = 0; i < entries_.size(); ++i) {
      entries_[i].step = loaded[i].first;
      entries_[i].slots = std::move(loaded[i].second);
    }
    step_ = step;
  }

 protected:
  /// A parameter, its state and the gradient of the step in progress (defined only inside update()).
  struct Entry {
    BasicParam<D> param;
    std::vector<Tensor<fp32, D>> slots;  // in the order of slots(shape); created at the first update
    std::int64_t step = 0;               // updates applied (already incremented inside update())
    float weight_decay = 0.f;
    Tensor<fp32, D> grad;
    fp32* slot(std::size_t k) const { return slots[k].data(); }
    std::int64_t numel() const { return param.tensor.numel(); }
  };

  /// `who` names the optimizer in the constructor's errors (name() is not callable yet). Decay follows
  /// Note [which parameters decay]: `weight_decay` for matrices, 0 for the rest.
  DeviceOptimizer(std::vector<BasicParam<D>> params, float lr, float weight_decay, const char* who) : lr_(lr) {
    TG_CHECK(lr >= 0, who, ": lr must be >= 0, got ", lr);
    std::set<std::string> names;
    for (auto& p : params) {
      TG_CHECK(names.insert(p.name).second, who, ": parameter '", p.name, "' appears twice");
      TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), who, ": parameter '", p.name,
               "' must be a defined, contiguous tensor");
      Entry e;
      e.weight_decay = is_no_decay(p) ? 0.f : weight_decay;
      e.param = std::move(p);
      entries_.push_back(std::move(e));
    }
  }

  /// The state buffers kept for a parameter of `shape` (the host optimizer's slots, same names and order).
  virtual std::vector<SlotSpec> slots(const Shape& shape) const = 0;
  /// Applies one update to every entry of `ready` (their step counts already incremented, grads set).
  virtual void update(std::span<Entry* const> ready, float lr) = 0;

  /// The entries of `ready` grouped by key(entry), in key order, each group in parameter order: the
  /// entries of one group share a multi-tensor launch.
  template <class KeyFn>
  static auto group_by(std::span<Entry* const> ready, KeyFn&& key) {
    std::map<std::invoke_result_t<KeyFn&, const Entry&>, std::vector<Entry*>> out;
    for (Entry* e : ready) out[key(*e)].push_back(e);
    return out;
  }

 private:
  static Tensor<fp32> to_host(const Tensor<fp32, D>& t) {
    if constexpr (std::is_same_v<D, cpu>) return t.detach().clone();
    else return t.detach().template to<cpu>();
  }
  static Tensor<fp32, D> to_device(const Tensor<fp32>& t) {
    if constexpr (std::is_same_v<D, cpu>) return t.detach().clone();
    else return t.detach().contiguous().template to<D>().detach();
  }

  std::vector<Entry> entries_;
  std::vector<Entry*> ready_;  // reused by step(): no allocation in the steady state
  float lr_ = 0.f;
  std::int64_t step_ = 0;
};

/// Note [global norm clipping] for a device optimizer's parameters, computed with ops on the parameters'
/// device: Σ g² per gradient in fp64 (one scalar read back in all), and the scaling written back in place.
template <Device D>
double clip_grad_norm(const DeviceOptimizer<D>& opt, double max_norm) {
  TG_CHECK(max_norm >= 0 && !std::isnan(max_norm), "clip_grad_norm: max_norm must be >= 0, got ", max_norm);
  NoGrad no_grad;
  Tensor<fp64, D> sq;
  opt.for_each_param([&](const BasicParam<D>& p) {
    const Tensor<fp32, D> g = p.tensor.grad();
    if (!g.defined() || g.numel() == 0) return;
    const Tensor<fp64, D> g64 = g.detach().template to<fp64>();
    const Tensor<fp64, D> s = sum(mul(g64, g64));
    sq = sq.defined() ? add(sq, s) : s;
  });
  const double total = sq.defined() ? std::sqrt(static_cast<double>(sq.item())) : 0.0;
  if (!std::isfinite(total)) return total;
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0)
    opt.for_each_param([&](const BasicParam<D>& p) {
      const Tensor<fp32, D> g = p.tensor.grad();
      if (g.defined() && g.numel() > 0) tg::detail::copy_tensor(mul(g.detach(), coef), g);
    });
  return total;
}

}  // namespace tg::optim

// Adam / AdamW over a model's parameters on any device: one fused multi-tensor launch per (group, step
// count) on CUDA (backend::cuda::adam_step_multi), the CPU kernel per tensor on the CPU; global-norm
// clipping for it; state saved and loaded under optim::Optimizer's names, so checkpoints do not change.
//   tg::optim::DeviceAdam<tg::cuda> opt(gpu_model.named_parameters(), {.lr = 6e-4f, .weight_decay = 0.1f});
//   loss.backward();  tg::optim::clip_grad_norm(opt, 1.0);  opt.step();  opt.zero_grad();
#pragma once

#include <cmath>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/cpu/optim_kernels.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/reduce.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/adam.hpp"

namespace tg::optim {

// Note [device optimizers]
// optim::Optimizer and its subclasses hold CPU tensors. A model trained on the GPU keeps its parameters,
// gradients and Adam moments there and steps with DeviceAdam<cuda>, which computes exactly what
// optim::Adam / optim::AdamW compute (Note [Adam update]: the same element function math::adam_update runs
// in both backends' kernels) with the same parameter groups (Note [which parameters decay]: matrices decay
// with `weight_decay`, the rest with 0), per-parameter step counts and optimizer step count. Its state
// travels as the host optimizer's NamedTensors ("<param>.exp_avg", "<param>.exp_avg_sq", "<param>.step",
// "optimizer.step"), so a trainer saves a GPU run by copying weights and state into its host model and
// host optimizer and writing those: the checkpoint format is one for both devices. DeviceAdam<cpu> runs
// the same code on the CPU (its tests run everywhere).
template <Device D>
class DeviceAdam {
 public:
  /// AdamW (decoupled decay) when `decoupled`, else Adam with L2 decay folded into the gradient.
  DeviceAdam(std::vector<BasicParam<D>> params, AdamWOptions o, bool decoupled = true)
      : h_(o), lr_(o.lr), decoupled_(decoupled) {
    TG_CHECK(o.lr >= 0, name(), ": lr must be >= 0, got ", o.lr);
    TG_CHECK(o.beta1 >= 0 && o.beta1 < 1, name(), ": beta1 must be in [0, 1), got ", o.beta1);
    TG_CHECK(o.beta2 >= 0 && o.beta2 < 1, name(), ": beta2 must be in [0, 1), got ", o.beta2);
    TG_CHECK(o.eps >= 0, name(), ": eps must be >= 0, got ", o.eps);
    std::set<std::string> names;
    for (auto& p : params) {
      TG_CHECK(names.insert(p.name).second, name(), ": parameter '", p.name, "' appears twice");
      TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), name(), ": parameter '", p.name,
               "' must be a defined, contiguous tensor");
      Entry e;
      e.weight_decay = is_no_decay(p) ? 0.f : o.weight_decay;
      e.param = std::move(p);
      entries_.push_back(std::move(e));
    }
  }

  const char* name() const { return decoupled_ ? "AdamW" : "Adam"; }

  /// Updates every parameter that has a gradient (optim::Optimizer::step's rules).
  void step() {
    ++step_;
    // Parameters with the same decay and step count share one launch.
    std::map<std::pair<float, std::int64_t>, std::vector<Entry*>> launches;
    for (auto& e : entries_) {
      const Tensor<fp32, D> g = e.param.tensor.grad();
      if (!g.defined()) continue;
      TG_CHECK(g.shape() == e.param.tensor.shape() && g.is_contiguous(), name(), ": the gradient of '", e.param.name,
               "' has shape ", g.shape(), ", the parameter has shape ", e.param.tensor.shape());
      if (!e.m.defined()) {
        e.m = Tensor<fp32, D>::zeros(e.param.tensor.shape());
        e.v = Tensor<fp32, D>::zeros(e.param.tensor.shape());
      }
      ++e.step;
      launches[{e.weight_decay, e.step}].push_back(&e);
    }
    for (auto& [key, list] : launches) {
      const auto [wd, t] = key;
      if constexpr (std::is_same_v<D, cpu>) {
        backend::cpu::AdamScalars s;
        s.lr = lr_;
        s.beta1 = h_.beta1;
        s.beta2 = h_.beta2;
        s.eps = h_.eps;
        s.weight_decay = wd;
        s.decoupled = decoupled_;
        s.step = t;
        for (Entry* e : list) {
          const Tensor<fp32, D> g = e->param.tensor.grad();
          backend::cpu::adam_step<fp32>(e->param.tensor.data(), g.data(), e->m.data(), e->v.data(), g.numel(), s);
        }
      } else {
        std::vector<backend::cuda::AdamTensor> tensors;
        for (Entry* e : list) {
          const Tensor<fp32, D> g = e->param.tensor.grad();
          tensors.push_back({e->param.tensor.data(), g.data(), e->m.data(), e->v.data(), g.numel()});
        }
        backend::cuda::adam_step_multi(tensors.data(), static_cast<int>(tensors.size()), lr_, h_.beta1, h_.beta2,
                                       h_.eps, wd, decoupled_, t);
      }
    }
  }
  /// Drops every gradient.
  void zero_grad() {
    for (auto& e : entries_) e.param.tensor.zero_grad();
  }
  void set_lr(float lr) { lr_ = lr; }
  float lr() const { return lr_; }
  std::int64_t step_count() const { return step_; }
  /// Calls f(const BasicParam<D>&) for every parameter.
  template <class F>
  void for_each_param(F&& f) const {
    for (auto& e : entries_) f(e.param);
  }

  /// Host copies of the state under optim::Optimizer's names (Note [device optimizers]).
  std::vector<NamedTensor> state_tensors() const {
    std::vector<NamedTensor> out;
    for (auto& e : entries_) {
      if (e.step == 0) continue;
      out.push_back({e.param.name + ".exp_avg", to_host(e.m)});
      out.push_back({e.param.name + ".exp_avg_sq", to_host(e.v)});
      out.push_back({e.param.name + ".step", Tensor<fp32>::full({}, static_cast<double>(e.step))});
    }
    out.push_back({"optimizer.step", Tensor<fp32>::full({}, static_cast<double>(step_))});
    return out;
  }
  /// Restores state from state_tensors() of this class or of optim::Adam / optim::AdamW over the same
  /// parameters (a missing "<param>.step" resets that parameter's state, as Optimizer::load_state does).
  void load_state(const std::vector<NamedTensor>& state) {
    StateEntries entries(state, name());
    for (auto& e : entries_) {
      const std::string& pn = e.param.name;
      const Tensor<fp32>* t = entries.take(pn + ".step");
      if (!t) {
        for (const char* s : {".exp_avg", ".exp_avg_sq"})
          TG_CHECK(!entries.has(pn + s), name(), ".load_state: '", pn, s, "' is given without '", pn, ".step'");
        e.step = 0;
        e.m = e.v = Tensor<fp32, D>();
        continue;
      }
      e.step = entries.whole(*t, pn + ".step");
      Tensor<fp32, D>* slot[2] = {&e.m, &e.v};
      const char* suffix[2] = {".exp_avg", ".exp_avg_sq"};
      for (int k = 0; k < 2; ++k) {
        const Tensor<fp32>* s = entries.take(pn + suffix[k]);
        TG_CHECK(s != nullptr, name(), ".load_state: missing entry '", pn, suffix[k], "'");
        TG_CHECK(s->shape() == e.param.tensor.shape(), name(), ".load_state: '", pn, suffix[k], "' has shape ",
                 s->shape(), ", expected ", e.param.tensor.shape());
        if constexpr (std::is_same_v<D, cpu>) *slot[k] = s->detach().clone();
        else *slot[k] = s->detach().contiguous().template to<D>().detach();
      }
    }
    if (const Tensor<fp32>* t = entries.take("optimizer.step")) step_ = entries.whole(*t, "optimizer.step");
    entries.finish();
  }

 private:
  struct Entry {
    BasicParam<D> param;
    Tensor<fp32, D> m, v;  // created at the first update
    std::int64_t step = 0;
    float weight_decay = 0.f;
  };
  static Tensor<fp32> to_host(const Tensor<fp32, D>& t) {
    if constexpr (std::is_same_v<D, cpu>) return t.detach().clone();
    else return t.detach().template to<cpu>();
  }

  std::vector<Entry> entries_;
  AdamWOptions h_;
  float lr_ = 0.f;
  bool decoupled_ = true;
  std::int64_t step_ = 0;
};

/// Note [global norm clipping] for a DeviceAdam's parameters, computed with ops on the parameters' device:
/// Σ g² per gradient in fp64 (one scalar read back in all), and the scaling written back in place.
template <Device D>
double clip_grad_norm(const DeviceAdam<D>& opt, double max_norm) {
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

// The optimizer interface shared by SGD, Adam, AdamW, LAMB and Adafactor: parameter groups, step(),
// zero_grad(), learning rates, step counts and named state tensors for checkpoints.
//   tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 6e-4f});
//   loss.backward();  opt.step();  opt.zero_grad();  auto state = opt.state_tensors();
#pragma once

#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "typegrad/optim/param.hpp"

namespace tg::optim {

/// A named tensor of optimizer state ("h.0.attn.c_attn.weight.exp_avg").
struct NamedTensor {
  std::string name;
  Tensor<fp32> tensor;
};

/// A load_state() argument indexed by entry name, shared by the optimizers' loaders: take() hands out an
/// entry and marks it used, whole() reads a step count, finish() rejects entries no parameter took. Errors
/// name the optimizer (`who`) and the entry.
class StateEntries {
 public:
  StateEntries(const std::vector<NamedTensor>& state, const char* who) : state_(state), who_(who) {
    for (auto& e : state)
      TG_CHECK(by_name_.emplace(e.name, &e.tensor).second, who_, ".load_state: duplicate entry '", e.name, "'");
  }
  /// The entry `key`, or nullptr when the state has none.
  const Tensor<fp32>* take(const std::string& key) {
    auto it = by_name_.find(key);
    if (it == by_name_.end()) return nullptr;
    used_.insert(key);
    return it->second;
  }
  bool has(const std::string& key) const { return by_name_.count(key) != 0; }
  /// A one-element entry holding a non-negative whole number (a step count).
  std::int64_t whole(const Tensor<fp32>& t, const std::string& key) const {
    TG_CHECK(t.numel() == 1, who_, ".load_state: '", key, "' must hold one element, it has shape ", t.shape());
    const float v = t.contiguous_raw().data()[0];
    TG_CHECK(v >= 0 && v == static_cast<float>(static_cast<std::int64_t>(v)), who_, ".load_state: '", key,
             "' must be a non-negative whole number, it is ", v);
    return static_cast<std::int64_t>(v);
  }
  /// Every entry must have been taken.
  void finish() const {
    for (auto& e : state_)
      TG_CHECK(used_.count(e.name), who_, ".load_state: unknown entry '", e.name,
               "' (no parameter of this optimizer has that state)");
  }

 private:
  const std::vector<NamedTensor>& state_;
  const char* who_;
  std::map<std::string, const Tensor<fp32>*> by_name_;
  std::set<std::string> used_;
};

/// One state buffer an optimizer keeps for a parameter: its suffix and shape (zero-initialised).
struct SlotSpec {
  std::string suffix;
  Shape shape;
};

// Note [optimizer state]
// State is created the first time a parameter is updated (zero-filled, contiguous fp32) and reused ever
// after, so step() makes no allocation in the steady state. Each parameter counts its own updates
// (`<name>.step`, PyTorch's per-parameter state["step"]): a parameter skipped because it has no
// gradient keeps its count, so its bias corrections match PyTorch's. The optimizer also counts step()
// calls (step_count(), exported as "optimizer.step"). Step counts travel as fp32 scalars, exact up to
// 2^24 steps. state_tensors() returns copies; load_state() copies into the optimizer's buffers and
// rejects a missing, misshapen or unknown entry with an error naming it.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  Optimizer(const Optimizer&) = delete;
  Optimizer& operator=(const Optimizer&) = delete;

  /// Updates every parameter that has a gradient (params whose grad() is undefined are skipped).
  void step() {
    ++step_;
    for (std::size_t gi = 0; gi < groups_.size(); ++gi) {
      Group& g = groups_[gi];
      for (std::size_t pi = 0; pi < g.params.size(); ++pi) {
        const Param& p = g.params[pi];
        const Tensor<fp32> grad = p.tensor.grad();
        if (!grad.defined()) continue;
        TG_CHECK(grad.shape() == p.tensor.shape() && grad.is_contiguous(), name(), ": the gradient of '", p.name,
                 "' has shape ", grad.shape(), ", the parameter has shape ", p.tensor.shape());
        State& st = g.state[pi];
        if (st.slots.empty() && st.step == 0) init_state(p, st);
        ++st.step;
        update(g, p, grad, st);
      }
    }
  }

  /// Drops every gradient (set_to_none, the default), or zero-fills them in place, keeping the buffers.
  void zero_grad(bool set_to_none = true) {
    for (auto& g : groups_)
      for (auto& p : g.params) {
        if (set_to_none) {
          p.tensor.zero_grad();
        } else if (Tensor<fp32> gr = p.tensor.grad(); gr.defined()) {
          backend::cpu::fill<fp32>(gr.data(), gr.numel(), 0.f);
        }
      }
  }

  /// Sets every group's lr to lr · group.lr_scale.
  void set_lr(float lr) {
    lr_ = lr;
    for (auto& g : groups_) g.lr = lr * g.lr_scale;
  }
  float lr() const { return lr_; }
  void set_group_lr(std::size_t group, float lr) { group_at(group).lr = lr; }
  float group_lr(std::size_t group) const { return const_cast<Optimizer*>(this)->group_at(group).lr; }
  float group_weight_decay(std::size_t group) const { return const_cast<Optimizer*>(this)->group_at(group).weight_decay; }
  std::size_t num_groups() const { return groups_.size(); }

  /// Number of step() calls so far.
  std::int64_t step_count() const { return step_; }
  /// Updates applied to the named parameter (0 before its first gradient).
  std::int64_t param_step_count(const std::string& param) const {
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i)
        if (g.params[i].name == param) return g.state[i].step;
    throw Error(name(), ": no parameter named '", param, "'");
  }

  /// Calls f(const Param&) for every parameter, group by group (no allocation).
  template <class F>
  void for_each_param(F&& f) const {
    for (auto& g : groups_)
      for (auto& p : g.params) f(p);
  }
  /// Every parameter, group by group.
  std::vector<Param> params() const {
    std::vector<Param> out;
    for (auto& g : groups_) out.insert(out.end(), g.params.begin(), g.params.end());
    return out;
  }

  /// Copies of the state: "<param>.<slot>" and "<param>.step" for every parameter updated so far, plus
  /// "optimizer.step".
  std::vector<NamedTensor> state_tensors() const {
    std::vector<NamedTensor> out;
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        const State& st = g.state[i];
        if (st.step == 0) continue;
        const auto specs = slots(g.params[i]);
        for (std::size_t k = 0; k < specs.size(); ++k)
          out.push_back({g.params[i].name + "." + specs[k].suffix, copy_of(st.slots[k])});
        out.push_back({g.params[i].name + ".step", Tensor<fp32>::full({}, static_cast<double>(st.step))});
      }
    out.push_back({"optimizer.step", Tensor<fp32>::full({}, static_cast<double>(step_))});
    return out;
  }

  /// Restores state saved by state_tensors() (of an optimizer of the same kind over the same parameters).
  void load_state(const std::vector<NamedTensor>& state) {
    StateEntries entries(state, name());
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        const Param& p = g.params[i];
        State& st = g.state[i];
        const auto specs = slots(p);
        const Tensor<fp32>* step_t = entries.take(p.name + ".step");
        if (!step_t) {
          for (auto& s : specs)
            TG_CHECK(!entries.has(p.name + "." + s.suffix), name(), ".load_state: '", p.name, ".", s.suffix,
                     "' is given without '", p.name, ".step'");
          st = State{};
          continue;
        }
        st.step = entries.whole(*step_t, p.name + ".step");
        if (st.slots.empty()) init_state(p, st);
        for (std::size_t k = 0; k < specs.size(); ++k) {
          const std::string key = p.name + "." + specs[k].suffix;
          const Tensor<fp32>* t = entries.take(key);
          TG_CHECK(t != nullptr, name(), ".load_state: missing entry '", key, "'");
          TG_CHECK(t->shape() == specs[k].shape, name(), ".load_state: '", key, "' has shape ", t->shape(),
                   ", expected ", specs[k].shape);
          tg::detail::copy_tensor(*t, st.slots[k]);
        }
      }
    if (const Tensor<fp32>* t = entries.take("optimizer.step")) step_ = entries.whole(*t, "optimizer.step");
    entries.finish();
  }

  virtual const char* name() const = 0;

 protected:
  struct State {
    std::int64_t step = 0;             // updates applied to this parameter
    std::vector<Tensor<fp32>> slots;   // in the order of slots(param)
  };
  struct Group {
    std::vector<Param> params;
    std::vector<State> state;
    float lr_scale = 1.f;
    float lr = 0.f;
    float weight_decay = 0.f;
  };

  Optimizer(std::vector<ParamGroup> groups, float lr, float default_weight_decay) : lr_(lr) {
    std::set<std::string> names;
    for (auto& pg : groups) {
      Group g;
      g.lr_scale = pg.lr_scale;
      g.lr = lr * pg.lr_scale;
      g.weight_decay = pg.weight_decay.value_or(default_weight_decay);
      for (auto& p : pg.params) {
        TG_CHECK(names.insert(p.name).second, "optimizer: parameter '", p.name, "' appears twice");
        TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), "optimizer: parameter '", p.name,
                 "' must be a defined, contiguous tensor");
      }
      g.params = std::move(pg.params);
      g.state.resize(g.params.size());
      groups_.push_back(std::move(g));
    }
  }
  static std::vector<ParamGroup> one_group(std::vector<Param> params) {
    std::vector<ParamGroup> g(1);
    g[0].params = std::move(params);
    return g;
  }

  /// The state buffers this optimizer keeps for `p`.
  virtual std::vector<SlotSpec> slots(const Param& p) const = 0;
  /// Applies one update; `st.step` was already incremented (t >= 1).
  virtual void update(Group& g, const Param& p, const Tensor<fp32>& grad, State& st) = 0;

 private:
  void init_state(const Param& p, State& st) {
    st.slots.clear();
    for (auto& s : slots(p)) st.slots.push_back(Tensor<fp32>::zeros(s.shape));
  }
  static Tensor<fp32> copy_of(const Tensor<fp32>& t) {
    Tensor<fp32> c = Tensor<fp32>::empty(t.shape());
    if (t.numel() > 0) std::memcpy(c.data(), t.data(), t.nbytes());
    return c;
  }
  Group& group_at(std::size_t i) {
    TG_CHECK(i < groups_.size(), name(), ": group ", i, " out of range (", groups_.size(), " groups)");
    return groups_[i];
  }

  std::vector<Group> groups_;
  float lr_ = 0.f;
  std::int64_t step_ = 0;
};

}  // namespace tg::optim

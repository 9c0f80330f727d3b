// The one optimizer hierarchy, for every device: BasicOptimizer<D> holds the parameter groups, the
// per-parameter state, learning rates, step counts and the named state tensors of checkpoints; SGD, Adam,
// AdamW, LAMB and Adafactor (BasicSgd<D>, ..., with CPU aliases Sgd, ...) are its update rules.
//   tg::optim::AdamW opt(tg::optim::default_groups(params, 0.1f), {.lr = 6e-4f});            // CPU
//   tg::optim::BasicAdamW<tg::cuda> gpu_opt(tg::optim::default_groups(gpu_params, 0.1f), {.lr = 6e-4f});
//   loss.backward();  opt.step();  opt.zero_grad();  auto state = opt.state_tensors();
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "typegrad/detail/kernels/core.hpp"
#include "typegrad/detail/kernels/optim.hpp"
#include "typegrad/ops/views.hpp"
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
// One state layout on every device. Parameters come in groups (ParamGroup: lr_scale, weight decay; Note
// [which parameters decay] gives default_groups). Each parameter has state slots (fp32 tensors on the
// parameters' device, zero-filled, contiguous, created the first time it is updated and reused ever after,
// so step() allocates no tensor in the steady state) and counts its own updates (`<name>.step`, PyTorch's
// per-parameter state["step"]): a parameter skipped because it has no gradient keeps its count, so its
// bias corrections match PyTorch's. The optimizer also counts step() calls (step_count(), exported as
// "optimizer.step"). state_tensors() returns host fp32 copies named "<param>.<slot>" (the slot names of
// the optimizer's slots(): exp_avg, exp_avg_sq, momentum_buffer, exp_avg_sq_row, ...), "<param>.step" and
// "optimizer.step" (step counts as fp32 scalars, exact up to 2^24 steps); load_state() takes such host
// tensors on any device, so a checkpoint written on one device resumes on another. load_state checks
// every entry (a missing, misshapen, unknown or duplicate one is an error naming it) before it changes
// anything, so a failed load leaves the optimizer as it was.
//
// Note [device optimizers]
// There is one optimizer hierarchy: BasicOptimizer<D> with its update rules BasicSgd<D>, BasicAdam<D>,
// BasicAdamW<D>, BasicLamb<D> and BasicAdafactor<D> (the CPU's are Sgd, Adam, AdamW, Lamb, Adafactor).
// The base class gathers the parameters that have a gradient and hands them to update() at once; each
// rule groups them by what its kernel's scalars depend on (the group's lr and weight decay, the step count)
// and calls the multi-tensor kernel of detail/kernels/optim.hpp once per such group: one launch (or a fixed
// few) for all the group's tensors on CUDA, the per-tensor CPU kernels in a loop on the CPU. The kernels of
// both devices run the same element functions (detail/math.hpp), so a GPU run computes what a CPU run
// computes, up to the order of fp64 sums and fp32 rounding of the hardware.
class AnyOptimizer;

template <Device D>
class BasicOptimizer;

/// What a checkpoint needs of an optimizer on any device (io::save_train_state, load_train_state): its kind,
/// its step count and its state as host tensors (Note [optimizer state]).
class AnyOptimizer {
 public:
  virtual ~AnyOptimizer() = default;
  virtual const char* name() const = 0;
  virtual std::int64_t step_count() const = 0;
  virtual std::vector<NamedTensor> state_tensors() const = 0;
  virtual void load_state(const std::vector<NamedTensor>& state) = 0;
};

template <Device D>
class BasicOptimizer : public AnyOptimizer {
 public:
  using device_type = D;
  BasicOptimizer(const BasicOptimizer&) = delete;
  BasicOptimizer& operator=(const BasicOptimizer&) = delete;

  /// Updates every parameter that has a gradient (params whose grad() is undefined are skipped).
  void step() {
    ++step_;
    ready_.clear();
    for (auto& g : groups_)
      for (std::size_t pi = 0; pi < g.params.size(); ++pi) {
        const BasicParam<D>& p = g.params[pi];
        Tensor<fp32, D> grad = p.tensor.grad();
        if (!grad.defined()) continue;
        TG_CHECK(grad.shape() == p.tensor.shape() && grad.is_contiguous(), name(), ": the gradient of '", p.name,
                 "' has shape ", grad.shape(), ", the parameter has shape ", p.tensor.shape());
        State& st = g.state[pi];
        if (st.slots.empty() && st.step == 0) init_state(p, st);
        ++st.step;
        ready_.push_back({&p, std::move(grad), &st, &g, ready_.size()});
      }
    if (!ready_.empty()) update(ready_);
    for (Update& u : ready_) u.grad = Tensor<fp32, D>();  // no reference to a gradient outlives step()
  }

  /// step() with the decision on the device (Note [the step boundary on the device]): the update rule's
  /// kernel reads skip, lr and t from `state` (kBoundarySize fp64 values on D). The step counts advance
  /// here as if the step is taken; undo_step() takes them back when the host reads that it was skipped.
  void step_on_device(const double* state) {
    TG_CHECK(reads_device_boundary(), name(), ": this optimizer cannot take its step from a device boundary (its update rule does not say reads_device_boundary(); SGD, Adam, AdamW, LAMB and Adafactor do)");
    boundary_ = state;
    try {
      step();
    } catch (...) {
      boundary_ = nullptr;
      throw;
    }
    boundary_ = nullptr;
  }
  /// Takes back the step counts of the last step() (a step the device skipped: nothing was updated).
  void undo_step() {
    TG_CHECK(step_ > 0, name(), ".undo_step: no step to take back");
    --step_;
    for (Update& u : ready_) --u.state->step;
    ready_.clear();
  }
  /// Whether the update rule can read its step from a device boundary (step_on_device).
  virtual bool reads_device_boundary() const { return false; }
  /// The per-step constants a device boundary hands the rule's kernel for update number t (Adam's bias
  /// corrections 1 - β1^t and 1 - β2^t, computed here as the host step computes them); 1 and 1 otherwise.
  virtual std::pair<double, double> device_step_constants(std::int64_t t) const {
    (void)t;
    return {1.0, 1.0};
  }
  /// The update count every parameter shares (the t - 1 of the next step); an error naming two parameters
  /// when they differ (a parameter that had no gradient at some step).
  std::int64_t uniform_param_step() const {
    return uniform_param_step([](const std::string&) { return true; });
  }
  /// uniform_param_step over the parameters `updated_here(name)` accepts (ZeRO: the ones this rank owns and
  /// updates; CrossRank::updates_here).
  template <class Pred>
  std::int64_t uniform_param_step(Pred&& updated_here) const {
    const State* first = nullptr;
    const std::string* first_name = nullptr;
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        if (!updated_here(g.params[i].name)) continue;
        if (!first) {
          first = &g.state[i];
          first_name = &g.params[i].name;
        } else if (g.state[i].step != first->step) {
          throw Error(name(), ": parameter '", *first_name, "' has ", first->step, " updates and '", g.params[i].name, "' ",
                      g.state[i].step, ": the step boundary on the device needs every parameter updated at every step");
        }
      }
    return first ? first->step : 0;
  }

  /// Drops every gradient (set_to_none, the default), or zero-fills them in place, keeping the buffers.
  void zero_grad(bool set_to_none = true) {
    for (auto& g : groups_)
      for (auto& p : g.params) {
        if (set_to_none) {
          p.tensor.zero_grad();
        } else if (Tensor<fp32, D> gr = p.tensor.grad(); gr.defined()) {
          TG_BACKEND(D, fill<fp32>(gr.data(), gr.numel(), 0.f));
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
  float group_lr(std::size_t group) const { return group_at(group).lr; }
  float group_weight_decay(std::size_t group) const { return group_at(group).weight_decay; }
  std::size_t num_groups() const { return groups_.size(); }

  /// Number of step() calls so far.
  std::int64_t step_count() const override { return step_; }
  /// Updates applied to the named parameter (0 before its first gradient).
  std::int64_t param_step_count(const std::string& param) const { return find(param).second->step; }
  /// The weight decay of the named parameter's group.
  float param_weight_decay(const std::string& param) const { return find(param).first->weight_decay; }

  /// Calls f(const BasicParam<D>&) for every parameter, group by group (no allocation).
  template <class F>
  void for_each_param(F&& f) const {
    for (auto& g : groups_)
      for (auto& p : g.params) f(p);
  }
  /// Every parameter, group by group.
  std::vector<BasicParam<D>> params() const {
    std::vector<BasicParam<D>> out;
    for (auto& g : groups_) out.insert(out.end(), g.params.begin(), g.params.end());
    return out;
  }

  /// Drops the state of every parameter whose name `keep` rejects (as if never updated): a ZeRO rank keeps
  /// its shard after loading a consolidated checkpoint (dist::DataParallel::shard_loaded_state). Virtual, for an
  /// optimizer that keeps its state elsewhere (OffloadedOptimizer: its host optimizer's).
  virtual void keep_state_only(const std::function<bool(const std::string&)>& keep) {
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i)
        if (!keep(g.params[i].name)) g.state[i] = State{};
  }

  /// Host fp32 copies of the state: "<param>.<slot>" and "<param>.step" for every parameter updated so far,
  /// plus "optimizer.step".
  std::vector<NamedTensor> state_tensors() const override {
    std::vector<NamedTensor> out;
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        const State& st = g.state[i];
        if (st.step == 0) continue;
        const auto specs = slots(g.params[i].tensor.shape());
        for (std::size_t k = 0; k < specs.size(); ++k)
          out.push_back({g.params[i].name + "." + specs[k].suffix, host_copy(st.slots[k])});
        out.push_back({g.params[i].name + ".step", Tensor<fp32>::full({}, static_cast<double>(st.step))});
      }
    out.push_back({"optimizer.step", Tensor<fp32>::full({}, static_cast<double>(step_))});
    return out;
  }

  /// Restores state saved by state_tensors() of an optimizer of the same kind over the same parameters, on
  /// any device. A parameter without "<param>.step" gets fresh state. All checks come first: on an error
  /// the optimizer is as it was.
  void load_state(const std::vector<NamedTensor>& state) override {
    StateEntries entries(state, name());
    struct Loaded {
      State* st;
      const BasicParam<D>* p;
      bool present;  // "<param>.step" was given
      std::int64_t step;
      std::vector<const Tensor<fp32>*> slots;
    };
    std::vector<Loaded> loaded;
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i) {
        const BasicParam<D>& p = g.params[i];
        const auto specs = slots(p.tensor.shape());
        Loaded l{&g.state[i], &p, false, 0, {}};
        if (const Tensor<fp32>* step_t = entries.take(p.name + ".step")) {
          l.present = true;
          l.step = entries.whole(*step_t, p.name + ".step");
          for (auto& s : specs) {
            const std::string key = p.name + "." + s.suffix;
            const Tensor<fp32>* t = entries.take(key);
            TG_CHECK(t != nullptr, name(), ".load_state: missing entry '", key, "'");
            TG_CHECK(t->shape() == s.shape, name(), ".load_state: '", key, "' has shape ", t->shape(), ", expected ",
                     s.shape);
            l.slots.push_back(t);
          }
        } else {
          for (auto& s : specs)
            TG_CHECK(!entries.has(p.name + "." + s.suffix), name(), ".load_state: '", p.name, ".", s.suffix,
                     "' is given without '", p.name, ".step'");
        }
        loaded.push_back(std::move(l));
      }
    std::int64_t step = step_;
    if (const Tensor<fp32>* t = entries.take("optimizer.step")) step = entries.whole(*t, "optimizer.step");
    entries.finish();
    for (Loaded& l : loaded) {
      *l.st = State{};
      if (!l.present) continue;
      init_state(*l.p, *l.st);
      l.st->step = l.step;
      for (std::size_t k = 0; k < l.slots.size(); ++k)
        tg::detail::copy_tensor(l.slots[k]->contiguous_raw().template to<D>().detach(), l.st->slots[k]);
    }
    step_ = step;
  }

 protected:
  struct State {
    std::int64_t step = 0;                // updates applied to this parameter
    std::vector<Tensor<fp32, D>> slots;   // in the order of slots(shape)
  };
  struct Group {
    std::vector<BasicParam<D>> params;
    std::vector<State> state;
    float lr_scale = 1.f;
    float lr = 0.f;
    float weight_decay = 0.f;
  };
  /// A parameter in the step in progress: its gradient, state (step already incremented) and group.
  struct Update {
    const BasicParam<D>* param;
    Tensor<fp32, D> grad;
    State* state;
    const Group* group;
    std::size_t index;  // parameter order within this step
    fp32* p() const { return param->tensor.data(); }
    const fp32* g() const { return grad.data(); }
    fp32* slot(std::size_t k) const { return state->slots[k].data(); }
    std::int64_t numel() const { return param->tensor.numel(); }
    const Shape& shape() const { return param->tensor.shape(); }
    float lr() const { return group->lr; }
    float lr_scale() const { return group->lr_scale; }
    float weight_decay() const { return group->weight_decay; }
    std::int64_t step() const { return state->step; }
  };

  /// `who` names the optimizer in the constructor's errors (name() is not callable yet).
  BasicOptimizer(std::vector<BasicParamGroup<D>> groups, float lr, float default_weight_decay, const char* who)
      : lr_(lr) {
    TG_CHECK(lr >= 0, who, ": lr must be >= 0, got ", lr);
    std::set<std::string> names;
    for (auto& pg : groups) {
      Group g;
      g.lr_scale = pg.lr_scale;
      g.lr = lr * pg.lr_scale;
      g.weight_decay = pg.weight_decay.value_or(default_weight_decay);
      for (auto& p : pg.params) {
        TG_CHECK(names.insert(p.name).second, who, ": parameter '", p.name, "' appears twice");
        TG_CHECK(p.tensor.defined() && p.tensor.is_contiguous(), who, ": parameter '", p.name,
                 "' must be a defined, contiguous tensor");
      }
      g.params = std::move(pg.params);
      g.state.resize(g.params.size());
      groups_.push_back(std::move(g));
    }
  }
  static std::vector<BasicParamGroup<D>> one_group(std::vector<BasicParam<D>> params) {
    std::vector<BasicParamGroup<D>> g(1);
    g[0].params = std::move(params);
    return g;
  }

  /// The device boundary state of the step in progress (step_on_device), or nullptr.
  const double* boundary() const { return boundary_; }
  // Under a device boundary an update's kernel reads its lr (times the group's scale) and step count from the
  // boundary state, so the host's stay out of its arguments and the launch is the same every step (Note [graph
  // blockers]); without one, the kernel takes them from the host.
  /// The lr an update's kernel is launched with: the group's, or 0 under a device boundary.
  float launch_lr(const Update& u) const { return boundary_ ? 0.f : u.lr(); }
  /// The step count an update's kernel is launched with: the parameter's, or `on_device` under a device boundary.
  std::int64_t launch_step(const Update& u, std::int64_t on_device = 0) const { return boundary_ ? on_device : u.step(); }
  /// The lr part of for_each_run's key: the group's lr, or under a device boundary the group's lr scale (the
  /// kernel multiplies the boundary's lr by it), so that runs share the scale instead.
  float run_lr_key(const Update& u) const { return boundary_ ? u.lr_scale() : u.lr(); }

  /// The state buffers this optimizer keeps for a parameter of `shape`.
  virtual std::vector<SlotSpec> slots(const Shape& shape) const = 0;
  /// Applies one update to every parameter of `ready` (in parameter order; step counts incremented).
  virtual void update(std::span<Update> ready) = 0;

  /// Calls f(run) for each run of `ready` sharing key(update), in key order, each run in parameter order:
  /// the updates of one run share a multi-tensor kernel call. Reorders `ready`; allocates nothing.
  template <class KeyFn, class F>
  static void for_each_run(std::span<Update> ready, KeyFn&& key, F&& f) {
    std::sort(ready.begin(), ready.end(), [&](const Update& a, const Update& b) {
      return std::pair(key(a), a.index) < std::pair(key(b), b.index);
    });
    for (std::size_t i = 0; i < ready.size();) {
      std::size_t j = i + 1;
      while (j < ready.size() && key(ready[j]) == key(ready[i])) ++j;
      f(ready.subspan(i, j - i));
      i = j;
    }
  }

 private:
  /// A host fp32 copy of `t` (no autograd record): the download from a device, or a copy of a CPU tensor.
  static Tensor<fp32> host_copy(const Tensor<fp32, D>& t) {
    Tensor<fp32> h = t.detach().template to<cpu>();
    if (h.numel() == 0 || h.data() != t.data()) return h;  // a fresh download, not t itself
    Tensor<fp32> c = Tensor<fp32>::empty(t.shape());
    tg::detail::copy_tensor(h, c);
    return c;
  }
  void init_state(const BasicParam<D>& p, State& st) const {
    st.slots.clear();
    for (auto& s : slots(p.tensor.shape())) st.slots.push_back(Tensor<fp32, D>::zeros(s.shape));
  }
  const Group& group_at(std::size_t i) const {
    TG_CHECK(i < groups_.size(), name(), ": group ", i, " out of range (", groups_.size(), " groups)");
    return groups_[i];
  }
  Group& group_at(std::size_t i) { return const_cast<Group&>(std::as_const(*this).group_at(i)); }
  std::pair<const Group*, const State*> find(const std::string& param) const {
    for (auto& g : groups_)
      for (std::size_t i = 0; i < g.params.size(); ++i)
        if (g.params[i].name == param) return {&g, &g.state[i]};
    throw Error(name(), ": no parameter named '", param, "'");
  }

  std::vector<Group> groups_;
  std::vector<Update> ready_;  // reused by step(); after it, the parameters it stepped (undo_step)
  const double* boundary_ = nullptr;
  float lr_ = 0.f;
  std::int64_t step_ = 0;
};

/// The CPU optimizer (the base of Sgd, Adam, AdamW, Lamb and Adafactor).
using Optimizer = BasicOptimizer<cpu>;

}  // namespace tg::optim

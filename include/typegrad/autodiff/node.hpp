// Autograd metadata on tensors and the one helper every op uses to record itself on the tape.
//   auto out = ...forward...;
//   autodiff::record(op_name, out, Saved{...}, [](Saved& s, const Tensor<T>& dout, auto need) { ... }, x);
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "typegrad/autodiff/region.hpp"
#include "typegrad/autodiff/tape.hpp"
#include "typegrad/core/tensor.hpp"

namespace tg::autodiff {

template <Element T, Device D>
struct AutogradMeta {
  std::uint64_t id = next_tensor_id();
  bool requires_grad = false;
  bool retain_grad = false;
  Tensor<T, D> grad;                 // contiguous, same shape as the tensor
  std::shared_ptr<Node> producer;    // null for leaves
  /// Called once a leaf's gradient of a backward pass is complete (data-parallel hooks, ZeRO).
  std::vector<std::function<void(const Tensor<T, D>&)>> grad_ready_hooks;
  /// Set by narrow_classes on the view it returns: the padded tensor whose leading columns the view is, so
  /// cross_entropy can take its gradient there (Note [cross-entropy on padded logits]).
  Tensor<T, D> padded_base;
  bool is_leaf() const { return producer == nullptr; }
};

template <Element T, Device D>
std::shared_ptr<AutogradMeta<T, D>>& ensure_meta(Tensor<T, D>& t) {
  if (!t.autograd_meta()) t.autograd_meta() = std::make_shared<AutogradMeta<T, D>>();
  return t.autograd_meta();
}

template <Element T, Device D>
TensorInfo info_of(const Tensor<T, D>& t) {
  return {t.autograd_meta() ? t.autograd_meta()->id : 0, t.shape(), dtype_traits<T>::dtype, device_traits<D>::kind};
}

/// grad += g (g is made contiguous and must have the tensor's shape).
template <Element T, Device D>
void accumulate_grad(AutogradMeta<T, D>& meta, const Tensor<T, D>& g, const Shape& shape, const char* op) {
  TG_CHECK(g.shape() == shape, op, " backward: gradient shape ", g.shape(), " does not match the input's shape ", shape);
  if (!meta.grad.defined()) {
    // Nothing else references g's buffer (a gradient freshly computed by the backward formula): adopt it, on
    // either device (the GPU's kernels run in order on one stream, so the buffer is the gradient as it is).
    if (g.storage() && g.storage().use_count() == 1 && g.storage_offset() == 0 && g.is_contiguous() &&
        g.storage()->bytes() == g.nbytes()) {
      meta.grad = g.detach();
      return;
    }
    // Own the buffer: g may alias a saved tensor or a view of another gradient (a strided g is gathered).
    Tensor<T, D> owned = Tensor<T, D>::empty(shape);
    detail::copy_tensor(g, owned);
    meta.grad = std::move(owned);
    return;
  }
  const Tensor<T, D> c = g.contiguous_raw();
  TG_BACKEND(D, add_inplace<T>(meta.grad.data(), c.data(), c.numel()));
}

template <class X>
struct input_slot;
template <Element T, Device D>
struct input_slot<Tensor<T, D>> {
  std::shared_ptr<AutogradMeta<T, D>> meta;  // null when the input does not require grad
  Shape shape;
};

// Note [one op, one node]
// Every recorded op has exactly one output (multi-output ops such as split are several narrow ops).
// record() attaches a node to `out` when grad mode is on and any input requires grad. The node owns the
// op's Saved struct; at backward it calls fn(saved, dout, need) where need[i] tells whether input i
// wants a gradient, and fn returns a tuple with one tensor per input (undefined = no contribution).
template <class Saved, class Fn, Element TO, Device DO, class... Ins>
class OpNode final : public Node {
 public:
  OpNode(const char* op, std::vector<TensorInfo> ins, TensorInfo out, Saved saved, Fn fn,
         std::weak_ptr<AutogradMeta<TO, DO>> out_meta, std::tuple<input_slot<Ins>...> slots)
      : Node(op, std::move(ins), std::move(out)), saved_(std::move(saved)), fn_(std::move(fn)),
        out_meta_(std::move(out_meta)), slots_(std::move(slots)) {}

  bool run_backward() override {
    auto out = out_meta_.lock();
    if (!out || !out->grad.defined()) return false;
    TG_CHECK(!released_, op(), " backward: the graph was already released by an earlier backward(); "
             "call backward(retain_graph=true) the first time to backpropagate through it twice");
    std::array<bool, sizeof...(Ins)> need{};
    std::apply([&](auto&... s) { std::size_t i = 0; ((need[i++] = s.meta && s.meta->requires_grad), ...); }, slots_);
    Tensor<TO, DO> dout = out->grad;
    if (!out->retain_grad) out->grad = Tensor<TO, DO>();  // non-leaf gradients are transient
    auto grads = fn_(saved_, dout, need);
    deliver(grads, std::index_sequence_for<Ins...>{});
    return true;
  }
  void release() override {
    released_ = true;
    saved_ = Saved{};
    slots_ = {};
  }
  void free_saved() override { saved_ = Saved{}; }

 private:
  template <class Tuple, std::size_t... I>
  void deliver(Tuple& grads, std::index_sequence<I...>) {
    (deliver_one(std::get<I>(slots_), std::get<I>(grads)), ...);
  }
  template <class Slot, class G>
  void deliver_one(Slot& slot, G& g) {
    if (!slot.meta || !slot.meta->requires_grad || !g.defined()) return;
    accumulate_grad(*slot.meta, g, slot.shape, op());
    if (slot.meta->is_leaf())
      for (auto& hook : slot.meta->grad_ready_hooks) hook(slot.meta->grad);
  }

  Saved saved_;
  Fn fn_;
  std::weak_ptr<AutogradMeta<TO, DO>> out_meta_;
  std::tuple<input_slot<Ins>...> slots_;
};

template <class... Ins>
bool any_requires_grad(const Ins&... ins) {
  return grad_enabled() && (... || ins.requires_grad());
}

template <class Saved, class Fn, Element TO, Device DO, class... Ins>
void record(const char* op, Tensor<TO, DO>& out, Saved saved, Fn fn, const Ins&... ins) {
  OpObserver* const o = op_observer();
  if (o) o->on_op(op, out.shape(), dtype_traits<TO>::dtype);
  if (!any_requires_grad(ins...)) {
    // A checkpoint region's forward runs without recording but must learn whether to record itself.
    if (!region_stack().empty() && (... || ins.requires_grad())) region_note_requires_grad();
    if (o) o->on_io(out.storage(), out.autograd_meta().get(), {ins.storage().get()...});
    return;
  }
  auto& meta = ensure_meta(out);
  meta->requires_grad = true;
  std::vector<TensorInfo> infos{info_of(ins)...};
  auto node = std::make_shared<OpNode<Saved, Fn, TO, DO, Ins...>>(
      op, std::move(infos), info_of(out), std::move(saved), std::move(fn), meta,
      std::tuple<input_slot<Ins>...>{input_slot<Ins>{ins.requires_grad() ? ins.autograd_meta() : nullptr, ins.shape()}...});
  meta->producer = node;
  current_tape().push(node);
  if (o) o->on_io(out.storage(), meta.get(), {ins.storage().get()...});
}

}  // namespace tg::autodiff

namespace tg {

template <Element T, Device D>
bool Tensor<T, D>::requires_grad() const {
  return meta_ && meta_->requires_grad;
}
template <Element T, Device D>
Tensor<T, D>& Tensor<T, D>::requires_grad_(bool on) {
  TG_CHECK(FloatingElement<T> || !on, "requires_grad_: only floating-point tensors can require gradients, this one is ",
           dtype_traits<T>::name);
  TG_CHECK(!meta_ || meta_->is_leaf(), "requires_grad_: only leaf tensors can change requires_grad (this one is the "
           "output of ", meta_ && meta_->producer ? meta_->producer->op() : "?", ")");
  autodiff::ensure_meta(*this)->requires_grad = on;
  return *this;
}
template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::grad() const {
  return meta_ ? meta_->grad : Tensor<T, D>();
}
template <Element T, Device D>
void Tensor<T, D>::zero_grad() const {
  if (meta_) meta_->grad = Tensor<T, D>();
}
template <Element T, Device D>
Tensor<T, D>& Tensor<T, D>::retain_grad() {
  autodiff::ensure_meta(*this)->retain_grad = true;
  return *this;
}
template <Element T, Device D>
std::uint64_t Tensor<T, D>::id() const {
  return meta_ ? meta_->id : 0;
}
template <Element T, Device D>
void Tensor<T, D>::backward(bool retain_graph) const {
  TG_CHECK(numel() == 1, "backward: the loss has shape ", sizes_,
           "; backward() without an upstream gradient needs a one-element tensor (pass the gradient explicitly)");
  backward(Tensor<T, D>::ones(sizes_), retain_graph);
}
template <Element T, Device D>
void Tensor<T, D>::backward(const Tensor<T, D>& upstream, bool retain_graph) const {
  TG_CHECK(requires_grad(), "backward: this tensor does not require grad (no input of its computation required "
           "grad, or it was computed under NoGrad)");
  TG_CHECK(upstream.shape() == sizes_, "backward: the upstream gradient has shape ", upstream.shape(),
           ", the tensor has shape ", sizes_);
  if (meta_->is_leaf()) {
    autodiff::accumulate_grad(*meta_, upstream, sizes_, "backward");
    return;
  }
  TG_CHECK(!meta_->producer->released(), "backward: the graph that produced this tensor (last op: ",
           meta_->producer->op(), ") was already released by an earlier backward(); call backward(retain_graph=true) "
           "the first time to backpropagate through it twice");
  meta_->grad = Tensor<T, D>();
  autodiff::accumulate_grad(*meta_, upstream, sizes_, "backward");
  autodiff::current_tape().backward_from(*meta_->producer, retain_graph);
}

}  // namespace tg

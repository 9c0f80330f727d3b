// concat (a list of tensors joined along one dim) and split (narrow views: one node per piece).
//   auto qkv = tg::concat({q, k, v}, -1);            // (B,T,3C)
//   auto parts = tg::split(qkv, C, -1);              // three (B,T,C) views, no copy
#pragma once

#include <string>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/ops/views.hpp"

namespace tg::autodiff {

// Note [list-input nodes]
// record() in node.hpp takes a compile-time pack of inputs; concat takes a run-time list. This overload
// records one node whose inputs are the list's tensors (still one output, per Note [one op, one node]).
// fn(saved, dout, need) gets need as a vector<bool> and returns a vector with one tensor per input
// (undefined = no contribution). Partial ordering picks it over the variadic record() for a vector.
template <class Saved, class Fn, Element T, Device D>
class ListOpNode final : public Node {
 public:
  ListOpNode(const char* op, std::vector<TensorInfo> ins, TensorInfo out, Saved saved, Fn fn,
             std::weak_ptr<AutogradMeta<T, D>> out_meta, std::vector<input_slot<Tensor<T, D>>> slots)
      : Node(op, std::move(ins), std::move(out)), saved_(std::move(saved)), fn_(std::move(fn)),
        out_meta_(std::move(out_meta)), slots_(std::move(slots)) {}

  bool run_backward() override {
    auto out = out_meta_.lock();
    if (!out || !out->grad.defined()) return false;
    TG_CHECK(!released_, op(), " backward: the graph was already released by an earlier backward(); "
             "call backward(retain_graph=true) the first time to backpropagate through it twice");
    std::vector<bool> need(slots_.size());
    for (std::size_t i = 0; i < slots_.size(); ++i) need[i] = slots_[i].meta && slots_[i].meta->requires_grad;
    Tensor<T, D> dout = out->grad;
    if (!out->retain_grad) out->grad = Tensor<T, D>();  // non-leaf gradients are transient
    const std::vector<Tensor<T, D>> grads = fn_(saved_, dout, need);
    TG_CHECK(grads.size() == slots_.size(), op(), " backward: returned ", grads.size(), " gradients for ",
             slots_.size(), " inputs");
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      auto& slot = slots_[i];
      if (!need[i] || !grads[i].defined()) continue;
      accumulate_grad(*slot.meta, grads[i], slot.shape, op());
      if (slot.meta->is_leaf())
        for (auto& hook : slot.meta->grad_ready_hooks) hook(slot.meta->grad);
    }
    return true;
  }
  void release() override {
    released_ = true;
    saved_ = Saved{};
    slots_.clear();
  }
  void free_saved() override { saved_ = Saved{}; }

 private:
  Saved saved_;
  Fn fn_;
  std::weak_ptr<AutogradMeta<T, D>> out_meta_;
  std::vector<input_slot<Tensor<T, D>>> slots_;
};

template <class Saved, class Fn, Element T, Device D>
void record(const char* op, Tensor<T, D>& out, Saved saved, Fn fn, const std::vector<Tensor<T, D>>& ins) {
  bool any = false;
  for (const auto& t : ins) any = any || t.requires_grad();
  if (!grad_enabled() || !any) {
    if (any && !region_stack().empty()) region_note_requires_grad();  // see record() in node.hpp
    return;
  }
  auto& meta = ensure_meta(out);
  meta->requires_grad = true;
  std::vector<TensorInfo> infos;
  std::vector<input_slot<Tensor<T, D>>> slots;
  for (const auto& t : ins) {
    infos.push_back(info_of(t));
    slots.push_back(input_slot<Tensor<T, D>>{t.requires_grad() ? t.autograd_meta() : nullptr, t.shape()});
  }
  auto node = std::make_shared<ListOpNode<Saved, Fn, T, D>>(op, std::move(infos), info_of(out), std::move(saved),
                                                            std::move(fn), meta, std::move(slots));
  meta->producer = node;
  current_tape().push(node);
}

}  // namespace tg::autodiff

namespace tg {

/// What concat keeps for backward: no tensors, only where each input sits along the concat dim.
struct ConcatSaved {
  int dim = 0;
  std::vector<std::int64_t> starts;  // offset of input k along `dim`
  std::vector<Shape> shapes;         // input k's shape
};

/// Joins tensors of equal shape except along `dim` (all of one rank) into one contiguous tensor.
/// d out / d x_k is the slice of dout at x_k's position.
template <FloatingElement T, Device D>
Tensor<T, D> concat(const std::vector<Tensor<T, D>>& xs, std::int64_t dim) {
  TG_CHECK(!xs.empty(), "concat: the list of tensors is empty");
  TG_CHECK(xs[0].defined(), "concat: tensor 0 is undefined");
  const Shape& s0 = xs[0].shape();
  TG_CHECK(s0.size() > 0, "concat: cannot concatenate zero-dimensional tensors (tensor 0 has shape ", s0, ")");
  const int d = wrap_dim(dim, s0.size(), "concat");
  ConcatSaved saved;
  saved.dim = d;
  Shape out_shape = s0;
  out_shape[d] = 0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    TG_CHECK(xs[k].defined(), "concat: tensor ", k, " is undefined");
    const Shape& s = xs[k].shape();
    bool same = s.size() == s0.size();
    for (int i = 0; same && i < s.size(); ++i) same = i == d || s[i] == s0[i];
    TG_CHECK(same, "concat: tensor ", k, " has shape ", s, " but tensor 0 has shape ", s0,
             "; the shapes must match in every dim except the concat dim ", d);
    saved.starts.push_back(out_shape[d]);
    saved.shapes.push_back(s);
    out_shape[d] += s[d];
  }
  Tensor<T, D> out = Tensor<T, D>::empty(out_shape);  // (..., sum_k n_k, ...)
  for (std::size_t k = 0; k < xs.size(); ++k)
    detail::copy_tensor(xs[k], out.as_strided_raw(saved.shapes[k], out.strides(), saved.starts[k] * out.strides()[d]));
  autodiff::record("concat", out, std::move(saved),
                   [](ConcatSaved& s, const Tensor<T, D>& dout, const std::vector<bool>& need) {
                     std::vector<Tensor<T, D>> grads(s.shapes.size());
                     for (std::size_t k = 0; k < grads.size(); ++k)
                       if (need[k])
                         grads[k] = dout.as_strided_raw(s.shapes[k], dout.strides(),
                                                        dout.storage_offset() + s.starts[k] * dout.strides()[s.dim]);
                     return grads;
                   }, xs);
  return out;
}

/// Splits x along `dim` into pieces of the given sizes (which must sum to x's size there). Each piece
/// is x.narrow(dim, start, size): a view sharing x's storage, recorded as its own node (narrow records
/// "slice").
template <Element T, Device D>
std::vector<Tensor<T, D>> split(const Tensor<T, D>& x, const std::vector<std::int64_t>& sizes, std::int64_t dim = 0) {
  const int d = wrap_dim(dim, x.dim(), "split");
  std::int64_t total = 0;
  std::string list = "[";
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    TG_CHECK(sizes[k] >= 0, "split: sizes must be non-negative, got ", sizes[k], " at position ", k);
    total += sizes[k];
    list += (k ? "," : "") + std::to_string(sizes[k]);
  }
  list += "]";
  TG_CHECK(total == x.shape()[d], "split: the sizes ", list, " sum to ", total, ", but dim ", d, " of shape ",
           x.shape(), " has size ", x.shape()[d]);
  std::vector<Tensor<T, D>> out;
  std::int64_t start = 0;
  for (std::int64_t n : sizes) {
    out.push_back(x.narrow(d, start, n));
    start += n;
  }
  return out;
}

/// Splits x along `dim` into pieces of `chunk` elements (the last one shorter when it does not divide).
/// Note: split(x, {n}, dim) with a one-element list picks this overload; it agrees with the sizes form
/// whenever that one is valid (n equal to the dim's size gives the single piece x).
template <Element T, Device D>
std::vector<Tensor<T, D>> split(const Tensor<T, D>& x, std::int64_t chunk, std::int64_t dim = 0) {
  const int d = wrap_dim(dim, x.dim(), "split");
  TG_CHECK(chunk > 0, "split: the chunk size must be positive, got ", chunk);
  const std::int64_t n = x.shape()[d];
  std::vector<std::int64_t> sizes;
  for (std::int64_t start = 0; start < n; start += chunk) sizes.push_back(std::min(chunk, n - start));
  if (sizes.empty()) sizes.push_back(0);  // an empty dim splits into one empty piece
  return split(x, sizes, d);
}

}  // namespace tg

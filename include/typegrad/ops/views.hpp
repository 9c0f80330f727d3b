// View ops (reshape/view, transpose/permute, slice/narrow, expand, (un)squeeze), contiguous, clone and
// the explicit conversions to<U>() / to<Device>(). Views share storage; their backward maps the
// gradient back onto the input's geometry.
//   auto q = qkv.narrow(2, 0, C).view({B, T, H, C / H}).transpose(1, 2);   // (B,H,T,hs), no copy
#pragma once

#include <numeric>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/ops/reduce.hpp"

namespace tg {

namespace detail {

/// Strides that let `shape` view contiguous-in-order memory of `t`, or an empty Shape if impossible.
template <Element T, Device D>
Shape view_strides(const Tensor<T, D>& t, const Shape& shape) {
  if (t.is_contiguous()) return contiguous_strides(shape);
  return Shape();
}

inline Shape infer_shape(Shape shape, std::int64_t numel, const char* op, const Shape& from) {
  int infer = -1;
  std::int64_t known = 1;
  for (int i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      TG_CHECK(infer < 0, op, ": only one dimension can be -1, got ", shape);
      infer = i;
    } else {
      TG_CHECK(shape[i] >= 0, op, ": invalid dimension ", shape[i], " in ", shape);
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    TG_CHECK(known != 0 && numel % known == 0, op, ": cannot reshape a tensor of shape ", from, " into ", shape);
    shape[infer] = numel / known;
  }
  TG_CHECK(shape.numel() == numel, op, ": cannot reshape a tensor of shape ", from, " (", numel, " elements) into ",
           shape, " (", shape.numel(), " elements)");
  return shape;
}
}  // namespace detail

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::view(const Shape& requested) const {
  const Shape shape = detail::infer_shape(requested, numel(), "view", sizes_);
  TG_CHECK(is_contiguous(), "view: the tensor of shape ", sizes_, " is not contiguous; use reshape() (which copies) or "
           "contiguous() first");
  Tensor out = as_strided_raw(shape, contiguous_strides(shape), offset_);
  autodiff::record("view", out, detail::NoSaved{},
                   [in_shape = sizes_](detail::NoSaved&, const Tensor& dout, auto) {
                     const Tensor c = dout.contiguous_raw();
                     return std::tuple{c.as_strided_raw(in_shape, contiguous_strides(in_shape), c.storage_offset())};
                   }, *this);
  return out;
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::reshape(const Shape& requested) const {
  const Shape shape = detail::infer_shape(requested, numel(), "reshape", sizes_);  // errors name reshape, not view
  if (is_contiguous()) return view(shape);
  return contiguous().view(shape);
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::transpose(std::int64_t d0, std::int64_t d1) const {
  const int a = wrap_dim(d0, dim(), "transpose"), b = wrap_dim(d1, dim(), "transpose");
  Shape sz = sizes_, st = strides_;
  std::swap(sz[a], sz[b]);
  std::swap(st[a], st[b]);
  Tensor out = as_strided_raw(sz, st, offset_);
  autodiff::record("transpose", out, detail::NoSaved{},
                   [a, b](detail::NoSaved&, const Tensor& dout, auto) { return std::tuple{dout.transpose(a, b)}; }, *this);
  return out;
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::permute(std::initializer_list<std::int64_t> dims) const {
  TG_CHECK(static_cast<int>(dims.size()) == dim(), "permute: got ", dims.size(), " dims for a tensor of shape ", sizes_);
  Shape perm, sz, st;
  std::array<bool, kMaxDims> seen{};
  for (auto d : dims) {
    const int w = wrap_dim(d, dim(), "permute");
    TG_CHECK(!seen[w], "permute: dim ", w, " appears twice");
    seen[w] = true;
    perm.push_back(w);
    sz.push_back(sizes_[w]);
    st.push_back(strides_[w]);
  }
  Tensor out = as_strided_raw(sz, st, offset_);
  autodiff::record("permute", out, detail::NoSaved{},
                   [perm](detail::NoSaved&, const Tensor& dout, auto) {
                     Shape inv = Shape::filled(perm.size(), 0), isz, ist;
                     for (int i = 0; i < perm.size(); ++i) inv[static_cast<int>(perm[i])] = i;
                     for (int i = 0; i < perm.size(); ++i) {
                       isz.push_back(dout.shape()[static_cast<int>(inv[i])]);
                       ist.push_back(dout.strides()[static_cast<int>(inv[i])]);
                     }
                     return std::tuple{dout.as_strided_raw(isz, ist, dout.storage_offset())};
                   }, *this);
  return out;
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::slice(std::int64_t d, std::int64_t start, std::int64_t end, std::int64_t step) const {
  const int w = wrap_dim(d, dim(), "slice");
  TG_CHECK(step > 0, "slice: step must be positive, got ", step);
  const std::int64_t n = sizes_[w];
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<std::int64_t>(start, 0, n);
  end = std::clamp<std::int64_t>(end, start, n);
  Shape sz = sizes_, st = strides_;
  sz[w] = (end - start + step - 1) / step;
  st[w] = strides_[w] * step;
  Tensor out = as_strided_raw(sz, st, offset_ + start * strides_[w]);
  autodiff::record("slice", out, detail::NoSaved{},
                   [in_shape = sizes_, w, start, step](detail::NoSaved&, const Tensor& dout, auto) {
                     Tensor din = Tensor::zeros(in_shape);
                     Shape st = din.strides();
                     st[w] *= step;
                     detail::copy_tensor(dout, din.as_strided_raw(dout.shape(), st, start * din.strides()[w]));
                     return std::tuple{din};
                   }, *this);
  return out;
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::narrow(std::int64_t d, std::int64_t start, std::int64_t length) const {
  const int w = wrap_dim(d, dim(), "narrow");
  TG_CHECK(start >= 0 && length >= 0 && start + length <= sizes_[w], "narrow: range [", start, ", ", start + length,
           ") is out of bounds for dim ", w, " of size ", sizes_[w], " (shape ", sizes_, ")");
  return slice(w, start, start + length);
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::expand(const Shape& shape) const {
  TG_CHECK(shape.size() >= dim(), "expand: cannot expand shape ", sizes_, " to fewer dims ", shape);
  Shape st = Shape::filled(shape.size(), 0), target = shape;
  const int lead = shape.size() - dim();
  for (int i = 0; i < shape.size(); ++i) {
    if (i < lead) {
      TG_CHECK(shape[i] >= 0, "expand: new leading dims must be sizes, got ", shape);
      continue;
    }
    const std::int64_t have = sizes_[i - lead];
    if (target[i] == -1) target[i] = have;
    TG_CHECK(have == target[i] || have == 1, "expand: the size ", have, " of dim ", i - lead, " must match ", target[i],
             " or be 1 (shape ", sizes_, " to ", shape, ")");
    st[i] = have == target[i] ? strides_[i - lead] : 0;
  }
  Tensor out = as_strided_raw(target, st, offset_);
  autodiff::record("expand", out, detail::NoSaved{},
                   [in_shape = sizes_](detail::NoSaved&, const Tensor& dout, auto) {
                     return std::tuple{sum_to_shape(dout, in_shape)};
                   }, *this);
  return out;
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::unsqueeze(std::int64_t d) const {
  const int w = wrap_dim(d, dim() + 1, "unsqueeze");
  Shape sz = sizes_;
  sz.insert(w, 1);
  return reshape(sz);
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::squeeze(std::int64_t d) const {
  const int w = wrap_dim(d, dim(), "squeeze");
  TG_CHECK(sizes_[w] == 1, "squeeze: dim ", w, " has size ", sizes_[w], ", not 1 (shape ", sizes_, ")");
  Shape sz = sizes_;
  sz.erase(w);
  return reshape(sz);
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

template <Element T, Device D>
Tensor<T, D> Tensor<T, D>::clone() const {
  Tensor out = empty(sizes_);
  detail::copy_tensor(*this, out);
  autodiff::record("clone", out, detail::NoSaved{},
                   [](detail::NoSaved&, const Tensor& dout, auto) { return std::tuple{dout}; }, *this);
  return out;
}

template <Element T, Device D>
template <class X>
auto Tensor<T, D>::to() const {
  if constexpr (Element<X>) {
    if constexpr (std::is_same_v<X, T>) {
      return *this;
    } else {
      Tensor<X, D> out = Tensor<X, D>::empty(sizes_);
      detail::copy_tensor(*this, out);
      if constexpr (FloatingElement<T> && FloatingElement<X>) {
        autodiff::record("to", out, detail::NoSaved{},
                         [](detail::NoSaved&, const Tensor<X, D>& dout, auto) { return std::tuple{dout.template to<T>()}; },
                         *this);
      }
      return out;
    }
  } else if constexpr (Device<X>) {
    if constexpr (std::is_same_v<X, D>) {
      return *this;
    } else {
      // Host <-> device copy of the contiguous data (either side made contiguous first, by that side's
      // strided copy). Recorded as "to": backward copies back.
      static_assert(std::is_same_v<D, cpu> || std::is_same_v<X, cpu>, "Tensor::to<Device>: one side must be the CPU");
      Tensor<T, X> out = Tensor<T, X>::empty(sizes_);
      if constexpr (std::is_same_v<D, cpu>) {
        const Tensor c = contiguous_raw();
        backend::cuda::copy_host_to_device(out.data(), c.data(), c.nbytes());
      } else {
        const Tensor c = contiguous_raw();
        backend::cuda::copy_device_to_host(out.data(), c.data(), c.nbytes());
      }
      if constexpr (FloatingElement<T>) {
        autodiff::record("to", out, detail::NoSaved{},
                         [](detail::NoSaved&, const Tensor<T, X>& dout, auto) { return std::tuple{dout.template to<D>()}; },
                         *this);
      }
      return out;
    }
  } else {
    static_assert(Element<X> || Device<X>, "Tensor::to<X>(): X must be an element type (tg::fp32, tg::bf16, ...) "
                                           "or a device tag (tg::cpu, tg::cuda)");
  }
}

}  // namespace tg

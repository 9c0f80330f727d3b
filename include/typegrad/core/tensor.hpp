// Tensor<T, Device>: reference-counted storage, run-time shape and strides, precision and device in the type.
//   auto x = tg::Tensor<tg::fp32>::normal({4, 64, 768});     // (B,T,C), seeded from the default generator
//   auto h = x.to<tg::bf16>();  auto xt = x.transpose(1, 2);  // explicit conversion; a strided view
#pragma once

#include <cmath>
#include <functional>
#include <initializer_list>
#include <memory>
#include <new>
#include <ostream>
#include <span>
#include <type_traits>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/core/storage.hpp"
#include "typegrad/detail/kernels/core.hpp"

namespace tg {

template <Element T, Device D>
class Tensor;

namespace autodiff {
template <Element T, Device D>
struct AutogradMeta;
}

template <class X>
struct is_tensor : std::false_type {};
template <Element T, Device D>
struct is_tensor<Tensor<T, D>> : std::true_type {};

namespace detail {
template <Element S, Element T, Device D>
void copy_tensor(const Tensor<S, D>& src, const Tensor<T, D>& dst);
}

template <Element T, Device D = cpu>
class Tensor {
 public:
  using value_type = T;
  using device_type = D;

  Tensor() = default;

  // ---- factories -------------------------------------------------------------------------------
  /// Uninitialized contiguous tensor.
  static Tensor empty(const Shape& shape) {
    // The byte count is checked before it is computed (a product past 2^62 bytes is no request memory can
    // meet), and a failed allocation names the tensor it was for.
    constexpr std::int64_t kMaxBytes = std::int64_t{1} << 62;
    std::int64_t n = 1;
    for (auto d : shape) {
      TG_CHECK(d >= 0, "Tensor::empty: negative dimension in shape ", shape);
      if (__builtin_mul_overflow(n, d, &n) || n > kMaxBytes / static_cast<std::int64_t>(sizeof(T)))
        throw Error("Tensor<", dtype_traits<T>::name, ">::empty: shape ", shape, " needs more than 2^62 bytes");
    }
    Tensor t;
    try {
      t.storage_ = Storage::allocate<D>(static_cast<std::size_t>(n) * sizeof(T));
    } catch (const Error& e) {
      throw Error("Tensor<", dtype_traits<T>::name, ">::empty(", shape, "), ", n * static_cast<std::int64_t>(sizeof(T)),
                  " bytes: ", e.what());
    } catch (const std::bad_alloc&) {
      throw Error("Tensor<", dtype_traits<T>::name, ">::empty(", shape, "): out of memory allocating ",
                  n * static_cast<std::int64_t>(sizeof(T)), " bytes");
    }
    t.sizes_ = shape;
    t.strides_ = contiguous_strides(shape);
    return t;
  }
  static Tensor full(const Shape& shape, double value) {
    Tensor t = empty(shape);
    if constexpr (std::is_same_v<D, cpu>) backend::watched::fill<T>(t.data(), t.numel(), scalar_cast<T>(value));  // Note [launch watch]
    else backend::watched_cuda::fill<T>(t.data(), t.numel(), scalar_cast<T>(value));
    return t;
  }
  static Tensor zeros(const Shape& shape) { return full(shape, 0.0); }
  static Tensor ones(const Shape& shape) { return full(shape, 1.0); }
  static Tensor arange(double start, double end, double step = 1.0) {
    if constexpr (!std::is_same_v<D, cpu>) return Tensor<T, cpu>::arange(start, end, step).template to<D>();  // same numbers as on the host
    else {
    TG_CHECK(step != 0.0, "Tensor::arange: step must not be 0");
    const double count = (end - start) / step;
    const auto n = static_cast<std::int64_t>(count > 0 ? std::ceil(count) : 0);
    Tensor t = empty({n});
    backend::cpu::arange<T>(t.data(), n, start, step);
    return t;
    }
  }
  static Tensor arange(std::int64_t n) { return arange(0.0, static_cast<double>(n)); }
  static Tensor normal(const Shape& shape, float mean = 0.f, float stddev = 1.f, Generator& gen = default_generator())
    requires FloatingElement<T>
  {
    if constexpr (!std::is_same_v<D, cpu>) return Tensor<T, cpu>::normal(shape, mean, stddev, gen).template to<D>();  // same numbers as on the host
    else {
    Tensor t = empty(shape);
    backend::cpu::random_normal<T>(t.data(), t.numel(), gen.seed(), gen.advance(static_cast<std::uint64_t>(t.numel())), mean, stddev);
    return t;
    }
  }
  static Tensor uniform(const Shape& shape, float lo = 0.f, float hi = 1.f, Generator& gen = default_generator())
    requires FloatingElement<T>
  {
    if constexpr (!std::is_same_v<D, cpu>) return Tensor<T, cpu>::uniform(shape, lo, hi, gen).template to<D>();  // same numbers as on the host
    else {
    Tensor t = empty(shape);
    backend::cpu::random_uniform<T>(t.data(), t.numel(), gen.seed(), gen.advance(static_cast<std::uint64_t>(t.numel())), lo, hi);
    return t;
    }
  }
  /// A tensor holding `values` (converted to T) in row-major order.
  static Tensor from_values(const Shape& shape, std::span<const double> values) {
    if constexpr (!std::is_same_v<D, cpu>) return Tensor<T, cpu>::from_values(shape, values).template to<D>();  // same numbers as on the host
    else {
    TG_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(), "Tensor::from_values: shape ", shape,
             " needs ", shape.numel(), " values, got ", values.size());
    Tensor t = empty(shape);
    for (std::size_t i = 0; i < values.size(); ++i) t.data()[i] = scalar_cast<T>(values[i]);
    return t;
    }
  }
  static Tensor from_values(const Shape& shape, std::initializer_list<double> values) {
    return from_values(shape, std::span<const double>(values.begin(), values.size()));
  }
  static Tensor from_vector(const Shape& shape, const std::vector<T>& values) {
    if constexpr (!std::is_same_v<D, cpu>) return Tensor<T, cpu>::from_vector(shape, values).template to<D>();  // same numbers as on the host
    else {
    TG_CHECK(static_cast<std::int64_t>(values.size()) == shape.numel(), "Tensor::from_vector: shape ", shape,
             " needs ", shape.numel(), " values, got ", values.size());
    Tensor t = empty(shape);
    std::copy(values.begin(), values.end(), t.data());
    return t;
    }
  }

  // ---- geometry ------------------------------------------------------------------------------
  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return sizes_; }
  const Shape& sizes() const { return sizes_; }
  const Shape& strides() const { return strides_; }
  int dim() const { return sizes_.size(); }
  std::int64_t size(std::int64_t d) const { return sizes_[wrap_dim(d, dim(), "Tensor::size")]; }
  std::int64_t stride(std::int64_t d) const { return strides_[wrap_dim(d, dim(), "Tensor::stride")]; }
  std::int64_t numel() const { return sizes_.numel(); }
  std::int64_t storage_offset() const { return offset_; }
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  T* data() const { return storage_ ? static_cast<T*>(storage_->data()) + offset_ : nullptr; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * sizeof(T); }
  bool is_contiguous() const {
    std::int64_t expected = 1;
    for (int i = dim() - 1; i >= 0; --i) {
      if (sizes_[i] == 1) continue;
      if (strides_[i] != expected) return false;
      expected *= sizes_[i];
    }
    return true;
  }
  static constexpr DType dtype() { return dtype_traits<T>::dtype; }
  static constexpr DeviceKind device() { return device_traits<D>::kind; }

  // ---- element access (CPU; for tests, printing and small host-side work) ----------------------
  T at(std::initializer_list<std::int64_t> index) const {
    static_assert(std::is_same_v<D, cpu>, "Tensor::at: element access needs a CPU tensor; copy with .to<tg::cpu>() first");
    return data()[element_offset(index)];
  }
  void set(std::initializer_list<std::int64_t> index, T value) const {
    static_assert(std::is_same_v<D, cpu>, "Tensor::set: element access needs a CPU tensor; copy with .to<tg::cpu>() first");
    data()[element_offset(index)] = value;
  }
  T item() const {
    if constexpr (!std::is_same_v<D, cpu>) return detach().template to<cpu>().item();
    else {
    TG_CHECK(numel() == 1, "Tensor::item: the tensor has ", numel(), " elements (shape ", sizes_, "), expected 1");
    return data()[0];
    }
  }
  /// Elements in row-major order (any strides).
  std::vector<T> to_vector() const {
    if constexpr (!std::is_same_v<D, cpu>) {
      return detach().template to<cpu>().to_vector();
    } else {
      const Tensor c = contiguous_raw();
      return std::vector<T>(c.data(), c.data() + c.numel());
    }
  }

  // ---- views and copies (differentiable; defined in ops/views.hpp) -----------------------------
  Tensor view(const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;
  Tensor flatten() const { return reshape({numel()}); }
  Tensor transpose(std::int64_t d0, std::int64_t d1) const;
  Tensor permute(std::initializer_list<std::int64_t> dims) const;
  Tensor slice(std::int64_t dim, std::int64_t start, std::int64_t end, std::int64_t step = 1) const;
  Tensor narrow(std::int64_t dim, std::int64_t start, std::int64_t length) const;
  Tensor expand(const Shape& shape) const;
  Tensor unsqueeze(std::int64_t dim) const;
  Tensor squeeze(std::int64_t dim) const;
  /// Self if already contiguous, else a contiguous copy.
  Tensor contiguous() const;
  Tensor clone() const;
  /// to<U>() converts precision; to<Device>() moves between devices. Both are explicit and differentiable.
  template <class X>
  auto to() const;

  // ---- autodiff ------------------------------------------------------------------------------
  bool requires_grad() const;
  /// Marks a leaf as trainable (its gradient accumulates in grad()).
  Tensor& requires_grad_(bool on = true);
  /// The accumulated gradient (undefined until a backward reached this tensor).
  Tensor grad() const;
  void zero_grad() const;
  /// Backward from a scalar (one-element) tensor.
  void backward(bool retain_graph = false) const;
  /// Backward with a given upstream gradient of this tensor's shape.
  void backward(const Tensor& upstream, bool retain_graph = false) const;
  /// Keep this non-leaf tensor's gradient after backward.
  Tensor& retain_grad();
  const std::shared_ptr<autodiff::AutogradMeta<T, D>>& autograd_meta() const { return meta_; }
  std::shared_ptr<autodiff::AutogradMeta<T, D>>& autograd_meta() { return meta_; }
  /// A stable id for tape records (assigned on first use).
  std::uint64_t id() const;

  // ---- raw access for kernels and ops (not recorded) --------------------------------------------
  /// A view sharing storage, with no autograd history.
  Tensor as_strided_raw(const Shape& sizes, const Shape& strides, std::int64_t offset) const {
    Tensor t;
    t.storage_ = storage_;
    t.sizes_ = sizes;
    t.strides_ = strides;
    t.offset_ = offset;
    return t;
  }
  Tensor detach() const { return as_strided_raw(sizes_, strides_, offset_); }
  /// A contiguous tensor of `shape` over `storage` (a pending value of a fused chain: Note [fusion rewrites]).
  static Tensor over_storage_raw(std::shared_ptr<Storage> storage, const Shape& shape) {
    Tensor t;
    t.storage_ = std::move(storage);
    t.sizes_ = shape;
    t.strides_ = contiguous_strides(shape);
    return t;
  }
  Tensor contiguous_raw() const {
    if (is_contiguous()) return detach();
    Tensor out = empty(sizes_);
    detail::copy_tensor(*this, out);
    return out;
  }

 private:
  std::int64_t element_offset(std::initializer_list<std::int64_t> index) const {
    TG_CHECK(static_cast<int>(index.size()) == dim(), "Tensor::at: index has ", index.size(),
             " coordinates, the tensor has shape ", sizes_);
    std::int64_t off = 0;
    int d = 0;
    for (auto i : index) {
      TG_CHECK(i >= 0 && i < sizes_[d], "Tensor::at: index ", i, " out of range for dim ", d, " of shape ", sizes_);
      off += i * strides_[d++];
    }
    return off;
  }

  std::shared_ptr<Storage> storage_;
  std::int64_t offset_ = 0;
  Shape sizes_;
  Shape strides_;
  std::shared_ptr<autodiff::AutogradMeta<T, D>> meta_;
};

namespace detail {
template <Element S, Element T, Device D>
void copy_tensor(const Tensor<S, D>& src, const Tensor<T, D>& dst) {
  TG_CHECK(src.shape() == dst.shape(), "copy: shapes differ: src is ", src.shape(), ", dst is ", dst.shape());
  TG_BACKEND(D, copy_strided<S, T>(src.data(), src.strides(), dst.data(), dst.strides(), src.shape()));
}
}  // namespace detail

/// Prints dtype, device, shape and (up to 6 per dimension) values.
template <Element T, Device D>
std::ostream& operator<<(std::ostream& os, const Tensor<T, D>& t);

}  // namespace tg

// Shape: a small fixed-capacity vector of dimension sizes (also used for strides).
//   tg::Shape s{4, 64, 768};  s.numel() == 196608;  to_string(s) == "[4,64,768]"
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <ostream>
#include <span>
#include <string>

#include "typegrad/core/error.hpp"

namespace tg {

inline constexpr int kMaxDims = 8;

class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) : Shape(std::span<const std::int64_t>(dims.begin(), dims.size())) {}
  explicit Shape(std::span<const std::int64_t> dims) {
    TG_CHECK(dims.size() <= kMaxDims, "Shape: at most ", kMaxDims, " dimensions are supported, got ", dims.size());
    n_ = static_cast<int>(dims.size());
    std::copy(dims.begin(), dims.end(), d_.begin());
  }
  static Shape filled(int rank, std::int64_t value) {
    Shape s;
    s.n_ = rank;
    std::fill_n(s.d_.begin(), rank, value);
    return s;
  }

  int size() const { return n_; }
  bool empty() const { return n_ == 0; }
  std::int64_t operator[](int i) const { return d_[i]; }
  std::int64_t& operator[](int i) { return d_[i]; }
  const std::int64_t* begin() const { return d_.data(); }
  const std::int64_t* end() const { return d_.data() + n_; }
  std::int64_t* begin() { return d_.data(); }
  std::int64_t* end() { return d_.data() + n_; }
  std::int64_t back() const { return d_[n_ - 1]; }

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < n_; ++i) n *= d_[i];
    return n;
  }
  void push_back(std::int64_t v) {
    TG_CHECK(n_ < kMaxDims, "Shape: at most ", kMaxDims, " dimensions are supported");
    d_[n_++] = v;
  }
  void insert(int pos, std::int64_t v) {
    TG_CHECK(n_ < kMaxDims, "Shape: at most ", kMaxDims, " dimensions are supported");
    for (int i = n_; i > pos; --i) d_[i] = d_[i - 1];
    d_[pos] = v;
    ++n_;
  }
  void erase(int pos) {
    for (int i = pos; i + 1 < n_; ++i) d_[i] = d_[i + 1];
    --n_;
  }
  friend bool operator==(const Shape& a, const Shape& b) {
    return a.n_ == b.n_ && std::equal(a.begin(), a.end(), b.begin());
  }

 private:
  std::array<std::int64_t, kMaxDims> d_{};
  int n_ = 0;
};

inline std::string to_string(const Shape& s) {
  std::string out = "[";
  for (int i = 0; i < s.size(); ++i) {
    if (i) out += ',';
    out += std::to_string(s[i]);
  }
  return out + "]";
}
inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << to_string(s); }

/// Row-major (C-contiguous) strides for a shape, in elements.
inline Shape contiguous_strides(const Shape& s) {
  Shape st = Shape::filled(s.size(), 1);
  for (int i = s.size() - 2; i >= 0; --i) st[i] = st[i + 1] * std::max<std::int64_t>(s[i + 1], 1);
  return st;
}

/// Wraps a possibly negative dimension index into [0, rank); `op` names the caller in the error.
inline int wrap_dim(std::int64_t dim, int rank, const char* op) {
  const std::int64_t r = rank == 0 ? 1 : rank;
  TG_CHECK(dim >= -r && dim < r, op, ": dim ", dim, " is out of range for a tensor of rank ", rank);
  return static_cast<int>(dim < 0 ? dim + r : dim);
}

/// Broadcast shape of a and b (numpy rules), or an error naming `op` and both shapes.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const int n = std::max(a.size(), b.size());
  Shape out = Shape::filled(n, 1);
  for (int i = 0; i < n; ++i) {
    const int ia = a.size() - n + i, ib = b.size() - n + i;
    const std::int64_t da = ia >= 0 ? a[ia] : 1, db = ib >= 0 ? b[ib] : 1;
    TG_CHECK(da == db || da == 1 || db == 1, op, ": shapes cannot be broadcast: a is ", a, ", b is ", b);
    out[i] = da == 1 ? db : da;
  }
  return out;
}

}  // namespace tg

// Printing: dtype, device, shape, then the values (at most 6 per dimension, with "..." for the rest).
//   std::cout << tg::Tensor<tg::fp32>::arange(3);   // Tensor<fp32, cpu> [3]\n[0, 1, 2]
#pragma once

#include <iomanip>
#include <ostream>
#include <type_traits>

#include "typegrad/core/tensor.hpp"

namespace tg {

namespace detail {
template <Element T>
void print_rec(std::ostream& os, const T* p, const Shape& sz, const Shape& st, int d) {
  constexpr std::int64_t kShow = 6;
  if (sz.size() == 0) {
    os << static_cast<double>(scalar_cast<double>(p[0]));
    return;
  }
  os << '[';
  const std::int64_t n = sz[d];
  for (std::int64_t i = 0; i < n; ++i) {
    if (n > kShow && i == kShow / 2) {
      os << "..., ";
      i = n - kShow / 2;
    }
    if (d + 1 == sz.size()) os << scalar_cast<double>(p[i * st[d]]);
    else print_rec(os, p + i * st[d], sz, st, d + 1);
    if (i + 1 < n) os << ", ";
  }
  os << ']';
}
}  // namespace detail

template <Element T, Device D>
std::ostream& operator<<(std::ostream& os, const Tensor<T, D>& t) {
  os << "Tensor<" << dtype_traits<T>::name << ", " << device_traits<D>::name << "> " << t.shape();
  if (!t.defined()) return os << " (undefined)";
  os << '\n';
  const auto flags = os.flags();
  os << std::setprecision(6);
  if constexpr (!std::is_same_v<D, cpu>) {  // a device tensor's values are printed from a host copy
    const Tensor<T, cpu> host = t.detach().template to<cpu>();
    detail::print_rec(os, host.data(), host.shape(), host.strides(), 0);
  } else {
    detail::print_rec(os, t.data(), t.shape(), t.strides(), 0);
  }
  os.flags(flags);
  return os;
}

}  // namespace tg

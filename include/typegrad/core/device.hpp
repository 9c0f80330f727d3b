// Device tags. A tensor's device is part of its type: Tensor<fp32, cpu> and Tensor<fp32, cuda> differ.
//   tg::Tensor<tg::fp32, tg::cpu> t;  static_assert(tg::device_traits<tg::cpu>::name == "cpu");
#pragma once

#include <string_view>
#include <type_traits>

namespace tg {

struct cpu {};
struct cuda {};

enum class DeviceKind : unsigned char { cpu, cuda };

template <class D>
struct device_traits;
template <>
struct device_traits<cpu> {
  static constexpr DeviceKind kind = DeviceKind::cpu;
  static constexpr std::string_view name = "cpu";
};
template <>
struct device_traits<cuda> {
  static constexpr DeviceKind kind = DeviceKind::cuda;
  static constexpr std::string_view name = "cuda";
};

template <class D>
concept Device = requires { device_traits<D>::kind; };

}  // namespace tg

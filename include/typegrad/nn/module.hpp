// Parameters and the module conventions: every module names its parameters GPT-2 style and can list them.
//   std::vector<tg::nn::NamedParameter> ps;  model.collect_parameters("", ps);   // "h.3.attn.c_attn.weight", ...
//   tg::nn::count_parameters(ps);  // 124,475,904 for the gpt2 preset (tied LM head counted once)
#pragma once

#include <string>
#include <type_traits>
#include <vector>

#include "typegrad/core/tensor.hpp"
#include "typegrad/ops/padded_rows.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/param.hpp"

namespace tg::nn {

/// A trainable fp32 master tensor and its hierarchical name (the optimizers' Param: one type for the
/// model, the optimizer, checkpoints and sharding). Copies share the tensor and its gradient.
using NamedParameter = optim::Param;
/// The same on device D (a model built with BasicGPT<D>).
template <Device D>
using DeviceParameter = optim::BasicParam<D>;

inline std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

template <Device D>
std::int64_t count_parameters(const std::vector<optim::BasicParam<D>>& ps) {
  std::int64_t n = 0;
  for (const auto& p : ps) n += p.tensor.numel();
  return n;
}

/// `src`'s values as a new leaf on device D that requires grad (undefined stays undefined). Parameters are
/// drawn on the host and copied, so a seed gives the same weights on every device.
template <Device D, Device S>
Tensor<fp32, D> parameter_on(const Tensor<fp32, S>& src) {
  if (!src.defined()) return Tensor<fp32, D>();
  Tensor<fp32, D> t;
  if constexpr (std::is_same_v<D, S>) t = src.detach().clone();
  else t = src.detach().template to<D>().detach();
  t.requires_grad_();
  return t;
}

/// A trainable (rows, cols) copy of `src` on D whose storage holds `stored_rows` rows, the ones past `rows` zero
/// (Note [padded vocabulary]): the parameter is the leading rows' view (contiguous); `stored_rows` <= rows: no
/// padding (parameter_on).
template <Device D, Device S>
Tensor<fp32, D> padded_parameter(const Tensor<fp32, S>& src, std::int64_t stored_rows) {
  if (!src.defined() || stored_rows <= src.size(0)) return parameter_on<D>(src);
  TG_CHECK(src.dim() == 2, "padded_parameter: a matrix is padded by rows, got ", src.shape());
  Tensor<fp32, D> full = Tensor<fp32, D>::zeros({stored_rows, src.size(1)});
  tg::detail::copy_tensor(src.detach().template to<D>().detach(), full.narrow(0, 0, src.size(0)).detach());
  Tensor<fp32, D> t = full.narrow(0, 0, src.size(0)).detach();
  t.requires_grad_();
  return t;
}
using tg::stored_rows;  // ops/padded_rows.hpp

/// A leaf fp32 parameter drawn from N(0, std) with the given generator.
template <Device D = cpu>
Tensor<fp32, D> normal_parameter(const Shape& shape, float stddev, Generator& gen) {
  Tensor<fp32> t = Tensor<fp32>::normal(shape, 0.f, stddev, gen);
  if constexpr (!std::is_same_v<D, cpu>) {
    return parameter_on<D>(t);
  } else {
    t.requires_grad_();
    return t;
  }
}
template <Device D = cpu>
Tensor<fp32, D> constant_parameter(const Shape& shape, double value) {
  Tensor<fp32> t = Tensor<fp32>::full(shape, value);
  if constexpr (!std::is_same_v<D, cpu>) {
    return parameter_on<D>(t);
  } else {
    t.requires_grad_();
    return t;
  }
}

/// Copies the values of `from` into `to` in place (same names and shapes, in order; any devices): how a
/// device model's weights reach the host model for a checkpoint, and back after a resume.
template <Device S, Device D>
void copy_parameter_values(const std::vector<optim::BasicParam<S>>& from, const std::vector<optim::BasicParam<D>>& to) {
  TG_CHECK(from.size() == to.size(), "copy_parameter_values: ", from.size(), " source parameters, ", to.size(),
           " destination parameters");
  for (std::size_t i = 0; i < from.size(); ++i) {
    const auto& s = from[i];
    const auto& d = to[i];
    TG_CHECK(s.name == d.name && s.tensor.shape() == d.tensor.shape(), "copy_parameter_values: parameter ", i, " is '",
             s.name, "' ", s.tensor.shape(), " in the source and '", d.name, "' ", d.tensor.shape(), " in the destination");
    TG_CHECK(d.tensor.is_contiguous(), "copy_parameter_values: '", d.name, "' must be contiguous");
    const Tensor<fp32, D> v = s.tensor.detach().template to<D>();
    if (v.numel() > 0) tg::detail::copy_tensor(v, d.tensor);
  }
}

}  // namespace tg::nn

// Parameters and the module conventions: every module names its parameters GPT-2 style and can list them.
//   std::vector<tg::nn::NamedParameter> ps;  model.collect_parameters("", ps);   // "h.3.attn.c_attn.weight", ...
//   tg::nn::count_parameters(ps);  // 124,475,904 for the gpt2 preset (tied LM head counted once)
#pragma once

#include <string>
#include <vector>

#include "typegrad/core/tensor.hpp"
#include "typegrad/optim/param.hpp"

namespace tg::nn {

/// A trainable fp32 master tensor and its hierarchical name (the optimizers' Param: one type for the
/// model, the optimizer, checkpoints and sharding). Copies share the tensor and its gradient.
using NamedParameter = optim::Param;

inline std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

inline std::int64_t count_parameters(const std::vector<NamedParameter>& ps) {
  std::int64_t n = 0;
  for (const auto& p : ps) n += p.tensor.numel();
  return n;
}

/// A leaf fp32 parameter drawn from N(0, std) with the given generator.
inline Tensor<fp32> normal_parameter(const Shape& shape, float stddev, Generator& gen) {
  Tensor<fp32> t = Tensor<fp32>::normal(shape, 0.f, stddev, gen);
  t.requires_grad_();
  return t;
}
inline Tensor<fp32> constant_parameter(const Shape& shape, double value) {
  Tensor<fp32> t = Tensor<fp32>::full(shape, value);
  t.requires_grad_();
  return t;
}

}  // namespace tg::nn

// Named trainable parameters (fp32 master weights) and parameter groups for the optimizers.
//   std::vector<tg::optim::Param> ps{tg::optim::Param("h.0.mlp.c_fc.weight", w), tg::optim::Param("h.0.mlp.c_fc.bias", b)};
//   auto groups = tg::optim::default_groups(ps, /*weight_decay=*/0.1f);   // {decay: [weight], no_decay: [bias]}
//   auto gpu_groups = tg::optim::default_groups(gpu_model.named_parameters(), 0.1f);  // the same on the GPU
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/tensor.hpp"

namespace tg::optim {

/// A parameter: its GPT-2 style name ("h.3.attn.c_attn.weight") and an fp32 leaf on device D that requires
/// grad. The tensor is shared with the model (same storage and autograd meta): the optimizer updates it in
/// place. `Param` is the CPU form; BasicParam<cuda> is a model's parameter on the GPU (BasicOptimizer<cuda>'s).
template <Device D>
struct BasicParam {
  std::string name;
  Tensor<fp32, D> tensor;

  BasicParam() = default;
  /// Marks `t` as requiring grad; it must be a contiguous leaf.
  BasicParam(std::string n, Tensor<fp32, D> t) : name(std::move(n)), tensor(std::move(t)) {
    TG_CHECK(!name.empty(), "optim::Param: a parameter needs a name");
    TG_CHECK(tensor.defined(), "optim::Param: '", name, "' has no tensor");
    TG_CHECK(tensor.is_contiguous(), "optim::Param: '", name, "' must be contiguous, its shape is ", tensor.shape(),
             " with strides ", tensor.strides());
    tensor.requires_grad_(true);
  }
};
using Param = BasicParam<cpu>;

/// Parameters on device D sharing hyperparameters. `lr_scale` multiplies the optimizer's lr (set_lr sets every
/// group's lr to lr·lr_scale); `weight_decay` overrides the optimizer's default when set.
template <Device D>
struct BasicParamGroup {
  std::vector<BasicParam<D>> params;
  float lr_scale = 1.f;
  std::optional<float> weight_decay;
};
using ParamGroup = BasicParamGroup<cpu>;

namespace detail {
inline std::vector<std::string_view> split_dots(std::string_view s) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == '.') {
      parts.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  return parts;
}
}  // namespace detail

// Note [which parameters decay]
// Weight decay shrinks weight matrices only (GPT-2 / nanoGPT practice; Loshchilov & Hutter 2019 decay
// "weights"). A parameter goes to the no-decay group when any of these holds:
//   * its name's last dot-separated component is "bias"             (h.0.attn.c_attn.bias)
//   * a component starts with "ln"                                  (h.0.ln_1.weight, ln_f.bias: LayerNorm)
//   * a component is "wte" or "wpe"                                 (token / position embeddings)
//   * the tensor has fewer than 2 dimensions                        (any other gain or scalar)
// Every other (>= 2-D) parameter decays. Components are matched whole, so "kiln.weight" is not LayerNorm.
template <Device D>
bool is_no_decay(const BasicParam<D>& p) {
  const auto parts = detail::split_dots(p.name);
  if (!parts.empty() && parts.back() == "bias") return true;
  for (auto c : parts)
    if (c.starts_with("ln") || c == "wte" || c == "wpe") return true;
  return p.tensor.dim() < 2;
}

/// {decay group (weight_decay), no-decay group (0)} by Note [which parameters decay], on any device; empty
/// groups are kept so the indices are fixed: groups[0] decays, groups[1] does not.
template <Device D>
std::vector<BasicParamGroup<D>> default_groups(const std::vector<BasicParam<D>>& params, float weight_decay) {
  BasicParamGroup<D> decay{{}, 1.f, weight_decay}, no_decay{{}, 1.f, 0.f};
  for (const BasicParam<D>& p : params) (is_no_decay(p) ? no_decay : decay).params.push_back(p);
  return {std::move(decay), std::move(no_decay)};
}
/// The CPU form, for a braced list of parameters.
inline std::vector<ParamGroup> default_groups(const std::vector<Param>& params, float weight_decay) {
  return default_groups<cpu>(params, weight_decay);
}

}  // namespace tg::optim

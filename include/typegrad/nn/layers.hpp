// The basic layers: Linear, Embedding, LayerNorm (BasicLinear<D>, ... on device D; the plain names are the
// CPU forms). Parameters are fp32 masters; forward<T> computes in T,
// reading each weight through amp::param_as<T> (the per-step T copy an amp::WeightCopies<T> attached to the
// parameter, else a to<T>() copy, which is the identity for fp32; Note [master weights and per-step copies]).
//   tg::nn::Linear fc(768, 3072, gen);  auto y = fc.forward(x);        // x (B,T,768) -> (B,T,3072)
//   tg::nn::LayerNorm ln(768);          auto h = ln.forward(x);
#pragma once

#include "typegrad/amp/weights.hpp"
#include "typegrad/nn/module.hpp"
#include "typegrad/ops/add_layernorm.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/matmul.hpp"

namespace tg::nn {

/// y = x·Wᵀ + b with W [out, in] (PyTorch nn.Linear layout), b [out].
template <Device D = cpu>
class BasicLinear {
 public:
  BasicLinear() = default;
  BasicLinear(std::int64_t in, std::int64_t out, Generator& gen, float init_std = 0.02f, bool bias = true)
      : weight_(normal_parameter<D>({out, in}, init_std, gen)), has_bias_(bias) {
    if (bias) bias_ = constant_parameter<D>({out}, 0.0);
  }
  /// A copy of `other`'s parameters on device D.
  template <Device S>
  explicit BasicLinear(const BasicLinear<S>& other)
      : weight_(parameter_on<D>(other.weight())), bias_(parameter_on<D>(other.bias())), has_bias_(other.has_bias()) {}
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<T, D>& x) const {
    if (has_bias_) return linear(x, amp::param_as<T>(weight_), amp::param_as<T>(bias_));
    return linear(x, amp::param_as<T>(weight_));
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    out.push_back({join_name(prefix, "weight"), weight_});
    if (has_bias_) out.push_back({join_name(prefix, "bias"), bias_});
  }
  const Tensor<fp32, D>& weight() const { return weight_; }
  const Tensor<fp32, D>& bias() const { return bias_; }
  bool has_bias() const { return has_bias_; }

 private:
  Tensor<fp32, D> weight_, bias_;
  bool has_bias_ = true;
};
using Linear = BasicLinear<cpu>;

/// Token lookup: weight [num, dim]; forward(idx [...]) -> [..., dim].
/// The indices stay on the host on every device (Note [CUDA entry points]).
template <Device D = cpu>
class BasicEmbedding {
 public:
  BasicEmbedding() = default;
  /// `stored_rows` > num: the rows are stored padded with zero rows to that many (Note [padded vocabulary]); the
  /// parameter is the num x dim view, drawn as without padding.
  BasicEmbedding(std::int64_t num, std::int64_t dim, Generator& gen, float init_std = 0.02f, std::int64_t stored_rows = 0)
      : weight_(padded_parameter<D>(Tensor<fp32>::normal({num, dim}, 0.f, init_std, gen), stored_rows)) {}
  template <Device S>
  explicit BasicEmbedding(const BasicEmbedding<S>& other) : weight_(padded_parameter<D>(other.weight(), nn::stored_rows(other.weight()))) {}
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<std::int64_t>& idx) const {
    return embedding(amp::param_as<T>(weight_), idx);
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    out.push_back({join_name(prefix, "weight"), weight_});
  }
  const Tensor<fp32, D>& weight() const { return weight_; }

 private:
  Tensor<fp32, D> weight_;
};
using Embedding = BasicEmbedding<cpu>;

/// LayerNorm over the last dim with affine weight (ones) and bias (zeros).
template <Device D = cpu>
class BasicLayerNorm {
 public:
  BasicLayerNorm() = default;
  explicit BasicLayerNorm(std::int64_t dim, float eps = 1e-5f)
      : weight_(constant_parameter<D>({dim}, 1.0)), bias_(constant_parameter<D>({dim}, 0.0)), eps_(eps) {}
  template <Device S>
  explicit BasicLayerNorm(const BasicLayerNorm<S>& other)
      : weight_(parameter_on<D>(other.weight())), bias_(parameter_on<D>(other.bias())), eps_(other.eps()) {}
  template <FloatingElement T>
  Tensor<T, D> forward(const Tensor<T, D>& x) const {
    return layernorm(x, amp::param_as<T>(weight_), amp::param_as<T>(bias_), eps_);
  }
  /// x + branch and this LayerNorm of it, in one pass (Note [fused residual add and LayerNorm]).
  template <FloatingElement T>
  AddLayerNorm<T, D> forward_add(const Tensor<T, D>& x, const Tensor<T, D>& branch) const {
    return add_layernorm(x, branch, amp::param_as<T>(weight_), amp::param_as<T>(bias_), eps_);
  }
  void collect_parameters(const std::string& prefix, std::vector<DeviceParameter<D>>& out) const {
    out.push_back({join_name(prefix, "weight"), weight_});
    out.push_back({join_name(prefix, "bias"), bias_});
  }
  const Tensor<fp32, D>& weight() const { return weight_; }
  const Tensor<fp32, D>& bias() const { return bias_; }
  float eps() const { return eps_; }

 private:
  Tensor<fp32, D> weight_, bias_;
  float eps_ = 1e-5f;
};
using LayerNorm = BasicLayerNorm<cpu>;

}  // namespace tg::nn

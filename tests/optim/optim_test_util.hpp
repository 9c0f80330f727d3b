// Helpers shared by the optimizer tests: parameters from values, setting gradients, relative errors.
//   auto p = make_param("h.0.mlp.c_fc.weight", {3, 4}, 7);   set_grad(p, g);
//   double e = rel_err_inf(ours, ref);                        // max|a − b| / max|b|
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace tg::optim::testing {

/// A parameter with deterministic N(0, 1) values drawn from `seed`.
inline Param make_param(const std::string& name, const Shape& shape, std::uint64_t seed) {
  Generator gen(seed);
  return Param(name, Tensor<fp32>::normal(shape, 0.f, 1.f, gen));
}
inline Tensor<fp32> random_like(const Param& p, std::uint64_t seed, float scale = 1.f) {
  Generator gen(seed);
  return Tensor<fp32>::normal(p.tensor.shape(), 0.f, scale, gen);
}
/// Replaces p's gradient with g (a leaf's backward(upstream) accumulates upstream into grad()).
inline void set_grad(const Param& p, const Tensor<fp32>& g) {
  p.tensor.zero_grad();
  p.tensor.backward(g);
}
inline std::vector<double> as_doubles(const Tensor<fp32>& t) {
  const auto v = t.to_vector();
  return std::vector<double>(v.begin(), v.end());
}
/// The metric of every optimizer comparison: max_i |a_i − b_i| / max_i |b_i| (∞-norm relative error of a
/// whole tensor; an element-wise ratio would blow up on entries that pass near zero).
inline double rel_err_inf(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  if (std::isnan(num)) return num;
  return den == 0 ? num : num / den;
}
inline double rel_err_inf(const Tensor<fp32>& a, const std::vector<double>& b) { return rel_err_inf(as_doubles(a), b); }
inline double rel_err_inf(const Tensor<fp32>& a, const Tensor<fp32>& b) { return rel_err_inf(as_doubles(a), as_doubles(b)); }

/// One group per parameter, each with its Note [which parameters decay] weight decay: every update is its
/// own multi-tensor run where default_groups puts several in one.
inline std::vector<ParamGroup> group_per_param(const std::vector<Param>& ps, float wd) {
  std::vector<ParamGroup> out;
  for (const auto& p : ps) out.push_back({{p}, 1.f, is_no_decay(p) ? 0.f : wd});
  return out;
}
/// An optimizer's state_tensors() by entry name, as values (for comparing two optimizers' state).
inline std::map<std::string, std::vector<float>> by_name(const std::vector<NamedTensor>& state) {
  std::map<std::string, std::vector<float>> out;
  for (const auto& e : state) out[e.name] = e.tensor.to_vector();
  return out;
}

}  // namespace tg::optim::testing

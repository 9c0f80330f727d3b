// A pointwise chain as data: the unary and binary elementwise ops that a compiled step's fusion rewrite
// (Note [fusion rewrites]) found in a row, over at most kMaxInputs tensors and a few constants, evaluated by
// tg::pointwise_chain in one pass. Plain data (no tensors), shared by the op, the CPU kernels and the rewrite.
//   pw::ChainProgram p;  p.inputs = 1;  p.constants = {0.5};
//   p.steps = {{math::Unary::tanh, 0}, {math::Binary::mul, 2, 1}};   // slot 2 = tanh(x0); slot 3 = slot 2 * 0.5
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/detail/math.hpp"

namespace tg::pw {

/// One op of a chain: slot[out] = u(slot[a]) or b(slot[a], slot[c]).
struct ChainStep {
  bool binary = false;
  math::Unary u = math::Unary::exp;
  math::Binary b = math::Binary::add;
  int a = 0, c = 0;
  ChainStep() = default;
  ChainStep(math::Unary op, int x) : u(op), a(x) {}
  ChainStep(math::Binary op, int x, int y) : binary(true), b(op), a(x), c(y) {}
  bool operator==(const ChainStep&) const = default;
  /// Its fields, for the launch watch (Note [launch watch]).
  auto watch_fields() const { return std::tie(binary, u, b, a, c); }
};

inline const char* chain_op_name(const ChainStep& s) {
  if (s.binary) {
    switch (s.b) {
      case math::Binary::add: return "add";
      case math::Binary::sub: return "sub";
      case math::Binary::mul: return "mul";
      case math::Binary::div: return "div";
    }
  }
  switch (s.u) {
    case math::Unary::exp: return "exp";
    case math::Unary::log: return "log";
    case math::Unary::sqrt: return "sqrt";
    case math::Unary::rsqrt: return "rsqrt";
    case math::Unary::tanh: return "tanh";
    case math::Unary::sigmoid: return "sigmoid";
    case math::Unary::relu: return "relu";
    case math::Unary::gelu_tanh: return "gelu_tanh";
    case math::Unary::gelu_erf: return "gelu";
    case math::Unary::silu: return "silu";
  }
  return "?";
}

/// Slots: [0, inputs) the input tensors, then one per constant, then one per step; the last step's slot is
/// the result. A step reads only slots before its own.
struct ChainProgram {
  static constexpr int kMaxInputs = 6;
  static constexpr int kMaxConstants = 8;
  static constexpr int kMaxSteps = 16;
  int inputs = 0;
  std::vector<double> constants;
  std::vector<ChainStep> steps;

  int first_step_slot() const { return inputs + static_cast<int>(constants.size()); }
  int slots() const { return first_step_slot() + static_cast<int>(steps.size()); }

  /// Throws tg::Error naming what is wrong (an operand out of range, too many inputs, no step).
  void validate(const char* who) const {
    TG_CHECK(inputs >= 1 && inputs <= kMaxInputs, who, ": a chain reads 1 to ", kMaxInputs, " input tensors, this one ", inputs);
    TG_CHECK(static_cast<int>(constants.size()) <= kMaxConstants, who, ": a chain has at most ", kMaxConstants, " constants, this one ",
             constants.size());
    TG_CHECK(!steps.empty() && static_cast<int>(steps.size()) <= kMaxSteps, who, ": a chain has 1 to ", kMaxSteps, " steps, this one ",
             steps.size());
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const int own = first_step_slot() + static_cast<int>(i);
      const ChainStep& s = steps[i];
      TG_CHECK(s.a >= 0 && s.a < own && (!s.binary || (s.c >= 0 && s.c < own)), who, ": step ", i, " (", chain_op_name(s),
               ") reads a slot that is not before its own (", own, ")");
    }
  }

  /// "t0 = tanh(x0); t1 = mul(t0, 0.5)": for messages and tests.
  std::string describe() const {
    auto slot = [&](int k) {
      if (k < inputs) return "x" + std::to_string(k);
      if (k < first_step_slot()) return std::to_string(constants[static_cast<std::size_t>(k - inputs)]);
      return "t" + std::to_string(k - first_step_slot());
    };
    std::string s;
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (i) s += "; ";
      s += "t" + std::to_string(i) + " = " + chain_op_name(steps[i]) + "(" + slot(steps[i].a);
      if (steps[i].binary) s += ", " + slot(steps[i].c);
      s += ")";
    }
    return s;
  }
};

}  // namespace tg::pw

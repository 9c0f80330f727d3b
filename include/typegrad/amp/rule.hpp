// The autocast rule families and the per-op rule trait, light enough for kernel files (Note [an op declares
// its autocast rule]). autocast.hpp turns a rule and a precision policy into storage and math types.
//   TG_AUTOCAST_RULE(rope, fp32_math)                        // in ops/rope.hpp, next to the op
//   using A = tg::amp::kernel_math_t<tg::amp::op::rope, T>;  // the register type its kernels compute in
#pragma once

#include <type_traits>

#include "typegrad/core/dtype.hpp"

namespace tg::amp {

/// The rule families.
enum class Rule {
  gemm,         // storage: compute type; math: accumulation type (fp32)
  fp32_math,    // storage: compute type (loss: accumulation type); math: fp32 whatever the storage
  elementwise,  // storage: the promotion of the operands' types; math: fp32 registers for 16-bit storage
  master,       // storage and math: the master (param) type
};

/// rule_of<op::X>::value: the rule of op tag X. The table of the original ops is below; an op added since
/// declares its tag and rule in its own header with TG_AUTOCAST_RULE.
template <class Op>
struct rule_of;

/// Op tags: the ops the rules name (one per op family of ops/; later ops declare theirs with TG_AUTOCAST_RULE).
namespace op {
struct matmul {};
struct linear {};
struct linear_gelu {};  // linear_gelu_tanh: the GEMM with its GELU epilogue (the GELU runs on the fp32 sum)
struct attention {};  // the QKᵀ and PV products; its softmax follows op::softmax
struct embedding {};
struct softmax {};
struct log_softmax {};
struct layernorm {};
struct rmsnorm {};
struct exp {};
struct log {};
struct reduce {};        // sum, mean, max over a dim
struct cross_entropy {};
struct optimizer {};     // the update math and its state
struct add {};
struct sub {};
struct mul {};
struct div {};
struct gelu {};
struct dropout {};
}  // namespace op

// The original ops' rules (ops added since declare theirs in their own header with TG_AUTOCAST_RULE).
template <> struct rule_of<op::matmul> { static constexpr Rule value = Rule::gemm; };
template <> struct rule_of<op::linear> { static constexpr Rule value = Rule::gemm; };
template <> struct rule_of<op::linear_gelu> { static constexpr Rule value = Rule::gemm; };
template <> struct rule_of<op::attention> { static constexpr Rule value = Rule::gemm; };
template <> struct rule_of<op::embedding> { static constexpr Rule value = Rule::gemm; };  // a gather of the GEMM-typed copy
template <> struct rule_of<op::softmax> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::log_softmax> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::layernorm> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::rmsnorm> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::exp> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::log> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::reduce> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::cross_entropy> { static constexpr Rule value = Rule::fp32_math; };
template <> struct rule_of<op::optimizer> { static constexpr Rule value = Rule::master; };
template <> struct rule_of<op::add> { static constexpr Rule value = Rule::elementwise; };
template <> struct rule_of<op::sub> { static constexpr Rule value = Rule::elementwise; };
template <> struct rule_of<op::mul> { static constexpr Rule value = Rule::elementwise; };
template <> struct rule_of<op::div> { static constexpr Rule value = Rule::elementwise; };
template <> struct rule_of<op::gelu> { static constexpr Rule value = Rule::elementwise; };
template <> struct rule_of<op::dropout> { static constexpr Rule value = Rule::elementwise; };

/// The type an op's kernels compute in for storage type T under its rule: the master type itself for
/// `master` ops, otherwise accum_t<T> (fp32 registers for 16-bit storage, fp64 for fp64). The static_assert
/// in autocast<Op, P> ties this to the policy's accumulation type.
template <class Op, class T>
using kernel_math_t = std::conditional_t<rule_of<Op>::value == Rule::master, T, accum_t<T>>;

// Note [an op declares its autocast rule]
// Each op added through the one-op path (docs/adding-an-op.md) names its rule family in its own header,
//   TG_AUTOCAST_RULE(rope, fp32_math)
// which declares the tag tg::amp::op::rope and specializes rule_of for it, so amp::autocast<op::rope, P>,
// storage_t and math_t work for it with no line in autocast.hpp. The rule is consulted for real: the op's
// kernels take their register type from kernel_math_t<op::rope, T>, and the op's database entry checks
// the rule it documents. The line sits in the op header's kernel section (Note [kernels declared once]),
// so both backends' kernel files see it.
#define TG_AUTOCAST_RULE(OP, RULE)                                   \
  namespace tg::amp {                                                \
  namespace op {                                                     \
  struct OP {};                                                      \
  }                                                                  \
  template <>                                                        \
  struct rule_of<op::OP> {                                           \
    static constexpr Rule value = Rule::RULE;                        \
  };                                                                 \
  }

}  // namespace tg::amp

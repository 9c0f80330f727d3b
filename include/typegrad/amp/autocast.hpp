// Autocast rules: one trait over (op, policy) gives each op's storage type (its tensors in memory) and
// math type (registers and accumulators). The table and its reasons are in docs/mixed-precision.md.
//   using T = tg::amp::storage_t<tg::amp::op::linear, tg::amp::bf16_mixed>;        // bf16
//   using L = tg::amp::storage_t<tg::amp::op::cross_entropy, tg::amp::bf16_mixed>; // fp32 (the loss)
#pragma once

#include <type_traits>

#include "typegrad/amp/precision.hpp"
#include "typegrad/amp/rule.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/ops/views.hpp"

namespace tg::amp {

// The op tags, the rule families and each op's rule (rule_of) are in amp/rule.hpp, light enough for the
// kernel files, which take their register type from it (kernel_math_t).

/// Promotion for elementwise ops with operands of types A and B: the wider type when one holds every
/// value of the other (fp16 ⊂ fp32, bf16 ⊂ fp32, fp32 ⊂ fp64), fp32 for bf16 with fp16 (neither holds the
/// other: bf16 has the range, fp16 the precision). Ops never promote implicitly (mixing types does not
/// compile, Note [mixing precisions or devices]); callers convert with .to<promote_t<A, B>>().
template <FloatingElement A, FloatingElement B>
struct promote {
  using type = std::conditional_t<
      std::is_same_v<A, B>, A,
      std::conditional_t<std::is_same_v<A, fp64> || std::is_same_v<B, fp64>, fp64, fp32>>;
};
template <FloatingElement A, FloatingElement B>
using promote_t = typename promote<A, B>::type;

// Note [autocast rules]
// autocast<Op, P> has storage_type (the element type of the op's tensors) and math_type (the type its
// arithmetic runs in). Ops are templates over one storage type T and their kernels compute in
// kernel_math_t<Op, T> (amp/rule.hpp: accum_t<T>, fp32 for 16-bit storage, except for `master` ops): the
// nn row kernels (backends/cpu/nn.cpp), rope and swiglu name their op's rule there, the GEMMs use
// accum_t<T> (Note [GEMM conventions]), so "fp32 math"
// for softmax, norms, exp/log, reductions and the loss holds for every storage type: the kernels read
// 16-bit, compute in fp32 registers and round once on store. The loss is the one fp32_math op whose
// output is stored in fp32 (cross_entropy_as<fp32>), so loss scaling and logging see it unrounded.
// static_asserts below tie the table to the kernels: a kernel whose accumulation type drifted from the
// table's math type would fail to compile here.
template <class Op, PrecisionPolicy P>
struct autocast {
  static constexpr Rule rule = rule_of<Op>::value;
  using storage_type = std::conditional_t<
      rule == Rule::master, typename P::param_type,
      std::conditional_t<std::is_same_v<Op, op::cross_entropy>, typename P::accum_type, typename P::compute_type>>;
  using math_type = std::conditional_t<rule == Rule::master, typename P::param_type, typename P::accum_type>;
  /// The type of the op's input when it differs from its output (the loss reads compute-typed logits).
  using input_type = std::conditional_t<rule == Rule::master, typename P::grad_type, typename P::compute_type>;
  static_assert(rule == Rule::master || std::is_same_v<accum_t<input_type>, math_type> ||
                    std::is_same_v<math_type, fp64>,
                "tg::amp::autocast: the CPU kernels accumulate 16-bit and fp32 storage in fp32; a policy whose Accum "
                "differs needs kernels that accumulate in it");
};

template <class Op, PrecisionPolicy P>
using storage_t = typename autocast<Op, P>::storage_type;
template <class Op, PrecisionPolicy P>
using math_t = typename autocast<Op, P>::math_type;
template <class Op, PrecisionPolicy P>
using input_t = typename autocast<Op, P>::input_type;

/// x converted to the storage type Op reads under P (the identity when it already has it; a
/// differentiable to<>() otherwise).
template <class Op, PrecisionPolicy P, FloatingElement T, Device D>
auto cast_for(const Tensor<T, D>& x) {
  return x.template to<input_t<Op, P>>();
}

}  // namespace tg::amp

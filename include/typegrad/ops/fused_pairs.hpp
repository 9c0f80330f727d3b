// What tg::compile's pair rewrite (Note [pair rewrites], compile/fusion.hpp) runs when a pair's consumer comes:
// add_layernorm for an add read by a layernorm, dropout_add for a dropout read by a residual add,
// linear_gelu_tanh for a linear read by gelu_tanh, scale_masked_softmax for a scale and a mask read by a softmax.
// The consumer ops call these through ops/fusion_hook.hpp.
#pragma once

#include <cstdint>

#include "typegrad/ops/add_layernorm.hpp"
#include "typegrad/ops/dropout_add.hpp"
#include "typegrad/ops/fusion_hook.hpp"
#include "typegrad/ops/linear_gelu.hpp"
#include "typegrad/ops/scale_masked_softmax.hpp"

// Declared here too: this header may be reached from inside one of the four above (through binary.hpp or
// unary.hpp, which include it last), before that header's definitions.
namespace tg {
template <FloatingElement T, Device D>
Tensor<T, D> linear_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& weight, const Tensor<T, D>& bias);
template <FloatingElement T, Device D>
Tensor<T, D> linear_gelu_tanh(const Tensor<T, D>& x, const Tensor<T, D>& weight);
namespace detail {
template <FloatingElement T, Device D>
Tensor<T, D> add_layernorm_into(const Tensor<T, D>& x, const Tensor<T, D>& branch, const Tensor<T, D>& weight,
                                const Tensor<T, D>& bias, double eps, Tensor<T, D>& h, bool record_add);
template <FloatingElement T, Device D>
Tensor<T, D> dropout_add_at(const Tensor<T, D>& x, const Tensor<T, D>& branch, double p, const DropoutDraw& at);
template <FloatingElement T, Device D>
Tensor<T, D> scale_masked_softmax_at(const Tensor<T, D>& x, const Tensor<T, D>* scale, bool divide,
                                     const Tensor<std::uint8_t, D>* mask, double fill);
}  // namespace detail
}  // namespace tg

namespace tg::detail {

template <FloatingElement T, Device D>
const Tensor<T, D>& pair_input(const fusion::PairState& s, std::size_t i) {
  TG_CHECK(i < s.inputs.size(), "tg::compile: fusion: the pair ", fusion::pair_kind_name(s.kind), " kept ", s.inputs.size(),
           " operands of its producer, not ", i + 1);
  return *static_cast<const Tensor<T, D>*>(s.inputs[i].get());
}

/// Calls the rewriter's done() when the fused op returns or throws (the pair's state goes either way).
class PairDone {
 public:
  explicit PairDone(fusion::Rewriter& r) : r_(r) {}
  ~PairDone() { r_.done(); }
  PairDone(const PairDone&) = delete;
  PairDone& operator=(const PairDone&) = delete;

 private:
  fusion::Rewriter& r_;
};

template <FloatingElement T, Device D>
Tensor<T, D> run_fused_pair(fusion::Rewriter& r, const Tensor<T, D>* other) {
  fusion::PairState& s = r.pair();
  const PairDone done(r);
  Tensor<T, D> out;
  {
    fusion::Suspend plain;  // the fused op's own ops run as written
    switch (s.kind) {
      case fusion::PairKind::dropout_add:
        TG_CHECK(other, "tg::compile: fusion: dropout_add needs the residual operand");
        out = dropout_add_at(*other, pair_input<T, D>(s, 0), s.p, DropoutDraw{s.seed, s.offset, s.base});
        break;
      case fusion::PairKind::linear_gelu_tanh:
        out = s.inputs.size() == 3 ? linear_gelu_tanh(pair_input<T, D>(s, 0), pair_input<T, D>(s, 1), pair_input<T, D>(s, 2))
                                   : linear_gelu_tanh(pair_input<T, D>(s, 0), pair_input<T, D>(s, 1));
        break;
      case fusion::PairKind::add_layernorm:
        throw Error("tg::compile: fusion: add_layernorm is run by its layernorm");
      case fusion::PairKind::scale_masked_softmax:
        throw Error("tg::compile: fusion: scale_masked_softmax is run by its softmax");
    }
  }
  return out;
}

template <FloatingElement T, Device D>
Tensor<T, D> run_fused_add_layernorm(fusion::Rewriter& r, const Tensor<T, D>& h, const Tensor<T, D>& weight,
                                     const Tensor<T, D>& bias, double eps) {
  fusion::PairState& s = r.pair();
  TG_CHECK(s.kind == fusion::PairKind::add_layernorm && s.filled && s.filled.get() == h.storage().get(),
           "tg::compile: fusion: a layernorm consumed a pair that is not its add's");
  const PairDone done(r);
  const std::shared_ptr<Storage> filled = s.filled;
  const std::shared_ptr<const std::string> why = filled->pending_message();
  filled->clear_pending();  // written now, by the kernel below
  Tensor<T, D> y;
  try {
    fusion::Suspend plain;
    Tensor<T, D> sum = h;  // the add recorded its node; the handle only gives the kernel h's memory
    y = add_layernorm_into(pair_input<T, D>(s, 0), pair_input<T, D>(s, 1), weight, bias, eps, sum, false);
  } catch (...) {
    filled->set_pending(why);  // not written: reading it stays an error
    throw;
  }
  return y;
}

template <FloatingElement T, Device D>
Tensor<T, D> run_fused_scale_masked_softmax(fusion::Rewriter& r) {
  fusion::PairState& s = r.pair();
  TG_CHECK(s.kind == fusion::PairKind::scale_masked_softmax, "tg::compile: fusion: a softmax consumed the pair ",
           fusion::pair_kind_name(s.kind));
  const PairDone done(r);
  const bool scaled = s.scale_operand >= 0;
  const Tensor<T, D>& x = pair_input<T, D>(s, scaled ? static_cast<std::size_t>(1 - s.scale_operand) : 0);
  const Tensor<T, D>* scale = scaled ? &pair_input<T, D>(s, static_cast<std::size_t>(s.scale_operand)) : nullptr;
  const auto* mask = static_cast<const Tensor<std::uint8_t, D>*>(s.mask.get());
  fusion::Suspend plain;
  return scale_masked_softmax_at(x, scale, s.divide, mask, s.fill);
}

}  // namespace tg::detail

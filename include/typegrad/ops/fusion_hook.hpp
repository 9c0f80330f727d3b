// The hook through which tg::compile's fusion rewrite (Note [fusion rewrites], compile/fusion.hpp) takes over
// the elementwise ops (exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, gelu_tanh, silu, add, sub, mul, div and
// their scalar forms) of a compiled step. With no rewriter installed on the thread (every eager step) an op
// pays one thread-local load.
#pragma once

#include <array>
#include <memory>
#include <optional>
#include <vector>

#include "typegrad/core/storage.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/chain_program.hpp"

namespace tg::fusion {

/// One operand of a fusable op as the rewrite sees it: its identity (storage, offset, shape, strides), and for
/// a one-element CPU tensor that needs no gradient, its value (a constant of the chain).
struct OperandInfo {
  const std::shared_ptr<Storage>* storage = nullptr;  // the tensor's (valid during the call)
  const void* meta = nullptr;                         // its autograd identity (null: none): x and x.detach() differ
  std::int64_t offset = 0;
  Shape shape, strides;
  bool requires_grad = false;
  bool constant = false;
  double value = 0;
  const Storage* raw() const { return storage ? storage->get() : nullptr; }
};

enum class Action : unsigned char {
  run,     ///< the op runs as usual
  member,  ///< the op is a link of a fused chain: it returns a pending tensor (never computed) over `pending`
  tail,    ///< the op ends a fused chain: it runs the chain (program() over inputs()) and returns its result
};
struct Decision {
  Action action = Action::run;
  std::shared_ptr<Storage> pending;
  std::array<bool, 2> new_input{false, false};  ///< operands that became inputs of the chain (add_input, in order)
};

/// The compile step's rewriter (capture::FusionScout finds chains, capture::FusionApply fuses them).
class Rewriter {
 public:
  virtual ~Rewriter() = default;
  /// A fusable op (`step`'s op; its operand fields are unused) over operands[0, n) is about to run on `device`
  /// in `dtype`, producing `out_shape`.
  virtual Decision on_op(const pw::ChainStep& step, const OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                         DeviceKind device) = 0;
  /// After a member or tail decision: a typed copy (a Tensor<T, D>) of each operand new_input names.
  virtual void add_input(std::shared_ptr<const void> tensor) = 0;
  /// At a tail: the chain, its inputs (typed copies) in slot order and the shape the ops would have given (a
  /// constant of higher rank adds leading ones); done() once it ran.
  virtual const pw::ChainProgram& program() const = 0;
  virtual const Shape& out_shape() const = 0;
  virtual const std::vector<std::shared_ptr<const void>>& inputs() const = 0;
  virtual void done() = 0;
};

/// The calling thread's rewriter (null: none, the eager default).
Rewriter*& rewriter();

/// Removes the thread's rewriter for the scope (a chain's own op runs unrewritten).
class Suspend {
 public:
  Suspend() : previous_(rewriter()) { rewriter() = nullptr; }
  ~Suspend() { rewriter() = previous_; }
  Suspend(const Suspend&) = delete;
  Suspend& operator=(const Suspend&) = delete;

 private:
  Rewriter* previous_;
};

}  // namespace tg::fusion

namespace tg::detail {

template <Element T, Device D>
fusion::OperandInfo fusion_operand(const Tensor<T, D>& t) {
  fusion::OperandInfo o{&t.storage(), t.autograd_meta().get(), t.storage_offset(), t.shape(), t.strides(), t.requires_grad(), false, 0.0};
  if constexpr (std::is_same_v<D, cpu>) {
    if (t.numel() == 1 && !o.requires_grad && o.raw() && !o.raw()->is_pending()) {
      o.constant = true;
      o.value = scalar_cast<double>(t.data()[0]);
    }
  }
  return o;
}

/// Runs the rewriter's chain (defined in ops/pointwise_chain.hpp, which unary.hpp and binary.hpp include last).
template <FloatingElement T, Device D>
Tensor<T, D> run_fused_chain(fusion::Rewriter& r);

/// Called first by every fusable op: the op's result when a compiled step's rewrite takes the op over.
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_fuse(const pw::ChainStep& step, const Shape& out_shape, const Tensor<T, D>& a,
                                     const Tensor<T, D>* b = nullptr) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  const std::array<fusion::OperandInfo, 2> ops{fusion_operand(a), b ? fusion_operand(*b) : fusion::OperandInfo{}};
  fusion::Decision d = r->on_op(step, ops.data(), b ? 2 : 1, out_shape, dtype_traits<T>::dtype, device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  if (d.new_input[0]) r->add_input(std::make_shared<const Tensor<T, D>>(a));
  if (b && d.new_input[1]) r->add_input(std::make_shared<const Tensor<T, D>>(*b));
  if (d.action == fusion::Action::member) return Tensor<T, D>::over_storage_raw(std::move(d.pending), out_shape);
  return run_fused_chain<T, D>(*r);
}

}  // namespace tg::detail

// The hook through which tg::compile's fusion rewrite (Note [fusion rewrites], compile/fusion.hpp) takes over
// the elementwise ops (exp, log, sqrt, rsqrt, tanh, sigmoid, relu, gelu, gelu_tanh, silu, add, sub, mul, div and
// their scalar forms) of a compiled step. With no rewriter installed on the thread (every eager step) an op
// pays one thread-local load.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
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

/// The ops a pair rewrite (Note [pair rewrites], compile/fusion.hpp) takes over besides the elementwise ones
/// (add and gelu_tanh report themselves as chain steps).
enum class Special : unsigned char { none, dropout, linear, layernorm, masked_fill, softmax };
/// The fused op a pair of ops becomes (scale_masked_softmax: two or three ops, the scale, the mask and the softmax).
enum class PairKind : unsigned char { add_layernorm, dropout_add, linear_gelu_tanh, scale_masked_softmax };
const char* pair_kind_name(PairKind k);
const char* special_name(Special op);

enum class Action : unsigned char {
  run,      ///< the op runs as usual
  member,   ///< a link of a fused chain, or a pair's producer whose value is never stored: the op returns a
            ///< pending tensor over `pending` (no node; a pair's producer keeps its operands in pair())
  tail,     ///< the op ends a fused chain: it runs the chain (program() over inputs()) and returns its result
  deferred, ///< a pair's producer whose value its consumer writes (add before layernorm): the op allocates its
            ///< output, marks it pending with `why`, hands it to pair().filled and records its node, but runs
            ///< no kernel
  consume,  ///< a pair's consumer: the op runs the fused op (pair()), reading the producer's value from operand
            ///< `value_operand`
  hold,     ///< an elementwise op that is a pair's first op whose value is never stored (mul before masked_fill):
            ///< it returns a pending tensor over `pending` and keeps its operands, in order, in pair().inputs
};
struct Decision {
  Action action = Action::run;
  std::shared_ptr<Storage> pending;
  std::shared_ptr<const std::string> why;       ///< deferred: what reading the unwritten output says
  std::array<bool, 2> new_input{false, false};  ///< operands that became inputs of the chain (add_input, in order)
  int value_operand = 0;
};

/// The pair whose producer ran and whose consumer runs next (FusionApply's; kept until done()).
struct PairState {
  PairKind kind = PairKind::add_layernorm;
  std::vector<std::shared_ptr<const void>> inputs;  ///< typed copies (Tensor<T, D>) of the producer's operands
  std::shared_ptr<Storage> filled;                   ///< add_layernorm: the add's output, written by the consumer
  std::uint64_t seed = 0, offset = 0;                ///< dropout_add: the dropout's Philox position
  const std::uint64_t* base = nullptr;               ///< (relative to *base when not null: Note [the Philox base in memory])
  double p = 0;                                      ///< and its probability
  int scale_operand = -1;                            ///< scale_masked_softmax: the input that is the scale (-1: none)
  bool divide = false;                               ///< and whether it divides
  std::shared_ptr<const void> mask;                  ///< the masked_fill's mask (a Tensor<std::uint8_t, D>; null: none)
  double fill = 0;                                   ///< and its value
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
  /// A dropout, linear, layernorm, masked_fill or softmax (Special) over operands[0, n) about to run (Note [pair
  /// rewrites]).
  virtual Decision on_special(Special op, const OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                              DeviceKind device) = 0;
  /// The open pair (after a member or deferred decision of its producer, until the consumer's done()).
  virtual PairState& pair() = 0;
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

/// Runs the rewriter's open pair with `other` the consumer's operand that is not the producer's value (dropout_add:
/// the residual; linear_gelu_tanh: none) and calls done(); defined in ops/fused_pairs.hpp (included last by
/// pointwise_chain.hpp and layernorm.hpp).
template <FloatingElement T, Device D>
Tensor<T, D> run_fused_pair(fusion::Rewriter& r, const Tensor<T, D>* other);
/// The add_layernorm pair's consumer: writes the deferred sum h and returns layernorm(h) (ops/fused_pairs.hpp).
template <FloatingElement T, Device D>
Tensor<T, D> run_fused_add_layernorm(fusion::Rewriter& r, const Tensor<T, D>& h, const Tensor<T, D>& weight,
                                     const Tensor<T, D>& bias, double eps);

/// The scale_masked_softmax pair's softmax: runs the fused op over the pair's inputs (ops/fused_pairs.hpp).
template <FloatingElement T, Device D>
Tensor<T, D> run_fused_scale_masked_softmax(fusion::Rewriter& r);

/// Called first by every fusable op: the op's result when a compiled step's rewrite takes the op over. An op
/// that can be a pair's deferred producer (add) passes `deferred`: set when the result is an unwritten output
/// the op must still record its node for.
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_fuse(const pw::ChainStep& step, const Shape& out_shape, const Tensor<T, D>& a,
                                     const Tensor<T, D>* b = nullptr, bool* deferred = nullptr) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  const std::array<fusion::OperandInfo, 2> ops{fusion_operand(a), b ? fusion_operand(*b) : fusion::OperandInfo{}};
  fusion::Decision d = r->on_op(step, ops.data(), b ? 2 : 1, out_shape, dtype_traits<T>::dtype, device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  if (d.action == fusion::Action::consume) return run_fused_pair<T, D>(*r, d.value_operand == 0 ? b : &a);
  if (d.action == fusion::Action::hold) {
    fusion::PairState& s = r->pair();
    s.inputs.push_back(std::make_shared<const Tensor<T, D>>(a));
    if (b) s.inputs.push_back(std::make_shared<const Tensor<T, D>>(*b));
    return Tensor<T, D>::over_storage_raw(std::move(d.pending), out_shape);
  }
  if (d.action == fusion::Action::deferred) {
    TG_CHECK(deferred, "tg::compile: fusion: op '", pw::chain_op_name(step), "' cannot be a deferred producer");
    Tensor<T, D> out = Tensor<T, D>::empty(out_shape);
    out.storage()->set_pending(std::move(d.why));
    fusion::PairState& s = r->pair();
    s.filled = out.storage();
    s.inputs.push_back(std::make_shared<const Tensor<T, D>>(a));
    if (b) s.inputs.push_back(std::make_shared<const Tensor<T, D>>(*b));
    *deferred = true;
    return out;
  }
  if (d.new_input[0]) r->add_input(std::make_shared<const Tensor<T, D>>(a));
  if (b && d.new_input[1]) r->add_input(std::make_shared<const Tensor<T, D>>(*b));
  if (d.action == fusion::Action::member) return Tensor<T, D>::over_storage_raw(std::move(d.pending), out_shape);
  return run_fused_chain<T, D>(*r);
}

/// Called by a pair's producer (dropout, linear) before it runs: a pending tensor when the rewrite defers it (its
/// operands kept in the rewriter's pair(); a dropout then stores its Philox position there).
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_defer(fusion::Special op, const Shape& out_shape,
                                      std::initializer_list<const Tensor<T, D>*> operands) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  std::array<fusion::OperandInfo, 3> ops{};
  int n = 0;
  for (const Tensor<T, D>* t : operands) ops[static_cast<std::size_t>(n++)] = fusion_operand(*t);
  fusion::Decision d = r->on_special(op, ops.data(), n, out_shape, dtype_traits<T>::dtype, device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  TG_CHECK(d.action == fusion::Action::member, "tg::compile: fusion: '", fusion::special_name(op), "' cannot be a pair's consumer");
  fusion::PairState& s = r->pair();
  for (const Tensor<T, D>* t : operands) s.inputs.push_back(std::make_shared<const Tensor<T, D>>(*t));
  return Tensor<T, D>::over_storage_raw(std::move(d.pending), out_shape);
}

/// Called by layernorm before it runs: its result when it consumes a deferred add (the pair add_layernorm).
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_consume_layernorm(const Tensor<T, D>& x, const Tensor<T, D>& weight, const Tensor<T, D>& bias,
                                                  double eps) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  const std::array<fusion::OperandInfo, 3> ops{fusion_operand(x), fusion_operand(weight), fusion_operand(bias)};
  fusion::Decision d = r->on_special(fusion::Special::layernorm, ops.data(), 3, x.shape(), dtype_traits<T>::dtype,
                                     device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  TG_CHECK(d.action == fusion::Action::consume, "tg::compile: fusion: a layernorm cannot be a pair's producer");
  return run_fused_add_layernorm<T, D>(*r, x, weight, bias, eps);
}

/// Called by masked_fill before it runs: a pending tensor when it is an op of a scale_masked_softmax pair (its mask
/// and fill kept in the rewriter's pair(); x too when it is the pair's first op).
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_defer_masked_fill(const Tensor<T, D>& x, const Tensor<std::uint8_t, D>& mask, double value) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  const std::array<fusion::OperandInfo, 2> ops{fusion_operand(x), fusion_operand(mask)};
  fusion::Decision d = r->on_special(fusion::Special::masked_fill, ops.data(), 2, x.shape(), dtype_traits<T>::dtype,
                                     device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  TG_CHECK(d.action == fusion::Action::member, "tg::compile: fusion: a masked_fill can only be a scale_masked_softmax pair's first or middle op");
  fusion::PairState& s = r->pair();
  if (d.new_input[0]) s.inputs.push_back(std::make_shared<const Tensor<T, D>>(x));
  s.mask = std::make_shared<const Tensor<std::uint8_t, D>>(mask);
  s.fill = value;
  return Tensor<T, D>::over_storage_raw(std::move(d.pending), x.shape());
}

/// Called by softmax (over the last dim) before it runs: its result when it ends a scale_masked_softmax pair.
template <FloatingElement T, Device D>
std::optional<Tensor<T, D>> try_consume_softmax(const Tensor<T, D>& x) {
  fusion::Rewriter* r = fusion::rewriter();
  if (!r) [[likely]] return std::nullopt;
  const std::array<fusion::OperandInfo, 1> ops{fusion_operand(x)};
  fusion::Decision d = r->on_special(fusion::Special::softmax, ops.data(), 1, x.shape(), dtype_traits<T>::dtype, device_traits<D>::kind);
  if (d.action == fusion::Action::run) return std::nullopt;
  TG_CHECK(d.action == fusion::Action::consume, "tg::compile: fusion: a softmax can only end a scale_masked_softmax pair");
  return run_fused_scale_masked_softmax<T, D>(*r);
}

}  // namespace tg::detail

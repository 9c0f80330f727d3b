// tg::compile's fusion rewrite (Note [fusion rewrites]): FusionScout finds the chains of unfused elementwise ops
// in a captured step, FusionApply runs each chain as one tg::pointwise_chain op in the steps after.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/detail/chain_program.hpp"
#include "typegrad/ops/fusion_hook.hpp"

namespace tg::capture {

// Note [fusion rewrites]
// A step written with separate elementwise ops (a hand-written GELU: 0.5 * x * (1 + tanh(k * (x + c * x * x * x))))
// reads and writes a whole tensor per op and keeps each intermediate for the backward. With CompileOptions::fuse
// (the default) a compiled step rewrites such chains:
//   * Find (the first call of a signature, run eagerly): every fusable op (exp, log, sqrt, rsqrt, tanh, sigmoid,
//     relu, gelu, gelu_tanh, silu, add, sub, mul, div, scalar forms included) run with gradients on, outside a
//     backward walk and outside checkpointed regions, is listed with its operands' identities (storage, offset,
//     shape, strides); every op's inputs are followed (OpObserver::on_io). A chain is a run of such ops recorded
//     one right after the other, of one dtype, device and output shape of at least kMinChainElements elements
//     (scalars such as a loss are read on the host, which the rewrite cannot see), in which every output but the last is
//     read only by later ops of the run and is gone when the step ends (nothing else holds it), with at most
//     kMaxInputs input tensors, kMaxConstants constants (one-element CPU tensors that need no gradient: their
//     values are read at each call) and kMaxSteps ops. The step is then captured again with the chains fused.
//   * Fuse (every later call): each op of a chain returns a pending tensor (a storage with no memory: reading
//     it throws an error naming the chain) while the rewrite checks it against the capture (op, shape, dtype,
//     which operands are the chain's own values) and builds the program; the last op runs tg::pointwise_chain
//     over the chain's inputs: one pass forward, one node keeping only the inputs, one pass backward. A link's
//     value is that very tensor (storage, view and autograd identity: a detach of it, or another view, is a read
//     the chain cannot take over). An op recorded between two links or an operand wired differently is an error
//     naming the op (the step's ops depend on its data), raised before the op runs; a chain left open or one
//     that did not run, at the end of the step. After such an error the signature is captured again without
//     fusion (said once on stderr). A call under NoGrad is another signature (nothing is rewritten there).
// The op guard and the memory plan are those of the fused step (captured on the second call), so the steady state
// still makes no allocator call. Fused and unfused results differ by rounding (Note [fusion rewrites] in
// ops/pointwise_chain.hpp); CompileOptions{.fuse = false} keeps the step's ops as written, bit for bit.

/// One op of a planned chain: its op, output, dtype and device, and for each operand, the link of the same chain
/// whose value it reads (-1: an input of the chain) and whether it is a constant.
struct ChainLink {
  pw::ChainStep step;
  Shape shape;
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
  int operands = 1;
  int from[2] = {-1, -1};
  bool constant[2] = {false, false};
};
/// A chain of a compiled step: the fusable ops numbered first .. first + links.size() - 1 (counting from 0 in
/// the step, only those run where a rewrite may take them over).
struct FusedChain {
  std::int64_t first = 0;
  std::vector<ChainLink> links;
  std::vector<std::shared_ptr<const std::string>> messages;  // what reading link k's (pending) value says
  std::string describe() const;  // "gelu_tanh -> mul -> add [4,64,128] bf16"
};

// Note [pair rewrites]
// Four patterns of ops that a model may write separately have a fused op each; a compiled step (CompileOptions::fuse)
// runs the pattern as that op:
//   add(x, r) read by layernorm(h, w, b)            -> add_layernorm  (h is kept: the residual stream reads it on)
//   dropout(r) read by add(x, d) or add(d, x)       -> dropout_add    (d is never stored)
//   linear(x, W[, b]) read by gelu_tanh(pre)        -> linear_gelu_tanh (pre is the fused op's own saved value),
//                                                      off the CPU only (below)
//   mul(x, s) or div(x, s), s one element needing no gradient, read by masked_fill(a, mask, fill) read by
//   softmax(over the last dim); or two of the three (the scale and the softmax, or the mask and the softmax)
//                                                   -> scale_masked_softmax (a hand-written attention's middle:
//                                                      Note [fused scale, mask and softmax]; neither the scaled
//                                                      nor the masked scores are stored), off the CPU only under
//                                                      TG_FUSE_PAIRS=all until its CUDA kernels have run on a GPU
// (The three-op pattern is a "pair" too below: its middle op reads the first's value and is read by the last.)
// The first call (FusionScout) lists these ops beside the elementwise ones, with the same operand identities. A
// pair is a producer and its consumer recorded one right after the other, of one dtype and device, the consumer
// reading that very tensor (storage, view and autograd identity); for add, both operands of the output's shape (no
// broadcasting); for dropout and linear, a value read by the consumer only and gone when the step ends. Pairs are
// chosen before chains: an op in a pair is in no chain. In the fused calls (FusionApply) the producer keeps its
// operands (and the dropout its Philox position, drawn from its generator as dropout draws it) and returns
// either a pending tensor with no memory (dropout, linear: no node) or, for add, its output allocated and marked
// pending with its "add" node recorded as usual; the consumer runs the fused op, which writes the add's output.
// Each fused op runs the pair's kernels or computes the same values: add_layernorm and dropout_add equal their
// pairs bit for bit on each device (Note [fused residual add and LayerNorm], Note [fused dropout and residual
// add]), linear_gelu_tanh on the CPU (on the GPU its cuBLASLt epilogue differs by rounding: Note [fused linear +
// GELU]); the tape keeps the add's node, so gradients sum in the pair's order. On the CPU linear_gelu_tanh runs
// the pair's own kernels and its one node keeps the GELU's incoming gradient alive through the linear's backward
// (the pair's gelu node freed it first: 65 KiB more at the peak of tests/compile/test_pair_fusion.cpp's block), so
// the CPU keeps that pair as written; TG_FUSE_PAIRS=all rewrites it there too (how the CPU tests run the GPU's
// path). scale_masked_softmax is the other way round: written for the GPU but not yet run there (docs/cuda.md), a
// GPU step keeps the three ops unless TG_FUSE_PAIRS=all. A different op, operand or an op
// recorded between the two is an error naming it, raised before the op runs, and the signature is captured again
// without fusion, as for chains. Reading a pending value, or the add's output before its layernorm, is an error
// naming the pair.

/// A pair of a compiled step run as one fused op: the producer numbered `first` (among the ops a rewrite may take
/// over, as a chain's) and its consumer, first + length - 1 (a scale_masked_softmax's masked_fill between them).
struct FusedPair {
  fusion::PairKind kind = fusion::PairKind::add_layernorm;
  std::int64_t first = 0;
  int length = 2;          // ops: 3 for a scale, a mask and a softmax
  int scale_operand = -1;  // scale_masked_softmax: the first op's operand that is the scale (-1: no scale)
  bool divide = false;     // and whether that op is a div
  bool masked = false;     // a masked_fill is in the pattern
  Shape shape;  // the producer's output
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
  int producer_operands = 2;  // linear: 2 without a bias, 3 with
  int value_operand = 0;      // the consumer's operand that is the producer's value
  std::shared_ptr<const std::string> message;  // what reading the producer's value (or the middle op's) says
  std::string describe() const;                // "linear -> gelu_tanh [8,128,1024] f32 as linear_gelu_tanh"
};

/// What the first call of a signature found.
struct FusionPlan {
  std::vector<FusedChain> chains;
  std::vector<FusedPair> pairs;
  bool empty() const { return chains.empty() && pairs.empty(); }
};

/// The smallest output a chain is fused for. Below it a pass costs nothing worth saving, and small values (a
/// loss, a scale) are the ones a step reads on the host, which a rewrite cannot see (reading a chain's value
/// is an error once fused).
inline constexpr std::int64_t kMinChainElements = 1024;

/// Whether a fusable op running now may be rewritten: gradients on, not inside a backward walk (recomputes
/// included), not inside a checkpointed region's forward.
bool fusable_context();

/// Finds the chains of a step run eagerly (the first call of a signature).
class FusionScout final : public fusion::Rewriter {
 public:
  FusionScout();
  fusion::Decision on_op(const pw::ChainStep& step, const fusion::OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                         DeviceKind device) override;
  fusion::Decision on_special(fusion::Special op, const fusion::OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                              DeviceKind device) override;
  void add_input(std::shared_ptr<const void>) override {}
  const pw::ChainProgram& program() const override { return none_; }
  const Shape& out_shape() const override { return no_shape_; }
  const std::vector<std::shared_ptr<const void>>& inputs() const override { return no_inputs_; }
  void done() override {}
  fusion::PairState& pair() override { return no_pair_; }
  /// From the op observer: an op recorded, with its output and inputs.
  void on_recorded();
  void on_io(const std::shared_ptr<Storage>& output, const void* output_meta, std::initializer_list<const Storage*> inputs);
  /// The pairs and chains, once the step has returned.
  FusionPlan plan() const;

 private:
  struct Operand {
    std::weak_ptr<Storage> storage;  // held weakly: the run's memory is not changed, and no identity is reused
    const void* meta = nullptr;
    std::int64_t offset = 0;
    Shape shape, strides;
    bool constant = false;
    bool requires_grad = false;
    int from = -1;  // the event whose value it is (that very tensor: storage, view and autograd identity), else -1
    bool same(const Operand& o) const {
      return !storage.owner_before(o.storage) && !o.storage.owner_before(storage) && meta == o.meta && offset == o.offset &&
             shape == o.shape && strides == o.strides;
    }
  };
  struct Event {
    pw::ChainStep step;
    fusion::Special special = fusion::Special::none;  // none: an elementwise op (step)
    int n = 1;
    Operand in[3];
    Shape shape;
    DType dtype = DType::f32;
    DeviceKind device = DeviceKind::cpu;
    std::int64_t recorded_at = 0;  // its index among the ops the observer saw
    std::weak_ptr<Storage> out;
    const void* out_meta = nullptr;
    std::vector<int> readers;      // the events that read its output
    bool read_elsewhere = false;   // an op that is not a fusable event read it
  };
  int producer_of(const Storage* s) const;
  void list(const pw::ChainStep& step, fusion::Special special, const fusion::OperandInfo* operands, int n, const Shape& out_shape,
            DType dtype, DeviceKind device);
  std::vector<FusedPair> pairs(std::vector<bool>& taken) const;
  std::vector<Event> events_;
  std::map<const Storage*, int> produced_;
  std::int64_t recorded_ = 0;
  bool awaiting_ = false;
  pw::ChainProgram none_;
  Shape no_shape_;
  std::vector<std::shared_ptr<const void>> no_inputs_;
  fusion::PairState no_pair_;
  bool every_device_;  // TG_FUSE_PAIRS=all: linear -> gelu_tanh on the CPU too
};

/// Fuses the planned pairs and chains of a step (every call after the first of a signature).
class FusionApply final : public fusion::Rewriter {
 public:
  explicit FusionApply(const FusionPlan& plan) : chains_(&plan.chains), pairs_(&plan.pairs) {}
  fusion::Decision on_op(const pw::ChainStep& step, const fusion::OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                         DeviceKind device) override;
  fusion::Decision on_special(fusion::Special op, const fusion::OperandInfo* operands, int n, const Shape& out_shape, DType dtype,
                              DeviceKind device) override;
  fusion::PairState& pair() override { return pair_; }
  void add_input(std::shared_ptr<const void> tensor) override { inputs_.push_back(std::move(tensor)); }
  const pw::ChainProgram& program() const override { return program_; }
  const Shape& out_shape() const override { return out_shape_; }
  const std::vector<std::shared_ptr<const void>>& inputs() const override { return inputs_; }
  void done() override;
  /// From the op observer: an op recorded (an error between two links of a chain or the ops of a pair).
  void on_recorded(const char* op);
  /// After the step: every chain ran, none is left open.
  void finish() const;

 private:
  [[noreturn]] void diverged(const std::string& what) const;
  [[noreturn]] void pair_diverged(const std::string& what) const;
  fusion::Decision produce(const pw::ChainStep* step, fusion::Special op, const fusion::OperandInfo* operands, int n,
                           const Shape& out_shape, DType dtype, DeviceKind device);
  fusion::Decision consume(const pw::ChainStep* step, fusion::Special op, const fusion::OperandInfo* operands, int n,
                           const Shape& out_shape, DType dtype, DeviceKind device);
  const std::vector<FusedChain>* chains_;
  const std::vector<FusedPair>* pairs_;
  std::size_t next_ = 0;       // the next chain to run
  std::size_t next_pair_ = 0;  // the next pair to run
  std::int64_t ordinal_ = 0;   // fusable ops seen
  bool open_ = false;
  bool pair_open_ = false;     // a pair's producer ran, its consumer is next
  bool pair_running_ = false;  // its consumer runs the fused op (until done())
  bool own_record_ = false;    // the deferred add's own node is still to be recorded
  int stage_ = 0;              // ops of the open pair that ran (a three-op pattern's middle op comes at 1)
  fusion::PairState pair_;
  std::shared_ptr<Storage> pair_value_;  // the producer's pending value (dropout, linear)
  std::size_t link_ = 0;       // the next link of the open chain
  std::vector<std::shared_ptr<Storage>> pending_;  // the open chain's values (kept: no address is reused meanwhile)
  struct Ref {
    char kind;  // 'x' input, 'c' constant, 't' a link's value
    int index;
  };
  std::vector<std::array<Ref, 2>> refs_;
  struct InputId {
    const Storage* storage;  // alive: inputs_ holds every input until the chain is done
    const void* meta;
    std::int64_t offset;
    Shape shape, strides;
    bool operator==(const InputId&) const = default;
  };
  std::vector<InputId> input_ids_;
  std::vector<std::shared_ptr<const void>> inputs_;
  pw::ChainProgram program_;
  Shape out_shape_;
};

/// Installs a rewriter on the calling thread for the scope (restoring the previous one).
class RewriterScope {
 public:
  explicit RewriterScope(fusion::Rewriter* r) : previous_(fusion::rewriter()) { fusion::rewriter() = r; }
  ~RewriterScope() { fusion::rewriter() = previous_; }
  RewriterScope(const RewriterScope&) = delete;
  RewriterScope& operator=(const RewriterScope&) = delete;

 private:
  fusion::Rewriter* previous_;
};

}  // namespace tg::capture

// The tape: nodes recorded in execution order, replayed in reverse by backward().
//   { tg::NoGrad guard; auto y = model(x); }          // nothing recorded inside
//   loss.backward();                                  // walks the tape from loss's node down
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/core/storage.hpp"

namespace tg::autodiff {

/// What a node records about each tensor it touches (Note [tape nodes are data]).
struct TensorInfo {
  std::uint64_t id = 0;
  Shape shape;
  DType dtype = DType::f32;
  DeviceKind device = DeviceKind::cpu;
};

// Note [tape nodes are data]
// Every node records the op's name, its inputs' and output's ids, shapes and dtypes, and owns the op's
// Saved struct (exactly what backward needs). Ownership: an output tensor's autograd meta owns its
// producer node; a node owns its inputs' metas (so a chain stays alive as long as its last tensor does),
// and refers to its output weakly. The thread's tape holds weak references in execution order, so
// backward can walk nodes in reverse topological order, and a later compile step can replay, plan
// memory for, or rewrite the recorded sequence. Nodes whose tensors all died simply expire.
class Node {
 public:
  Node(const char* op, std::vector<TensorInfo> inputs, TensorInfo output)
      : op_(op), inputs_(std::move(inputs)), output_(std::move(output)) {}
  virtual ~Node() = default;

  const char* op() const { return op_; }
  const std::vector<TensorInfo>& inputs() const { return inputs_; }
  const TensorInfo& output() const { return output_; }
  std::uint64_t sequence() const { return sequence_; }
  bool released() const { return released_; }

  /// Reads the output's gradient and accumulates into the inputs' gradients. Returns false when the
  /// output has no gradient (the node did not contribute to the loss).
  virtual bool run_backward() = 0;
  /// Frees what the node saved for backward (after backward, unless the graph is retained).
  virtual void release() { released_ = true; }
  /// Frees the saved tensors only, right after the node ran in a walk that does not retain the graph;
  /// release() follows at the walk's end (the inputs' metas, which own the upstream nodes, live until then).
  virtual void free_saved() {}

 private:
  friend class Tape;
  const char* op_;
  std::vector<TensorInfo> inputs_;
  TensorInfo output_;
  std::uint64_t sequence_ = 0;

 protected:
  bool released_ = false;
};

class Tape {
 public:
  void push(const std::shared_ptr<Node>& node);
  /// Runs backward over every live node recorded up to and including `last`, newest first.
  void backward_from(const Node& last, bool retain_graph);
  std::size_t size() const { return nodes_.size(); }
  /// Live nodes in execution order (for inspection and tests).
  std::vector<std::shared_ptr<Node>> live_nodes() const;
  void clear() { nodes_.clear(); }

 private:
  void compact();
  std::vector<std::weak_ptr<Node>> nodes_;
  std::uint64_t next_sequence_ = 1;
  std::size_t compact_at_ = 1024;
};

/// Sees every op that records itself (whether or not it is recorded: backward formulas and NoGrad code too)
/// and the start of each backward walk, on the thread that installed it (tg::compile's guards).
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void on_op(const char* op, const Shape& output, DType dtype) = 0;
  /// After on_op, once the op is recorded: the storages of its output and inputs and the output's autograd
  /// identity (null without one; tg::compile's fusion rewrite follows values by them).
  virtual void on_io(const std::shared_ptr<Storage>& /*output*/, const void* /*output_meta*/,
                     std::initializer_list<const Storage*> /*inputs*/) {}
  virtual void on_backward() {}
};
/// The calling thread's observer (null: none).
OpObserver*& op_observer();

/// The calling thread's current tape (the top of its stack of tapes).
Tape& current_tape();
/// Makes `tape` current on this thread until the guard dies (checkpoint recompute, compile capture).
class TapeScope {
 public:
  explicit TapeScope(Tape& tape);
  ~TapeScope();
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;

 private:
  Tape* previous_;
};

bool grad_enabled();
void set_grad_enabled(bool on);
/// Whether the backward walk running on this thread keeps what the nodes saved (backward(retain_graph=true)).
/// When it does not, an op's backward may drop a saved tensor as soon as it has used it (the walk frees the
/// rest after the node), as the separate nodes of an unfused pair would have freed theirs.
bool retaining_graph();
/// Whether a backward walk runs on this thread (its formulas, and the checkpoint recomputes inside it).
bool in_backward();
std::uint64_t next_tensor_id();

}  // namespace tg::autodiff

namespace tg {
/// Disables recording on this thread for its lifetime.
class NoGrad {
 public:
  NoGrad() : previous_(autodiff::grad_enabled()) { autodiff::set_grad_enabled(false); }
  ~NoGrad() { autodiff::set_grad_enabled(previous_); }
  NoGrad(const NoGrad&) = delete;
  NoGrad& operator=(const NoGrad&) = delete;

 private:
  bool previous_;
};
}  // namespace tg

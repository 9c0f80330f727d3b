// The thread-local tape stack and backward's walk (see Note [tape nodes are data]).
#include <algorithm>
#include <atomic>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/ops/fusion_hook.hpp"

// The thread's fusion rewriter and the pending storages' error (Note [fusion rewrites]) live here, with the
// thread's op observer, so every part of the library that records ops links them.
namespace tg {
void Storage::throw_pending() const { throw Error(*pending_); }
namespace fusion {
Rewriter*& rewriter() {
  thread_local Rewriter* r = nullptr;
  return r;
}
}  // namespace fusion
}  // namespace tg

namespace tg::autodiff {

namespace {
thread_local Tape t_root_tape;
thread_local Tape* t_current = nullptr;
thread_local bool t_grad_enabled = true;
thread_local OpObserver* t_observer = nullptr;
std::atomic<std::uint64_t> g_next_id{1};
}  // namespace

Tape& current_tape() { return t_current ? *t_current : t_root_tape; }
TapeScope::TapeScope(Tape& tape) : previous_(t_current) { t_current = &tape; }
TapeScope::~TapeScope() { t_current = previous_; }
OpObserver*& op_observer() { return t_observer; }
thread_local bool t_retaining_graph = false;
bool grad_enabled() { return t_grad_enabled; }
bool retaining_graph() { return t_retaining_graph; }
thread_local int t_backward_depth = 0;
bool in_backward() { return t_backward_depth > 0; }
void set_grad_enabled(bool on) { t_grad_enabled = on; }
std::uint64_t next_tensor_id() { return g_next_id.fetch_add(1, std::memory_order_relaxed); }

void Tape::push(const std::shared_ptr<Node>& node) {
  node->sequence_ = next_sequence_++;
  nodes_.push_back(node);
  if (nodes_.size() >= compact_at_) compact();
}

void Tape::compact() {
  std::erase_if(nodes_, [](const std::weak_ptr<Node>& w) { return w.expired(); });
  compact_at_ = std::max<std::size_t>(1024, 2 * nodes_.size());
}

std::vector<std::shared_ptr<Node>> Tape::live_nodes() const {
  std::vector<std::shared_ptr<Node>> out;
  for (const auto& w : nodes_)
    if (auto n = w.lock()) out.push_back(std::move(n));
  return out;
}

void Tape::backward_from(const Node& last, bool retain_graph) {
  // nodes_ is in execution order; every node newer than `last` cannot feed it and is skipped.
  struct GradModeOff {  // backward formulas are not themselves recorded
    bool previous = t_grad_enabled;
    GradModeOff() { t_grad_enabled = false; }
    ~GradModeOff() { t_grad_enabled = previous; }
  } grad_mode_off;
  struct Retaining {  // what retaining_graph() answers during this walk
    bool previous = t_retaining_graph;
    explicit Retaining(bool r) { t_retaining_graph = r; }
    ~Retaining() { t_retaining_graph = previous; }
  } retaining(retain_graph);
  struct Depth {  // what in_backward() answers (checkpoint recomputes run inside the walk)
    Depth() { ++t_backward_depth; }
    ~Depth() { --t_backward_depth; }
  } depth;
  if (t_observer) t_observer->on_backward();
  std::vector<std::shared_ptr<Node>> ran;
  for (auto rit = nodes_.rbegin(); rit != nodes_.rend(); ++rit) {
    auto node = rit->lock();
    if (!node || node->sequence() > last.sequence()) continue;
    if (node->run_backward()) {  // throws if released and needed
      // Each node runs at most once per walk, so what it saved can go now: activations are returned during
      // backward, not after it. Its input metas (which own the upstream nodes) stay until the walk ends.
      if (!retain_graph) node->free_saved();
      ran.push_back(std::move(node));
    }
  }
  if (!retain_graph)
    for (auto& n : ran) n->release();
  compact();
}

}  // namespace tg::autodiff

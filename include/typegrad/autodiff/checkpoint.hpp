// Activation-checkpoint regions as types: a region's forward keeps only its inputs (and what its policy
// selects); one tape node's backward recomputes the region into a sub-tape and back-propagates through it.
//   tg::Checkpoint<tg::nn::Block, tg::RecomputeAll> ck(block);  auto y = ck.forward(x, dropout_gen, true);
//   auto z = tg::checkpoint<tg::SelectiveRecompute>([&](const tg::Tensor<float>& t) { return mlp.forward(t); }, x);
#pragma once

#include <concepts>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/autodiff/region.hpp"

namespace tg {

// Note [checkpoint regions]
// A region is a function fn(inputs...) -> Tensor run through tg::checkpoint<Policy> (or a block wrapped
// in Checkpoint<Block, Policy>). Its forward runs fn once under NoGrad, so no op inside records and every
// intermediate is freed as soon as fn drops it; the region then records ONE node (op
// "checkpoint[<policy>]") whose Saved state is: storage-sharing detached views of the inputs, fn itself,
// the outputs the policy kept, and the state of every generator drawn from inside. Its backward
//   1. sets those generators to their state at the region's start (restoring theirs afterwards),
//   2. reruns fn with recording on, into a fresh sub-tape (TapeScope), on new leaves that are detached
//      views of the saved inputs (requiring grad where the region's input did),
//   3. back-propagates the upstream gradient through the sub-tape (parameters used inside are leaves
//      there, so their gradients accumulate and their grad-ready hooks fire as without checkpointing),
//   4. delivers the leaves' gradients to the region's inputs, and frees the sub-tape.
// Randomness replays identically because generators are counter-based (Note [dropout replays its mask]):
// Generator::advance reports draws to the active regions (rng_watch_draw), so a region learns which
// generators it used and their states without being told; the recompute checks that it drew exactly as
// many numbers from each, and from no other generator. Generators used inside must outlive the backward.
//
// Policies are types: RecomputeAll keeps nothing but the inputs; SelectiveRecompute also keeps the GEMM
// outputs (matmul, linear) and recomputes the cheap rest (elementwise ops, layernorm, softmax, dropout,
// the fused attention, layout copies), in the spirit of Megatron-LM's selective recomputation (Korthikanti
// et al. 2022): GEMMs are most of a block's FLOPs, the rest most of its activation bytes. The GEMM ops ask
// region_kept_output (region.hpp): in a region's forward its output is stored, in a recompute the k-th
// GEMM takes the k-th stored output instead of computing it (and still records its node, saving its
// recomputed operands). Regions nest: an inner region met while an outer one recomputes records its own
// node on the outer sub-tape and is itself recomputed when the outer sub-tape's backward reaches it; its
// GEMMs reuse the outer region's kept outputs and, if its own policy keeps GEMMs, store them again
// (shared storage, no copy).
//
// Mixed precision: parameters carry their own compute copies (the slot on their storage, core/storage.hpp),
// so the recompute reads the same per-step weight copies as the forward did with nothing captured here
// (Note [regions see the copies]).
//
// Gradients are bitwise those without checkpointing when the region's function is deterministic (it is
// here: same kernels, same thread count, same Philox counters) and every region input's gradient comes
// from inside the region only (true for a GPT block's input). If an input is also used outside the
// region, its gradient sums the same terms in another association: (outside + (in1 + in2)) instead of
// ((outside + in1) + in2), equal up to rounding.

/// Recompute everything: the region keeps only its inputs ("blocks" in the trainer).
struct RecomputeAll {
  static constexpr bool keep_gemm = false;
  static constexpr const char* name = "blocks";
  static constexpr const char* op_name = "checkpoint[blocks]";
};
/// Keep GEMM (matmul, linear) outputs, recompute everything else ("selective" in the trainer).
struct SelectiveRecompute {
  static constexpr bool keep_gemm = true;
  static constexpr const char* name = "selective";
  static constexpr const char* op_name = "checkpoint[selective]";
};

template <class P>
concept CheckpointPolicy = requires {
  { P::keep_gemm } -> std::convertible_to<bool>;
  { P::name } -> std::convertible_to<const char*>;
  { P::op_name } -> std::convertible_to<const char*>;
};

namespace autodiff {

template <class X>
inline constexpr bool is_tensor_v = false;
template <Element T, Device D>
inline constexpr bool is_tensor_v<Tensor<T, D>> = true;

template <CheckpointPolicy Policy, class Fn, Element TO, Device DO, class... Ins>
class RegionNode final : public Node {
 public:
  RegionNode(std::vector<TensorInfo> infos, TensorInfo out, Fn fn, std::tuple<Ins...> inputs,
             std::vector<std::any> kept, std::vector<RngRecord> rng, std::weak_ptr<AutogradMeta<TO, DO>> out_meta,
             std::tuple<input_slot<Ins>...> slots)
      : Node(Policy::op_name, std::move(infos), std::move(out)), fn_(std::move(fn)), saved_inputs_(std::move(inputs)),
        kept_(std::move(kept)), rng_(std::move(rng)), out_meta_(std::move(out_meta)), slots_(std::move(slots)) {}

  bool run_backward() override {
    auto out = out_meta_.lock();
    if (!out || !out->grad.defined()) return false;
    TG_CHECK(!released_, op(), " backward: this checkpoint region was already released by an earlier backward() "
             "(its saved inputs and kept outputs are freed); call backward(retain_graph=true) the first time to "
             "backpropagate through it twice");
    Tensor<TO, DO> dout = out->grad;
    if (!out->retain_grad) out->grad = Tensor<TO, DO>();  // non-leaf gradients are transient
    auto leaves = make_leaves(std::index_sequence_for<Ins...>{});
    Tape sub;
    const Tensor<TO, DO> y = recompute(sub, leaves);
    TG_CHECK(y.shape() == output().shape, op(), " backward: the recompute returned shape ", y.shape(),
             ", the forward returned ", output().shape, ": the region's function must be deterministic");
    if (y.requires_grad()) {
      TapeScope scope(sub);
      y.backward(dout);
    }
    deliver(leaves, std::index_sequence_for<Ins...>{});
    return true;
  }
  void release() override {
    free_saved();
    released_ = true;
    slots_ = {};
    fn_.reset();
  }
  void free_saved() override {
    saved_inputs_ = {};
    kept_.clear();
    kept_.shrink_to_fit();
  }

 private:
  template <std::size_t... I>
  std::tuple<Ins...> make_leaves(std::index_sequence<I...>) const {
    std::tuple<Ins...> leaves{std::get<I>(saved_inputs_).detach()...};
    (make_leaf(std::get<I>(leaves), std::get<I>(slots_)), ...);
    return leaves;
  }
  template <class X, class Slot>
  static void make_leaf(X& leaf, const Slot& slot) {
    if (slot.meta && slot.meta->requires_grad) leaf.requires_grad_(true);
  }

  /// Reruns fn with recording on into `sub`, generators rewound to the region's start, kept outputs reused.
  Tensor<TO, DO> recompute(Tape& sub, const std::tuple<Ins...>& leaves) {
    struct RngRewind {  // restores the generators' current states whatever happens
      std::vector<RngRecord>& rng;
      std::vector<std::pair<std::uint64_t, std::uint64_t>> now;
      explicit RngRewind(std::vector<RngRecord>& r) : rng(r) {
        for (auto& rec : rng) {
          now.emplace_back(rec.gen->seed(), rec.gen->offset());
          rec.gen->set_state(rec.seed, rec.entry_offset);
        }
      }
      ~RngRewind() {
        for (std::size_t i = 0; i < rng.size(); ++i) rng[i].gen->set_state(now[i].first, now[i].second);
      }
    };
    struct GradOn {
      bool previous = grad_enabled();
      GradOn() { set_grad_enabled(true); }
      ~GradOn() { set_grad_enabled(previous); }
    };
    RngRewind rewind(rng_);
    RegionContext ctx{Policy::op_name, RegionPhase::recompute, Policy::keep_gemm, &kept_, 0, &rng_, false};
    RegionScope region(ctx);
    TapeScope tape(sub);
    GradOn grad_on;
    Tensor<TO, DO> y = std::apply(*fn_, leaves);
    ++checkpoint_stats().recomputes;
    TG_CHECK(ctx.cursor == kept_.size(), op(), " backward: the recompute reused ", ctx.cursor, " of the ",
             kept_.size(), " kept outputs: the region's function must run the same ops on every call");
    for (const auto& r : rng_)
      TG_CHECK(r.gen->seed() == r.seed && r.gen->offset() == r.exit_offset, op(), " backward: the recompute drew ",
               r.gen->offset() - r.entry_offset, " random numbers from a generator (seed ", r.seed, "), the forward drew ",
               r.exit_offset - r.entry_offset, ": the region's function must draw the same numbers on every call");
    return y;
  }

  template <std::size_t... I>
  void deliver(std::tuple<Ins...>& leaves, std::index_sequence<I...>) {
    (deliver_one(std::get<I>(slots_), std::get<I>(leaves)), ...);
  }
  template <class Slot, class X>
  void deliver_one(Slot& slot, const X& leaf) {
    if (!slot.meta || !slot.meta->requires_grad) return;
    const X g = leaf.grad();
    if (!g.defined()) return;
    accumulate_grad(*slot.meta, g, slot.shape, op());
    if (slot.meta->is_leaf())
      for (auto& hook : slot.meta->grad_ready_hooks) hook(slot.meta->grad);
  }

  std::optional<Fn> fn_;
  std::tuple<Ins...> saved_inputs_;
  std::vector<std::any> kept_;
  std::vector<RngRecord> rng_;
  std::weak_ptr<AutogradMeta<TO, DO>> out_meta_;
  std::tuple<input_slot<Ins>...> slots_;
};

}  // namespace autodiff

/// Runs fn(inputs...) as a checkpoint region (Note [checkpoint regions]). fn returns one tensor; it must
/// run the same ops and draw the same random numbers on every call, and stay callable (with everything it
/// references) until backward has run. Under NoGrad, or when nothing inside requires grad, it is a plain
/// call.
template <CheckpointPolicy Policy, class Fn, Element... Ts, Device... Ds>
auto checkpoint(Fn fn, const Tensor<Ts, Ds>&... inputs) {
  using Out = std::remove_cvref_t<std::invoke_result_t<Fn&, const Tensor<Ts, Ds>&...>>;
  static_assert(autodiff::is_tensor_v<Out>, "tg::checkpoint: the region's function must return one tg::Tensor (a "
                                            "tape node has one output); split a multi-output region into several");
  if (!autodiff::grad_enabled()) return Out(fn(inputs...));
  std::vector<std::any> kept;
  std::vector<autodiff::RngRecord> rng;
  autodiff::RegionContext ctx{Policy::op_name, autodiff::RegionPhase::forward, Policy::keep_gemm, &kept, 0, &rng, false};
  Out y;
  {
    autodiff::RegionScope region(ctx);
    NoGrad no_grad;
    y = fn(inputs...);
  }
  for (auto& r : rng) r.exit_offset = r.gen->offset();
  if (!ctx.saw_grad && !(... || inputs.requires_grad())) return y;
  y = y.detach();  // a fresh handle: fn may have returned an input or a view sharing its autograd meta
  auto& meta = autodiff::ensure_meta(y);
  meta->requires_grad = true;
  using NodeT = autodiff::RegionNode<Policy, Fn, typename Out::value_type, typename Out::device_type, Tensor<Ts, Ds>...>;
  auto node = std::make_shared<NodeT>(
      std::vector<autodiff::TensorInfo>{autodiff::info_of(inputs)...}, autodiff::info_of(y), std::move(fn),
      std::tuple<Tensor<Ts, Ds>...>{inputs.detach()...}, std::move(kept), std::move(rng), meta,
      std::tuple<autodiff::input_slot<Tensor<Ts, Ds>>...>{
          autodiff::input_slot<Tensor<Ts, Ds>>{inputs.requires_grad() ? inputs.autograd_meta() : nullptr, inputs.shape()}...});
  meta->producer = node;
  autodiff::current_tape().push(node);
  ++autodiff::checkpoint_stats().regions_recorded;
  return y;
}

namespace autodiff {
/// How a wrapped module's extra forward arguments are held until backward: generators by reference (the
/// region replays their state), everything else by value.
template <class A>
using region_capture_t = std::conditional_t<std::is_lvalue_reference_v<A> && std::is_same_v<std::remove_cvref_t<A>, Generator>,
                                            A, std::decay_t<A>>;
}  // namespace autodiff

/// A module (anything with forward(x, extra...)) whose forward is a checkpoint region with policy Policy.
/// Holds the module by pointer: it must outlive the backward.
template <class Block, CheckpointPolicy Policy = RecomputeAll>
class Checkpoint {
 public:
  using policy = Policy;
  explicit Checkpoint(const Block& block) : block_(&block) {}

  template <Element T, Device D, class... Args>
  Tensor<T, D> forward(const Tensor<T, D>& x, Args&&... args) const {
    return checkpoint<Policy>(
        [block = block_, extra = std::tuple<autodiff::region_capture_t<Args&&>...>(std::forward<Args>(args)...)](
            const Tensor<T, D>& in) mutable {
          return std::apply([&](auto&... a) { return block->forward(in, a...); }, extra);
        },
        x);
  }
  const Block& block() const { return *block_; }

 private:
  const Block* block_;
};

/// No checkpointing: a module's forward is a plain call and keeps every activation ("none" in the trainer).
struct NoCheckpoint {
  static constexpr const char* name = "none";
};

/// A model's activation-checkpointing policy: NoCheckpoint, or a region policy (SelectiveRecompute,
/// RecomputeAll). Models take it as a type (BasicGPT::forward<T, C>); a CLI picks it with with_checkpointing.
template <class C>
concept ActivationCheckpointing = std::same_as<C, NoCheckpoint> || CheckpointPolicy<C>;

/// block.forward(x, args...) under the policy C: a checkpoint region of C, or a plain call for NoCheckpoint.
template <ActivationCheckpointing C, class Block, Element T, Device D, class... Args>
Tensor<T, D> checkpointed(const Block& block, const Tensor<T, D>& x, Args&&... args) {
  if constexpr (std::is_same_v<C, NoCheckpoint>) return block.forward(x, std::forward<Args>(args)...);
  else return Checkpoint<Block, C>(block).forward(x, std::forward<Args>(args)...);
}

/// The one run-time -> type boundary for activation checkpointing (a CLI's --checkpoint): calls
/// f.template operator()<C>() for "none" (NoCheckpoint), "selective" (SelectiveRecompute) or "blocks"
/// (RecomputeAll) and returns its result; any other name is a tg::Error naming the choices.
template <class F>
decltype(auto) with_checkpointing(std::string_view name, F&& f) {
  if (name == NoCheckpoint::name) return f.template operator()<NoCheckpoint>();
  if (name == SelectiveRecompute::name) return f.template operator()<SelectiveRecompute>();
  if (name == RecomputeAll::name) return f.template operator()<RecomputeAll>();
  throw Error("checkpointing: unknown mode '", std::string(name), "' (expected none, selective or blocks)");
}

}  // namespace tg

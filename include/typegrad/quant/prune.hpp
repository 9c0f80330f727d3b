// Magnitude pruning of a GPT's linear weights: unstructured (global or per layer) and 2:4 semi-structured,
// with Zhu & Gupta's gradual schedule; masks as 0/1 tensors, applied in place on the parameters' device.
//   tg::quant::Pruner<tg::cpu> pruner(model.named_parameters(), tg::quant::parse_prune_spec("unstructured:0.5"));
//   pruner.prune_to(0.5);  pruner.apply_to_weights();   // then per step: apply_to_grads(), step, apply_to_weights()
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/param.hpp"

namespace tg::quant {

// Note [pruning masks]
// Each prunable weight W (is_prunable: the 2-D weights of the blocks' linear layers) has a keep mask M of its
// shape, M ∈ {0,1}: the model computes with W ⊙ M, and a pruned weight (M = 0) is held at exactly +0.0 in the
// fp32 master. The masks are chosen by magnitude (Han et al. 2015; Zhu & Gupta 2017): Pruner::prune_to(s)
// prunes the round(s·n) smallest |w| (globally over all n prunable weights, or per layer), or, for 2:4
// (NVIDIA's semi-structured sparsity, Mishra et al. 2021), the 2 smallest of every 4 consecutive weights
// along the input dimension. Masks only shrink: a weight once pruned stays pruned (prune_to to a lower
// sparsity changes nothing), so the gradual schedule's successive updates nest.
// Where the trainer applies them (train::StepOptions's hooks):
//   * gradients: after the last micro-batch's backward, before unscale / the inf check / clipping / the
//     optimizer step (before_update): apply_to_grads() sets ∂L/∂w = 0 for pruned w, so the global norm, the
//     clip and the optimizer's moments see only the live weights. A pruned position's gradient is discarded
//     whatever it held (also inf / NaN: masked_fill writes 0, where a multiply by 0 would keep a NaN).
//   * weights: after every optimizer step that was taken and before the 16-bit weight copies are refreshed
//     from the masters (after_update): apply_to_weights(). Needed even with masked gradients: Adam's m and v
//     (or SGD's momentum) still hold the history from before a weight was pruned, so the update of a pruned
//     weight is not zero; the refreshed bf16/fp16 copies then carry the zeros the forward reads.
//   * mask updates: at a step t with GradualSchedule::updates_at(t), after that step's update,
//     prune_to(sparsity_at(t)) recomputes the masks from the updated weights, then apply_to_weights().
//     prune_to itself changes only the masks, never the weights.
//   * checkpoints: mask_tensors() gives each mask as a host U8 tensor "prune.mask.<param name>" (1 = kept,
//     0 = pruned), saved among a checkpoint's auxiliary tensors (io::kAuxPrefix); a resume passes them to
//     load_masks() of a Pruner with the same spec, which checks them all before changing any mask.
// Masks live on the parameters' device as U8 "pruned" flags (1 - M) and are applied with the existing
// masked_fill kernel, in place (out = flag ? 0 : x reads and writes element i only, so aliasing x and out is
// exact on both backends): one byte per weight on the device, and +0.0 bits whatever the weight held.
// A host copy of M (one byte per weight) is the reference for selection, reports and checkpoints.

enum class SparsityPattern { unstructured, two_four };
enum class PruneScope { global, per_layer };

struct PruneSpec {
  SparsityPattern pattern = SparsityPattern::unstructured;
  double sparsity = 0.5;                  ///< the target; 2:4 is 0.5 by construction
  PruneScope scope = PruneScope::global;  ///< unstructured only (2:4 groups are local)
  bool operator==(const PruneSpec&) const = default;
};

/// "unstructured:S" (global), "unstructured:S:per-layer" (also ":global"), or "2:4" (sparsity 0.5). Anything else
/// is a tg::Error: "--prune: '<text>': <why>; expected unstructured:S with 0 <= S < 1, or 2:4 ...".
PruneSpec parse_prune_spec(std::string_view text);
/// The spec in parse_prune_spec's syntax ("unstructured:0.5:per-layer", "2:4").
std::string to_string(const PruneSpec& spec);
/// Throws a tg::Error unless: unstructured with 0 <= sparsity < 1 (finite), or two_four with sparsity 0.5.
void validate(const PruneSpec& spec);

/// Zhu & Gupta (2017), "To prune, or not to prune", eq. 1: the sparsity at step t,
///   s_t = s_f + (s_i − s_f)·(1 − (t − t0)/(t1 − t0))³   for t0 <= t <= t1,
/// s_i (initial) before t0 and s_f (final_sparsity) after t1 (t0 = start, t1 = end). It rises fast at first,
/// while redundant weights abound, and levels off towards s_f. The masks are updated at t0, t0 + every, ...
/// within [t0, t1], and at t1 (Δt = every in the paper).
struct GradualSchedule {
  std::int64_t start = 0, end = 0, every = 1;
  double initial = 0.0, final_sparsity = 0.5;
  /// s_t in fp64 (exactly s_i at t <= t0 and s_f at t >= t1; with t1 == t0, s_f from t0 on).
  double sparsity_at(std::int64_t step) const;
  /// start <= step <= end and ((step − start) % every == 0 or step == end).
  bool updates_at(std::int64_t step) const;
  /// Throws a tg::Error unless start <= end, every >= 1 and both sparsities are in [0, 1).
  void validate() const;
};

/// The prunable parameters of a GPT: the 2-D weights of the blocks' linear layers, i.e. a name
/// "h.<i>.<...>.weight" with a 2-D shape and no LayerNorm component ("ln*"): h.{i}.attn.c_attn.weight,
/// h.{i}.attn.c_proj.weight, h.{i}.mlp.c_fc.weight, h.{i}.mlp.c_proj.weight. Embeddings (wte, tied to the LM
/// head; wpe), LayerNorms and biases are never pruned.
bool is_prunable(const std::string& name, const Shape& shape);

namespace detail {
/// The selection key of a weight: |w| (NaN as +inf, so it is never chosen over a finite weight and the order
/// stays a strict weak order), or −1 for a weight already pruned (below every |w|: it stays pruned).
inline float prune_key(float w, bool kept) {
  if (!kept) return -1.f;
  return w != w ? std::numeric_limits<float>::infinity() : std::fabs(w);
}
/// Prunes (keep[i] = 0) the k smallest keys, ties broken by index: after it, keep[i] == 0 exactly for the
/// first k elements of the order (key, i), plus any already 0. With the −1 keys of pruned weights this is
/// "the k smallest |w| among live weights on top of the pruned ones" and the pruned count is max(k, before).
/// Expected O(n): nth_element finds the threshold τ on a copy, one pass prunes key < τ and the first
/// k − #{key < τ} elements with key == τ.
void prune_smallest(std::span<const float> keys, std::int64_t k, std::span<std::uint8_t> keep);
/// 2:4: in every group of 4 consecutive elements (keys.size() % 4 == 0), prunes the 2 smallest keys (ties by
/// index); a group with 2 or more pruned already is left as is.
void prune_two_four(std::span<const float> keys, std::span<std::uint8_t> keep);
/// The first group of 4 (its element index) whose zero count is neither 2 nor, when `allow_dense`, 0; −1 if none.
std::int64_t first_bad_two_four_group(std::span<const std::uint8_t> keep, bool allow_dense);
}  // namespace detail

/// Masks for the prunable parameters of a model on device D (Note [pruning masks]).
template <Device D>
class Pruner {
 public:
  struct LayerSparsity {
    std::string name;
    std::int64_t pruned, total;
  };

  /// Picks the prunable parameters of `params` (in their order; error if none). 2:4 needs every prunable
  /// weight's input dimension (its last) divisible by 4; the error names the parameter. All masks start at ones.
  Pruner(const std::vector<optim::BasicParam<D>>& params, PruneSpec spec) : spec_(spec) {
    validate(spec_);
    for (const optim::BasicParam<D>& p : params) {
      if (!is_prunable(p.name, p.tensor.shape())) continue;
      TG_CHECK(p.tensor.is_contiguous(), "Pruner: parameter '", p.name, "' must be contiguous");
      if (spec_.pattern == SparsityPattern::two_four)
        TG_CHECK(p.tensor.size(-1) % 4 == 0, "Pruner: 2:4 sparsity needs the input dimension of '", p.name,
                 "' to be divisible by 4, its shape is ", p.tensor.shape());
      entries_.push_back(Entry{p, total_, p.tensor.numel(), 0, {}});
      total_ += p.tensor.numel();
    }
    TG_CHECK(!entries_.empty(), "Pruner: none of the ", params.size(),
             " parameters is prunable (the 2-D weights of the blocks' linear layers, h.<i>.*.weight)");
    keep_.assign(static_cast<std::size_t>(total_), 1);
  }

  /// Recomputes the masks from the weights' magnitudes now (Note [pruning masks]); the weights are unchanged.
  ///   unstructured, global:    the round(s·n) smallest |w| over all n prunable weights, ties by flat index
  ///                            (the parameters concatenated in order);
  ///   unstructured, per layer: round(s·n_l) in each layer l;
  ///   2:4:                     s = 0.5 prunes the 2 smallest |w| of every 4 consecutive along the input
  ///                            dimension (ties by index); s = 0 leaves the masks as they are.
  /// Pruned weights stay pruned, so a count is max(round(s·n), pruned before).
  void prune_to(double sparsity) {
    if (spec_.pattern == SparsityPattern::two_four) {
      TG_CHECK(sparsity == 0.5 || sparsity == 0.0, "Pruner::prune_to: 2:4 sparsity is 0.5 (or 0: no pruning), got ", sparsity);
    } else {
      TG_CHECK(sparsity >= 0.0 && sparsity < 1.0, "Pruner::prune_to: sparsity must be in [0, 1), got ", sparsity);
    }
    if (sparsity == 0.0) return;
    const auto target = [sparsity](std::int64_t n) { return static_cast<std::int64_t>(std::llround(sparsity * static_cast<double>(n))); };
    if (spec_.pattern == SparsityPattern::unstructured && spec_.scope == PruneScope::global && target(total_) <= pruned_count())
      return;
    std::vector<float> keys(static_cast<std::size_t>(total_));
    for (const Entry& e : entries_) fill_keys(e, keys);
    const std::span<std::uint8_t> keep(keep_);
    const std::span<const float> all(keys);
    if (spec_.pattern == SparsityPattern::two_four) {
      for (const Entry& e : entries_) detail::prune_two_four(all.subspan(e.offset, e.numel), keep.subspan(e.offset, e.numel));
    } else if (spec_.scope == PruneScope::global) {
      detail::prune_smallest(all, target(total_), keep);
    } else {
      for (const Entry& e : entries_)
        detail::prune_smallest(all.subspan(e.offset, e.numel), target(e.numel), keep.subspan(e.offset, e.numel));
    }
    sync_device_masks(/*all=*/false);
  }

  /// w ← w ⊙ M for every prunable weight, in place on D (pruned weights become +0.0).
  void apply_to_weights() const {
    NoGrad no_grad;
    for (const Entry& e : entries_)
      if (e.pruned > 0) zero_pruned(e, e.param.tensor, "weight");
  }
  /// ∂L/∂w ← ∂L/∂w ⊙ M for every prunable weight that has a gradient, in place on D.
  void apply_to_grads() const {
    NoGrad no_grad;
    for (const Entry& e : entries_)
      if (e.pruned > 0)
        if (const Tensor<fp32, D> g = e.param.tensor.grad(); g.defined()) zero_pruned(e, g, "gradient");
  }

  /// Pruned / prunable elements.
  double sparsity() const { return static_cast<double>(pruned_count()) / static_cast<double>(total_); }
  /// Pruned and total elements of each prunable parameter, in order.
  std::vector<LayerSparsity> report() const {
    std::vector<LayerSparsity> r;
    for (const Entry& e : entries_) r.push_back({e.param.name, e.pruned, e.numel});
    return r;
  }
  const PruneSpec& spec() const { return spec_; }
  /// The prunable parameters, in order.
  std::vector<std::string> names() const {
    std::vector<std::string> r;
    for (const Entry& e : entries_) r.push_back(e.param.name);
    return r;
  }

  /// Each mask as a fresh host U8 tensor of its parameter's shape (1 = kept, 0 = pruned), named
  /// "prune.mask.<param name>", in order.
  std::vector<std::pair<std::string, Tensor<std::uint8_t>>> mask_tensors() const {
    std::vector<std::pair<std::string, Tensor<std::uint8_t>>> r;
    for (const Entry& e : entries_) {
      const auto first = keep_.begin() + e.offset;
      r.emplace_back(std::string(kMaskPrefix) + e.param.name,
                     Tensor<std::uint8_t>::from_vector(e.param.tensor.shape(), std::vector<std::uint8_t>(first, first + e.numel)));
    }
    return r;
  }

  /// Restores masks saved by mask_tensors(). Checked before any mask changes, each failure a tg::Error naming
  /// the mask: exactly one mask per prunable parameter (none missing, none extra or repeated), its
  /// parameter's shape, every value 0 or 1, and for 2:4 the pattern (every group of 4 along the input dimension
  /// with exactly 2 zeros; or every mask all ones, as before the first prune_to).
  void load_masks(const std::vector<std::pair<std::string, Tensor<std::uint8_t>>>& masks) {
    std::vector<std::uint8_t> staged(keep_.size());
    std::vector<bool> seen(entries_.size(), false);
    for (const auto& [name, t] : masks) {
      TG_CHECK(name.starts_with(kMaskPrefix), "Pruner::load_masks: '", name, "' is not a pruning mask (expected '",
               kMaskPrefix, "<parameter name>')");
      const std::string param = name.substr(std::string_view(kMaskPrefix).size());
      std::size_t i = 0;
      while (i < entries_.size() && entries_[i].param.name != param) ++i;
      TG_CHECK(i < entries_.size(), "Pruner::load_masks: mask '", name, "' names no prunable parameter of the model");
      TG_CHECK(!seen[i], "Pruner::load_masks: mask '", name, "' is given more than once");
      seen[i] = true;
      const Entry& e = entries_[i];
      TG_CHECK(t.defined(), "Pruner::load_masks: mask '", name, "' is an undefined tensor");
      TG_CHECK(t.shape() == e.param.tensor.shape(), "Pruner::load_masks: mask '", name, "' has shape ", t.shape(),
               ", the parameter has shape ", e.param.tensor.shape());
      const std::vector<std::uint8_t> v = t.to_vector();
      for (std::size_t j = 0; j < v.size(); ++j)
        TG_CHECK(v[j] <= 1, "Pruner::load_masks: mask '", name, "' holds ", static_cast<int>(v[j]), " at flat index ", j,
                 "; a mask holds 0 (pruned) or 1 (kept)");
      std::copy(v.begin(), v.end(), staged.begin() + e.offset);
    }
    for (std::size_t i = 0; i < entries_.size(); ++i)
      TG_CHECK(seen[i], "Pruner::load_masks: no mask for the prunable parameter '", entries_[i].param.name, "' (expected '",
               kMaskPrefix, entries_[i].param.name, "')");
    if (spec_.pattern == SparsityPattern::two_four) {
      const bool dense = std::find(staged.begin(), staged.end(), std::uint8_t{0}) == staged.end();
      for (const Entry& e : entries_) {
        const std::int64_t g = detail::first_bad_two_four_group(std::span<const std::uint8_t>(staged).subspan(e.offset, e.numel), dense);
        const std::int64_t in = e.param.tensor.size(-1);
        TG_CHECK(g < 0, "Pruner::load_masks: mask '", kMaskPrefix, e.param.name, "' breaks the 2:4 pattern: the group of 4 at row ",
                 g / in, ", columns ", g % in, "..", g % in + 3, " does not have exactly 2 zeros");
      }
    }
    keep_ = std::move(staged);
    sync_device_masks(/*all=*/true);
  }

  /// True when every pruned weight is exactly zero, compared bitwise: its bits with the sign cleared are all
  /// zero (+0.0, which apply_to_weights writes, or −0.0). Copies the weights to the host.
  bool weights_respect_masks() const {
    for (const Entry& e : entries_) {
      if (e.pruned == 0) continue;
      const std::vector<fp32> w = e.param.tensor.to_vector();
      for (std::int64_t j = 0; j < e.numel; ++j)
        if (keep_[static_cast<std::size_t>(e.offset + j)] == 0 && (std::bit_cast<std::uint32_t>(static_cast<float>(w[j])) << 1) != 0)
          return false;
    }
    return true;
  }

  static constexpr const char* kMaskPrefix = "prune.mask.";

 private:
  struct Entry {
    optim::BasicParam<D> param;  // shares the model's tensor
    std::int64_t offset;         // of its mask in keep_
    std::int64_t numel;
    std::int64_t pruned;            // zeros of its mask
    Tensor<std::uint8_t, D> flags;  // 1 − M on D (undefined while nothing is pruned); replaced, never written
  };

  std::int64_t pruned_count() const {
    std::int64_t n = 0;
    for (const Entry& e : entries_) n += e.pruned;
    return n;
  }
  void fill_keys(const Entry& e, std::vector<float>& keys) const {
    const std::vector<fp32> w = e.param.tensor.to_vector();  // to the host
    for (std::int64_t j = 0; j < e.numel; ++j) {
      const auto i = static_cast<std::size_t>(e.offset + j);
      keys[i] = detail::prune_key(w[j], keep_[i] != 0);
    }
  }
  /// Recounts each mask and uploads the flags of those that changed: those whose count changed (prune_to only
  /// adds zeros), or all of them (`all`, load_masks: a mask may trade one pruned set for another).
  void sync_device_masks(bool all) {
    for (Entry& e : entries_) {
      const auto first = keep_.begin() + e.offset, last = first + e.numel;
      const std::int64_t pruned = e.numel - static_cast<std::int64_t>(std::count(first, last, std::uint8_t{1}));
      if (!all && pruned == e.pruned) continue;
      e.pruned = pruned;
      if (pruned == 0) {
        e.flags = {};
        continue;
      }
      std::vector<std::uint8_t> flags(static_cast<std::size_t>(e.numel));
      std::transform(first, last, flags.begin(), [](std::uint8_t k) { return static_cast<std::uint8_t>(k == 0); });
      e.flags = Tensor<std::uint8_t, D>::from_vector(e.param.tensor.shape(), flags);
    }
  }
  /// x ← flags ? 0 : x, in place (x contiguous with the parameter's shape).
  static void zero_pruned(const Entry& e, const Tensor<fp32, D>& x, const char* what) {
    TG_CHECK(x.shape() == e.param.tensor.shape() && x.is_contiguous(), "Pruner: the ", what, " of '", e.param.name,
             "' must be contiguous with shape ", e.param.tensor.shape(), ", it has shape ", x.shape(), " and strides ", x.strides());
    TG_BACKEND(D, masked_fill<fp32>(x.data(), x.strides(), e.flags.data(), e.flags.strides(), fp32(0.f), x.data(), x.shape()));
  }

  PruneSpec spec_;
  std::vector<Entry> entries_;
  std::int64_t total_ = 0;
  std::vector<std::uint8_t> keep_;  // M for every prunable weight, the parameters concatenated (host)
};

}  // namespace tg::quant

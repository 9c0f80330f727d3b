// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): a GPT whose attention heads, MLP width and vocabulary
// are split across the ranks of a group, with the communication as differentiable ops.
//   auto tp = tg::dist::world().split(0, rank);  tg::dist::TensorParallelGPT<> model(full_model, *tp);
//   auto logits = model.forward<float>(idx, gen, true);  auto loss = model.loss(logits, targets);   // logits: this rank's vocabulary
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "typegrad/amp/weights.hpp"
#include "typegrad/autodiff/checkpoint.hpp"
#include "typegrad/autodiff/node.hpp"
#include "typegrad/dist/comm.hpp"
#include "typegrad/dist/data_parallel.hpp"
#include "typegrad/dist/grid.hpp"
#include "typegrad/dist/pipeline.hpp"
#include "typegrad/nn/gpt.hpp"
#include "typegrad/ops/attention.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/concat.hpp"
#include "typegrad/ops/dropout.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/linear_gelu.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/views.hpp"
#include "typegrad/optim/cross_rank.hpp"
#include "typegrad/optim/param.hpp"
#include "typegrad/train/step.hpp"

namespace tg::dist {

// Note [tensor parallelism]
// With n ranks in the tensor-parallel group and rank r (Megatron-LM's layout; every rank holds the same
// replicated tensors and its own slice of the split ones):
//   * attention: c_attn [3C, C] is split by heads: rank r keeps the rows of its C/n query, key and value
//     features (heads r·H/n .. (r+1)·H/n - 1), so its attention runs on its own heads alone; c_proj [C, C] is
//     split by columns (the same features) and its partial products are summed over the group;
//   * MLP: c_fc [4C, C] by rows (column-parallel), c_proj [C, 4C] by columns (row-parallel), then the sum;
//   * the row-parallel layers' biases, the LayerNorms and wpe are replicated and added after the sum;
//   * the vocabulary: wte [V, C] by rows (ranges of ceil(V/n)); the embedding looks up the rank's rows (zero
//     for other tokens) and sums over the group; the tied LM head gives each rank the logits of its own
//     vocabulary range, and vocab_parallel_cross_entropy computes the loss from them without gathering them.
// The communication is two differentiable ops (Megatron's f and g): copy_to_group (forward: identity;
// backward: the sum of the gradients over the group) before each column-parallel part, and reduce_from_group
// (forward: the sum; backward: identity) after each row-parallel one: one all-reduce per block half in forward
// and its conjugate in backward. The replicated parameters see identical inputs and gradients on every rank,
// so they need no reduction. Dropout on the replicated activations draws the same numbers on every rank
// (same generator, same shapes), so a run equals the one-process run up to the order of fp32 sums.
// For the global gradient norm the split parameters' squares are summed over the group and the replicated
// ones counted once (TensorParallelSync::counts_in_norm).

namespace detail {
/// Bytes one rank sends in a ring all-reduce of `bytes` over n ranks: 2(n-1)/n of them (Note [tensor parallelism]).
inline std::int64_t all_reduce_wire(std::int64_t bytes, int n) { return n > 1 ? 2 * bytes * (n - 1) / n : 0; }
/// Bytes one rank sends in a ring all-gather or reduce-scatter whose full tensor is `bytes`: (n-1)/n of them.
inline std::int64_t gather_wire(std::int64_t bytes, int n) { return n > 1 ? bytes * (n - 1) / n : 0; }
}  // namespace detail

/// Forward: x; backward: the gradient summed over `comm`'s ranks (Megatron's f). `bytes`, when given, counts
/// the bytes this rank sends (Note [tensor parallelism]).
template <FloatingElement T, Device D>
Tensor<T, D> copy_to_group(const Tensor<T, D>& x, Communicator& comm, std::int64_t* bytes = nullptr) {
  Tensor<T, D> out = x.detach();
  struct Saved {
    Communicator* comm;
    std::int64_t* bytes;
  };
  autodiff::record("copy_to_group", out, Saved{&comm, bytes},
                   [](Saved& s, const Tensor<T, D>& dout, auto) {
                     Tensor<T, D> g = Tensor<T, D>::empty(dout.shape());
                     tg::detail::copy_tensor(dout, g);
                     s.comm->all_reduce(g, ReduceOp::sum);
                     if (s.bytes) *s.bytes += detail::all_reduce_wire(static_cast<std::int64_t>(g.nbytes()), s.comm->size());
                     return std::tuple{g};
                   }, x);
  return out;
}

/// Forward: x summed over `comm`'s ranks; backward: identity (Megatron's g).
template <FloatingElement T, Device D>
Tensor<T, D> reduce_from_group(const Tensor<T, D>& x, Communicator& comm, std::int64_t* bytes = nullptr) {
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  tg::detail::copy_tensor(x, out);
  comm.all_reduce(out, ReduceOp::sum);
  if (bytes) *bytes += detail::all_reduce_wire(static_cast<std::int64_t>(out.nbytes()), comm.size());
  struct Saved {};
  autodiff::record("reduce_from_group", out, Saved{}, [](Saved&, const Tensor<T, D>& dout, auto) { return std::tuple{dout}; }, x);
  return out;
}

// Note [sequence parallelism]
// Between the tensor-parallel parts of a block (the LayerNorms, the dropouts, the residual adds) every rank
// of a plain tensor-parallel group holds the same (B,T,C) activations and does the same work on them.
// Sequence parallelism (Korthikanti et al. 2022) splits those regions along the sequence instead: rank r of n
// holds positions [r·T/n, (r+1)·T/n) (T must be a multiple of n), so their activations and their work are
// divided by n. The communication changes shape, not volume: before each column-parallel part the sequence is
// gathered (gather_from_sequence: an all-gather forward, a reduce-scatter backward) and after each row-parallel
// part the partial sums are summed and scattered (reduce_scatter_to_sequence: a reduce-scatter forward, an
// all-gather backward), and an all-gather plus a reduce-scatter send what one all-reduce sends. The
// embedding's vocabulary-parallel sum becomes a reduce-scatter and the head gathers the sequence before
// the LM head. The replicated parameters used in those regions (the LayerNorms, the row-parallel biases, wpe)
// then see only their rank's positions, so their gradients are summed over the group: each block reads them
// through one copy_to_group of their concatenated fp32 masters (one all-reduce of 6C values in backward, in
// fp32). Dropout on a sequence slice draws the numbers the full tensor would (sequence_parallel_dropout), so
// a run with sequence parallelism equals the one-process run like plain tensor parallelism does.

/// Positions [begin, end) of rank r's part of a sequence of T positions split over n ranks (T a multiple of n).
inline std::pair<std::int64_t, std::int64_t> sequence_range(std::int64_t T, int r, int n) { return {r * (T / n), (r + 1) * (T / n)}; }

namespace detail {
/// The counts of a (B, T, ...) tensor's sequence parts over n ranks, in elements.
inline std::vector<std::int64_t> sequence_counts(const Shape& full, int n) {
  const std::int64_t per = full.numel() / std::max<std::int64_t>(1, full[1]) * (full[1] / n);
  return std::vector<std::int64_t>(static_cast<std::size_t>(n), per);
}
/// Rank-major packing of dim 1 (part r: x[:, r·T/n : (r+1)·T/n] contiguous), for a reduce-scatter. A
/// contiguous x with one batch row is already in that order: returned as a flat view, not copied.
template <FloatingElement T, Device D>
Tensor<T, D> pack_sequence(const Tensor<T, D>& x, int n) {
  if (x.size(0) == 1 && x.is_contiguous()) return x.detach().reshape({x.numel()});
  Tensor<T, D> flat = Tensor<T, D>::empty({x.numel()});
  const std::int64_t Tl = x.size(1) / n, part = x.numel() / n;
  Shape ps = x.shape();
  ps[1] = Tl;
  for (int r = 0; r < n; ++r) tg::detail::copy_tensor(x.narrow(1, r * Tl, Tl), flat.narrow(0, r * part, part).reshape(ps));
  return flat;
}
/// The inverse of pack_sequence: a (B, T, ...) tensor of `full` shape from rank-major parts (with one batch
/// row, `flat` itself viewed in that shape).
template <FloatingElement T, Device D>
Tensor<T, D> unpack_sequence(const Tensor<T, D>& flat, const Shape& full, int n) {
  if (full[0] == 1) return flat.detach().reshape(full);
  Tensor<T, D> out = Tensor<T, D>::empty(full);
  const std::int64_t Tl = full[1] / n, part = full.numel() / n;
  Shape ps = full;
  ps[1] = Tl;
  for (int r = 0; r < n; ++r) tg::detail::copy_tensor(flat.narrow(0, r * part, part).reshape(ps), out.narrow(1, r * Tl, Tl));
  return out;
}
inline void check_sequence_split(const Shape& full, int n, const char* op) {
  TG_CHECK(full.size() >= 2, op, ": a (B, T, ...) tensor is split along its sequence (dim 1), got ", full);
  TG_CHECK(full[1] % n == 0, op, ": a sequence of ", full[1], " positions does not split evenly over ", n,
           " tensor-parallel ranks (sequence parallelism needs a sequence length that is a multiple of the tensor-parallel size)");
}
}  // namespace detail

/// Forward: this rank's sequence part x (B, T/n, ...) gathered into (B, T, ...) over `comm` (Note [sequence
/// parallelism]); backward: the gradient summed over the group, this rank's part kept (a reduce-scatter).
template <FloatingElement T, Device D>
Tensor<T, D> gather_from_sequence(const Tensor<T, D>& x, Communicator& comm, std::int64_t* bytes = nullptr) {
  const int n = comm.size();
  TG_CHECK(x.dim() >= 2, "gather_from_sequence: a (B, T, ...) tensor is split along its sequence (dim 1), got ", x.shape());
  Shape full = x.shape();
  full[1] *= n;
  const auto counts = detail::sequence_counts(full, n);
  const Tensor<T, D> mine = x.contiguous_raw();
  Tensor<T, D> flat = Tensor<T, D>::empty({full.numel()});
  comm.all_gather(buffer_of(mine), buffer_of(flat), counts);
  Tensor<T, D> out = detail::unpack_sequence(flat, full, n).detach();
  if (bytes) *bytes += detail::gather_wire(static_cast<std::int64_t>(out.nbytes()), n);
  struct Saved {
    Communicator* comm;
    std::int64_t* bytes;
    Shape local;
  };
  autodiff::record("gather_from_sequence", out, Saved{&comm, bytes, x.shape()},
                   [](Saved& s, const Tensor<T, D>& dout, auto) {
                     const int m = s.comm->size();
                     const Tensor<T, D> packed = detail::pack_sequence(dout, m);
                     Tensor<T, D> g = Tensor<T, D>::empty(s.local);
                     s.comm->reduce_scatter(buffer_of(packed), buffer_of(g), detail::sequence_counts(dout.shape(), m), ReduceOp::sum);
                     if (s.bytes) *s.bytes += detail::gather_wire(static_cast<std::int64_t>(dout.nbytes()), m);
                     return std::tuple{g};
                   }, x);
  return out;
}

/// Forward: x (B, T, ...) summed over `comm`'s ranks, this rank's sequence part (B, T/n, ...) kept (a
/// reduce-scatter; Note [sequence parallelism]); backward: the parts' gradients gathered (an all-gather).
template <FloatingElement T, Device D>
Tensor<T, D> reduce_scatter_to_sequence(const Tensor<T, D>& x, Communicator& comm, std::int64_t* bytes = nullptr) {
  const int n = comm.size();
  detail::check_sequence_split(x.shape(), n, "reduce_scatter_to_sequence");
  Shape local = x.shape();
  local[1] /= n;
  const Tensor<T, D> packed = detail::pack_sequence(x, n);
  Tensor<T, D> out = Tensor<T, D>::empty(local);
  comm.reduce_scatter(buffer_of(packed), buffer_of(out), detail::sequence_counts(x.shape(), n), ReduceOp::sum);
  if (bytes) *bytes += detail::gather_wire(static_cast<std::int64_t>(x.nbytes()), n);
  struct Saved {
    Communicator* comm;
    std::int64_t* bytes;
    Shape full;
  };
  autodiff::record("reduce_scatter_to_sequence", out, Saved{&comm, bytes, x.shape()},
                   [](Saved& s, const Tensor<T, D>& dout, auto) {
                     const int m = s.comm->size();
                     const Tensor<T, D> mine = dout.contiguous_raw();
                     Tensor<T, D> flat = Tensor<T, D>::empty({s.full.numel()});
                     s.comm->all_gather(buffer_of(mine), buffer_of(flat), detail::sequence_counts(s.full, m));
                     if (s.bytes) *s.bytes += detail::gather_wire(static_cast<std::int64_t>(flat.nbytes()), m);
                     return std::tuple{detail::unpack_sequence(flat, s.full, m)};
                   }, x);
  return out;
}

/// Dropout of positions [t0, t0 + Tl) of a (B, T, ...) tensor given as that slice x (B, Tl, ...): element
/// (b, t, j) of x is kept or dropped as element (b, t0 + t, j) of the full tensor would be by dropout() (Note
/// [dropout replays its mask]), and the generator advances by the full tensor's count, so the ranks of a
/// sequence-parallel group draw, between them, the one-process run's mask (Note [sequence parallelism]).
template <FloatingElement T, Device D>
Tensor<T, D> sequence_parallel_dropout(const Tensor<T, D>& x, double p, Generator& gen, bool training, std::int64_t full_length, std::int64_t t0) {
  TG_CHECK(p >= 0.0 && p < 1.0, "sequence_parallel_dropout: p must be in [0, 1), got ", p);
  TG_CHECK(x.dim() >= 2, "sequence_parallel_dropout: x must be (B, T, ...), got ", x.shape());
  TG_CHECK(t0 >= 0 && t0 + x.size(1) <= full_length, "sequence_parallel_dropout: positions [", t0, ", ", t0 + x.size(1),
           ") are outside a sequence of ", full_length);
  if (!training || p == 0.0) return x;
  const std::int64_t B = x.size(0), Tl = x.size(1), inner = B * Tl > 0 ? x.numel() / (B * Tl) : 0;
  const std::uint64_t seed = gen.seed(),
                      offset = tg::detail::dropout_position(gen.advance(tg::detail::dropout_counters(static_cast<std::uint64_t>(B * full_length * inner))));
  struct Saved {
    std::uint64_t seed, offset;
    double p;
    std::int64_t full_length, t0;
  };
  // Batch row b of the slice is elements [(b·T + t0)·inner, ...) of the full tensor's stream: one launch per row.
  auto apply = [](const Saved& s, const Tensor<T, D>& in) {
    Tensor<T, D> out = Tensor<T, D>::empty(in.shape());
    const std::int64_t rows = in.size(0), per = in.size(0) > 0 ? in.numel() / in.size(0) : 0, len = in.size(1);
    const std::int64_t inner_ = len > 0 ? per / len : 0;
    for (std::int64_t b = 0; b < rows; ++b) {
      const Tensor<T, D> src = in.narrow(0, b, 1), dst = out.narrow(0, b, 1);
      const std::uint64_t at = s.offset + static_cast<std::uint64_t>((b * s.full_length + s.t0) * inner_);
      TG_BACKEND(D, dropout_forward<T>(src.data(), src.strides(), dst.data(), src.shape(), s.seed, at, nullptr, s.p));
    }
    return out;
  };
  const Saved saved{seed, offset, p, full_length, t0};
  Tensor<T, D> out = apply(saved, x);
  autodiff::record("sequence_parallel_dropout", out, saved,
                   [apply](Saved& s, const Tensor<T, D>& dout, auto) { return std::tuple{apply(s, dout)}; }, x);
  return out;
}

/// Mean cross-entropy of logits split by vocabulary over `comm` (rank r holds columns [v0, v0 + Vl) of the V
/// logits): log-sum-exp per row from the ranks' partial ones (an all-gather of one number per row), the target's
/// logit from its owner (an all-reduce), so the full logits are never gathered. Every rank returns the loss;
/// the backward gives each rank the gradient of its own columns: (softmax - onehot) / rows. The math is fp64 on
/// the host (a device's logits are copied there and the gradient back).
template <FloatingElement T, Device D>
Tensor<T, D> vocab_parallel_cross_entropy(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets, Communicator& comm,
                                          std::int64_t v0, std::int64_t vocab) {
  TG_CHECK(logits.dim() >= 1, "vocab_parallel_cross_entropy: logits must have a last dim of classes, got ", logits.shape());
  const std::int64_t Vl = logits.size(-1), N = Vl > 0 ? logits.numel() / Vl : 0;
  TG_CHECK(targets.numel() == N, "vocab_parallel_cross_entropy: ", N, " rows of logits, ", targets.numel(), " targets");
  const Tensor<T> l = logits.detach().template to<cpu>().contiguous_raw();
  const Tensor<std::int64_t> t = targets.contiguous_raw();
  const int n = comm.size();
  std::vector<double> lse_parts(static_cast<std::size_t>(N) * static_cast<std::size_t>(n));
  std::vector<double> mine(static_cast<std::size_t>(N)), target_logit(static_cast<std::size_t>(N), 0.0);
  for (std::int64_t i = 0; i < N; ++i) {
    const T* row = l.data() + i * Vl;
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j < Vl; ++j) m = std::max(m, static_cast<double>(row[j]));
    double s = 0;
    for (std::int64_t j = 0; j < Vl; ++j) s += std::exp(static_cast<double>(row[j]) - m);
    mine[static_cast<std::size_t>(i)] = m + std::log(s);
    const std::int64_t y = t.data()[i];
    TG_CHECK(y >= 0 && y < vocab, "vocab_parallel_cross_entropy: target ", y, " is outside the vocabulary of ", vocab);
    if (y >= v0 && y < v0 + Vl) target_logit[static_cast<std::size_t>(i)] = static_cast<double>(row[y - v0]);
  }
  std::vector<std::int64_t> counts(static_cast<std::size_t>(n), N);
  const DeviceKind host = DeviceKind::cpu;
  comm.all_gather(Buffer{mine.data(), N, DType::f64, host}, Buffer{lse_parts.data(), N * n, DType::f64, host}, counts);
  comm.all_reduce(std::span<double>(target_logit), ReduceOp::sum);
  std::vector<double> lse(static_cast<std::size_t>(N));
  double total = 0;
  for (std::int64_t i = 0; i < N; ++i) {
    double m = -std::numeric_limits<double>::infinity();
    for (int r = 0; r < n; ++r) m = std::max(m, lse_parts[static_cast<std::size_t>(r * N + i)]);
    double s = 0;
    for (int r = 0; r < n; ++r) s += std::exp(lse_parts[static_cast<std::size_t>(r * N + i)] - m);
    lse[static_cast<std::size_t>(i)] = m + std::log(s);
    total += lse[static_cast<std::size_t>(i)] - target_logit[static_cast<std::size_t>(i)];
  }
  Tensor<T, D> out = Tensor<T>::full({}, total / static_cast<double>(std::max<std::int64_t>(1, N))).template to<D>().detach();
  struct Saved {
    Tensor<T> logits;
    Tensor<std::int64_t> targets;
    std::vector<double> lse;
    std::int64_t v0;
  };
  autodiff::record("vocab_parallel_cross_entropy", out, Saved{l, t, std::move(lse), v0},
                   [N, Vl, shape = logits.shape()](Saved& s, const Tensor<T, D>& dout, auto) {
                     const double g = static_cast<double>(dout.item()) / static_cast<double>(std::max<std::int64_t>(1, N));
                     Tensor<T> dl = Tensor<T>::empty(shape);
                     for (std::int64_t i = 0; i < N; ++i) {
                       const T* row = s.logits.data() + i * Vl;
                       T* d = dl.data() + i * Vl;
                       const double lse_i = s.lse[static_cast<std::size_t>(i)];
                       const std::int64_t y = s.targets.data()[i] - s.v0;
                       for (std::int64_t j = 0; j < Vl; ++j)
                         d[j] = T(std::exp(static_cast<double>(row[j]) - lse_i) * g - (j == y ? g : 0.0));
                     }
                     return std::tuple{dl.template to<D>().detach()};
                   }, logits);
  return out;
}

/// How a parameter is laid out across the tensor-parallel group (Note [tensor parallelism]).
enum class Split {
  replicated,  ///< every rank holds all of it
  rows,        ///< dim 0 in ranges of ceil(rows / n) (wte, c_fc)
  qkv_rows,    ///< dim 0 as three parts (q, k, v), each split in n equal ranges
  cols         ///< dim 1 in n equal ranges (the row-parallel c_proj weights)
};

/// A split parameter: its GPT-2 name, this rank's slice (a trainable leaf), and the full shape.
template <Device D>
struct ShardedParam {
  std::string name;
  Tensor<fp32, D> tensor;
  Split split = Split::replicated;
  Shape full_shape;
};

namespace detail {
/// [begin, end) of rank r's range of `extent` split in n (ranges of ceil(extent / n); the last may be short).
inline std::pair<std::int64_t, std::int64_t> range_of(std::int64_t extent, int r, int n) {
  const std::int64_t per = (extent + n - 1) / n;
  return {std::min(extent, per * r), std::min(extent, per * (r + 1))};
}
/// Copies between a full host tensor and rank r's slice under `split`: slice <- full (to_slice) or full <- slice.
inline void move_slice(const Tensor<fp32>& full, const Tensor<fp32>& slice, Split split, int r, int n, bool to_slice) {
  const Shape& fs = full.shape();
  const std::int64_t inner = fs.numel() / std::max<std::int64_t>(1, fs[0]);  // elements per dim-0 row
  auto rows = [&](std::int64_t full_row, std::int64_t slice_row, std::int64_t count) {
    fp32* f = full.data() + full_row * inner;
    fp32* s = slice.data() + slice_row * inner;
    if (to_slice) std::copy(f, f + count * inner, s);
    else std::copy(s, s + count * inner, f);
  };
  switch (split) {
    case Split::replicated: rows(0, 0, fs[0]); return;
    case Split::rows: {
      const auto [b, e] = range_of(fs[0], r, n);
      rows(b, 0, e - b);
      return;
    }
    case Split::qkv_rows: {
      const std::int64_t part = fs[0] / 3, per = part / n;
      for (int k = 0; k < 3; ++k) rows(k * part + r * per, k * per, per);
      return;
    }
    case Split::cols: {
      const std::int64_t R = fs[0], K = fs[1], per = K / n;
      for (std::int64_t i = 0; i < R; ++i) {
        fp32* f = full.data() + i * K + r * per;
        fp32* s = slice.data() + i * per;
        if (to_slice) std::copy(f, f + per, s);
        else std::copy(s, s + per, f);
      }
      return;
    }
  }
}
/// The shape of rank r's slice of `full` under `split`.
inline Shape slice_shape(const Shape& full, Split split, int r, int n) {
  Shape s = full;
  switch (split) {
    case Split::replicated: break;
    case Split::rows: {
      const auto [b, e] = range_of(full[0], r, n);
      s[0] = e - b;
      break;
    }
    case Split::qkv_rows: s[0] = full[0] / n; break;
    case Split::cols: s[1] = full[1] / n; break;
  }
  return s;
}
}  // namespace detail

/// How a TensorParallelGPT splits its work.
struct TensorParallelOptions {
  /// Split the LayerNorm, dropout and residual regions along the sequence (Note [sequence parallelism]): their
  /// activations and work are divided by the group's size; the sequence length must be a multiple of it.
  bool sequence_parallel = false;
};

/// A GPT split across a tensor-parallel group (Note [tensor parallelism]): built from the full model (so it
/// starts from the one-process model's weights), trained through train::TrainStep with its loss() and a
/// TensorParallelSync, gathered back to the full layout for checkpoints.
template <Device D = cpu>
class TensorParallelGPT {
 public:
  /// The whole model split over the tensor-parallel group `tp`.
  TensorParallelGPT(const nn::BasicGPT<cpu>& full, Communicator& tp, TensorParallelOptions options = {})
      : TensorParallelGPT(full, tp, nullptr, nullptr, options) {}
  TensorParallelGPT(const TensorParallelGPT&) = delete;
  TensorParallelGPT& operator=(const TensorParallelGPT&) = delete;
  /// This rank's stage of a process grid (Note [process grid]): its pipeline stage's blocks (Note [pipeline
  /// parallelism]), split over its tensor-parallel group; used by PipelineStep.
  TensorParallelGPT(const nn::BasicGPT<cpu>& full, const ProcessGrid& grid, TensorParallelOptions options = {})
      : TensorParallelGPT(full, *grid.tp, grid.pp.get(), grid.model.get(), options) {}

  const nn::GPTConfig& config() const { return config_; }
  Communicator& tensor_group() const { return *tp_; }
  Communicator& pipeline() const { return *pp_; }
  /// The ranks holding one whole replica (tensor-parallel group x pipeline).
  Communicator& model_group() const { return *model_; }
  bool sequence_parallel() const { return options_.sequence_parallel; }
  /// The shape of the activations between blocks (and between pipeline stages) for a (B, T) batch: (B, T, C),
  /// or this rank's part of the sequence (B, T/n, C) under sequence parallelism.
  Shape activation_shape(std::int64_t B, std::int64_t T) const {
    return {B, options_.sequence_parallel ? T / tp_->size() : T, config_.n_embd};
  }
  /// Where this stage's dropout draws lie in a (B, T) micro-batch (Note [pipeline parallelism]; under sequence
  /// parallelism each rank advances by the full tensors' counts too).
  DropoutCounters dropout_counters(std::int64_t B, std::int64_t T) const { return gpt_dropout_counters(config_, first_, last_, is_first(), B, T); }
  bool is_first() const { return pp_->rank() == 0; }
  bool is_last() const { return pp_->rank() == pp_->size() - 1; }
  std::int64_t first_block() const { return first_; }
  std::int64_t last_block() const { return last_; }
  /// This rank's vocabulary range [vocab_begin, vocab_end).
  std::int64_t vocab_begin() const { return v0_; }
  std::int64_t vocab_end() const { return v1_; }

  /// This rank's parameters (slices), GPT-2 names, for the optimizer and TrainStep.
  std::vector<optim::BasicParam<D>> named_parameters() const {
    std::vector<optim::BasicParam<D>> out;
    for (const auto& p : params_) out.emplace_back(p.name, p.tensor);
    return out;
  }
  const std::vector<ShardedParam<D>>& sharded_parameters() const { return params_; }

  /// This rank's logits (B,T,vocab_end - vocab_begin) in T (a model without a pipeline), the blocks under the
  /// checkpointing policy Ckpt.
  template <FloatingElement T, ActivationCheckpointing Ckpt = NoCheckpoint>
  Tensor<T, D> forward(const Tensor<std::int64_t>& idx, Generator& dropout_gen, bool training = true) const {
    TG_CHECK(pp_->size() == 1, "TensorParallelGPT::forward: a pipeline stage runs through PipelineStep");
    return head<T>(blocks<T, Ckpt>(embed<T>(idx, dropout_gen, training), dropout_gen, training));
  }

  /// The first stage's input: the vocabulary-parallel embedding (this rank's rows, zero for tokens outside its
  /// range, summed over the group) plus wpe, (B,T,C).
  template <FloatingElement T>
  Tensor<T, D> embed(const Tensor<std::int64_t>& idx, Generator& dropout_gen, bool training) const {
    TG_CHECK(idx.dim() == 2, "TensorParallelGPT: idx must be (B,T), got ", idx.shape());
    const std::int64_t B = idx.size(0), T_ = idx.size(1);
    TG_CHECK(T_ <= config_.block_size, "TensorParallelGPT: sequence length ", T_, " exceeds block_size ", config_.block_size);
    Tensor<std::int64_t> local = Tensor<std::int64_t>::empty(idx.shape());
    Tensor<T> mask_host = Tensor<T>::empty({B, T_, 1});
    const Tensor<std::int64_t> ic = idx.contiguous_raw();
    for (std::int64_t i = 0; i < B * T_; ++i) {
      const std::int64_t v = ic.data()[i];
      const bool in = v >= v0_ && v < v1_;
      local.data()[i] = in ? v - v0_ : 0;
      mask_host.data()[i] = T(in ? 1.0f : 0.0f);
    }
    const Tensor<T, D> mask = mask_host.template to<D>();
    const Tensor<T, D> tokens = mul(embedding(w<T>("wte.weight"), local), mask);
    if (!options_.sequence_parallel) {
      Tensor<T, D> x = reduce_from_group(tokens, *tp_, &bytes_);
      x = add(x, embedding(w<T>("wpe.weight"), Tensor<std::int64_t>::arange(T_)));
      return dropout(x, config_.dropout, dropout_gen, training);
    }
    // Note [sequence parallelism]: the token sum scattered over the sequence, this rank's positions of wpe (read
    // through one copy_to_group of the rows in use, so its gradient is summed over the group).
    TG_CHECK(T_ % tp_->size() == 0, "sequence parallelism: a sequence of ", T_, " positions does not split evenly over ", tp_->size(),
             " tensor-parallel ranks (the sequence length must be a multiple of the tensor-parallel size)");
    const auto [t0, t1] = sequence_range(T_, tp_->rank(), tp_->size());
    Tensor<T, D> x = reduce_scatter_to_sequence(tokens, *tp_, &bytes_);
    const Tensor<fp32, D> positions = copy_to_group(find("wpe.weight").tensor.narrow(0, 0, T_), *tp_, &bytes_);
    x = add(x, positions.template to<T>().narrow(0, t0, t1 - t0));
    return sequence_parallel_dropout(x, config_.dropout, dropout_gen, training, T_, t0);
  }

  /// This rank's blocks on x (B,T,C) (Note [tensor parallelism]), each under the checkpointing policy Ckpt (its
  /// recompute repeats the block's all-reduces, in the same order on every rank).
  template <FloatingElement T, ActivationCheckpointing Ckpt = NoCheckpoint>
  Tensor<T, D> blocks(Tensor<T, D> x, Generator& dropout_gen, bool training) const {
    for (const Block& b : blocks_) x = checkpointed<Ckpt>(b, x, dropout_gen, training);
    return x;
  }

  /// Block l (pre-LN, attention then MLP, dropout on both branches) on x (B,T,C), or on this rank's part of the
  /// sequence (B,T/n,C) under sequence parallelism.
  template <FloatingElement T>
  Tensor<T, D> block_forward(std::int64_t l, Tensor<T, D> x, Generator& dropout_gen, bool training) const {
    if (options_.sequence_parallel) return sequence_parallel_block<T>(l, x, dropout_gen, training);
    const std::int64_t Hl = config_.n_head / tp_->size();  // this rank's heads
    Communicator& g = *tp_;
    const std::string h = "h." + std::to_string(l) + ".";
    const Tensor<T, D> a = copy_to_group(layernorm(x, w<T>(h + "ln_1.weight"), w<T>(h + "ln_1.bias")), g, &bytes_);
    const Tensor<T, D> qkv = linear(a, w<T>(h + "attn.c_attn.weight"), w<T>(h + "attn.c_attn.bias"));  // (B,T,3·C/n)
    // the local heads straight from the packed (q | k | v) columns, (B,T,C/n) out: no head-layout copies
    const Tensor<T, D> y = causal_attention_qkv(qkv, Hl);
    const Tensor<T, D> o = add(reduce_from_group(linear(y, w<T>(h + "attn.c_proj.weight")), g, &bytes_), w<T>(h + "attn.c_proj.bias"));
    x = add(x, dropout(o, config_.dropout, dropout_gen, training));
    const Tensor<T, D> m = copy_to_group(layernorm(x, w<T>(h + "ln_2.weight"), w<T>(h + "ln_2.bias")), g, &bytes_);
    const Tensor<T, D> f = linear_gelu_tanh(m, w<T>(h + "mlp.c_fc.weight"), w<T>(h + "mlp.c_fc.bias"));  // (B,T,4C/n)
    const Tensor<T, D> o2 = add(reduce_from_group(linear(f, w<T>(h + "mlp.c_proj.weight")), g, &bytes_), w<T>(h + "mlp.c_proj.bias"));
    return add(x, dropout(o2, config_.dropout, dropout_gen, training));
  }

  /// The last stage's output: this rank's logits (B,T,vocab_end - vocab_begin).
  template <FloatingElement T>
  Tensor<T, D> head(const Tensor<T, D>& x) const {
    TG_CHECK(v1_ > v0_, "TensorParallelGPT: rank ", tp_->rank(), " holds no vocabulary");
    Tensor<T, D> h;
    if (options_.sequence_parallel) {  // Note [sequence parallelism]: the sequence gathered before the LM head
      const auto ln = summed_over_group<T>({"ln_f.weight", "ln_f.bias"});
      h = gather_from_sequence(layernorm(x, ln[0], ln[1]), *tp_, &bytes_);
    } else {
      h = copy_to_group(layernorm(x, w<T>("ln_f.weight"), w<T>("ln_f.bias")), *tp_, &bytes_);
    }
    return linear(h, w<T>("wte.weight"));  // the tied head (the last stage's copy of wte under a pipeline)
  }
  template <FloatingElement T>
  Tensor<fp32, D> stage_loss(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets) const {
    return loss(logits, targets);
  }
  /// Whether this rank counts `name`'s squared gradient in the global norm: the split parameters on every
  /// rank, a replicated one on tensor-parallel rank 0, the tied embedding on the first stage only.
  bool counts_in_norm(const std::string& name) const {
    if (!is_first() && name == "wte.weight") return false;
    return tp_->rank() == 0 || split_of(name) != Split::replicated;
  }
  /// The tied embedding's weight on this stage (the first stage's wte shard, or the last stage's copy).
  Tensor<fp32, D> tied_weight() const { return is_first() || is_last() ? find("wte.weight").tensor : Tensor<fp32, D>(); }

  /// The mean cross-entropy from every rank's logits (vocab_parallel_cross_entropy), as an fp32 scalar.
  template <FloatingElement T>
  Tensor<fp32, D> loss(const Tensor<T, D>& logits, const Tensor<std::int64_t>& targets) const {
    return vocab_parallel_cross_entropy(logits.template to<fp32>(), targets, *tp_, v0_, config_.vocab_size);
  }

  /// Every parameter in the one-process layout (host fp32, GPT-2 names and shapes), gathered from the group:
  /// a collective.
  std::vector<optim::NamedTensor> gather_full() const {
    std::vector<optim::NamedTensor> out;
    for (const auto& p : params_) out.push_back({p.name, gather(p.tensor.detach().template to<cpu>(), p.split, p.full_shape)});
    return out;
  }
  /// A tensor with `name`'s slice layout (an optimizer state slot, a gradient) gathered to the full shape.
  Tensor<fp32> gather_like(const std::string& name, const Tensor<fp32>& slice) const {
    const auto& p = find(name);
    return gather(slice, p.split, p.full_shape);
  }
  /// This rank's slice of a full tensor laid out like parameter `name`.
  Tensor<fp32> slice_like(const std::string& name, const Tensor<fp32>& full) const {
    const auto& p = find(name);
    TG_CHECK(full.shape() == p.full_shape, "TensorParallelGPT: '", name, "' has shape ", full.shape(), ", expected ", p.full_shape);
    Tensor<fp32> s = Tensor<fp32>::empty(detail::slice_shape(p.full_shape, p.split, tp_->rank(), tp_->size()));
    detail::move_slice(full.contiguous_raw(), s, p.split, tp_->rank(), tp_->size(), true);
    return s;
  }
  Split split_of_param(const std::string& name) const { return find(name).split; }
  /// Bytes all-reduced over the tensor-parallel group by the model's forward and backward since the last reset
  /// (Note [tensor parallelism]: (4 per block + 2) all-reduces of (B,T,C) per micro-batch on a whole model).
  std::int64_t tensor_parallel_bytes() const { return bytes_; }
  void reset_tensor_parallel_bytes() { bytes_ = 0; }

  /// How the GPT-2 parameter `name` is split (Note [tensor parallelism]).
  static Split split_of(const std::string& name) {
    auto ends = [&](const char* s) { return name.ends_with(s); };
    if (name == "wte.weight" || ends("mlp.c_fc.weight") || ends("mlp.c_fc.bias")) return Split::rows;
    if (ends("attn.c_attn.weight") || ends("attn.c_attn.bias")) return Split::qkv_rows;
    if (ends("attn.c_proj.weight") || ends("mlp.c_proj.weight")) return Split::cols;
    return Split::replicated;
  }

 private:
  TensorParallelGPT(const nn::BasicGPT<cpu>& full, Communicator& tp, Communicator* pp, Communicator* model, TensorParallelOptions options)
      : config_(full.config()), tp_(&tp), options_(options) {
    if (!pp) {
      own_pp_ = std::make_unique<SingleProcess>(device_traits<D>::kind);
      pp = own_pp_.get();
    }
    pp_ = pp;
    model_ = model ? model : &tp;
    const int n = tp.size(), r = tp.rank(), p = pp->size(), s = pp->rank();
    TG_CHECK(config_.n_head % n == 0, "tensor parallelism: ", config_.n_head, " attention heads do not split over ", n,
             " ranks (the heads must be a multiple of the tensor-parallel size)");
    TG_CHECK(config_.vocab_size >= n, "tensor parallelism: a vocabulary of ", config_.vocab_size, " does not split over ", n, " ranks");
    TG_CHECK(p <= config_.n_layer, "pipeline parallelism: ", p, " stages for ", config_.n_layer, " blocks (each stage needs at least one block)");
    first_ = s * config_.n_layer / p;
    last_ = (s + 1) * config_.n_layer / p;
    for (const auto& prm : full.named_parameters()) {
      if (!on_this_stage(prm.name)) continue;
      const Split split = split_of(prm.name);
      Tensor<fp32> host = prm.tensor.detach().contiguous_raw();
      Tensor<fp32> slice = Tensor<fp32>::empty(detail::slice_shape(host.shape(), split, r, n));
      detail::move_slice(host, slice, split, r, n, true);
      Tensor<fp32, D> leaf = slice.template to<D>().detach();
      if constexpr (std::is_same_v<D, cpu>) leaf = leaf.clone();  // not the full model's storage
      leaf.requires_grad_(true);
      params_.push_back({prm.name, leaf, split, host.shape()});
    }
    std::tie(v0_, v1_) = detail::range_of(config_.vocab_size, r, n);
    for (std::int64_t l = first_; l < last_; ++l) blocks_.push_back({this, l});
  }
  // One block as a module for checkpoint regions (which hold it by pointer: kept in blocks_, alive as the model).
  struct Block {
    const TensorParallelGPT* model;
    std::int64_t index;
    template <FloatingElement T>
    Tensor<T, D> forward(const Tensor<T, D>& x, Generator& gen, bool training) const {
      return model->template block_forward<T>(index, x, gen, training);
    }
  };
  /// Block l under sequence parallelism (Note [sequence parallelism]) on this rank's positions x (B,T/n,C).
  template <FloatingElement T>
  Tensor<T, D> sequence_parallel_block(std::int64_t l, Tensor<T, D> x, Generator& dropout_gen, bool training) const {
    const std::int64_t n = tp_->size(), T_ = x.size(1) * n;
    const std::int64_t Hl = config_.n_head / n, t0 = tp_->rank() * x.size(1);
    Communicator& g = *tp_;
    const std::string h = "h." + std::to_string(l) + ".";
    const auto rep = summed_over_group<T>({h + "ln_1.weight", h + "ln_1.bias", h + "attn.c_proj.bias", h + "ln_2.weight", h + "ln_2.bias",
                                           h + "mlp.c_proj.bias"});
    const Tensor<T, D> a = gather_from_sequence(layernorm(x, rep[0], rep[1]), g, &bytes_);  // (B,T,C)
    const Tensor<T, D> qkv = linear(a, w<T>(h + "attn.c_attn.weight"), w<T>(h + "attn.c_attn.bias"));  // (B,T,3·C/n)
    // the local heads straight from the packed (q | k | v) columns, (B,T,C/n) out: no head-layout copies
    const Tensor<T, D> y = causal_attention_qkv(qkv, Hl);
    const Tensor<T, D> o = add(reduce_scatter_to_sequence(linear(y, w<T>(h + "attn.c_proj.weight")), g, &bytes_), rep[2]);  // (B,T/n,C)
    x = add(x, sequence_parallel_dropout(o, config_.dropout, dropout_gen, training, T_, t0));
    const Tensor<T, D> m = gather_from_sequence(layernorm(x, rep[3], rep[4]), g, &bytes_);
    const Tensor<T, D> f = linear_gelu_tanh(m, w<T>(h + "mlp.c_fc.weight"), w<T>(h + "mlp.c_fc.bias"));  // (B,T,4C/n)
    const Tensor<T, D> o2 = add(reduce_scatter_to_sequence(linear(f, w<T>(h + "mlp.c_proj.weight")), g, &bytes_), rep[5]);
    return add(x, sequence_parallel_dropout(o2, config_.dropout, dropout_gen, training, T_, t0));
  }
  /// The replicated 1-D parameters `names` in T, read through one copy_to_group of their concatenated fp32
  /// masters: their gradients, from this rank's positions only, are summed over the group in one all-reduce
  /// (Note [sequence parallelism]).
  template <FloatingElement T>
  std::vector<Tensor<T, D>> summed_over_group(const std::vector<std::string>& names) const {
    std::vector<Tensor<fp32, D>> masters;
    for (const auto& n : names) masters.push_back(find(n).tensor);
    const Tensor<fp32, D> all = copy_to_group(concat(masters, 0), *tp_, &bytes_);
    std::vector<Tensor<T, D>> out;
    std::int64_t at = 0;
    for (const auto& m : masters) {
      out.push_back(all.narrow(0, at, m.numel()).template to<T>());
      at += m.numel();
    }
    return out;
  }
  bool on_this_stage(const std::string& name) const {
    if (name == "wte.weight") return is_first() || is_last();
    if (name.starts_with("wpe.")) return is_first();
    if (name.starts_with("ln_f.")) return is_last();
    const std::int64_t block = std::stoll(name.substr(2, name.find('.', 2) - 2));  // "h.<block>."
    return block >= first_ && block < last_;
  }
  template <FloatingElement T>
  Tensor<T, D> w(const std::string& name) const {
    return amp::param_as<T>(find(name).tensor);
  }
  const ShardedParam<D>& find(const std::string& name) const {
    for (const auto& p : params_)
      if (p.name == name) return p;
    throw Error("TensorParallelGPT: no parameter named '", name, "'");
  }
  Tensor<fp32> gather(const Tensor<fp32>& slice, Split split, const Shape& full_shape) const {
    const int n = tp_->size();
    Tensor<fp32> full = Tensor<fp32>::empty(full_shape);
    if (split == Split::replicated || n == 1) {
      tg::detail::copy_tensor(slice.contiguous_raw(), full);
      return full;
    }
    std::vector<std::int64_t> counts(static_cast<std::size_t>(n));
    std::int64_t total = 0;
    for (int r = 0; r < n; ++r) total += counts[static_cast<std::size_t>(r)] = detail::slice_shape(full_shape, split, r, n).numel();
    std::vector<fp32> all(static_cast<std::size_t>(total));
    Tensor<fp32> mine = slice.contiguous_raw();
    tp_->all_gather(Buffer{mine.data(), mine.numel()}, Buffer{all.data(), total}, counts);
    std::int64_t at = 0;
    for (int r = 0; r < n; ++r) {
      Tensor<fp32> part = Tensor<fp32>::empty(detail::slice_shape(full_shape, split, r, n));
      std::copy(all.begin() + at, all.begin() + at + part.numel(), part.data());
      detail::move_slice(full, part, split, r, n, false);
      at += part.numel();
    }
    return full;
  }

  nn::GPTConfig config_;
  Communicator* tp_;
  TensorParallelOptions options_;
  Communicator* pp_ = nullptr;
  Communicator* model_ = nullptr;
  std::unique_ptr<Communicator> own_pp_;  // a single stage when no pipeline is given
  std::int64_t first_ = 0, last_ = 0;
  std::vector<Block> blocks_;  // first_ .. last_ - 1 (point at this model: not copyable or movable)
  std::vector<ShardedParam<D>> params_;
  std::int64_t v0_ = 0, v1_ = 0;
  mutable std::int64_t bytes_ = 0;  // Note [tensor parallelism]: the all-reduced bytes, counted by the ops
};

/// The tensor-parallel group's part in each training step (train::StepSync): the boundary's flags and the
/// split parameters' squared norms summed over the group, the replicated ones counted once (on rank 0).
template <Device D>
class TensorParallelSync final : public train::StepSync {
 public:
  explicit TensorParallelSync(const TensorParallelGPT<D>& model) : model_(&model) {}
  void sum(std::span<double> values) const override { model_->tensor_group().all_reduce(values, ReduceOp::sum); }
  bool sharded_grads() const override { return model_->tensor_group().size() > 1; }
  int ranks() const override { return model_->tensor_group().size(); }
  bool counts_in_norm(const std::string& param) const override { return model_->counts_in_norm(param); }
  void before_backward(std::int64_t, std::int64_t) override {}
  void after_backward(std::int64_t, std::int64_t) override {}
  void after_update() override {}
  bool changes_weights_after_update() const override { return false; }

 private:
  const TensorParallelGPT<D>* model_;
};

// Note [checkpoints of a process grid]
// A grid's checkpoint is written in the one-process layout (GPT-2 names and shapes, the optimizer's state
// under its one-process names), so any grid, or one process, resumes any other grid's run.
// gather_one_process_state: each stage gathers its parameters and its optimizer state over its tensor-parallel
// group (a state slot shaped like its parameter's slice is gathered like the parameter; step counts are
// replicated), then the stages' lists are joined over the pipeline (the tied wte and "optimizer.step" taken
// from the first stage), on the model group's rank 0. load_one_process_state gives each rank the slices of its
// stage's parameters and state from the one-process lists. Optimizer state not shaped like its parameter
// (Adafactor's factored moments) cannot be split and is an error under tensor parallelism.

/// The parameter `entry` ("<param>.<slot>") belongs to, among `names`; "" when none.
inline std::string param_of_entry(const std::string& entry, const std::vector<std::string>& names) {
  std::string best;
  for (const auto& n : names)
    if (entry.size() > n.size() && entry.starts_with(n) && entry[n.size()] == '.' && entry.find('.', n.size() + 1) == std::string::npos &&
        n.size() > best.size())
      best = n;
  return best;
}

/// The parameters and optimizer state of a grid's replica in the one-process layout (Note [checkpoints of a
/// process grid]), on its model group's rank 0 (empty lists elsewhere). A collective over the model group.
struct OneProcessState {
  std::vector<optim::NamedTensor> params, state;
};
template <Device D>
OneProcessState gather_one_process_state(const TensorParallelGPT<D>& model, const optim::AnyOptimizer& opt) {
  std::vector<std::string> names;
  for (const auto& p : model.sharded_parameters()) names.push_back(p.name);
  std::vector<optim::NamedTensor> params = model.gather_full(), state;
  for (auto& e : opt.state_tensors()) {
    const std::string p = param_of_entry(e.name, names);
    if (p.empty() || e.name == p + ".step") {
      state.push_back(std::move(e));
      continue;
    }
    const auto& sp = *std::find_if(model.sharded_parameters().begin(), model.sharded_parameters().end(),
                                   [&](const auto& x) { return x.name == p; });
    if (sp.split == Split::replicated) {
      state.push_back(std::move(e));
      continue;
    }
    TG_CHECK(e.tensor.shape() == sp.tensor.shape(), "tensor parallelism: the optimizer state '", e.name, "' (shape ", e.tensor.shape(),
             ") is not shaped like its parameter's slice ", sp.tensor.shape(), ": it cannot be gathered (use adamw, adam, sgd or lamb)");
    state.push_back({e.name, model.gather_like(p, e.tensor)});
  }
  const int root = 0;
  const bool mine = model.tensor_group().rank() == 0;
  OneProcessState out{gather_named_tensors(std::move(params), model.pipeline(), root), gather_named_tensors(std::move(state), model.pipeline(), root)};
  if (!mine) out = {};
  return out;
}

/// Loads this rank's slices of one-process parameters and optimizer state (as written by a one-process run or
/// gather_one_process_state) into the stage's parameters and `opt` (Note [checkpoints of a process grid]).
template <Device D>
void load_one_process_state(const TensorParallelGPT<D>& model, optim::BasicOptimizer<D>& opt, const std::vector<optim::NamedTensor>& params,
                            const std::vector<optim::NamedTensor>& state) {
  std::map<std::string, const Tensor<fp32>*> full;
  for (const auto& e : params) full[e.name] = &e.tensor;
  std::vector<std::string> names;
  for (const auto& p : model.sharded_parameters()) {
    auto it = full.find(p.name);
    TG_CHECK(it != full.end(), "tensor parallelism: the checkpoint has no parameter '", p.name, "'");
    names.push_back(p.name);
  }
  std::vector<optim::NamedTensor> mine;
  for (const auto& e : state) {
    if (e.name == "optimizer.step") {
      mine.push_back(e);
      continue;
    }
    const std::string p = param_of_entry(e.name, names);
    if (p.empty()) continue;  // another stage's
    if (e.name == p + ".step" || e.tensor.shape() != full.at(p)->shape() || model.split_of_param(p) == Split::replicated) {
      TG_CHECK(e.name == p + ".step" || model.split_of_param(p) == Split::replicated, "tensor parallelism: the optimizer state '", e.name,
               "' is not shaped like its parameter: it cannot be split (use adamw, adam, sgd or lamb)");
      mine.push_back(e);
      continue;
    }
    mine.push_back({e.name, model.slice_like(p, e.tensor)});
  }
  opt.load_state(mine);  // checks everything before it changes anything
  for (const auto& p : model.sharded_parameters())
    tg::detail::copy_tensor(model.slice_like(p.name, *full.at(p.name)).template to<D>().detach(), p.tensor.detach());
}

/// A data x tensor-parallel grid's part in each TrainStep (no pipeline; PipelineStep takes the data-parallel
/// group itself): the replicas' gradients reduced in buckets over the data-parallel group (DataParallel: DDP,
/// ZeRO-1 or ZeRO-2 over the replicas of each slice), the flags summed over the world, the squared norms over
/// the tensor-parallel group, or over the world when ZeRO leaves each replica a shard of the gradients.
template <Device D>
class GridSync final : public train::StepSync {
 public:
  GridSync(const TensorParallelGPT<D>& model, const ProcessGrid& grid, DataParallelOptions options = {})
      : model_(&model), grid_(&grid), dp_(*grid.dp, model.named_parameters(), options) {
    TG_CHECK(grid.pp_size == 1, "GridSync: a grid with a pipeline trains through PipelineStep");
  }
  void sum(std::span<double> values) const override { grid_->world->all_reduce(values, ReduceOp::sum); }
  void sum_norms(std::span<double> values) const override { (zero() ? *grid_->world : *grid_->model).all_reduce(values, ReduceOp::sum); }
  bool sharded_grads() const override { return grid_->model->size() > 1 || zero(); }
  int ranks() const override { return grid_->world->size(); }
  bool counts_in_norm(const std::string& param) const override { return model_->counts_in_norm(param); }
  void before_backward(std::int64_t micro, std::int64_t n) override { dp_.before_backward(micro, n); }
  void after_backward(std::int64_t micro, std::int64_t n) override { dp_.after_backward(micro, n); }
  void after_update() override { dp_.after_update(); }
  void abandon_step() noexcept override { dp_.abandon_step(); }
  bool changes_weights_after_update() const override { return dp_.changes_weights_after_update(); }
  DataParallel<D>& data_parallel() { return dp_; }

 private:
  bool zero() const { return dp_.sharding() != Sharding::none && grid_->dp_size > 1; }
  const TensorParallelGPT<D>* model_;
  const ProcessGrid* grid_;
  DataParallel<D> dp_;
};

}  // namespace tg::dist

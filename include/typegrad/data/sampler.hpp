// BatchSampler: (B,T) windows of a token split as int64 inputs and next-token targets; random (seeded,
// counter-based, exactly resumable) or sequential (the split in order, for validation).
//   tg::data::BatchSampler s(ds.train(), /*batch=*/8, /*context=*/256, /*seed=*/1);
//   auto [x, y] = s.next();  auto pos = s.position();  /* ... */  s.set_position(pos);  // same batches again
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/core/tensor.hpp"
#include "typegrad/data/dataset.hpp"

namespace tg::data {

/// inputs[b, t] = stream[s_b + t], targets[b, t] = stream[s_b + t + 1]. Both (B,T).
struct Batch {
  Tensor<std::int64_t> inputs;
  Tensor<std::int64_t> targets;
};

enum class SampleMode {
  random,     ///< B windows at independent uniform starts in [0, n - T - 1]
  sequential  ///< non-overlapping windows at starts 0, T, 2T, ... in order, B per batch; wraps after the last
};

/// The sampler's whole state: restoring it continues with exactly the same batches.
struct SamplerPosition {
  std::uint64_t seed = 0;
  std::uint64_t counter = 0;  ///< batches drawn so far
  bool operator==(const SamplerPosition&) const = default;
};

/// Note [counter-based batch sampling]
/// In random mode the start of row r of batch c is a pure function of (seed, c, r): the Philox4x32-10 block
/// of counter (c, r) under key seed gives 64 random bits u, and start = floor(u * (n - T) / 2^64) (Lemire's
/// multiply-shift; bias below (n - T) / 2^64). So batches do not depend on how many were drawn before or
/// on B for the rows they share, and (seed, c) is the whole state, kept as a tg::Generator's (seed, offset).
/// A batch is read from the split's TokenStream with copy_window, so it is bit-identical whether the stream
/// is in memory or a token file's mapping (Note [token streams]); batch_at(position) computes any batch
/// without drawing, which is what the prefetching sampler's worker thread calls (data/prefetch.hpp).
/// A row offset o makes the sampler's rows r those of rows o + r of the same counter: in a data-parallel run
/// rank k draws rows k·B .. k·B + B - 1 of each global batch of size·B rows, so the ranks together draw
/// exactly the batches one process with batch size·B draws (Note [data parallelism]).
class BatchSampler {
 public:
  BatchSampler(TokenSplit split, std::int64_t batch, std::int64_t context, std::uint64_t seed = 0,
               SampleMode mode = SampleMode::random, std::int64_t row_offset = 0)
      : split_(std::move(split)), batch_(batch), context_(context), mode_(mode), row_offset_(row_offset), gen_(seed) {
    TG_CHECK(batch > 0, "BatchSampler: batch must be > 0, got ", batch);
    TG_CHECK(row_offset >= 0 && (mode == SampleMode::random || row_offset == 0), "BatchSampler: a row offset (",
             row_offset, ") needs random mode and must be >= 0");
    TG_CHECK(context > 0, "BatchSampler: context must be > 0, got ", context);
    TG_CHECK(split_.stream && split_.size >= context + 1, "BatchSampler: the split has ", split_.size,
             " tokens, fewer than context + 1 = ", context + 1, " (one window of inputs and its shifted targets)");
  }
  /// The sequential sampler of a split (validation): covers every window once per num_batches() batches.
  static BatchSampler sequential(TokenSplit split, std::int64_t batch, std::int64_t context) {
    return BatchSampler(std::move(split), batch, context, 0, SampleMode::sequential);
  }

  std::int64_t batch_size() const { return batch_; }
  std::int64_t context() const { return context_; }
  SampleMode mode() const { return mode_; }
  /// The global row of this sampler's row 0 (a data-parallel rank's first row).
  std::int64_t row_offset() const { return row_offset_; }
  const TokenSplit& split() const { return split_; }
  /// Random mode: the number of distinct window starts (n - T). Sequential: windows per pass, (n - 1) / T.
  std::int64_t num_windows() const {
    return mode_ == SampleMode::random ? split_.size - context_ : (split_.size - 1) / context_;
  }
  /// Sequential mode: batches per pass over the split (the last may have fewer than B rows).
  std::int64_t num_batches() const {
    TG_CHECK(mode_ == SampleMode::sequential, "BatchSampler::num_batches: only a sequential sampler has a fixed count");
    return (num_windows() + batch_ - 1) / batch_;
  }

  SamplerPosition position() const { return {gen_.seed(), gen_.offset()}; }
  void set_position(const SamplerPosition& p) { gen_.set_state(p.seed, p.counter); }
  void reset() { gen_.set_state(gen_.seed(), 0); }

  /// Window starts (relative to the split) of batch `counter`; a pure function of (seed, counter).
  std::vector<std::int64_t> window_starts(std::uint64_t counter) const { return window_starts(gen_.seed(), counter); }
  /// The window starts of batch `counter` under `seed` (this sampler's split, B, T and mode).
  std::vector<std::int64_t> window_starts(std::uint64_t seed, std::uint64_t counter) const {
    std::vector<std::int64_t> starts;
    if (mode_ == SampleMode::random) {
      const auto n_starts = static_cast<std::uint64_t>(num_windows());
      starts.resize(static_cast<std::size_t>(batch_));
      for (std::int64_t r = 0; r < batch_; ++r) {
        const auto ru = static_cast<std::uint64_t>(r + row_offset_);
        const auto w = detail::philox4x32_10(
            {static_cast<std::uint32_t>(counter), static_cast<std::uint32_t>(counter >> 32),
             static_cast<std::uint32_t>(ru), static_cast<std::uint32_t>(ru >> 32)},
            {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
        const std::uint64_t u = (static_cast<std::uint64_t>(w[0]) << 32) | w[1];
        starts[static_cast<std::size_t>(r)] =
            static_cast<std::int64_t>((static_cast<unsigned __int128>(u) * n_starts) >> 64);
      }
    } else {
      const std::int64_t nb = num_batches();
      const std::int64_t c = static_cast<std::int64_t>(counter % static_cast<std::uint64_t>(nb));
      const std::int64_t first = c * batch_, last = std::min(num_windows(), first + batch_);
      for (std::int64_t k = first; k < last; ++k) starts.push_back(k * context_);
    }
    return starts;
  }

  /// The batch next() returns at position p (seed p.seed, batch p.counter), without moving this sampler:
  /// a pure function of p and the sampler's split, B, T and mode, safe to call from several threads.
  Batch batch_at(const SamplerPosition& p) const {
    const std::vector<std::int64_t> starts = window_starts(p.seed, p.counter);
    const auto rows = static_cast<std::int64_t>(starts.size());
    Batch b{Tensor<std::int64_t>::empty({rows, context_}), Tensor<std::int64_t>::empty({rows, context_})};
    std::int64_t* x = b.inputs.data();   // (rows,T)
    std::int64_t* y = b.targets.data();  // (rows,T)
    const TokenStream& stream = *split_.stream;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t s = split_.begin + starts[static_cast<std::size_t>(r)];
      stream.copy_window(s, context_, x + r * context_);
      stream.copy_window(s + 1, context_, y + r * context_);
    }
    return b;
  }

  /// The next batch: inputs and targets (rows, T), rows = B (sequential: fewer in a pass's last batch).
  Batch next() {
    const std::uint64_t seed = gen_.seed();
    return batch_at({seed, gen_.advance(1)});
  }

 private:
  TokenSplit split_;
  std::int64_t batch_;
  std::int64_t context_;
  SampleMode mode_;
  std::int64_t row_offset_ = 0;
  Generator gen_;  // (seed, offset) = (seed, batches drawn)
};

}  // namespace tg::data

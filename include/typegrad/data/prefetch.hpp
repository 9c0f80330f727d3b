// PrefetchingSampler: a BatchSampler whose next batches are prepared by a background thread while the
// caller trains on the current one; the same batches in the same order, the same position and resume.
//   tg::data::PrefetchingSampler s(tg::data::BatchSampler(ds.train(), 16, 1024, seed), /*depth=*/2);
//   auto [x, y] = s.next();  auto pos = s.position();  /* ... */  s.set_position(pos);  // same batches again
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "typegrad/data/sampler.hpp"

namespace tg::data {

/// Note [prefetching batches]
/// A worker std::thread computes batch c + 1, c + 2, ... (at most `depth` ready and waiting) while the
/// consumer holds batch c. Batches come from BatchSampler::batch_at(position), a pure function of (seed,
/// counter) and the sampler's immutable split, B, T and mode (Note [counter-based batch sampling]), so the
/// worker needs no sampler state of its own: it reads the shared configuration, which nobody writes after
/// construction, and takes the (seed, counter) to prepare from the shared state under one mutex. Hence the
/// batches, their order and position() are exactly the plain sampler's, whatever the timing.
///
/// Creating the batch tensors on the worker is safe: Tensor<int64>::empty takes memory from the CPU caching
/// allocator, whose every operation holds its mutex (core/allocator.hpp; the instance is a function-local
/// static, initialized thread-safely), Storage is reference counted through std::shared_ptr (atomic
/// counts), and a new tensor has no autograd metadata: the tape, the grad mode and checkpoint regions are
/// thread_local and never touched by empty() or by batch_at (which draws nothing from a tg::Generator). A
/// batch freed by the consumer returns to the same cache, from which the worker takes the next one, so the
/// steady state makes no system allocation. The token stream is immutable and safe to read concurrently.
///
/// Hand-off: ready batches wait in a queue tagged with their counter; next() waits for the front one, pops
/// it and wakes the worker. set_position() bumps a generation number, drops the queue and restarts the
/// worker's counter at the new position; a batch the worker was preparing meanwhile carries the old
/// generation and is discarded. An exception thrown while preparing batch c is stored in c's slot and
/// rethrown by the next() that reaches it (which still counts as batch c, as in the plain sampler); the
/// worker goes on with c + 1. The destructor sets a stop flag, wakes the worker and joins it: the worker
/// finishes at most the one batch it is preparing, so destruction waits for no more than one batch.
/// The worker keeps no pointer to the PrefetchingSampler itself (only to the shared state), so the object
/// can be moved.
class PrefetchingSampler {
 public:
  /// Makes the batch at a position; called on the worker thread, so it must be safe to call concurrently
  /// with the consumer's use of anything it shares.
  using Producer = std::function<Batch(const SamplerPosition&)>;

  /// Prefetches `sampler`'s batches from its current position; depth = batches prepared ahead (>= 1), or
  /// 0 for no thread at all (next() prepares the batch itself, like the plain sampler).
  explicit PrefetchingSampler(BatchSampler sampler, int depth = 2);
  /// Prefetches produce(position) for positions {start.seed, start.counter}, {start.seed, start.counter + 1}, ...
  PrefetchingSampler(Producer produce, SamplerPosition start, int depth = 2);
  ~PrefetchingSampler();
  PrefetchingSampler(PrefetchingSampler&&) noexcept;
  PrefetchingSampler& operator=(PrefetchingSampler&&) noexcept;
  PrefetchingSampler(const PrefetchingSampler&) = delete;
  PrefetchingSampler& operator=(const PrefetchingSampler&) = delete;

  /// The next batch, exactly the plain sampler's; waits while the worker has not prepared it yet and
  /// rethrows an exception thrown while preparing it.
  Batch next();
  /// The consumer's position: the batches handed out by next() so far (not those prepared ahead).
  SamplerPosition position() const;
  /// Continues from `p` (resume): discards every prepared batch and restarts the worker there.
  void set_position(const SamplerPosition& p);
  /// set_position({seed, 0}).
  void reset();
  int depth() const;
  /// The wrapped sampler (its own position is not used); null when made from a Producer.
  const BatchSampler* sampler() const { return sampler_.get(); }

 private:
  struct State;
  PrefetchingSampler(std::shared_ptr<const BatchSampler> sampler, int depth);
  std::shared_ptr<const BatchSampler> sampler_;  // shared with the producer the worker calls
  std::unique_ptr<State> state_;                 // the worker thread and the queue (a stable address)
};

}  // namespace tg::data

// Which per-step weight copies (amp/weights.hpp) param_as<T> reads on this thread, and how a checkpoint
// region carries that choice from its forward to its recompute in backward (Note [regions see the copies]).
#pragma once

#include "typegrad/core/dtype.hpp"

namespace tg::amp {

template <FloatingElement T>
class WeightCopies;

namespace detail {

template <FloatingElement T>
inline thread_local const WeightCopies<T>* active_copies = nullptr;

// Note [regions see the copies]
// A checkpoint region's forward runs inside the training loop's UseCopies scope, its recompute inside
// backward(), usually outside it. Without help the recompute's param_as<T> would fall back to a fresh
// master.to<T>(): the same values (the copies are refreshed only after an optimizer step, never between a
// forward and its backward), but one conversion of every weight per region per backward. So a region
// captures the active copies of each 16-bit compute type when it records, and re-activates them while it
// recomputes; the WeightCopies must then outlive the backward (MixedPrecision's does).
struct ActiveCopies {
  const WeightCopies<bf16>* bf16_copies = nullptr;
  const WeightCopies<fp16>* fp16_copies = nullptr;

  static ActiveCopies current() { return {active_copies<bf16>, active_copies<fp16>}; }
};

/// Makes `copies` the active ones until the scope ends, then restores the previous ones.
class ActivateCopies {
 public:
  explicit ActivateCopies(const ActiveCopies& copies) : previous_(ActiveCopies::current()) { set(copies); }
  ~ActivateCopies() { set(previous_); }
  ActivateCopies(const ActivateCopies&) = delete;
  ActivateCopies& operator=(const ActivateCopies&) = delete;

 private:
  static void set(const ActiveCopies& c) {
    active_copies<bf16> = c.bf16_copies;
    active_copies<fp16> = c.fp16_copies;
  }
  ActiveCopies previous_;
};

}  // namespace detail
}  // namespace tg::amp

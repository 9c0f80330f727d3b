// Which per-step weight copies (amp/weights.hpp) param_as<T, D> reads on this thread, one slot per compute
// type and device, and how a checkpoint region carries that choice from its forward to its recompute in
// backward (Note [regions see the copies]).
//   const tg::amp::WeightCopies<tg::bf16, tg::cuda>* now = tg::amp::detail::active_copies<tg::bf16, tg::cuda>;
//   { tg::amp::detail::ActivateCopies again(saved); /* recompute */ }   // saved = ActiveCopies::current()
#pragma once

#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"

namespace tg::amp {

template <FloatingElement T, Device D = cpu>
class WeightCopies;

namespace detail {

/// The WeightCopies<T, D> that param_as<T> reads for a master on D (null: none active). The device tags
/// exist in every build, so the cuda slots exist (and stay null) without the CUDA backend too.
template <FloatingElement T, Device D = cpu>
inline thread_local const WeightCopies<T, D>* active_copies = nullptr;

// Note [regions see the copies]
// A checkpoint region's forward runs inside the training loop's UseCopies scope, its recompute inside
// backward(), usually outside it. Without help the recompute's param_as<T> would fall back to a fresh
// master.to<T>(): the same values (the copies are refreshed only after an optimizer step, never between a
// forward and its backward), but one conversion of every weight per region per backward. So a region
// captures the active copies of each 16-bit compute type on each device when it records, and re-activates
// them while it recomputes; the WeightCopies must then outlive the backward (MixedPrecision's does).
struct ActiveCopies {
  const WeightCopies<bf16, cpu>* bf16_copies = nullptr;
  const WeightCopies<fp16, cpu>* fp16_copies = nullptr;
  const WeightCopies<bf16, cuda>* bf16_cuda_copies = nullptr;
  const WeightCopies<fp16, cuda>* fp16_cuda_copies = nullptr;

  static ActiveCopies current() {
    return {active_copies<bf16, cpu>, active_copies<fp16, cpu>, active_copies<bf16, cuda>, active_copies<fp16, cuda>};
  }
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
    active_copies<bf16, cpu> = c.bf16_copies;
    active_copies<fp16, cpu> = c.fp16_copies;
    active_copies<bf16, cuda> = c.bf16_cuda_copies;
    active_copies<fp16, cuda> = c.fp16_cuda_copies;
  }
  ActiveCopies previous_;
};

}  // namespace detail
}  // namespace tg::amp

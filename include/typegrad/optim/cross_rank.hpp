// What the step boundary asks of the other ranks of a data-parallel run (Note [cross-rank step decisions]).
//   struct Mine : tg::optim::CrossRank { void sum(std::span<double> v) const override; bool sharded_grads() const override; int ranks() const override; };
//   accum.cross_rank(&mine);   // GradAccumulator::micro_step then decides skips and norms for every rank alike
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "typegrad/core/error.hpp"

namespace tg::optim {

// Note [cross-rank step decisions]
// In a data-parallel run each rank runs its own step boundary, and every rank must decide the same way:
// whether the step is skipped (a loss scaler's inf/NaN, a non-finite loss under OnNonFinite) and by how much
// the gradients are clipped. A CrossRank tells the boundary how: sum() adds numbers over the ranks (every
// rank gets the same sums), and sharded_grads() says whether each rank holds only its shard of the reduced
// gradients (ZeRO), so that squared norms are summed over the ranks, or every rank holds all of them (DDP),
// so that the local norm is already the global one. The inf/NaN and bad-loss flags are always summed: a
// loss is each rank's own. Without a CrossRank (one process) nothing changes.
class CrossRank {
 public:
  virtual ~CrossRank() = default;
  /// Sums `values` over the ranks, in place.
  virtual void sum(std::span<double> values) const = 0;
  /// Sums squared gradient norms over the ranks that hold different parameters (with sharded_grads()): all of
  /// them by default; a grid of data-parallel replicas of a model-parallel group sums over that group only.
  virtual void sum_norms(std::span<double> values) const { sum(values); }
  /// Whether each rank holds only its shard of the gradients at the step boundary.
  virtual bool sharded_grads() const = 0;
  /// The number of ranks.
  virtual int ranks() const = 0;
  /// Whether this rank adds parameter `param`'s squared gradient to the norm sum (with sharded_grads()): a
  /// parameter replicated on every rank of a tensor-parallel group is counted on one of them only.
  virtual bool counts_in_norm(const std::string& param) const {
    (void)param;
    return true;
  }
  /// Whether this rank's optimizer updates parameter `param` (ZeRO: its owner only; the others hold no
  /// gradient and no state for it, so the device boundary reads the step count of the ones it updates).
  virtual bool updates_here(const std::string& param) const {
    (void)param;
    return true;
  }

  // The device boundary (Note [the device boundary across ranks], optim/device_boundary.hpp): sums of fp64
  // values that live on the step's device, queued in the device's order, read by nothing on the host.
  /// Whether sum_on_device and sum_norms_on_device work (a data-parallel run's sync; not the model-parallel ones).
  virtual bool sums_on_device() const { return false; }
  /// Sums `count` fp64 values at `values`, on the step's device, over the ranks, in place.
  virtual void sum_on_device(double* values, std::int64_t count) const {
    (void)values;
    (void)count;
    throw Error("CrossRank: this run's ranks decide each step on the host; it cannot sum values on the device");
  }
  /// sum_on_device over the ranks whose squared norms add up (as sum_norms).
  virtual void sum_norms_on_device(double* values, std::int64_t count) const { sum_on_device(values, count); }
  /// From here to settle(), the collectives of the step are ordered on the device and their host waits kept
  /// (Note [device-ordered waits], dist/comm.hpp); DeviceBoundary::begin calls it.
  virtual void defer_host_waits() const {}
  /// Waits on the host for every collective deferred since defer_host_waits() (checking each), and stops
  /// deferring; DeviceBoundary::read calls it before its download, and begin() for a step that did not end.
  virtual void settle() const {}
};

}  // namespace tg::optim

// The step boundary on the step's device (Note [the step boundary on the device]): the state the boundary's
// kernels decide in, and its one read-back per step. train::TrainStep uses it with StepOptions::device_boundary.
//   tg::optim::DeviceBoundary<tg::cuda> b({.clip = true, .max_norm = 1.0});
//   const auto t = opt.uniform_param_step();  b.begin(lr, t, opt.device_step_constants(t + 1), scale, n);  // each step
//   b.note_loss(loss, n);  mul(loss, b.loss_factor()).backward();   // each micro-batch
//   b.decide(opt);  opt.step_on_device(b.state());  opt.zero_grad();  const auto r = b.read();
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/core/tensor.hpp"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/kernels/optim.hpp"
#include "typegrad/optim/cross_rank.hpp"
#include "typegrad/optim/optimizer.hpp"

namespace tg::optim {

// Note [the device boundary across ranks]
// In a data-parallel run (dist::DataParallel: DDP, ZeRO-1, ZeRO-2) every rank runs its own boundary and all
// must decide alike (Note [cross-rank step decisions]). The host boundary sums its flags and norms over the
// ranks on the host; the device boundary sums the same values where they live. Its state keeps them adjacent
// (kLoss, kBadLoss, kFoundInf, kSumSquares), and decide() runs, after unscale and Σ g² and before
// boundary_decide:
//   * one all-reduce (sum) of kLoss, kBadLoss and kFoundInf over every rank: the losses' sum (run() divides
//     by the ranks: the mean), how many ranks saw a non-finite loss, how many an overflow;
//   * with sharded gradients (ZeRO, sharded_grads()), one all-reduce of kSumSquares over the ranks that hold
//     different parameters (sum_norms_on_device): the global Σ g². Under DDP every rank holds the whole
//     averaged gradient, so its own sum is already the global one.
// Both go through the run's communicator on the step's device (NCCL on a GPU, MPI on the CPU), in the
// device's order: the host reads nothing until the step's one read. The norm counts a parameter only where
// counts_in_norm() says so, as clip_grad_norm does; kBadLossValue stays this rank's own, so the readout tells
// "my loss" (bad_loss_here) from "another rank's". The sums are those the host boundary makes, of the same
// fp64 values through the same communicator, so the two boundaries stay the same bit for bit
// (tests/dist/test_dist.cpp, DataParallel.DeviceBoundary*).

/// What the host reads of a step decided on the device.
struct BoundaryReadout {
  double loss = 0;            ///< Σ micro-batch loss / n (in a data-parallel step: summed over the ranks)
  bool bad_loss = false;      ///< a micro-batch loss was inf or NaN (on any rank)
  bool bad_loss_here = false; ///< ... on this rank
  double bad_loss_value = 0;  ///< this rank's first such loss
  bool found_inf = false;     ///< unscale met an inf or NaN gradient
  bool norm_measured = false;
  double norm = 0;            ///< the global gradient norm before clipping (when measured)
  bool skipped = false;       ///< the optimizer updated nothing
};

/// The state of the step boundary on device D: kBoundarySize fp64 values and the backward's loss factor.
template <Device D>
class DeviceBoundary {
 public:
  /// `cross`: the other ranks of a data-parallel run (watched, not owned; it must sum on the device:
  /// CrossRank::sums_on_device), or nullptr for one process.
  explicit DeviceBoundary(backend::BoundaryRule rule, const CrossRank* cross = nullptr)
      : rule_(rule),
        cross_(cross),
        state_(Tensor<fp64, D>::zeros({backend::kBoundarySize})),
        factor_(Tensor<fp32, D>::ones({})),
        inputs_(Tensor<std::uint8_t, D>::zeros({static_cast<std::int64_t>(sizeof(backend::StepInputs))})) {
    static_assert(std::is_trivially_copyable_v<backend::StepInputs> && alignof(backend::StepInputs) <= 8);
    TG_CHECK(!rule.clip || (rule.max_norm >= 0 && rule.max_norm == rule.max_norm), "DeviceBoundary: max_norm must be >= 0, got ",
             rule.max_norm);
    TG_CHECK(!cross_ || cross_->sums_on_device(), "DeviceBoundary: this run's ranks decide each step on the host (a model-parallel ",
             "group); the step boundary on the device takes a data-parallel run or one process");
  }

  /// The host's part of a step, before its first forward: the schedule's lr, the optimizer's update count
  /// before the step (uniform_param_step()) and its step constants for the next (device_step_constants), the
  /// loss scale of the step's backward, micro-batches per step, and the Philox base of the step's dropouts
  /// (PhiloxBaseScope::base() of a scope over philox_cell(); Note [the Philox base in memory]). One upload of
  /// these step inputs to D, then boundary_begin reads them there: its launch is the same every step (Note
  /// [graph blockers]). The previous step must have been read (read() waits for its kernels).
  void begin(double lr, std::int64_t step, std::pair<double, double> step_constants, double scale, std::int64_t micro_batches,
             std::uint64_t philox_base = 0) {
    backend::StepInputs in;
    in.start.lr = lr;
    in.start.step = static_cast<double>(step);
    in.start.bc1 = step_constants.first;
    in.start.bc2 = step_constants.second;
    in.start.scale = scale;
    in.start.inv_n = 1.0 / static_cast<double>(micro_batches);
    in.philox_base = philox_base;
    if constexpr (std::is_same_v<D, cuda>) {  // stream-ordered; a graph's prelude (Note [graph blockers]): not watched
      const backend::LaunchWatchScope prelude(nullptr);
      backend::cuda::copy_host_to_device(inputs_.data(), &in, sizeof in);
    } else {
      std::memcpy(inputs_.data(), &in, sizeof in);
    }
    TG_BACKEND(D, boundary_begin<fp32>(state_.data(), factor_.data(), start()));
    if (cross_) {  // Note [device-ordered waits]: the step's collectives wait on the host at read()
      cross_->settle();
      cross_->defer_host_waits();
    }
  }
  /// A micro-batch's loss (fp32 scalar on D), one of n.
  void note_loss(const Tensor<fp32, D>& loss, std::int64_t n) {
    TG_CHECK(loss.numel() == 1, "DeviceBoundary::note_loss: the loss must be a scalar, got shape ", loss.shape());
    const Tensor<fp32, D> l = loss.detach().contiguous();
    TG_BACKEND(D, boundary_note_loss<fp32>(state_.data(), l.data(), static_cast<double>(n)));
  }
  /// The factor each micro-batch's loss is multiplied by before its backward: float(S / n).
  const Tensor<fp32, D>& loss_factor() const { return factor_; }

  /// The boundary's kernels over opt's gradients, in the host boundary's order: unscale (when a scaler
  /// scales the loss), Σ g² (when clipping or checking), the decision, clipping.
  template <class Opt>
  void decide(const Opt& opt) {
    grads_.clear();
    sizes_.clear();
    cgrads_.clear();
    csizes_.clear();
    const bool sharded = cross_ && cross_->ranks() > 1 && cross_->sharded_grads();
    opt.for_each_param([&](const BasicParam<D>& p) {
      const Tensor<fp32, D> g = p.tensor.grad();
      if (!g.defined() || g.numel() == 0) return;
      TG_CHECK(g.is_contiguous(), "DeviceBoundary: the gradient of '", p.name, "' is not contiguous");
      grads_.push_back(g.data());
      sizes_.push_back(g.numel());
      if (sharded && !cross_->counts_in_norm(p.name)) return;  // counted on another rank (as clip_grad_norm)
      cgrads_.push_back(g.data());
      csizes_.push_back(g.numel());
    });
    const int count = static_cast<int>(grads_.size());
    if (rule_.scaler_checks) TG_BACKEND(D, boundary_unscale<fp32>(grads_.data(), sizes_.data(), count, state_.data()));
    const bool measures = rule_.clip || (rule_.check_non_finite && !rule_.scaler_checks);
    if (measures)
      TG_BACKEND(D, boundary_sum_squares<fp32>(cgrads_.data(), csizes_.data(), static_cast<int>(cgrads_.size()), state_.data()));
    if (cross_ && cross_->ranks() > 1) {  // Note [the device boundary across ranks]
      static_assert(backend::kBadLoss == backend::kLoss + 1 && backend::kFoundInf == backend::kLoss + 2 &&
                    backend::kSumSquares == backend::kLoss + 3);
      cross_->sum_on_device(state_.data() + backend::kLoss, 3);
      if (measures && sharded) cross_->sum_norms_on_device(state_.data() + backend::kSumSquares, 1);
    }
    TG_BACKEND(D, boundary_decide<fp32>(state_.data(), rule_));
    if (rule_.clip) TG_BACKEND(D, boundary_clip<fp32>(grads_.data(), sizes_.data(), count, state_.data()));
  }

  /// The state on D (kBoundarySize fp64 values), for the optimizer's kernel.
  const double* state() const { return state_.data(); }
  /// The cell on D that holds the Philox base begin() was given (Note [the Philox base in memory]).
  const std::uint64_t* philox_cell() const {
    return reinterpret_cast<const std::uint64_t*>(inputs_.data() + offsetof(backend::StepInputs, philox_base));
  }

  /// The step's outcome: one download of the state.
  BoundaryReadout read() const {
    if (cross_) cross_->settle();  // the step's collectives, checked on the host (Note [device-ordered waits])
    ++reads_;
    // after the step's last kernel: where a graph of the step would end (its epilogue, not watched: Note [graph blockers])
    const backend::LaunchWatchScope epilogue(nullptr);
    const std::vector<double> v = state_.detach().template to<cpu>().to_vector();
    BoundaryReadout r;
    r.loss = v[backend::kLoss];
    r.bad_loss = v[backend::kBadLoss] != 0;
    r.bad_loss_value = v[backend::kBadLossValue];
    r.bad_loss_here = r.bad_loss && !std::isfinite(r.bad_loss_value);  // 0 when this rank's losses were finite
    r.found_inf = v[backend::kFoundInf] != 0;
    r.norm_measured = v[backend::kNormMeasured] != 0;
    r.norm = v[backend::kNorm];
    r.skipped = v[backend::kSkip] != 0;
    return r;
  }
  const backend::BoundaryRule& rule() const { return rule_; }
  /// How many times read() ran: one per step decided here.
  std::int64_t reads() const { return reads_; }

 private:
  backend::BoundaryRule rule_;
  const CrossRank* cross_ = nullptr;
  Tensor<fp64, D> state_;
  Tensor<fp32, D> factor_;
  Tensor<std::uint8_t, D> inputs_;  // the step inputs (backend::StepInputs), written by begin
  const backend::BoundaryStart* start() const {
    return reinterpret_cast<const backend::BoundaryStart*>(inputs_.data() + offsetof(backend::StepInputs, start));
  }
  std::vector<fp32*> grads_;  // reused: no allocation in the steady state
  std::vector<const fp32*> cgrads_;  // those the norm counts
  std::vector<std::int64_t> sizes_, csizes_;
  mutable std::int64_t reads_ = 0;
};

}  // namespace tg::optim

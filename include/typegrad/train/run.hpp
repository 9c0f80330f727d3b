// A training run's bookkeeping: its id, its clock (time per step, tokens per second, time left) and the
// human-readable sizes and durations a progress line prints.
//   tg::train::RunClock clock(tokens_per_step, start_step, last_step);
//   clock.step_done(step, seconds);  clock.tokens_per_second();  tg::train::human_time(clock.seconds_left());
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>

namespace tg::train {

/// A fresh run's id: 16 hex digits from the clock and the OS's entropy (checkpoints carry it, so a run
/// recognises its own files).
std::string new_run_id();

/// "1.23 GiB" at or above 1 GiB, else "12.3 MiB".
std::string human_bytes(std::int64_t bytes);
/// "12m05s".
std::string human_time(double seconds);

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

/// The time a run spends in its steps (evaluation, sampling and checkpoints excluded), steps
/// start_step + 1 .. last_step of tokens_per_step tokens each; a resumed run counts from its start_step.
class RunClock {
 public:
  RunClock(std::int64_t tokens_per_step, std::int64_t start_step, std::int64_t last_step)
      : tokens_per_step_(tokens_per_step), start_step_(start_step), last_step_(last_step), step_(start_step) {}
  /// Records that `step` finished, its steps taking `seconds`.
  void step_done(std::int64_t step, double seconds) {
    step_ = step;
    train_seconds_ += seconds;
  }
  /// Steps run in this process.
  std::int64_t steps_run() const { return std::max<std::int64_t>(0, step_ - start_step_); }
  double train_seconds() const { return train_seconds_; }
  double tokens_per_second() const {
    return train_seconds_ > 0 ? static_cast<double>(tokens_per_step_ * steps_run()) / train_seconds_ : 0.0;
  }
  double ms_per_step() const { return steps_run() > 0 ? train_seconds_ / static_cast<double>(steps_run()) * 1e3 : 0.0; }
  /// The time the remaining steps take at this process's mean step time.
  double seconds_left() const {
    return steps_run() > 0 ? train_seconds_ / static_cast<double>(steps_run()) * static_cast<double>(last_step_ - step_) : 0.0;
  }

 private:
  std::int64_t tokens_per_step_, start_step_, last_step_, step_;
  double train_seconds_ = 0;
};

}  // namespace tg::train

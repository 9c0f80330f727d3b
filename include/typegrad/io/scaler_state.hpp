// A loss scaler's state in a training checkpoint (io::TrainStateRecord::scaler) and back.
//   record.scaler = tg::io::scaler_record(amp.scaler);
//   if (!tg::io::restore_scaler(amp.scaler, loaded.scaler)) warn("the checkpoint's scaler state was ignored");
#pragma once

#include <optional>
#include <type_traits>

#include "typegrad/amp/scaler.hpp"
#include "typegrad/io/train_state.hpp"

namespace tg::io {

/// The numbers a checkpoint keeps of `scaler`; none for NoScaler (nothing to restore).
template <amp::LossScaler Scaler>
std::optional<ScalerStateRecord> scaler_record(const Scaler& scaler) {
  if constexpr (!Scaler::scales_loss) {
    return std::nullopt;
  } else {
    const amp::ScalerState st = scaler.state();
    return ScalerStateRecord{st.scale, st.growth_tracker, st.skipped_steps, st.steps};
  }
}

/// Puts a checkpoint's scaler numbers into `scaler`; its growth/backoff settings stay this run's. Without a
/// saved state (e.g. an fp32 checkpoint resumed in fp16) the scaler starts fresh. Returns false when the
/// checkpoint has a scaler state that `scaler` cannot take (NoScaler: an fp16 run resumed in bf16 or fp32).
template <amp::LossScaler Scaler>
bool restore_scaler(Scaler& scaler, const std::optional<ScalerStateRecord>& saved) {
  if constexpr (!Scaler::scales_loss) {
    (void)scaler;
    return !saved.has_value();
  } else {
    if (!saved) return true;
    amp::ScalerState st = scaler.state();
    st.scale = saved->scale;
    st.growth_tracker = saved->growth_tracker;
    st.skipped_steps = saved->skipped_steps;
    st.steps = saved->steps;
    scaler.load_state(st);  // validates (scale finite and > 0, tracker below the interval, ...)
    return true;
  }
}

}  // namespace tg::io

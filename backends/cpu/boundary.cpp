// The step boundary's kernels on the CPU (Note [the step boundary on the device], declared once for both
// devices in detail/kernels/optim.hpp). The "device" state is host memory here: each kernel is the host
// boundary's arithmetic on it, through the same kernels (unscale_and_check, sum_squares, scale_inplace), so
// the two boundaries agree bit for bit.
#include <cmath>

#include "typegrad/detail/cpu/amp_kernels.hpp"
#include "typegrad/detail/cpu/optim_kernels.hpp"

namespace tg::backend::cpu {

template <class T>
void boundary_begin(double* state, T* loss_factor, const BoundaryStart* start) {
  boundary_begin_values(state, loss_factor, *start);
}
template <class T>
void boundary_note_loss(double* state, const T* loss, double n) {
  const double v = static_cast<double>(*loss);
  state[kLoss] += v / n;
  if (!std::isfinite(v) && state[kBadLoss] == 0) {
    state[kBadLoss] = 1;
    state[kBadLossValue] = v;
  }
}
template <class T>
void boundary_unscale(T* const* grads, const std::int64_t* sizes, int count, double* state) {
  const float inv = static_cast<float>(1.0 / state[kScale]);
  bool found_inf = false;
  for (int i = 0; i < count; ++i) found_inf = unscale_and_check<T>(grads[i], sizes[i], inv) || found_inf;
  if (found_inf) state[kFoundInf] = 1;
}
template <class T>
void boundary_sum_squares(const T* const* grads, const std::int64_t* sizes, int count, double* state) {
  double sq = 0;
  for (int i = 0; i < count; ++i) sq += sum_squares<T>(grads[i], sizes[i]);
  state[kSumSquares] = sq;
}
template <class T>
void boundary_decide(double* state, const BoundaryRule& rule) {
  boundary_decide_values(state, rule);
}
template <class T>
void boundary_clip(T* const* grads, const std::int64_t* sizes, int count, const double* state) {
  if (state[kSkip] != 0 || !(state[kCoef] < 1.0)) return;
  for (int i = 0; i < count; ++i) scale_inplace<T>(grads[i], sizes[i], state[kCoef]);
}
TG_INSTANTIATE_KERNELS(TG_KERNELS_BOUNDARY, TG_FP32_TYPES)

}  // namespace tg::backend::cpu

// Knowledge distillation loss (Hinton, Vinyals & Dean 2015, "Distilling the Knowledge in a Neural Network"):
// a student's logits pulled toward a frozen teacher's softened distribution, plus the usual cross-entropy.
//   auto loss = tg::quant::distillation_loss(student_logits, teacher_logits, targets, 0.5f, 2.0f);  // (B,T,V) -> scalar
//   loss.backward();                                     // the student's logits get the gradient, the teacher none
#pragma once

#include <cmath>
#include <cstdint>

#include "typegrad/autodiff/tape.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/cross_entropy.hpp"
#include "typegrad/ops/kl_div.hpp"
#include "typegrad/ops/softmax.hpp"

namespace tg::quant {

// Note [distillation loss]
// With student logits s, teacher logits t (both (B,T,V) or (N,V)), targets y, weight α ∈ [0, 1] and
// temperature τ > 0 (Hinton et al. 2015, §2):
//   L = α · τ² · KL(softmax(t/τ) ‖ softmax(s/τ)) + (1 − α) · CE(s, y),
// the KL term being kl_div(log_softmax(s/τ), log_softmax(t/τ)), the mean over the B·T rows of Σ_v p (log p −
// log q) (Note [kl_div: batchmean over rows]), and CE the cross_entropy of the unscaled student logits (its
// mean over the targets ≠ ignore_index = -100; the KL term counts every row). The τ² keeps the soft term's
// gradient, which scales as 1/τ², comparable to the hard term's as τ changes (ibid.).
// Composite: built from the ops (div by τ, log_softmax, kl_div, cross_entropy_as, mul, add), so its backward
// comes from theirs. The teacher is detached and its branch runs under NoGrad: it never gets a gradient and
// records nothing, whether or not it requires grad.
// Precision. The loss is stored in accum_t<T>, as the training step's loss (amp::MixedPrecision::loss, an
// fp32 cross_entropy_as of 16-bit logits): fp32 for fp32 / bf16 / fp16 logits, fp64 for fp64. The CE term
// reads the T logits directly (fp32 math in its fused kernel). The KL term first converts the logits to
// accum_t<T> (a differentiable to<>(), the identity for fp32 / fp64), so the scaled logits and both
// log-probabilities are fp32: 16-bit log-probabilities (bf16 steps of 2^-5 at -5) would swamp the small
// differences log p − log q the KL measures. The student's gradient comes back to T through to<>()'s backward.
// The edge weights are exact: α = 0 is the cross-entropy itself (the same op, no KL computed), α = 1 skips
// the cross-entropy (targets are not read then, and may be any tensor, e.g. empty), τ = 1 skips the division.

/// α · τ² · KL(softmax(teacher/τ) ‖ softmax(student/τ)) + (1 − α) · CE(student, targets) (Note [distillation
/// loss]): student_logits and teacher_logits (B,T,V) or (N,V), targets (B,T) or (N) int64 (ignore_index -100
/// in the CE term); a 0-dim loss in accum_t<T> (fp32 for 16-bit logits). The teacher gets no gradient.
template <FloatingElement T, Device D>
Tensor<accum_t<T>, D> distillation_loss(const Tensor<T, D>& student_logits /*(B,T,V)*/,
                                        const Tensor<T, D>& teacher_logits /*(B,T,V), no grad*/,
                                        const Tensor<std::int64_t>& targets /*(B,T)*/, float alpha, float temperature) {
  using A = accum_t<T>;
  TG_CHECK(alpha >= 0.f && alpha <= 1.f, "distillation_loss: alpha (the weight of the distillation term) must be in "
           "[0, 1], got ", alpha);
  TG_CHECK(std::isfinite(temperature) && temperature > 0.f, "distillation_loss: temperature must be positive and "
           "finite, got ", temperature);
  TG_CHECK(student_logits.dim() == 2 || student_logits.dim() == 3,
           "distillation_loss: student_logits must be [N, V] or [B, T, V], got ", student_logits.shape());
  TG_CHECK(teacher_logits.shape() == student_logits.shape(), "distillation_loss: teacher_logits must have the shape of "
           "student_logits ", student_logits.shape(), ", got ", teacher_logits.shape());
  if (alpha < 1.f) {
    Shape want = student_logits.shape();
    want.erase(want.size() - 1);
    TG_CHECK(targets.shape() == want, "distillation_loss: targets must be ", want, " for student_logits ",
             student_logits.shape(), ", got ", targets.shape());
  }
  if (alpha == 0.f) return cross_entropy_as<A>(student_logits, targets);

  const double tau = static_cast<double>(temperature);
  auto soften = [tau](const Tensor<A, D>& logits) { return tau == 1.0 ? logits : div(logits, tau); };
  Tensor<A, D> teacher_log_p;
  {
    NoGrad no_grad;
    teacher_log_p = log_softmax(soften(teacher_logits.detach().template to<A>()));
  }
  const Tensor<A, D> student_log_q = log_softmax(soften(student_logits.template to<A>()));
  const Tensor<A, D> soft = mul(kl_div(student_log_q, teacher_log_p), static_cast<double>(alpha) * tau * tau);
  if (alpha == 1.f) return soft;
  return add(soft, mul(cross_entropy_as<A>(student_logits, targets), 1.0 - static_cast<double>(alpha)));
}

}  // namespace tg::quant

// dropout_add: a residual add with dropout on its branch in one pass, out = x + dropout(branch).
//   tg::Generator gen(1234);
//   auto out = tg::dropout_add(h, mlp_out, 0.1, gen, /*training=*/true);   // = tg::add(h, tg::dropout(mlp_out, 0.1, gen))
#pragma once

#include <cstdint>

#include "typegrad/core/dtype.hpp"
#include "typegrad/detail/kernels/declare.hpp"

// Note [fused dropout and residual add]
// The mask is dropout's (Note [dropout replays its mask]): element i of branch, row-major, is kept iff
// dropout_uniform(seed, offset + i) >= p, with offset the word position dropout draws at the call, so the draws and
// the generator's state after the call are dropout's. The dropped-out value is rounded to T before the add,
// as the unfused pair stores it, so out is `add(x, dropout(branch))` bit for bit on each device. One node
// "dropout_add": dx = dout, dbranch = dropout's mask applied to dout (recomputed from the saved seed and
// offset); nothing is saved but three scalars, and the dropped-out branch is never stored.
// p == 0 or training == false is `add(x, branch)` (an "add" node) and draws nothing.

// dropout_add_forward: out_i = x_i + (keep_i ? r_i / (1 − p) : 0) over contiguous x, r, out of n elements,
//                      keep_i as dropout_forward's for element i (its position offset + *base when base is not
//                      null); the dropped-out value rounded to T first.
#define TG_KERNELS_DROPOUT_ADD(K, ...)                                                                         \
  K(void, dropout_add_forward, (const T* x, const T* r, T* out, std::int64_t n, std::uint64_t seed,             \
                                std::uint64_t offset, const std::uint64_t* base, double p), __VA_ARGS__)
TG_DECLARE_KERNELS(TG_KERNELS_DROPOUT_ADD)

#ifndef TG_KERNELS_ONLY  // Note [kernels declared once]: kernel files see only the list above
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/dropout.hpp"

namespace tg {

namespace detail {
/// dropout_add with the mask at Philox position `at` (Note [the Philox base in memory]): what dropout_add runs after
/// drawing it, and what tg::compile's pair rewrite runs for a dropout followed by its residual add (Note [pair rewrites]).
template <FloatingElement T, Device D>
Tensor<T, D> dropout_add_at(const Tensor<T, D>& x, const Tensor<T, D>& branch, double p, const DropoutDraw& at) {
  const Tensor<T, D> xc = x.contiguous_raw(), rc = branch.contiguous_raw();
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, dropout_add_forward<T>(xc.data(), rc.data(), out.data(), out.numel(), at.seed, at.offset, at.base, p));
  autodiff::record("dropout_add", out, DropoutSaved{at.seed, at.offset, at.base, p},
                   [](DropoutSaved& s, const Tensor<T, D>& dout, auto need) {
                     Tensor<T, D> dr;
                     if (need[1]) {  // the mask applied to dout: dropout's backward
                       dr = Tensor<T, D>::empty(dout.shape());
                       TG_BACKEND(D, dropout_forward<T>(dout.data(), dout.strides(), dr.data(), dout.shape(), s.seed,
                                                        s.offset, s.base, s.p));
                     }
                     return std::tuple{need[0] ? dout : Tensor<T, D>(), dr};
                   }, x, branch);
  return out;
}
}  // namespace detail

/// x + dropout(branch, p) in one pass (Note [fused dropout and residual add]); x and branch have the same shape.
template <FloatingElement T, Device D>
Tensor<T, D> dropout_add(const Tensor<T, D>& x, const Tensor<T, D>& branch, double p, Generator& gen,
                         bool training = true) {
  TG_CHECK(p >= 0.0 && p < 1.0, "dropout_add: p must be in [0, 1), got ", p);
  TG_CHECK(x.shape() == branch.shape(), "dropout_add: x ", x.shape(), " and branch ", branch.shape(),
           " must have the same shape");
  if (!training || p == 0.0) return add(x, branch);
  return detail::dropout_add_at(x, branch, p, detail::dropout_draw<D>(gen, static_cast<std::uint64_t>(branch.numel())));
}

}  // namespace tg
#endif  // TG_KERNELS_ONLY

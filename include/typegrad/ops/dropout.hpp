// Inverted dropout with counter-based randomness: reproducible from (seed, offset), mask never stored.
//   tg::Generator gen(1234);
//   auto h = tg::dropout(x, 0.1, gen, /*training=*/true);   // kept elements scaled by 1/(1-p)
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/detail/kernels/elementwise.hpp"
#include "typegrad/ops/fusion_hook.hpp"

namespace tg {

// Note [dropout replays its mask]
// Element i (row-major over the output's shape, whatever the input's strides) is kept iff
// dropout_uniform(seed, offset + i) >= p (math::dropout_keep, p rounded to fp32): the uniform of word
// (offset + i) % 4 of philox_words(seed, (offset + i) / 4), so one Philox block decides four elements. Here
// seed = gen.seed() and offset = dropout_position(gen.advance(dropout_counters(numel))) at the call: the
// mask's word position, 4 per counter, the generator advanced by ceil(numel / 4) counters (core/random.hpp;
// Note [dropout masks in vectors]). Kept elements are scaled by
// 1/(1-p) (Srivastava et al. 2014, "inverted" form), so evaluation needs no rescaling. The Saved struct
// holds (seed, offset, p) instead of a mask: backward recomputes the mask with the same kernel, a
// checkpoint recompute replays the identical mask, and the memory held between forward and backward
// is three scalars. p == 0 or training == false returns x itself, records nothing and consumes no
// counters.

/// What dropout keeps for backward: the Philox stream position of its mask (a word position; relative to
/// *base when base is not null, Note [the Philox base in memory]) and p.
struct DropoutSaved {
  std::uint64_t seed = 0, offset = 0;
  const std::uint64_t* base = nullptr;
  double p = 0;
};

template <FloatingElement T, Device D>
Tensor<T, D> dropout(const Tensor<T, D>& x, double p, Generator& gen, bool training = true) {
  TG_CHECK(p >= 0.0 && p < 1.0, "dropout: p must be in [0, 1), got ", p);
  if (!training || p == 0.0) return x;
  if (fusion::rewriter()) [[unlikely]]  // a dropout whose residual add runs it (Note [pair rewrites])
    if (auto f = detail::try_defer(fusion::Special::dropout, x.shape(), {&x})) {
      fusion::PairState& s = fusion::rewriter()->pair();
      const detail::DropoutDraw at = detail::dropout_draw<D>(gen, static_cast<std::uint64_t>(x.numel()));
      s.seed = at.seed;
      s.offset = at.offset;
      s.base = at.base;
      s.p = p;
      return *f;
    }
  const detail::DropoutDraw at = detail::dropout_draw<D>(gen, static_cast<std::uint64_t>(x.numel()));
  Tensor<T, D> out = Tensor<T, D>::empty(x.shape());
  TG_BACKEND(D, dropout_forward<T>(x.data(), x.strides(), out.data(), x.shape(), at.seed, at.offset, at.base, p));
  autodiff::record("dropout", out, DropoutSaved{at.seed, at.offset, at.base, p},
                   [](DropoutSaved& s, const Tensor<T, D>& dout, auto) {
                     // d/dx (keep · x / (1-p)) = keep / (1-p): the same kernel applied to dout
                     Tensor<T, D> din = Tensor<T, D>::empty(dout.shape());
                     TG_BACKEND(D, dropout_forward<T>(dout.data(), dout.strides(), din.data(), dout.shape(), s.seed,
                                                      s.offset, s.base, s.p));
                     return std::tuple{din};
                   }, x);
  return out;
}

/// Dropout drawing from the process-wide default generator.
template <FloatingElement T, Device D>
Tensor<T, D> dropout(const Tensor<T, D>& x, double p, bool training = true) {
  return dropout(x, p, default_generator(), training);
}

}  // namespace tg

// A (R, C) matrix as (P, C) with zero rows after its own, for a GEMM on aligned extents (Note [padded
// vocabulary]): the LM head reads the token embedding padded to a multiple of 128 rows.
//   auto logits = tg::narrow_classes(tg::linear(h, tg::padded_rows(wte, 50304)), 50257);
#pragma once

#include <algorithm>
#include <cstdint>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/core/tensor.hpp"

namespace tg {

// Note [padded vocabulary]
// A GPT's token embedding (V, C) doubles as the LM head, whose GEMMs (logits = h·Wᵀ, dh = dlogits·W,
// dW = dlogitsᵀ·h) run on V, and GPT-2's V = 50257 is odd: a GPU takes its slow unaligned kernels for all three.
// With GPTConfig::vocab_multiple the model stores the embedding with its rows padded to a multiple (50304 for
// 128), the rows past V zero: the parameter itself is the (V, C) view of the first rows (nn::padded_parameter),
// so the optimizer, clipping, checkpoints (GPT-2's real shapes, PyTorch unchanged) and every other reader see
// V rows, and nothing ever writes the zero rows. The LM head reads padded_rows(W, P): that view widened to the
// (P, C) rows its storage holds (no copy) when the caller knows the rows past V are zero (the master, and its
// 16-bit weight copy, which amp::WeightCopies stores padded the same way), else a zero-padded copy; its
// logits (B, T, P) are narrowed to (B, T, V) before the loss, so the loss, sampling and evaluation see only
// the real vocabulary. Backward narrows the (P, C) gradient to (V, C): the padded model's loss and gradients
// are the unpadded model's (zero rows add zero terms).

/// The rows a matrix's storage holds from its first element (more than its rows when stored padded).
template <Element T, Device D>
std::int64_t stored_rows(const Tensor<T, D>& t) {
  if (!t.defined() || t.dim() != 2 || !t.storage() || t.size(1) == 0) return t.defined() && t.dim() > 0 ? t.size(0) : 0;
  const auto elems = static_cast<std::int64_t>(t.storage()->bytes() / sizeof(T)) - t.storage_offset();
  return std::max(t.size(0), elems / t.size(1));
}

/// w (R, C) as (rows, C), the rows past R zero. `storage_tail_is_zero`: the caller knows w's storage holds
/// rows x C elements from w's first, zero past R (a padded parameter): the result is then a view of it.
template <FloatingElement T, Device D>
Tensor<T, D> padded_rows(const Tensor<T, D>& w, std::int64_t rows, bool storage_tail_is_zero = false) {
  TG_CHECK(w.dim() == 2, "padded_rows: w must be a matrix, got ", w.shape());
  const std::int64_t R = w.size(0), C = w.size(1);
  TG_CHECK(rows >= R, "padded_rows: ", rows, " rows cannot hold the matrix's ", R);
  const bool in_place = storage_tail_is_zero && w.is_contiguous() && stored_rows(w) >= rows;
  Tensor<T, D> out;
  if (in_place) {
    out = w.as_strided_raw({rows, C}, {C, 1}, w.storage_offset());
  } else {
    out = Tensor<T, D>::zeros({rows, C});
    tg::detail::copy_tensor(w, out.narrow(0, 0, R).detach());
  }
  struct Saved {
    std::int64_t rows;
  };
  autodiff::record("padded_rows", out, Saved{R},
                   [](Saved& s, const Tensor<T, D>& dout, auto) { return std::tuple{dout.narrow(0, 0, s.rows).detach()}; }, w);
  return out;
}

/// The first `classes` entries of the last dim of padded logits (..., P): the narrow view the loss, sampling
/// and evaluation read. When recorded, the view remembers `padded`, so cross_entropy on it writes its gradient
/// into `padded`'s whole rows, zero past `classes`, instead of a (..., classes) gradient that the narrow's
/// backward widens again (Note [cross-entropy on padded logits]). Any other use of the view is a plain narrow.
template <FloatingElement T, Device D>
Tensor<T, D> narrow_classes(const Tensor<T, D>& padded, std::int64_t classes) {
  TG_CHECK(padded.dim() >= 1, "narrow_classes: logits must have a class dim, got ", padded.shape());
  const std::int64_t d = padded.dim() - 1;
  TG_CHECK(classes >= 1 && classes <= padded.size(d), "narrow_classes: ", classes, " classes do not fit in the last dim of ",
           padded.shape());
  Tensor<T, D> out = padded.narrow(d, 0, classes);
  if (out.autograd_meta() && out.autograd_meta()->producer) out.autograd_meta()->padded_base = padded;
  return out;
}

}  // namespace tg

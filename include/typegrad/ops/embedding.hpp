// embedding: rows of a weight table gathered by integer indices; backward scatter-adds into dweight.
//   auto x = tg::embedding(wte, idx);   // wte (V,C), idx (B,T) int64 -> (B,T,C)
//   // dwte[v] = Σ over positions with idx == v of dx, summed in position order (deterministic)
#pragma once

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/nn.hpp"

namespace tg {

namespace detail {
struct EmbeddingSaved {
  Tensor<std::int64_t> idx;  // the indices, contiguous (the weight itself is not needed)
};

/// Every index in [0, n) (or equal to `allowed`, when given); the error names the value, n and where.
/// Throws unless every index is in [0, n) or equal to *allowed; returns how many are not *allowed (those that
/// count: the cross-entropy's targets other than ignore_index), in the same pass.
inline std::int64_t check_index_range(const Tensor<std::int64_t>& idx, std::int64_t n, const char* op, const char* what,
                                      const char* bound, const std::int64_t* allowed = nullptr) {
  const std::int64_t* p = idx.data();
  std::int64_t counted = 0;
  for (std::int64_t i = 0; i < idx.numel(); ++i) {
    const bool skip = allowed && p[i] == *allowed;
    if ((p[i] < 0 || p[i] >= n) && !skip)
      throw Error(op, ": ", what, " ", p[i], " at position ", i, " is out of range for ", bound, " ", n);
    counted += !skip;
  }
  return counted;
}
}  // namespace detail

/// out[..., :] = weight[idx[...], :] for weight [V, C] and idx of any shape.
template <FloatingElement T, Device D>
Tensor<T, D> embedding(const Tensor<T, D>& weight, const Tensor<std::int64_t>& idx) {
  TG_CHECK(weight.dim() == 2, "embedding: weight must be [num_embeddings, dim], got ", weight.shape());
  const std::int64_t V = weight.shape()[0], C = weight.shape()[1];
  const Tensor<std::int64_t> ic = idx.contiguous_raw();
  detail::check_index_range(ic, V, "embedding", "index", "a weight of V =");
  const Tensor<T, D> wc = weight.contiguous_raw();
  Shape out_shape = idx.shape();
  out_shape.push_back(C);
  Tensor<T, D> out = Tensor<T, D>::empty(out_shape);
  TG_BACKEND(D, embedding_forward<T>(wc.data(), ic.data(), out.data(), ic.numel(), C));  // indices stay on the host
  autodiff::record("embedding", out, detail::EmbeddingSaved{ic},
                   [V, C](detail::EmbeddingSaved& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     Tensor<T, D> dw = Tensor<T, D>::empty({V, C});
                     TG_BACKEND(D, embedding_backward<T>(g.data(), s.idx.data(), dw.data(), s.idx.numel(), V, C));
                     return std::tuple{dw};
                   }, weight);
  return out;
}

}  // namespace tg

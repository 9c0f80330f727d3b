// Reductions: sum, mean, max over dims (keepdim or not), and sum_to_shape (the backward of broadcasting).
//   auto s = tg::sum(x, {-1}, /*keepdim=*/true);   // (B,T,1)
//   auto m = tg::max(logits, -1);                  // values; gradient flows to the (first) argmax
#pragma once

#include <algorithm>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/kernels/reduce.hpp"

namespace tg {

namespace detail {
struct NoSaved {};  // for ops whose backward needs only shapes

/// Sorted, de-duplicated, wrapped dims; an empty list means "all dims".
inline std::vector<int> reduction_dims(std::initializer_list<std::int64_t> dims, int rank, const char* op) {
  std::vector<int> out;
  if (dims.size() == 0) {
    for (int i = 0; i < rank; ++i) out.push_back(i);
    return out;
  }
  for (auto d : dims) out.push_back(wrap_dim(d, rank, op));
  std::sort(out.begin(), out.end());
  TG_CHECK(std::adjacent_find(out.begin(), out.end()) == out.end(), op, ": a dim appears twice in the reduction dims");
  return out;
}

inline Shape reduced_shape(const Shape& s, const std::vector<int>& dims, bool keepdim) {
  Shape out;
  for (int i = 0; i < s.size(); ++i) {
    const bool reduced = std::find(dims.begin(), dims.end(), i) != dims.end();
    if (!reduced) out.push_back(s[i]);
    else if (keepdim) out.push_back(1);
  }
  return out;
}

/// Sum over `dims` keeping them as size 1 (no autodiff).
template <Element T, Device D>
Tensor<T, D> sum_keepdim_raw(const Tensor<T, D>& x, const std::vector<int>& dims) {
  Tensor<T, D> cur = x.contiguous_raw();
  for (int d : dims) {
    const Shape& s = cur.shape();
    if (s[d] == 1) continue;
    std::int64_t outer = 1, inner = 1;
    for (int i = 0; i < d; ++i) outer *= s[i];
    for (int i = d + 1; i < s.size(); ++i) inner *= s[i];
    Shape os = s;
    os[d] = 1;
    Tensor<T, D> next = Tensor<T, D>::empty(os);
    TG_BACKEND(D, reduce_sum<T>(cur.data(), next.data(), outer, s[d], inner));
    cur = next;
  }
  return cur;
}
}  // namespace detail

/// Sums `g` down to `shape` (numpy broadcasting in reverse). No autodiff: used by backward formulas.
template <Element T, Device D>
Tensor<T, D> sum_to_shape(const Tensor<T, D>& g, const Shape& shape) {
  if (g.shape() == shape) return g;
  const int lead = g.dim() - shape.size();
  TG_CHECK(lead >= 0, "sum_to_shape: cannot reduce ", g.shape(), " to the larger rank of ", shape);
  std::vector<int> dims;
  for (int i = 0; i < g.dim(); ++i)
    if (i < lead || (shape[i - lead] == 1 && g.shape()[i] != 1)) dims.push_back(i);
  Tensor<T, D> r = detail::sum_keepdim_raw(g, dims);
  return r.as_strided_raw(shape, contiguous_strides(shape), r.storage_offset());
}

template <Element T, Device D>
Tensor<T, D> sum(const Tensor<T, D>& x, std::initializer_list<std::int64_t> dims = {}, bool keepdim = false)
  requires FloatingElement<T>
{
  const std::vector<int> rd = detail::reduction_dims(dims, x.dim(), "sum");
  Tensor<T, D> kept = detail::sum_keepdim_raw(x, rd);
  const Shape out_shape = detail::reduced_shape(x.shape(), rd, keepdim);
  Tensor<T, D> out = kept.as_strided_raw(out_shape, contiguous_strides(out_shape), kept.storage_offset());
  autodiff::record("sum", out, detail::NoSaved{},
                   [in_shape = x.shape(), kept_shape = kept.shape()](detail::NoSaved&, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> c = dout.contiguous_raw();
                     const Tensor<T, D> k = c.as_strided_raw(kept_shape, contiguous_strides(kept_shape), c.storage_offset());
                     return std::tuple{k.expand(in_shape).contiguous_raw()};
                   }, x);
  return out;
}

template <Element T, Device D>
Tensor<T, D> mean(const Tensor<T, D>& x, std::initializer_list<std::int64_t> dims = {}, bool keepdim = false)
  requires FloatingElement<T>;  // defined in ops/elementwise.hpp (sum times 1/n)

template <Device D>
struct MaxSaved {
  Tensor<std::int64_t, D> argmax;  // index along each reduced dim, in the kept (size-1) layout
};

/// Max over one dim; the gradient goes to the first maximal element.
template <Element T, Device D>
Tensor<T, D> max(const Tensor<T, D>& x, std::int64_t dim, bool keepdim = false)
  requires FloatingElement<T>
{
  const int d = wrap_dim(dim, x.dim(), "max");
  TG_CHECK(x.shape()[d] > 0, "max: cannot reduce the empty dim ", d, " of shape ", x.shape());
  const Tensor<T, D> c = x.contiguous_raw();
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < d; ++i) outer *= x.shape()[i];
  for (int i = d + 1; i < x.dim(); ++i) inner *= x.shape()[i];
  Shape ks = x.shape();
  ks[d] = 1;
  Tensor<T, D> kept = Tensor<T, D>::empty(ks);
  Tensor<std::int64_t, D> arg = Tensor<std::int64_t, D>::empty(ks);
  TG_BACKEND(D, reduce_max<T>(c.data(), kept.data(), arg.data(), outer, x.shape()[d], inner));
  const Shape out_shape = detail::reduced_shape(x.shape(), {d}, keepdim);
  Tensor<T, D> out = kept.as_strided_raw(out_shape, contiguous_strides(out_shape), 0);
  autodiff::record("max", out, MaxSaved<D>{arg},
                   [in_shape = x.shape(), d, outer, inner](MaxSaved<D>& s, const Tensor<T, D>& dout, auto) {
                     const Tensor<T, D> g = dout.contiguous_raw();
                     if constexpr (std::is_same_v<D, cuda>) {
                       Tensor<T, D> din = Tensor<T, D>::empty(in_shape);
                       backend::watched_cuda::max_backward<T>(g.data(), s.argmax.data(), din.data(), outer, in_shape[d], inner);
                       return std::tuple{din};
                     } else {
                       Tensor<T, D> din = Tensor<T, D>::zeros(in_shape);
                       const std::int64_t n = in_shape[d];
                       for (std::int64_t o = 0; o < outer; ++o)
                         for (std::int64_t i = 0; i < inner; ++i) {
                           const std::int64_t k = s.argmax.data()[o * inner + i];
                           din.data()[(o * n + k) * inner + i] = g.data()[o * inner + i];
                         }
                       return std::tuple{din};
                     }
                   }, x);
  return out;
}

}  // namespace tg

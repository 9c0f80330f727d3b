// Op database entries: binary arithmetic, reductions, views, copies and conversions.
#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

template <class F>
RefFn binary_ref(F f) {
  return [f](const X& x, const I&, const Sample&) {
    const Shape out = broadcast_shapes(x[0].shape(), x[1].shape(), "ref");
    return tabulate(out, [&](const auto& i) { return f(at_broadcast(x[0], i), at_broadcast(x[1], i)); });
  };
}

OpEntry& binary_samples(OpEntry& e, double lo_b = -2, double hi_b = 2) {
  return e.sample("same_shape", {{{3, 5}}, {{3, 5}, lo_b, hi_b}})
      .sample("broadcast_row", {{{4, 7}}, {{7}, lo_b, hi_b}})
      .sample("broadcast_both", {{{3, 1, 5}}, {{1, 4, 1}, lo_b, hi_b}})
      .sample("size_one_dims", {{{1, 1}}, {{2, 1, 3}, lo_b, hi_b}})
      .sample("transposed", {{{6, 5}, L::transposed}, {{6, 5}, lo_b, hi_b, L::strided}});
}

OpEntry add_entry() {
  OpEntry e = make_entry("add", [](const auto& x, const I&, const Sample&) { return tg::add(x[0], x[1]); });
  binary_samples(e).reference(binary_ref([](double a, double b) { return a + b; }));
  e.error("incompatible", [] { tg::add(Tensor<float>::zeros({4, 3}), Tensor<float>::zeros({5})); },
          "add: shapes cannot be broadcast: a is [4,3], b is [5]");
  return e;
}
OpEntry sub_entry() {
  OpEntry e = make_entry("sub", [](const auto& x, const I&, const Sample&) { return tg::sub(x[0], x[1]); });
  binary_samples(e).reference(binary_ref([](double a, double b) { return a - b; }));
  e.error("incompatible", [] { tg::sub(Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({2})); }, "sub: shapes cannot be broadcast");
  return e;
}
OpEntry mul_entry() {
  OpEntry e = make_entry("mul", [](const auto& x, const I&, const Sample&) { return tg::mul(x[0], x[1]); });
  binary_samples(e).reference(binary_ref([](double a, double b) { return a * b; }));
  e.error("incompatible", [] { tg::mul(Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({4})); }, "mul: shapes cannot be broadcast");
  return e;
}
OpEntry div_entry() {
  OpEntry e = make_entry("div", [](const auto& x, const I&, const Sample&) { return tg::div(x[0], x[1]); });
  binary_samples(e, 0.5, 2.0).reference(binary_ref([](double a, double b) { return a / b; }));
  e.error("incompatible", [] { tg::div(Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({4})); }, "div: shapes cannot be broadcast");
  return e;
}
OpEntry neg_entry() {
  OpEntry e = make_entry("neg", [](const auto& x, const I&, const Sample&) { return tg::neg(x[0]); });
  e.sample("matrix", {{{3, 4}}}).sample("strided", {{{2, 3, 5}, L::strided}});
  e.reference([](const X& x, const I&, const Sample&) { return tabulate(x[0].shape(), [&](const auto& i) { return -at_broadcast(x[0], i); }); });
  return e;
}
OpEntry scalar_entry() {
  OpEntry e = make_entry("scalar_arith", [](const auto& x, const I&, const Sample&) { return (2.0 - x[0] * 3.0) / 4.0 + 1.0; });
  e.sample("matrix", {{{3, 4}}});
  e.reference([](const X& x, const I&, const Sample&) {
    return tabulate(x[0].shape(), [&](const auto& i) { return (2.0 - at_broadcast(x[0], i) * 3.0) / 4.0 + 1.0; });
  });
  return e;
}

// Reductions: args = {dims..., keepdim}
Tensor<double> ref_reduce(const Tensor<double>& x, std::vector<int> dims, bool keepdim, bool is_max, bool is_mean) {
  Shape kept = x.shape();
  for (int d : dims) kept[d] = 1;
  Tensor<double> acc = Tensor<double>::full(kept, is_max ? -INFINITY : 0.0);
  std::int64_t count = 1;
  for (int d : dims) count *= x.shape()[d];
  for (std::int64_t f = 0; f < x.numel(); ++f) {
    auto i = unravel(f, x.shape());
    const double v = x.data()[f];
    for (int d : dims) i[d] = 0;
    std::int64_t off = 0;
    const Shape st = contiguous_strides(kept);
    for (int d = 0; d < kept.size(); ++d) off += i[d] * st[d];
    acc.data()[off] = is_max ? std::max(acc.data()[off], v) : acc.data()[off] + v;
  }
  if (is_mean)
    for (std::int64_t f = 0; f < acc.numel(); ++f) acc.data()[f] /= static_cast<double>(count);
  Shape out;
  for (int d = 0; d < x.dim(); ++d) {
    const bool r = std::find(dims.begin(), dims.end(), d) != dims.end();
    if (!r) out.push_back(x.shape()[d]);
    else if (keepdim) out.push_back(1);
  }
  return acc.as_strided_raw(out, contiguous_strides(out), 0);
}

OpEntry sum_entry() {
  OpEntry e = make_entry("sum", [](const auto& x, const I&, const Sample& s) {
    if (s.args.empty()) return tg::sum(x[0]);
    if (s.args.size() == 2) return tg::sum(x[0], {static_cast<std::int64_t>(s.args[0])}, s.args[1] != 0);
    return tg::sum(x[0], {static_cast<std::int64_t>(s.args[0]), static_cast<std::int64_t>(s.args[1])}, s.args[2] != 0);
  });
  e.sample("all", {{{3, 5}}})
      .sample("last_dim", {{{4, 7}}}, {}, {-1, 0})
      .sample("first_dim_keepdim", {{{5, 3, 2}}}, {}, {0, 1})
      .sample("two_dims", {{{3, 4, 5}, L::transposed}}, {}, {0, 2, 0})
      .sample("size_one", {{{1, 6}}}, {}, {0, 0});
  e.reference([](const X& x, const I&, const Sample& s) {
    std::vector<int> dims;
    if (s.args.empty()) for (int d = 0; d < x[0].dim(); ++d) dims.push_back(d);
    else for (std::size_t k = 0; k + 1 < s.args.size(); ++k) dims.push_back(wrap_dim(static_cast<std::int64_t>(s.args[k]), x[0].dim(), "ref"));
    std::sort(dims.begin(), dims.end());
    return ref_reduce(x[0], dims, !s.args.empty() && s.args.back() != 0, false, false);
  });
  e.error("dim_out_of_range", [] { tg::sum(Tensor<float>::zeros({2, 3}), {2}); }, "sum: dim 2 is out of range for a tensor of rank 2");
  e.error("repeated_dim", [] { tg::sum(Tensor<float>::zeros({2, 3}), {1, -1}); }, "sum: a dim appears twice");
  return e;
}
OpEntry mean_entry() {
  OpEntry e = make_entry("mean", [](const auto& x, const I&, const Sample& s) {
    if (s.args.empty()) return tg::mean(x[0]);
    return tg::mean(x[0], {static_cast<std::int64_t>(s.args[0])}, s.args[1] != 0);
  });
  e.sample("all", {{{3, 5}}}).sample("last_dim_keepdim", {{{4, 7}, L::strided}}, {}, {-1, 1});
  e.reference([](const X& x, const I&, const Sample& s) {
    std::vector<int> dims;
    if (s.args.empty()) for (int d = 0; d < x[0].dim(); ++d) dims.push_back(d);
    else dims.push_back(wrap_dim(static_cast<std::int64_t>(s.args[0]), x[0].dim(), "ref"));
    return ref_reduce(x[0], dims, !s.args.empty() && s.args.back() != 0, false, true);
  });
  return e;
}
OpEntry max_entry() {
  OpEntry e = make_entry("max", [](const auto& x, const I&, const Sample& s) {
    return tg::max(x[0], static_cast<std::int64_t>(s.args[0]), s.args[1] != 0);
  });
  e.sample("last_dim", {{{4, 7}}}, {}, {-1, 0})
      .sample("first_dim_keepdim", {{{5, 3}, L::transposed}}, {}, {0, 1})
      .sample("middle", {{{2, 9, 3}}}, {}, {1, 0});
  e.reference([](const X& x, const I&, const Sample& s) {
    return ref_reduce(x[0], {wrap_dim(static_cast<std::int64_t>(s.args[0]), x[0].dim(), "ref")}, s.args[1] != 0, true, false);
  });
  e.error("empty_dim", [] { tg::max(Tensor<float>::zeros({2, 0}), 1); }, "max: cannot reduce the empty dim 1");
  return e;
}

// ---- views: the reference re-indexes the contiguous input ----
RefFn permute_ref(std::vector<int> perm) {
  return [perm](const X& x, const I&, const Sample&) {
    Shape out;
    for (int p : perm) out.push_back(x[0].shape()[p]);
    return tabulate(out, [&](const auto& i) {
      std::vector<std::int64_t> src(i.size());
      for (std::size_t k = 0; k < perm.size(); ++k) src[static_cast<std::size_t>(perm[k])] = i[k];
      std::int64_t off = 0;
      const Shape st = contiguous_strides(x[0].shape());
      for (std::size_t k = 0; k < src.size(); ++k) off += src[k] * st[static_cast<int>(k)];
      return x[0].data()[off];
    });
  };
}
RefFn reshape_ref(Shape shape) {
  return [shape](const X& x, const I&, const Sample&) { return x[0].contiguous_raw().clone().as_strided_raw(shape, contiguous_strides(shape), 0); };
}

OpEntry view_entry() {
  OpEntry e = make_entry("view", [](const auto& x, const I&, const Sample&) { return x[0].view({5, -1}); });
  e.sample("matrix", {{{3, 10}}}).reference(reshape_ref({5, 6}));
  e.error("non_contiguous", [] { Tensor<float>::zeros({3, 4}).transpose(0, 1).view({12}); }, "view: the tensor of shape [4,3] is not contiguous");
  e.error("bad_numel", [] { Tensor<float>::zeros({3, 4}).view({5, 2}); }, "view: cannot reshape a tensor of shape [3,4] (12 elements) into [5,2]");
  e.error("two_minus_one", [] { Tensor<float>::zeros({3, 4}).view({-1, -1}); }, "only one dimension can be -1");
  return e;
}
OpEntry reshape_entry() {
  // reshape of a non-contiguous tensor copies (clone) and then views.
  OpEntry e = make_entry("clone", [](const auto& x, const I&, const Sample&) { return x[0].reshape({2, 15}); });
  e.sample("transposed", {{{5, 6}, L::transposed}}).sample("strided", {{{3, 10}, L::strided}}).reference(reshape_ref({2, 15}));
  return e;
}
OpEntry transpose_entry() {
  OpEntry e = make_entry("transpose", [](const auto& x, const I&, const Sample&) { return x[0].transpose(0, 2) * 1.0; });
  e.sample("rank3", {{{2, 3, 4}}}).sample("rank3_strided", {{{2, 3, 5}, L::strided}}).reference(permute_ref({2, 1, 0}));
  e.error("bad_dim", [] { Tensor<float>::zeros({2, 3}).transpose(0, 2); }, "transpose: dim 2 is out of range for a tensor of rank 2");
  return e;
}
OpEntry permute_entry() {
  OpEntry e = make_entry("permute", [](const auto& x, const I&, const Sample&) { return x[0].permute({1, 2, 0}) * 1.0; });
  e.sample("rank3", {{{2, 3, 4}}}).sample("rank3_transposed", {{{3, 2, 5}, L::transposed}}).reference(permute_ref({1, 2, 0}));
  e.error("duplicate", [] { Tensor<float>::zeros({2, 3}).permute({0, 0}); }, "permute: dim 0 appears twice");
  e.error("rank", [] { Tensor<float>::zeros({2, 3}).permute({0}); }, "permute: got 1 dims for a tensor of shape [2,3]");
  return e;
}
OpEntry slice_entry() {
  // args: dim, start, end, step
  OpEntry e = make_entry("slice", [](const auto& x, const I&, const Sample& s) {
    return x[0].slice(static_cast<std::int64_t>(s.args[0]), static_cast<std::int64_t>(s.args[1]), static_cast<std::int64_t>(s.args[2]),
                      static_cast<std::int64_t>(s.args[3])) * 1.0;
  });
  e.sample("rows_step2", {{{7, 3}}}, {}, {0, 1, 6, 2})
      .sample("negative_cols", {{{4, 9}, L::transposed}}, {}, {1, -5, -1, 1})
      .sample("clamped", {{{5, 4}}}, {}, {0, 2, 100, 1});
  e.reference([](const X& x, const I&, const Sample& s) {
    const int d = static_cast<int>(s.args[0]);
    const std::int64_t n = x[0].shape()[d];
    std::int64_t start = static_cast<std::int64_t>(s.args[1]), end = static_cast<std::int64_t>(s.args[2]);
    const std::int64_t step = static_cast<std::int64_t>(s.args[3]);
    if (start < 0) start += n;
    if (end < 0) end += n;
    end = std::min(end, n);
    Shape out = x[0].shape();
    out[d] = (end - start + step - 1) / step;
    return tabulate(out, [&](auto i) {
      i[static_cast<std::size_t>(d)] = start + i[static_cast<std::size_t>(d)] * step;
      return at_broadcast(x[0], i);
    });
  });
  e.error("zero_step", [] { Tensor<float>::zeros({4}).slice(0, 0, 4, 0); }, "slice: step must be positive, got 0");
  return e;
}
OpEntry narrow_entry() {
  OpEntry e = make_entry("narrow", [](const auto& x, const I&, const Sample&) { return x[0].narrow(1, 2, 3) * 1.0; });
  e.sample("cols", {{{4, 7}}});
  e.reference([](const X& x, const I&, const Sample&) {
    return tabulate({4, 3}, [&](auto i) { i[1] += 2; return at_broadcast(x[0], i); });
  });
  e.error("out_of_range", [] { Tensor<float>::zeros({4, 7}).narrow(1, 5, 3); }, "narrow: range [5, 8) is out of bounds for dim 1 of size 7");
  return e;
}
OpEntry expand_entry() {
  OpEntry e = make_entry("expand", [](const auto& x, const I&, const Sample&) { return x[0].expand({2, 4, 3}) * 1.0; });
  e.sample("broadcast", {{{4, 1}}});
  e.reference([](const X& x, const I&, const Sample&) { return tabulate({2, 4, 3}, [&](const auto& i) { return at_broadcast(x[0], i); }); });
  e.error("mismatch", [] { Tensor<float>::zeros({4, 2}).expand({4, 3}); }, "expand: the size 2 of dim 1 must match 3 or be 1");
  return e;
}
OpEntry squeeze_entry() {
  OpEntry e = make_entry("squeeze_unsqueeze", [](const auto& x, const I&, const Sample&) { return x[0].squeeze(1).unsqueeze(0); });
  e.sample("matrix", {{{3, 1, 4}}}).reference(reshape_ref({1, 3, 4}));
  e.error("not_one", [] { Tensor<float>::zeros({3, 2}).squeeze(1); }, "squeeze: dim 1 has size 2, not 1");
  return e;
}
OpEntry to_entry() {
  // Round trip through another precision: the gradient converts back.
  // fp64 goes through fp32 (rounding); the others through fp64 (exact). Inputs are T-rounded, so the
  // reference float(x) is exact for every precision.
  OpEntry e = make_entry("to", [](const auto& x, const I&, const Sample&) {
    using T = typename std::decay_t<decltype(x[0])>::value_type;
    if constexpr (std::is_same_v<T, double>) return x[0].template to<float>().template to<double>();
    else return x[0].template to<double>().template to<T>();
  });
  e.sample("matrix", {{{3, 4}}});
  e.reference([](const X& x, const I&, const Sample&) {
    return tabulate(x[0].shape(), [&](const auto& i) { return static_cast<double>(static_cast<float>(at_broadcast(x[0], i))); });
  });
  e.gradcheck_eps = 1e-2;  // the fp32 rounding step is flat below its ulp
  e.tol.fwd[0] = {1e-7, 1e-7};
  e.tol.grad[0] = {1e-7, 1e-7};
  return e;
}

TG_REGISTER_OP(add_entry());
TG_REGISTER_OP(sub_entry());
TG_REGISTER_OP(mul_entry());
TG_REGISTER_OP(div_entry());
TG_REGISTER_OP(neg_entry());
TG_REGISTER_OP(scalar_entry());
TG_REGISTER_OP(sum_entry());
TG_REGISTER_OP(mean_entry());
TG_REGISTER_OP(max_entry());
TG_REGISTER_OP(view_entry());
TG_REGISTER_OP(reshape_entry());
TG_REGISTER_OP(transpose_entry());
TG_REGISTER_OP(permute_entry());
TG_REGISTER_OP(slice_entry());
TG_REGISTER_OP(narrow_entry());
TG_REGISTER_OP(expand_entry());
TG_REGISTER_OP(squeeze_entry());
TG_REGISTER_OP(to_entry());

}  // namespace
}  // namespace tg::testing

// Op database entries: unary elementwise ops (exp ... silu), dropout, masked_fill / causal_mask,
// concat and split; plus a few behaviour tests the generic checks cannot express (dropout replay,
// split views).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "ops/op_db.hpp"
#include "typegrad/ops/pointwise.hpp"
#include "typegrad/ops/pointwise_chain.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

// Rounding bounds used to size tolerances below: one rounding to the storage type costs at most its
// unit roundoff (half an ulp, relative), 2^-8 (bf16, 8-bit significand) or 2^-11 (fp16, 11-bit); the fp32 math in
// between adds a few 2^-24. The defaults (2e-2 bf16, 4e-3 fp16) are 10x looser; entries that are exact
// copies (masked_fill, concat, split) compare exactly.
constexpr double kHalfUlpBf16 = 0x1p-8, kHalfUlpFp16 = 0x1p-11;

/// Exact in every precision: the op only moves or selects the (already rounded) input values.
Tolerances exact_tolerances() {
  Tolerances t;
  for (int p = 0; p < 4; ++p) t.fwd[p] = t.grad[p] = {0.0, 0.0};
  return t;
}

/// The loss' graph may be walked once: a second backward names the op recorded on the tape.
template <class F>
std::function<void()> backward_twice(F op) {
  return [op] {
    Tensor<float> x = Tensor<float>::uniform({2, 3}, 0.5f, 1.5f);
    x.requires_grad_();
    const Tensor<float> y = op(x);
    y.backward(Tensor<float>::ones(y.shape()));
    y.backward(Tensor<float>::ones(y.shape()));
  };
}

// ---- unary ops --------------------------------------------------------------------------------------
// The references are the textbook formulas in fp64, written independently of detail/math.hpp.
double ref_sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

template <class F>
RefFn unary_ref(F f) {
  return [f](const X& x, const I&, const Sample&) {
    const std::vector<double> v = values(x[0]);
    Tensor<double> out = Tensor<double>::empty(x[0].shape());
    for (std::size_t i = 0; i < v.size(); ++i) out.data()[i] = f(v[i]);
    return out;
  };
}

template <class Op, class F>
OpEntry unary_entry(const std::string& name, Op op, F ref, double lo, double hi) {
  OpEntry e = make_entry(name, [op](const auto& x, const I&, const Sample&) { return op(x[0]); });
  e.sample("odd_matrix", {{{3, 7}, lo, hi}})
      .sample("size_one_dims", {{{1, 5, 1}, lo, hi}})
      .sample("scalar", {{{}, lo, hi}})
      .sample("transposed", {{{6, 5}, lo, hi, L::transposed}})
      .sample("strided", {{{2, 3, 5}, lo, hi, L::strided}})
      .sample("parallel_transposed", {{{67, 503}, lo, hi, L::transposed}});  // > 2^15 elements: the OpenMP path
  e.reference(unary_ref(ref));
  // Forward: fp32 libm (a few 2^-24) plus one output rounding; 2x the half-ulp bound for 16-bit.
  e.tol.fwd[1] = {1e-6, 1e-6};
  e.tol.fwd[2] = {1e-6, 2 * kHalfUlpBf16};
  e.tol.fwd[3] = {1e-6, 2 * kHalfUlpFp16};
  // Gradients: dout · f'(saved) rounds once more (dout is rounded identically in the reference).
  e.tol.grad[1] = {1e-6, 1e-6};
  e.tol.grad[2] = {1e-6, 3 * kHalfUlpBf16};
  e.tol.grad[3] = {1e-6, 3 * kHalfUlpFp16};
  e.error("backward_twice", backward_twice(op), "(last op: " + name + ")");
  return e;
}

/// Ops that save their output: in 16-bit, f' is evaluated at the rounded output y(1+δ), |δ| <= half an
/// ulp, and the formula amplifies δ by |y f''/f'| as a function of y (PyTorch saves the same tensor).
/// The bound on that factor over the sample range is `amp`.
void output_saved_grad_tol(OpEntry& e, double amp) {
  e.tol.grad[2].rtol = (amp + 2.0) * kHalfUlpBf16;
  e.tol.grad[3].rtol = (amp + 2.0) * kHalfUlpFp16;
}

OpEntry exp_entry() {
  OpEntry e = unary_entry("exp", [](const auto& x) { return tg::exp(x); }, [](double v) { return std::exp(v); }, -3.0, 3.0);
  output_saved_grad_tol(e, 1.0);  // f' = y: δ passes through unamplified
  return e;
}
OpEntry log_entry() {
  return unary_entry("log", [](const auto& x) { return tg::log(x); }, [](double v) { return std::log(v); }, 0.05, 4.0);
}
OpEntry sqrt_entry() {
  OpEntry e = unary_entry("sqrt", [](const auto& x) { return tg::sqrt(x); }, [](double v) { return std::sqrt(v); }, 0.05, 4.0);
  output_saved_grad_tol(e, 1.0);  // f' = 1/(2y)
  return e;
}
OpEntry rsqrt_entry() {
  OpEntry e = unary_entry("rsqrt", [](const auto& x) { return tg::rsqrt(x); }, [](double v) { return 1.0 / std::sqrt(v); }, 0.1, 4.0);
  output_saved_grad_tol(e, 3.0);  // f' = -y^3/2: 3δ
  return e;
}
OpEntry tanh_entry() {
  OpEntry e = unary_entry("tanh", [](const auto& x) { return tg::tanh(x); }, [](double v) { return std::tanh(v); }, -2.0, 2.0);
  output_saved_grad_tol(e, 28.0);  // f' = 1 - y^2: 2y^2/(1-y^2) <= 27.3 at |x| = 2
  return e;
}
OpEntry sigmoid_entry() {
  OpEntry e = unary_entry("sigmoid", [](const auto& x) { return tg::sigmoid(x); }, ref_sigmoid, -4.0, 4.0);
  output_saved_grad_tol(e, 55.0);  // f' = y(1-y): y/(1-y) <= e^4 = 54.6 at x = 4
  return e;
}
OpEntry relu_entry() {
  // exact: relu selects x or 0 and its gradient selects dout or 0
  OpEntry e = unary_entry("relu", [](const auto& x) { return tg::relu(x); }, [](double v) { return v > 0 ? v : 0.0; }, -2.0, 2.0);
  e.tolerances(exact_tolerances());
  return e;
}
OpEntry gelu_entry() {
  OpEntry e = unary_entry("gelu", [](const auto& x) { return tg::gelu(x); },
                          [](double v) { return 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0))); }, -3.0, 3.0);
  // The run-time form selects the same op.
  e.sample("approx_flag", {{{4, 9}, -3.0, 3.0}}, {}, {0});
  e.f64 = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu(x[0]) : tg::gelu(x[0], GeluApprox::none); };
  e.f32 = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu(x[0]) : tg::gelu(x[0], GeluApprox::none); };
  e.bf = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu(x[0]) : tg::gelu(x[0], GeluApprox::none); };
  e.h = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu(x[0]) : tg::gelu(x[0], GeluApprox::none); };
  return e;
}
OpEntry gelu_tanh_entry() {
  OpEntry e = unary_entry("gelu_tanh", [](const auto& x) { return tg::gelu_tanh(x); },
                          [](double v) {
                            const double k = std::sqrt(2.0 / std::acos(-1.0));
                            return 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
                          }, -3.0, 3.0);
  // The run-time form selects the same op.
  e.sample("approx_flag", {{{4, 9}, -3.0, 3.0}}, {}, {1});
  e.f64 = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu_tanh(x[0]) : tg::gelu(x[0], GeluApprox::tanh); };
  e.f32 = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu_tanh(x[0]) : tg::gelu(x[0], GeluApprox::tanh); };
  e.bf = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu_tanh(x[0]) : tg::gelu(x[0], GeluApprox::tanh); };
  e.h = [](const auto& x, const I&, const Sample& s) { return s.args.empty() ? tg::gelu_tanh(x[0]) : tg::gelu(x[0], GeluApprox::tanh); };
  return e;
}
OpEntry silu_entry() {
  return unary_entry("silu", [](const auto& x) { return tg::silu(x); }, [](double v) { return v * ref_sigmoid(v); }, -4.0, 4.0);
}

// ---- dropout: args = {p, seed, offset, training} -------------------------------------------------
OpEntry dropout_entry() {
  OpEntry e = make_entry("dropout", [](const auto& x, const I&, const Sample& s) {
    Generator gen(static_cast<std::uint64_t>(s.args[1]));
    gen.set_state(static_cast<std::uint64_t>(s.args[1]), static_cast<std::uint64_t>(s.args[2]));
    return tg::dropout(x[0], s.args[0], gen, s.args[3] != 0);
  });
  e.sample("half", {{{5, 7}}}, {}, {0.5, 42, 0, 1})
      .sample("low_p_transposed", {{{6, 5}, L::transposed}}, {}, {0.1, 7, 1000, 1})
      .sample("high_p_strided", {{{3, 4, 5}, L::strided}}, {}, {0.9, 99, 5, 1})
      .sample("size_one_dims", {{{1, 9, 1}}}, {}, {0.3, 3, 1ull << 33, 1})  // offset above 2^32: both counter words
      .sample("parallel", {{{67, 503}}}, {}, {0.25, 2024, 17, 1})        // > 2^15 elements: the OpenMP path
      .sample("eval_identity", {{{4, 6}}}, {}, {0.5, 1, 0, 0})
      .sample("p_zero_identity", {{{4, 6}, L::transposed}}, {}, {0.0, 1, 0, 1});
  e.reference([](const X& x, const I&, const Sample& s) {
    const double p = s.args[0];
    const auto seed = static_cast<std::uint64_t>(s.args[1]), offset = static_cast<std::uint64_t>(s.args[2]);
    const bool active = s.args[3] != 0 && p != 0.0;
    const std::vector<double> v = values(x[0]);
    Tensor<double> out = Tensor<double>::empty(x[0].shape());
    for (std::size_t i = 0; i < v.size(); ++i) {
      // the documented rule: the mask starts at word 4·offset (the generator's counter); element i reads word
      // (4·offset + i) % 4 of counter (4·offset + i) / 4, 24 random bits of it as u in [0,1); keep iff u >= p (p in fp32)
      const std::uint64_t word = 4 * offset + i;
      const std::uint32_t w = tg::detail::philox_words(seed, word / 4)[word % 4];
      const double u = static_cast<double>(w >> 8) / 16777216.0;
      const bool keep = u >= static_cast<double>(static_cast<float>(p));
      out.data()[i] = !active ? v[i] : keep ? v[i] / (1.0 - p) : 0.0;
    }
    return out;
  });
  // x · (1/(1-p)) with the factor rounded to the compute type: two roundings in fp32, one more in 16-bit; an fp16
  // result below 2^-14 is subnormal, where that rounding's error is absolute: half of the spacing 2^-24.
  e.tol.fwd[1] = e.tol.grad[1] = {0.0, 3e-7};
  e.tol.fwd[2] = e.tol.grad[2] = {0.0, 1.1 * kHalfUlpBf16};
  e.tol.fwd[3] = e.tol.grad[3] = {1.1 * std::ldexp(1.0, -25), 1.1 * kHalfUlpFp16};
  e.error("p_one", [] { Generator gen(1); tg::dropout(Tensor<float>::zeros({2, 3}), 1.0, gen); }, "dropout: p must be in [0, 1), got 1");
  e.error("p_negative", [] { Generator gen(1); tg::dropout(Tensor<float>::zeros({2, 3}), -0.5, gen); }, "dropout: p must be in [0, 1), got -0.5");
  e.error("p_nan", [] { Generator gen(1); tg::dropout(Tensor<float>::zeros({2, 3}), std::nan(""), gen); }, "dropout: p must be in [0, 1), got nan");
  e.error("p_checked_in_eval", [] { Generator gen(1); tg::dropout(Tensor<float>::zeros({2}), 2.0, gen, false); }, "dropout: p must be in [0, 1), got 2");
  e.error("backward_twice", backward_twice([](const Tensor<float>& x) { Generator gen(5); return tg::dropout(x, 0.5, gen); }),
          "(last op: dropout)");
  return e;
}

// ---- masked_fill: index input 0 is the mask (drawn in {0, 1}), args = {value} -------------------------
OpEntry masked_fill_entry() {
  OpEntry e = make_entry("masked_fill", [](const auto& x, const I& idx, const Sample& s) {
    return tg::masked_fill(x[0], on_device_of(x[0], idx[0].template to<std::uint8_t>()), s.args[0]);
  });
  // Fill values are exactly representable in bf16 and fp16, so every precision is exact.
  e.sample("same_shape", {{{3, 7}}}, {IndexSpec{{3, 7}, 0, 2}}, {-3.0})
      .sample("broadcast_row", {{{4, 6}}}, {IndexSpec{{6}, 0, 2}}, {0.5})
      .sample("broadcast_col", {{{2, 5, 3}}}, {IndexSpec{{5, 1}, 0, 2}}, {-1024.0})
      .sample("size_one_dims", {{{1, 1, 4}}}, {IndexSpec{{1, 4}, 0, 2}}, {7.0})
      .sample("transposed", {{{6, 5}, L::transposed}}, {IndexSpec{{6, 5}, 0, 2}}, {0.0})
      .sample("strided_scalar_mask", {{{3, 8}, L::strided}}, {IndexSpec{{}, 1, 2}}, {2.0})
      .sample("parallel", {{{67, 503}}}, {IndexSpec{{503}, 0, 2}}, {-2.5});
  e.reference([](const X& x, const I& idx, const Sample& s) {
    const Tensor<double> m = idx[0].to<double>();
    return tabulate(x[0].shape(), [&](const auto& i) { return at_broadcast(m, i) != 0 ? s.args[0] : at_broadcast(x[0], i); });
  });
  e.tolerances(exact_tolerances());
  e.error("not_broadcastable", [] { tg::masked_fill(Tensor<float>::zeros({2, 4}), Tensor<std::uint8_t>::zeros({3}), 0.0); },
          "masked_fill: the mask of shape [3] cannot be broadcast to the input's shape [2,4]");
  e.error("mask_rank_too_high", [] { tg::masked_fill(Tensor<float>::zeros({2, 4}), Tensor<std::uint8_t>::zeros({2, 2, 4}), 0.0); },
          "masked_fill: the mask of shape [2,2,4] cannot be broadcast to the input's shape [2,4]");
  e.error("undefined_mask", [] { tg::masked_fill(Tensor<float>::zeros({2}), Tensor<std::uint8_t>(), 0.0); },
          "masked_fill: the mask is an undefined tensor");
  e.error("backward_twice", backward_twice([](const Tensor<float>& x) { return tg::masked_fill(x, Tensor<std::uint8_t>::ones({3}), 0.0); }),
          "(last op: masked_fill)");
  return e;
}

// causal_mask in its use: -inf above the diagonal of the last two dims. Forward only (the fp64
// finite-difference objective is -inf); masked_fill's gradients are checked above.
OpEntry causal_mask_entry() {
  OpEntry e = make_entry("causal_mask", [](const auto& x, const I&, const Sample&) {
    return tg::masked_fill(x[0], tg::causal_mask<device_of<decltype(x[0])>>(x[0].size(-1)), -INFINITY);
  });
  e.sample("batched", {{{2, 5, 5}}}).sample("one", {{{1, 1}}}).sample("transposed", {{{7, 7}, L::transposed}});
  e.reference([](const X& x, const I&, const Sample&) {
    return tabulate(x[0].shape(), [&](const auto& i) {
      const std::size_t r = i.size();
      return i[r - 1] > i[r - 2] ? -INFINITY : at_broadcast(x[0], i);
    });
  });
  e.tolerances(exact_tolerances());
  e.not_differentiable();
  e.error("negative", [] { tg::causal_mask(-1); }, "causal_mask: the size must be non-negative, got -1");
  return e;
}

// ---- concat: all inputs are the list, args = {dim} ---------------------------------------------------
OpEntry concat_entry() {
  OpEntry e = make_entry("concat", [](const auto& x, const I&, const Sample& s) {
    return tg::concat(x, static_cast<std::int64_t>(s.args[0]));
  });
  e.sample("dim0_three", {{{2, 3}}, {{4, 3}}, {{1, 3}}}, {}, {0})
      .sample("last_dim_mixed_layouts", {{{3, 4}, L::transposed}, {{3, 5}, L::strided}, {{3, 1}}}, {}, {-1})
      .sample("middle_dim", {{{2, 3, 4}}, {{2, 1, 4}, L::strided}}, {}, {1})
      .sample("single", {{{3, 5}, L::transposed}}, {}, {0})
      .sample("size_one", {{{1, 1}}, {{1, 1}}}, {}, {1})
      .sample("empty_piece", {{{2, 3}}, {{2, 0}}, {{2, 2}}}, {}, {1})
      .sample("one_constant", {{{3, 2}}, InputSpec({3, 3}).constant()}, {}, {1});  // gradient to one input only
  e.reference([](const X& x, const I&, const Sample& s) {
    const int d = wrap_dim(static_cast<std::int64_t>(s.args[0]), x[0].dim(), "ref");
    Shape out = x[0].shape();
    out[d] = 0;
    for (const auto& t : x) out[d] += t.shape()[d];
    return tabulate(out, [&](auto i) {
      std::size_t k = 0;
      while (i[static_cast<std::size_t>(d)] >= x[k].shape()[d]) i[static_cast<std::size_t>(d)] -= x[k++].shape()[d];
      return at_broadcast(x[k], i);
    });
  });
  e.tolerances(exact_tolerances());
  e.error("empty_list", [] { tg::concat(std::vector<Tensor<float>>{}, 0); }, "concat: the list of tensors is empty");
  e.error("mismatch_off_dim", [] { tg::concat(std::vector{Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({2, 4})}, 0); },
          "concat: tensor 1 has shape [2,4] but tensor 0 has shape [2,3]; the shapes must match in every dim except the concat dim 0");
  e.error("rank_mismatch", [] { tg::concat(std::vector{Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({3})}, 1); },
          "concat: tensor 1 has shape [3] but tensor 0 has shape [2,3]");
  e.error("dim_out_of_range", [] { tg::concat(std::vector{Tensor<float>::zeros({2, 3})}, 2); },
          "concat: dim 2 is out of range for a tensor of rank 2");
  e.error("zero_dim", [] { tg::concat(std::vector{Tensor<float>::zeros({})}, 0); },
          "concat: cannot concatenate zero-dimensional tensors (tensor 0 has shape [])");
  e.error("undefined", [] { tg::concat(std::vector{Tensor<float>::zeros({2}), Tensor<float>()}, 0); }, "concat: tensor 1 is undefined");
  e.error("backward_twice",
          backward_twice([](const Tensor<float>& x) { return tg::concat(std::vector{x, x}, 0); }), "(last op: concat)");
  return e;
}

// ---- split: args = {dim, piece, mode (0: sizes, 1: chunk), sizes... or chunk} ------------------------
template <class T, class D>
std::vector<Tensor<T, D>> split_by_args(const Tensor<T, D>& x, const Sample& s) {
  const auto dim = static_cast<std::int64_t>(s.args[0]);
  if (s.args[2] != 0) return tg::split(x, static_cast<std::int64_t>(s.args[3]), dim);
  std::vector<std::int64_t> sizes;
  for (std::size_t k = 3; k < s.args.size(); ++k) sizes.push_back(static_cast<std::int64_t>(s.args[k]));
  return tg::split(x, sizes, dim);
}
/// The reference's piece bounds along the dim: [start, start + len).
std::pair<std::int64_t, std::int64_t> ref_piece(const Sample& s, std::int64_t n) {
  const auto piece = static_cast<std::int64_t>(s.args[1]);
  if (s.args[2] != 0) {
    const auto chunk = static_cast<std::int64_t>(s.args[3]);
    return {piece * chunk, std::min(chunk, n - piece * chunk)};
  }
  std::int64_t start = 0;
  for (std::int64_t k = 0; k < piece; ++k) start += static_cast<std::int64_t>(s.args[3 + static_cast<std::size_t>(k)]);
  return {start, static_cast<std::int64_t>(s.args[3 + static_cast<std::size_t>(piece)])};
}

OpEntry split_entry() {
  // One piece per sample; each piece is a narrow view (recorded "slice"), its gradient lands in its range.
  OpEntry e = make_entry("split", [](const auto& x, const I&, const Sample& s) {
    return split_by_args(x[0], s)[static_cast<std::size_t>(s.args[1])];
  });
  e.sample("sizes_middle_piece", {{{4, 9}}}, {}, {1, 1, 0, 2, 3, 4})
      .sample("sizes_first_dim", {{{5, 3}, L::transposed}}, {}, {0, 0, 0, 4, 1})
      .sample("chunk_last_shorter", {{{7, 3}, L::transposed}}, {}, {0, 2, 1, 3})
      .sample("chunk_strided_negative_dim", {{{3, 10}, L::strided}}, {}, {-1, 0, 1, 4})
      .sample("size_one_piece", {{{2, 1, 6}}}, {}, {2, 1, 0, 5, 1});
  e.reference([](const X& x, const I&, const Sample& s) {
    const int d = wrap_dim(static_cast<std::int64_t>(s.args[0]), x[0].dim(), "ref");
    const auto [start, len] = ref_piece(s, x[0].shape()[d]);
    Shape out = x[0].shape();
    out[d] = len;
    return tabulate(out, [&](auto i) {
      i[static_cast<std::size_t>(d)] += start;
      return at_broadcast(x[0], i);
    });
  });
  e.tolerances(exact_tolerances());
  e.error("sizes_sum", [] { tg::split(Tensor<float>::zeros({2, 5}), std::vector<std::int64_t>{2, 2}, 1); },
          "split: the sizes [2,2] sum to 4, but dim 1 of shape [2,5] has size 5");
  e.error("negative_size", [] { tg::split(Tensor<float>::zeros({2, 5}), std::vector<std::int64_t>{6, -1}, 1); },
          "split: sizes must be non-negative, got -1 at position 1");
  e.error("chunk_zero", [] { tg::split(Tensor<float>::zeros({2, 5}), 0, 1); }, "split: the chunk size must be positive, got 0");
  e.error("dim_out_of_range", [] { tg::split(Tensor<float>::zeros({2, 5}), 2, -3); }, "split: dim -3 is out of range for a tensor of rank 2");
  return e;
}

// split then concat in reverse order: every piece's node feeds one concat; all pieces' gradients
// accumulate into the one input.
OpEntry split_concat_entry() {
  OpEntry e = make_entry("split_concat", [](const auto& x, const I&, const Sample& s) {
    auto parts = tg::split(x[0], static_cast<std::int64_t>(s.args[1]), static_cast<std::int64_t>(s.args[0]));
    std::reverse(parts.begin(), parts.end());
    return tg::concat(parts, static_cast<std::int64_t>(s.args[0]));
  });
  e.sample("rows", {{{7, 4}}}, {}, {0, 3}).sample("cols_transposed", {{{3, 8}, L::transposed}}, {}, {1, 3});
  e.reference([](const X& x, const I&, const Sample& s) {
    const int d = static_cast<int>(s.args[0]);
    const auto chunk = static_cast<std::int64_t>(s.args[1]), n = x[0].shape()[d];
    std::vector<std::int64_t> starts;  // chunk starts, reversed
    for (std::int64_t st = 0; st < n; st += chunk) starts.insert(starts.begin(), st);
    return tabulate(x[0].shape(), [&](auto i) {
      std::int64_t pos = i[static_cast<std::size_t>(d)];
      for (std::int64_t st : starts) {
        const std::int64_t len = std::min(chunk, n - st);
        if (pos < len) {
          i[static_cast<std::size_t>(d)] = st + pos;
          break;
        }
        pos -= len;
      }
      return at_broadcast(x[0], i);
    });
  });
  e.tolerances(exact_tolerances());
  return e;
}

TG_REGISTER_OP(exp_entry());
TG_REGISTER_OP(log_entry());
TG_REGISTER_OP(sqrt_entry());
TG_REGISTER_OP(rsqrt_entry());
TG_REGISTER_OP(tanh_entry());
TG_REGISTER_OP(sigmoid_entry());
TG_REGISTER_OP(relu_entry());
TG_REGISTER_OP(gelu_entry());
TG_REGISTER_OP(gelu_tanh_entry());
TG_REGISTER_OP(silu_entry());
TG_REGISTER_OP(dropout_entry());
TG_REGISTER_OP(masked_fill_entry());
TG_REGISTER_OP(causal_mask_entry());
TG_REGISTER_OP(concat_entry());
TG_REGISTER_OP(split_entry());
TG_REGISTER_OP(split_concat_entry());

// ---- pointwise (Note [fused pointwise expressions]) ------------------------------------------------------
// One expression using every node kind: + - * /, negation, numbers on both sides, exp, log, tanh, sqrt,
// sigmoid, relu; three inputs, broadcast in the samples.
template <class T, class D>
Tensor<T, D> pointwise_example(const Tensor<T, D>& a, const Tensor<T, D>& b, const Tensor<T, D>& c) {
  using namespace tg::pw;
  return tg::pointwise(tanh(_0 * 0.5 + _1) * _2 + sigmoid(_0) / (1.0 + exp(-_1)) - sqrt(_2) * relu(_0) + log(_2) / 3.0,
                       a, b, c);
}
double ref_pointwise(double a, double b, double c) {
  return std::tanh(a * 0.5 + b) * c + ref_sigmoid(a) / (1.0 + std::exp(-b)) - std::sqrt(c) * (a > 0 ? a : 0.0) +
         std::log(c) / 3.0;
}
OpEntry pointwise_entry() {
  OpEntry e = make_entry("pointwise", [](const auto& x, const I&, const Sample&) { return pointwise_example(x[0], x[1], x[2]); });
  e.sample("same_shape", {{{3, 5}}, {{3, 5}}, {{3, 5}, 0.5, 2.0}})
      .sample("broadcast", {{{2, 3, 4}}, {{4}}, {{2, 3, 1}, 0.5, 2.0}})
      .sample("strided", {{{4, 6}, L::transposed}, {{4, 6}, L::strided}, {{6}, 0.5, 2.0}})
      .sample("scalar_input", {{{5}}, {{}}, {{5}, 0.5, 2.0}});
  e.reference([](const X& x, const I&, const Sample&) {
    Shape shape = x[0].shape();
    for (std::size_t i = 1; i < 3; ++i) shape = broadcast_shapes(shape, x[i].shape(), "ref");
    const Tensor<double> a = x[0].expand(shape).contiguous(), b = x[1].expand(shape).contiguous(),
                         c = x[2].expand(shape).contiguous();
    Tensor<double> out = Tensor<double>::empty(shape);
    for (std::int64_t i = 0; i < out.numel(); ++i) out.data()[i] = ref_pointwise(a.data()[i], b.data()[i], c.data()[i]);
    return out;
  });
  e.error("shapes", [] { tg::pointwise(tg::pw::_0 + tg::pw::_1, Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({4})); },
          "pointwise: shapes cannot be broadcast: a is [2,3], b is [4]");
  return e;
}
TG_REGISTER_OP(pointwise_entry());

// tg::pointwise's relu and sigmoid compute what the tensor ops compute at the edges: relu passes NaN and -0 through
// (its gradient 0 at and below 0), sigmoid does not underflow early for large negative x (e^x / (1 + e^x) there).
TEST(OpDb_pointwise_behaviour, ReluAndSigmoidMatchTheTensorOpsAtTheEdges) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  Tensor<float> x = Tensor<float>::from_vector({8}, {nan, -0.f, 0.f, -3.f, 2.f, -95.f, -100.f, 40.f});
  x.requires_grad_();
  const Tensor<float> r = tg::pointwise(tg::pw::relu(tg::pw::_0), x), s = tg::pointwise(tg::pw::sigmoid(tg::pw::_0), x);
  const Tensor<float> rt = tg::relu(x.detach()), st = tg::sigmoid(x.detach());
  const auto rv = r.to_vector(), sv = s.to_vector(), rtv = rt.to_vector(), stv = st.to_vector();
  for (std::size_t i = 0; i < rv.size(); ++i) {
    EXPECT_EQ(std::memcmp(&rv[i], &rtv[i], sizeof(float)), 0) << "relu, element " << i << ": " << rv[i] << " vs " << rtv[i];
    if (std::isnan(stv[i])) EXPECT_TRUE(std::isnan(sv[i])) << "sigmoid, element " << i << ": " << sv[i];  // a NaN's sign is not kept
    else EXPECT_EQ(std::memcmp(&sv[i], &stv[i], sizeof(float)), 0) << "sigmoid, element " << i << ": " << sv[i] << " vs " << stv[i];
  }
  EXPECT_GT(sv[5], 0.f) << "sigmoid(-95) is a subnormal, not 0";
  r.backward(Tensor<float>::ones({8}));
  const auto g = x.grad().to_vector();
  EXPECT_EQ(g, (std::vector<float>{0.f, 0.f, 0.f, 0.f, 1.f, 0.f, 0.f, 1.f}));
}

// ---- pointwise_chain (Note [fusion rewrites]) ------------------------------------------------------------
// Two programs over three inputs (c positive) that use every op a chain can hold between them, constants, an
// operand read twice (x0 * x0) and values read by several later steps; Sample::args[0] picks the program.
tg::pw::ChainProgram chain_program(int which) {
  using tg::pw::ChainStep;
  using U = tg::math::Unary;
  using Bn = tg::math::Binary;
  tg::pw::ChainProgram p;
  p.inputs = 3;
  p.constants = {0.5, 1.0};  // slots 3 and 4; steps from slot 5
  if (which == 0)  // tanh(0.5 a + b) c - sigmoid(a) / (1 + e^b) - log(c) + a a
    p.steps = {ChainStep(Bn::mul, 0, 3),  ChainStep(Bn::add, 5, 1),  ChainStep(U::tanh, 6),      ChainStep(Bn::mul, 7, 2),
               ChainStep(U::sigmoid, 0),  ChainStep(U::exp, 1),      ChainStep(Bn::add, 4, 10),  ChainStep(Bn::div, 9, 11),
               ChainStep(Bn::sub, 8, 12), ChainStep(U::log, 2),      ChainStep(Bn::sub, 13, 14), ChainStep(Bn::mul, 0, 0),
               ChainStep(Bn::add, 15, 16)};
  else  // (sqrt(c) relu(a) + rsqrt(c) gelu_tanh(b)) / c + (gelu(a) - silu(b))
    p.steps = {ChainStep(U::sqrt, 2),     ChainStep(U::relu, 0),      ChainStep(Bn::mul, 5, 6),  ChainStep(U::rsqrt, 2),
               ChainStep(U::gelu_tanh, 1), ChainStep(Bn::mul, 8, 9),  ChainStep(Bn::add, 7, 10), ChainStep(U::gelu_erf, 0),
               ChainStep(U::silu, 1),     ChainStep(Bn::sub, 12, 13), ChainStep(Bn::div, 11, 2), ChainStep(Bn::add, 15, 14)};
  return p;
}
double ref_chain(int which, double a, double b, double c) {
  const double k = std::sqrt(2.0 / M_PI);
  if (which == 0) return std::tanh(0.5 * a + b) * c - ref_sigmoid(a) / (1.0 + std::exp(b)) - std::log(c) + a * a;
  const double gt = 0.5 * b * (1.0 + std::tanh(k * (b + 0.044715 * b * b * b)));
  const double ge = 0.5 * a * std::erfc(-a / std::sqrt(2.0));
  return (std::sqrt(c) * (a > 0 ? a : 0.0) + gt / std::sqrt(c)) / c + (ge - b * ref_sigmoid(b));
}
OpEntry pointwise_chain_entry() {
  OpEntry e = make_entry("pointwise_chain", [](const auto& x, const I&, const Sample& s) {
    return tg::pointwise_chain(chain_program(static_cast<int>(s.args.at(0))), std::vector{x[0], x[1], x[2]});
  });
  for (const double which : {0.0, 1.0}) {
    const std::string w = which == 0 ? "" : "_gelu";
    e.sample("same_shape" + w, {{{3, 5}}, {{3, 5}}, {{3, 5}, 0.5, 2.0}}, {}, {which})
        .sample("broadcast" + w, {{{2, 3, 4}}, {{4}}, {{2, 3, 1}, 0.5, 2.0}}, {}, {which})
        .sample("strided" + w, {{{4, 6}, L::transposed}, {{4, 6}, L::strided}, {{6}, 0.5, 2.0}}, {}, {which})
        .sample("long" + w, {{{3, 700}}, {{700}}, {{3, 1}, 0.5, 2.0}}, {}, {which});  // several blocks of 256, one row
  }
  e.reference([](const X& x, const I&, const Sample& s) {
    Shape shape = x[0].shape();
    for (std::size_t i = 1; i < 3; ++i) shape = broadcast_shapes(shape, x[i].shape(), "ref");
    const Tensor<double> a = x[0].expand(shape).contiguous(), b = x[1].expand(shape).contiguous(), c = x[2].expand(shape).contiguous();
    Tensor<double> out = Tensor<double>::empty(shape);
    const int which = static_cast<int>(s.args.at(0));
    for (std::int64_t i = 0; i < out.numel(); ++i) out.data()[i] = ref_chain(which, a.data()[i], b.data()[i], c.data()[i]);
    return out;
  });
  e.error("inputs", [] { tg::pointwise_chain(chain_program(0), std::vector{Tensor<float>::zeros({2})}); },
          "pointwise_chain: the program reads 3 inputs, 1 were given");
  e.error("operand", [] {
    tg::pw::ChainProgram p = chain_program(0);
    p.steps[1].c = 9;  // step 1 (slot 6) reading slot 9, not yet written
    tg::pointwise_chain(p, std::vector{Tensor<float>::zeros({2}), Tensor<float>::zeros({2}), Tensor<float>::zeros({2})});
  }, "pointwise_chain: step 1 (add) reads a slot that is not before its own (6)");
  e.error("shapes", [] {
    tg::pointwise_chain(chain_program(0), std::vector{Tensor<float>::zeros({2, 3}), Tensor<float>::zeros({4}), Tensor<float>::zeros({3})});
  }, "pointwise_chain: shapes cannot be broadcast: a is [2,3], b is [4]");
  return e;
}
TG_REGISTER_OP(pointwise_chain_entry());

// A chain gives the unfused ops' values (fp32: the forward bit for bit where the ops' kernels read contiguous
// inputs, as the blocks do) and their gradients within fp32 rounding, in one node keeping only its inputs.
TEST(OpDb_pointwise_chain_behaviour, TheOpsItReplaces) {
  Generator gen(12);
  for (int which = 0; which < 2; ++which) {
    const Tensor<float> a0 = Tensor<float>::uniform({64, 96}, -2.f, 2.f, gen), b0 = Tensor<float>::uniform({96}, -1.f, 1.f, gen),
                        c0 = Tensor<float>::uniform({64, 1}, 0.5f, 2.f, gen);
    const tg::pw::ChainProgram p = chain_program(which);
    std::vector<std::vector<float>> r[2];
    for (const bool fused : {true, false}) {
      Tensor<float> a = a0.clone().detach(), b = b0.clone().detach(), c = c0.clone().detach();
      a.requires_grad_();
      b.requires_grad_();
      c.requires_grad_();
      const std::vector xs{a, b, c};
      const Tensor<float> y = fused ? tg::pointwise_chain(p, xs) : tg::detail::chain_as_ops(p, xs);
      if (fused) EXPECT_STREQ(y.autograd_meta()->producer->op(), "pointwise_chain");
      y.backward(Tensor<float>::ones(y.shape()));
      r[fused ? 0 : 1] = {y.to_vector(), a.grad().to_vector(), b.grad().to_vector(), c.grad().to_vector()};
    }
    const char* what[] = {"y", "da", "db", "dc"};
    for (std::size_t t = 0; t < 4; ++t)
      for (std::size_t i = 0; i < r[1][t].size(); ++i)
        ASSERT_NEAR(r[0][t][i], r[1][t][i], 3e-5 * (1 + std::abs(r[1][t][i]))) << "program " << which << " " << what[t] << " at " << i;
    EXPECT_EQ(std::memcmp(r[0][0].data(), r[1][0].data(), r[1][0].size() * sizeof(float)), 0) << "program " << which << ": forward";
  }
}

// The fused expression is one tape node that keeps only its inputs, and equals the unfused ops (the same
// expression as tensor ops, one node each) within fp32 rounding, forward and every gradient.
TEST(OpDb_pointwise_behaviour, OneNodeKeepingItsInputsAndTheComposite) {
  Generator gen(11);
  const Tensor<float> a0 = Tensor<float>::uniform({64, 96}, -2.f, 2.f, gen), b0 = Tensor<float>::uniform({96}, -1.f, 1.f, gen),
                      c0 = Tensor<float>::uniform({64, 1}, 0.5f, 2.f, gen);
  auto run = [&](bool fused, std::int64_t* kept) {
    Tensor<float> a = a0.clone().detach(), b = b0.clone().detach(), c = c0.clone().detach();
    a.requires_grad_();
    b.requires_grad_();
    c.requires_grad_();
    const std::int64_t before = allocator<cpu>().stats().bytes_in_use;
    Tensor<float> y = fused ? pointwise_example(a, b, c)
                            : [&] {
                                using namespace tg::pw;
                                const std::array<Tensor<float>, 3> xs{a, b, c};
                                return eval_ops(tanh(_0 * 0.5 + _1) * _2 + sigmoid(_0) / (1.0 + exp(-_1)) -
                                                    sqrt(_2) * relu(_0) + log(_2) / 3.0,
                                                xs);
                              }();
    *kept = allocator<cpu>().stats().bytes_in_use - before;
    if (fused) {
      EXPECT_STREQ(y.autograd_meta()->producer->op(), "pointwise");
    }
    y.backward(Tensor<float>::ones(y.shape()));
    return std::vector<std::vector<float>>{y.to_vector(), a.grad().to_vector(), b.grad().to_vector(), c.grad().to_vector()};
  };
  std::int64_t kept_fused = 0, kept_ops = 0;
  const auto f = run(true, &kept_fused), u = run(false, &kept_ops);
  const char* what[] = {"y", "da", "db", "dc"};
  for (std::size_t t = 0; t < f.size(); ++t) {
    ASSERT_EQ(f[t].size(), u[t].size());
    for (std::size_t i = 0; i < f[t].size(); ++i)
      ASSERT_NEAR(f[t][i], u[t][i], 2e-5 * (1 + std::abs(u[t][i]))) << what[t] << " at " << i;
  }
  // the fused node keeps its output and the two broadcast inputs' dense copies; the ops keep every intermediate
  EXPECT_LT(kept_fused * 3, kept_ops) << "fused " << kept_fused << " bytes, unfused " << kept_ops;
}

// Negation keeps the sign of zero in the derivatives too: sqrt(-x) at x = +0 has the gradient the tensor ops
// give (neg then sqrt: -(0.5 / sqrt(-0)) = +inf) and the GPU's dual negation gives; a dual computed as 0 - x
// lost the sign and gave -inf.
TEST(OpDb_pointwise_behaviour, NegationKeepsTheSignOfZero) {
  using namespace tg::pw;
  for (const bool fused : {true, false}) {
    Tensor<float> x = Tensor<float>::zeros({1});
    x.requires_grad_();
    const Tensor<float> y = fused ? tg::pointwise(sqrt(-_0), x) : tg::sqrt(tg::neg(x));
    y.backward(Tensor<float>::ones({1}));
    const float g = x.grad().to_vector()[0];
    EXPECT_TRUE(std::isinf(g) && g > 0) << (fused ? "pointwise" : "tensor ops") << " gave " << g;
    EXPECT_TRUE(std::signbit(y.to_vector()[0])) << "sqrt(-0) is -0";
  }
}

// ---- behaviour the generic checks cannot express --------------------------------------------------
TEST(OpDb_dropout_behaviour, ConsumesCountersAndReplaysFromSeedOffset) {
  const Tensor<float> x = Tensor<float>::ones({4, 8});
  Generator gen(77);
  const Tensor<float> a = tg::dropout(x, 0.5, gen);
  EXPECT_EQ(gen.offset(), 8u);  // one counter per four elements
  const Tensor<float> b = tg::dropout(x, 0.5, gen);
  EXPECT_EQ(gen.offset(), 16u);
  EXPECT_NE(a.to_vector(), b.to_vector());  // fresh counters, a fresh mask (equal with probability 2^-32)
  Generator replay(77);
  EXPECT_EQ(tg::dropout(x, 0.5, replay).to_vector(), a.to_vector());  // same (seed, offset): same mask
  // identity paths consume nothing
  EXPECT_EQ(tg::dropout(x, 0.0, gen).storage(), x.storage());
  EXPECT_EQ(tg::dropout(x, 0.5, gen, false).storage(), x.storage());
  EXPECT_EQ(gen.offset(), 16u);
}

// Note [dropout masks in vectors]: the CPU kernels' vectorized keep rule is the definition (element i of a mask at
// word position P kept iff uniform_from_bits(philox_words(seed, (P + i) / 4)[(P + i) % 4]) >= p) for every length
// (whole vectors, pairs of them, the scalar tail, several blocks), strided rows, counters that carry into the high
// word, and (through the backend kernels, as a sequence-parallel slice draws) positions inside a counter.
bool keep_by_definition(std::uint64_t seed, std::uint64_t word, double p) {
  return tg::math::dropout_keep(tg::detail::uniform_from_bits(tg::detail::philox_words(seed, word / 4)[word % 4]), static_cast<float>(p));
}

TEST(OpDb_dropout_behaviour, MaskIsTheDefinitionOverBlocksAndTheCarry) {
  const double p = 0.37;
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  for (const std::uint64_t start : {std::uint64_t{0}, std::uint64_t{0xFFFFFFFFull} - 40, std::uint64_t{0x1FFFFFFF0ull}}) {
    for (const std::int64_t n : {1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 700}) {
      Generator gen(0x5eed5eed12345ull);
      gen.advance(start);
      const Tensor<float> x = Tensor<float>::arange(2 * n).view({n, 2}).transpose(0, 1);  // (2, n) strided
      const Tensor<float> y = tg::dropout(x, p, gen), r = Tensor<float>::ones({2, n});
      EXPECT_EQ(gen.offset(), start + static_cast<std::uint64_t>((2 * n + 3) / 4)) << "four elements per counter";
      Generator gen2(0x5eed5eed12345ull);
      gen2.advance(start + 1000);
      const Tensor<float> z = tg::dropout_add(r, r, p, gen2);
      const auto xv = x.contiguous().to_vector(), yv = y.to_vector(), zv = z.to_vector();
      for (std::int64_t i = 0; i < 2 * n; ++i) {
        const auto at = static_cast<std::size_t>(i);
        const bool k = keep_by_definition(gen.seed(), 4 * start + static_cast<std::uint64_t>(i), p);
        const bool k2 = keep_by_definition(gen.seed(), 4 * (start + 1000) + static_cast<std::uint64_t>(i), p);
        ASSERT_EQ(yv[at], k ? xv[at] * scale : 0.f) << "dropout: start " << start << ", n " << n << ", element " << i;
        ASSERT_EQ(zv[at], 1.f + (k2 ? scale : 0.f)) << "dropout_add: start " << start << ", n " << n << ", element " << i;
      }
      // The backend kernels at every word position inside a counter (1, 2, 3 words in), contiguous and strided.
      const Tensor<float> xc = x.contiguous();
      for (const std::uint64_t lead : {std::uint64_t{1}, std::uint64_t{2}, std::uint64_t{3}}) {
        const std::uint64_t at0 = 4 * start + lead;
        std::vector<float> out(static_cast<std::size_t>(2 * n)), out_add(static_cast<std::size_t>(2 * n));
        tg::backend::cpu::dropout_forward<float>(x.data(), x.strides(), out.data(), x.shape(), gen.seed(), at0, nullptr, p);
        tg::backend::cpu::dropout_add_forward<float>(r.data(), xc.data(), out_add.data(), 2 * n, gen.seed(), at0, nullptr, p);
        for (std::int64_t i = 0; i < 2 * n; ++i) {
          const auto at = static_cast<std::size_t>(i);
          const bool k = keep_by_definition(gen.seed(), at0 + static_cast<std::uint64_t>(i), p);
          ASSERT_EQ(out[at], k ? xv[at] * scale : 0.f) << "dropout_forward at word " << at0 << ", n " << n << ", element " << i;
          ASSERT_EQ(out_add[at], 1.f + (k ? xv[at] * scale : 0.f)) << "dropout_add_forward at word " << at0 << ", n " << n << ", element " << i;
        }
      }
    }
  }
}

// The 16-bit kernels convert in loops of their own over contiguous rows (so that they vectorize): each element is
// still the definition's value rounded as the op rounds it (dropout: the scaled value rounded to bf16 once;
// dropout_add: that value, then the sum in fp32 rounded again), over blocks, tails and a strided input.
TEST(OpDb_dropout_behaviour, Bf16ValuesAreTheDefinitionRoundedOnceEach) {
  const double p = 0.23;
  const float scale = static_cast<float>(1.0 / (1.0 - p));
  for (const std::int64_t n : {1, 17, 255, 256, 257, 700}) {
    Generator init(static_cast<std::uint64_t>(n));
    const Tensor<bf16> x = Tensor<float>::normal({2, n}, 0.f, 3.f, init).to<bf16>();
    const Tensor<bf16> r = Tensor<float>::normal({2, n}, 0.f, 3.f, init).to<bf16>();
    const Tensor<bf16> xt = x.transpose(0, 1).contiguous().transpose(0, 1);  // the same values, strided
    Generator gen(0xb16b16ull), gen_t(0xb16b16ull), gen_add(0xb16b16ull);
    const std::uint64_t start = gen.offset();
    const Tensor<bf16> y = tg::dropout(x, p, gen), yt = tg::dropout(xt, p, gen_t), z = tg::dropout_add(r, x, p, gen_add);
    const auto xv = x.to_vector(), rv = r.to_vector(), yv = y.to_vector(), ytv = yt.contiguous().to_vector(), zv = z.to_vector();
    for (std::int64_t i = 0; i < 2 * n; ++i) {
      const auto at = static_cast<std::size_t>(i);
      const bool k = keep_by_definition(gen.seed(), 4 * start + static_cast<std::uint64_t>(i), p);
      const bf16 d(k ? static_cast<float>(xv[at]) * scale : 0.f);
      const bf16 sum(static_cast<float>(rv[at]) + static_cast<float>(d));
      ASSERT_EQ(yv[at].bits, d.bits) << "dropout: n " << n << ", element " << i;
      ASSERT_EQ(ytv[at].bits, d.bits) << "dropout of a strided input: n " << n << ", element " << i;
      ASSERT_EQ(zv[at].bits, sum.bits) << "dropout_add: n " << n << ", element " << i;
    }
  }
}

TEST(OpDb_dropout_behaviour, KeptFractionAndBackwardMaskMatchForward) {
  Tensor<float> x = Tensor<float>::ones({256, 256});
  x.requires_grad_();
  Generator gen(3);
  const Tensor<float> y = tg::dropout(x, 0.3, gen);
  y.backward(Tensor<float>::ones(y.shape()));
  const auto yv = y.to_vector(), gv = x.grad().to_vector();
  std::int64_t kept = 0;
  for (std::size_t i = 0; i < yv.size(); ++i) {
    kept += yv[i] != 0;
    EXPECT_EQ(yv[i], gv[i]) << "backward's recomputed mask differs from forward's at " << i;
  }
  // 65536 Bernoulli(0.7) draws: standard deviation 117, so 6 sigma is about 700
  EXPECT_NEAR(static_cast<double>(kept), 0.7 * 65536, 700);
}

TEST(OpDb_split_behaviour, PiecesAreViewsAndEachIsItsOwnNode) {
  Tensor<float> x = Tensor<float>::arange(10).view({2, 5});
  x.requires_grad_();
  const auto parts = tg::split(x, std::vector<std::int64_t>{2, 3}, 1);
  ASSERT_EQ(parts.size(), 2u);
  EXPECT_EQ(parts[0].storage(), x.storage());
  EXPECT_EQ(parts[1].storage_offset(), 2);
  EXPECT_EQ(parts[1].shape(), Shape({2, 3}));
  ASSERT_TRUE(parts[0].autograd_meta() && parts[1].autograd_meta());
  EXPECT_NE(parts[0].autograd_meta()->producer, parts[1].autograd_meta()->producer);
  EXPECT_STREQ(parts[1].autograd_meta()->producer->op(), "slice");  // narrow is a unit-step slice
  EXPECT_EQ(tg::split(x, 2, 1).size(), 3u);  // chunks 2, 2, 1
}

}  // namespace
}  // namespace tg::testing

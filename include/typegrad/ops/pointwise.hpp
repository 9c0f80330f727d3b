// tg::pointwise: a chain of elementwise operations over broadcast inputs, evaluated in one pass, with one tape
// node whose backward computes every input's gradient in one more pass (Note [fused pointwise expressions]).
//   using namespace tg::pw;
//   auto y = tg::pointwise(tanh(_0 * 0.5 + _1) * _2, x, bias, scale);   // x [B,T,C], bias [C], scale [B,T,1]
#pragma once
#define TG_POINTWISE_HPP_IN_PROGRESS  // unary.hpp and binary.hpp leave pointwise_chain.hpp to the end of this header

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "typegrad/autodiff/node.hpp"
#include "typegrad/detail/cuda/pointwise.hpp"
#include "typegrad/ops/binary.hpp"
#include "typegrad/ops/reduce.hpp"
#include "typegrad/ops/unary.hpp"

// Note [fused pointwise expressions]
// A chain of elementwise ops run as separate ops reads and writes a whole tensor per op, and keeps each
// intermediate for the backward. tg::pointwise takes the chain as an expression over its inputs (_0, _1, ...,
// numbers, + - * /, and exp, log, tanh, sqrt, sigmoid, relu from tg::pw) and, on the CPU, evaluates it in one
// loop over the broadcast output (broadcast and strided inputs read in place), in the accumulation type (fp32
// for 16-bit storage, rounded once per output element), keeping only its inputs for the backward. The backward is one more loop: the expression evaluated on
// dual numbers (value and one partial derivative per input) gives every input's gradient at once; an input that
// was broadcast gets its gradient summed back to its shape. In 16-bit types the result differs from the
// unfused ops by their intermediate roundings (it is the more accurate one); in fp32 and fp64 by the order of
// the libm calls' arguments at most. On a GPU the same two passes run as kernels generated from the expression
// and compiled at run time (Note [pointwise kernels through NVRTC]); where that is unavailable, the expression
// runs as the corresponding tensor ops, so both devices give the same function either way.

namespace tg::pw {

// ---- dual numbers: a value and its partial derivatives with respect to N inputs ---------------------------
template <class S, std::size_t N>
struct Dual {
  S v{};
  std::array<S, N> d{};
};
template <class S, std::size_t N>
Dual<S, N> operator+(const Dual<S, N>& a, const Dual<S, N>& b) {
  Dual<S, N> r{a.v + b.v, {}};
  for (std::size_t i = 0; i < N; ++i) r.d[i] = a.d[i] + b.d[i];
  return r;
}
template <class S, std::size_t N>
Dual<S, N> operator-(const Dual<S, N>& a, const Dual<S, N>& b) {
  Dual<S, N> r{a.v - b.v, {}};
  for (std::size_t i = 0; i < N; ++i) r.d[i] = a.d[i] - b.d[i];
  return r;
}
template <class S, std::size_t N>
Dual<S, N> operator*(const Dual<S, N>& a, const Dual<S, N>& b) {
  Dual<S, N> r{a.v * b.v, {}};
  for (std::size_t i = 0; i < N; ++i) r.d[i] = a.d[i] * b.v + a.v * b.d[i];
  return r;
}
template <class S, std::size_t N>
Dual<S, N> operator/(const Dual<S, N>& a, const Dual<S, N>& b) {
  Dual<S, N> r{a.v / b.v, {}};
  for (std::size_t i = 0; i < N; ++i) r.d[i] = (a.d[i] - r.v * b.d[i]) / b.v;
  return r;
}
/// f(a) with f'(a) = df: the chain rule.
template <class S, std::size_t N>
Dual<S, N> chain(const Dual<S, N>& a, S f, S df) {
  Dual<S, N> r{f, {}};
  for (std::size_t i = 0; i < N; ++i) r.d[i] = a.d[i] * df;
  return r;
}

template <class S>
struct Scalar {  // the scalar type under S
  using type = S;
};
template <class S, std::size_t N>
struct Scalar<Dual<S, N>> {
  using type = S;
};
template <class S>
S lift(double c) {
  if constexpr (std::is_floating_point_v<S>) return static_cast<S>(c);
  else return S{static_cast<typename Scalar<S>::type>(c), {}};
}

// The element functions on scalars and on duals (derivatives written from the values already computed).
template <class S>
S f_neg(const S& a) {
  if constexpr (std::is_floating_point_v<S>) {
    return -a;
  } else {  // -v and -dv (0 - v would turn -0 into +0, and the GPU's dual negation does not)
    S r = a;
    r.v = -r.v;
    for (auto& d : r.d) d = -d;
    return r;
  }
}
template <class S>
S f_exp(const S& a) {
  if constexpr (std::is_floating_point_v<S>) return std::exp(a);
  else {
    const auto e = std::exp(a.v);
    return chain(a, e, e);
  }
}
template <class S>
S f_log(const S& a) {
  if constexpr (std::is_floating_point_v<S>) return std::log(a);
  else return chain(a, std::log(a.v), decltype(a.v)(1) / a.v);
}
template <class S>
S f_tanh(const S& a) {
  if constexpr (std::is_floating_point_v<S>) return std::tanh(a);
  else {
    const auto t = std::tanh(a.v);
    return chain(a, t, decltype(t)(1) - t * t);
  }
}
template <class S>
S f_sqrt(const S& a) {
  if constexpr (std::is_floating_point_v<S>) return std::sqrt(a);
  else {
    const auto s = std::sqrt(a.v);
    return chain(a, s, decltype(s)(0.5) / s);
  }
}
template <class S>
S f_sigmoid(const S& a) {  // math::sigmoid's form (e^x / (1 + e^x) below 0: no early underflow), as the tensor op
  if constexpr (std::is_floating_point_v<S>) return math::sigmoid(a);
  else {
    using T = decltype(a.v);
    const T s = math::sigmoid(a.v);
    return chain(a, s, s * (T(1) - s));
  }
}
template <class S>
S f_relu(const S& a) {  // the tensor op's value (NaN and -0 pass through); the derivative at 0 is taken as 0, as relu's
  if constexpr (std::is_floating_point_v<S>) return a < S(0) ? S(0) : a;
  else {
    using T = decltype(a.v);
    if (a.v > T(0)) return a;
    S r = lift<S>(0.0);
    r.v = a.v < T(0) ? T(0) : a.v;
    return r;
  }
}

// ---- expression nodes ----------------------------------------------------------------------------------------
template <int I>
struct Arg {};
struct Lit {
  double v;
};
enum class BinOp { add, sub, mul, div };
enum class UnOp { neg, exp, log, tanh, sqrt, sigmoid, relu };
template <BinOp Op, class L, class R>
struct Bin {
  L l;
  R r;
};
template <UnOp Op, class E>
struct Un {
  E e;
};

template <class E>
struct is_expr : std::false_type {};
template <int I>
struct is_expr<Arg<I>> : std::true_type {};
template <>
struct is_expr<Lit> : std::true_type {};
template <BinOp Op, class L, class R>
struct is_expr<Bin<Op, L, R>> : std::true_type {};
template <UnOp Op, class E>
struct is_expr<Un<Op, E>> : std::true_type {};
template <class E>
concept Expr = is_expr<std::remove_cvref_t<E>>::value;

/// The inputs an expression reads: one more than its largest argument index (0 for a constant).
template <int I>
constexpr int arity(const Arg<I>*) {
  return I + 1;
}
constexpr int arity(const Lit*) { return 0; }
template <BinOp Op, class L, class R>
constexpr int arity(const Bin<Op, L, R>*) {
  const int a = arity(static_cast<const L*>(nullptr)), b = arity(static_cast<const R*>(nullptr));
  return a > b ? a : b;
}
template <UnOp Op, class E>
constexpr int arity(const Un<Op, E>*) {
  return arity(static_cast<const E*>(nullptr));
}
template <Expr E>
inline constexpr int arity_v = arity(static_cast<const std::remove_cvref_t<E>*>(nullptr));

inline constexpr Arg<0> _0{};
inline constexpr Arg<1> _1{};
inline constexpr Arg<2> _2{};
inline constexpr Arg<3> _3{};
inline constexpr Arg<4> _4{};
inline constexpr Arg<5> _5{};

template <class X>
auto as_expr(const X& x) {
  if constexpr (Expr<X>) return x;
  else return Lit{static_cast<double>(x)};
}
template <class A, class B>
concept Operands = (Expr<A> && (Expr<B> || std::is_arithmetic_v<B>)) || (std::is_arithmetic_v<A> && Expr<B>);

#define TG_PW_BINARY(sym, op)                                                       \
  template <class A, class B>                                                       \
    requires Operands<A, B>                                                         \
  auto operator sym(const A& a, const B& b) {                                       \
    return Bin<op, decltype(as_expr(a)), decltype(as_expr(b))>{as_expr(a), as_expr(b)}; \
  }
TG_PW_BINARY(+, BinOp::add)
TG_PW_BINARY(-, BinOp::sub)
TG_PW_BINARY(*, BinOp::mul)
TG_PW_BINARY(/, BinOp::div)
#undef TG_PW_BINARY
template <Expr E>
auto operator-(const E& e) {
  return Un<UnOp::neg, E>{e};
}
#define TG_PW_UNARY(fn, op)            \
  template <Expr E>                    \
  auto fn(const E& e) {                \
    return Un<op, E>{e};               \
  }
TG_PW_UNARY(exp, UnOp::exp)
TG_PW_UNARY(log, UnOp::log)
TG_PW_UNARY(tanh, UnOp::tanh)
TG_PW_UNARY(sqrt, UnOp::sqrt)
TG_PW_UNARY(sigmoid, UnOp::sigmoid)
TG_PW_UNARY(relu, UnOp::relu)
#undef TG_PW_UNARY

// ---- evaluation on scalars or duals (args: a std::array<S, arity>) ---------------------------------------------
template <class S, std::size_t K, int I>
S eval(const Arg<I>&, const std::array<S, K>& x) {
  return x[I];
}
template <class S, std::size_t K>
S eval(const Lit& c, const std::array<S, K>&) {
  return lift<S>(c.v);
}
template <class S, std::size_t K, BinOp Op, class L, class R>
S eval(const Bin<Op, L, R>& e, const std::array<S, K>& x) {
  const S a = eval(e.l, x), b = eval(e.r, x);
  if constexpr (Op == BinOp::add) return a + b;
  else if constexpr (Op == BinOp::sub) return a - b;
  else if constexpr (Op == BinOp::mul) return a * b;
  else return a / b;
}
template <class S, std::size_t K, UnOp Op, class E>
S eval(const Un<Op, E>& u, const std::array<S, K>& x) {
  const S a = eval(u.e, x);
  if constexpr (Op == UnOp::neg) return f_neg(a);
  else if constexpr (Op == UnOp::exp) return f_exp(a);
  else if constexpr (Op == UnOp::log) return f_log(a);
  else if constexpr (Op == UnOp::tanh) return f_tanh(a);
  else if constexpr (Op == UnOp::sqrt) return f_sqrt(a);
  else if constexpr (Op == UnOp::sigmoid) return f_sigmoid(a);
  else return f_relu(a);
}

// ---- evaluation as tensor ops (the GPU's path, and a reference) -------------------------------------------
template <class T, class D, std::size_t K, int I>
Tensor<T, D> eval_ops(const Arg<I>&, const std::array<Tensor<T, D>, K>& x) {
  return x[I];
}
template <class T, class D, std::size_t K>
Tensor<T, D> eval_ops(const Lit& c, const std::array<Tensor<T, D>, K>&) {
  return Tensor<T, D>::full(Shape(), c.v);
}
template <class T, class D, std::size_t K, BinOp Op, class L, class R>
Tensor<T, D> eval_ops(const Bin<Op, L, R>& e, const std::array<Tensor<T, D>, K>& x) {
  const Tensor<T, D> a = eval_ops(e.l, x), b = eval_ops(e.r, x);
  if constexpr (Op == BinOp::add) return tg::add(a, b);
  else if constexpr (Op == BinOp::sub) return tg::sub(a, b);
  else if constexpr (Op == BinOp::mul) return tg::mul(a, b);
  else return tg::div(a, b);
}
template <class T, class D, std::size_t K, UnOp Op, class E>
Tensor<T, D> eval_ops(const Un<Op, E>& u, const std::array<Tensor<T, D>, K>& x) {
  const Tensor<T, D> a = eval_ops(u.e, x);
  if constexpr (Op == UnOp::neg) return tg::neg(a);
  else if constexpr (Op == UnOp::exp) return tg::exp(a);
  else if constexpr (Op == UnOp::log) return tg::log(a);
  else if constexpr (Op == UnOp::tanh) return tg::tanh(a);
  else if constexpr (Op == UnOp::sqrt) return tg::sqrt(a);
  else if constexpr (Op == UnOp::sigmoid) return tg::sigmoid(a);
  else return tg::relu(a);
}

// ---- the expression as CUDA source (Note [pointwise kernels through NVRTC]) ---------------------------------
/// A literal as CUDA source: `tg_lit<S>(L[k])`, the k-th value of the launch's literal table, while `lits` has
/// room (the table is part of the kernel's arguments, so an expression whose constants change each step compiles
/// once); otherwise, or without a table, its exact bits (`__longlong_as_double`, locale-free, -0.0 and non-finite
/// values included).
inline std::string literal_source(double v, std::vector<double>* lits) {
  if (lits && lits->size() < static_cast<std::size_t>(backend::cuda::kPointwiseMaxLiterals)) {
    lits->push_back(v);
    return "tg_lit<S>(L[" + std::to_string(lits->size() - 1) + "])";
  }
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  char buf[40];
  std::snprintf(buf, sizeof buf, "0x%016llxULL", static_cast<unsigned long long>(bits));
  return std::string("tg_lit<S>(__longlong_as_double((long long)") + buf + "))";
}
/// The expression as CUDA source over x0 .. x{K-1}; its literals go to `lits` (see literal_source).
template <int I>
std::string source(const Arg<I>&, std::vector<double>* = nullptr) {
  return "x" + std::to_string(I);
}
inline std::string source(const Lit& c, std::vector<double>* lits = nullptr) { return literal_source(c.v, lits); }
template <BinOp Op, class L, class R>
std::string source(const Bin<Op, L, R>& e, std::vector<double>* lits = nullptr) {
  constexpr const char* sym = Op == BinOp::add ? " + " : Op == BinOp::sub ? " - " : Op == BinOp::mul ? " * " : " / ";
  std::string l = source(e.l, lits);  // left before right: the table's order is the printing order
  return "(" + l + sym + source(e.r, lits) + ")";
}
template <UnOp Op, class E>
std::string source(const Un<Op, E>& u, std::vector<double>* lits = nullptr) {
  constexpr const char* fn = Op == UnOp::neg ? "-" : Op == UnOp::exp ? "tg_exp" : Op == UnOp::log ? "tg_log"
                             : Op == UnOp::tanh ? "tg_tanh" : Op == UnOp::sqrt ? "tg_sqrt"
                             : Op == UnOp::sigmoid ? "tg_sigmoid" : "tg_relu";
  return std::string("(") + fn + "(" + source(u.e, lits) + "))";
}

}  // namespace tg::pw

namespace tg {

namespace detail {
template <Element T, std::size_t K, Device D = cpu>
struct PointwiseSaved {
  std::array<Tensor<T, D>, K> x;  // the inputs as given (views, no copies)
};

/// The offsets of K operands, broadcast and strided over one row-major index space, walked element by element.
template <std::size_t K>
class BroadcastWalk {
 public:
  BroadcastWalk(const Shape& shape, const std::array<Shape, K>& strides) : shape_(shape), strides_(strides) {}
  /// Calls f(j, offsets) for j in [b, e), offsets[i] the element of operand i for output element j.
  template <class F>
  void run(std::int64_t b, std::int64_t e, F f) const {
    const int nd = shape_.size();
    std::array<std::int64_t, kMaxDims> coord{};
    std::array<std::int64_t, K> off{};
    std::int64_t rest = b;
    for (int d = nd - 1; d >= 0; --d) {
      coord[d] = shape_[d] ? rest % shape_[d] : 0;
      rest = shape_[d] ? rest / shape_[d] : 0;
      for (std::size_t i = 0; i < K; ++i) off[i] += coord[d] * strides_[i][d];
    }
    for (std::int64_t j = b; j < e; ++j) {
      f(j, off);
      for (int d = nd - 1; d >= 0; --d) {  // the next element: carry through the dims
        for (std::size_t i = 0; i < K; ++i) off[i] += strides_[i][d];
        if (++coord[d] < shape_[d]) break;
        for (std::size_t i = 0; i < K; ++i) off[i] -= coord[d] * strides_[i][d];
        coord[d] = 0;
      }
    }
  }

 private:
  Shape shape_;
  std::array<Shape, K> strides_;
};

/// Runs body(begin, end) over [0, n) in pieces, on the OpenMP threads when n is large.
template <class Body>
void pointwise_for(std::int64_t n, Body body) {
  constexpr std::int64_t kPiece = 4096;
  const std::int64_t pieces = (n + kPiece - 1) / kPiece;
#pragma omp parallel for schedule(static) if (pieces > 8)
  for (std::int64_t p = 0; p < pieces; ++p) body(p * kPiece, std::min(n, (p + 1) * kPiece));
}

/// The inputs of one pointwise call: detached (views, no copies), their shapes, and the broadcast output shape.
template <Element T, Device D, std::size_t K>
struct PointwiseInputs {
  std::array<Tensor<T, D>, K> x;
  std::array<Shape, K> shapes;
  Shape shape;
};
template <Element T, Device D, std::size_t K>
PointwiseInputs<T, D, K> pointwise_inputs(const std::array<Tensor<T, D>, K>& xs) {
  PointwiseInputs<T, D, K> in;
  in.shape = xs[0].shape();
  for (std::size_t i = 1; i < K; ++i) in.shape = broadcast_shapes(in.shape, xs[i].shape(), "pointwise");
  for (std::size_t i = 0; i < K; ++i) {
    in.x[i] = xs[i].detach();
    in.shapes[i] = in.x[i].shape();
  }
  return in;
}

/// The backward's result: each needed input's gradient over the output's shape, summed back to the input's shape.
template <Element T, Device D, std::size_t K, class Need>
auto pointwise_grads(const std::array<Tensor<T, D>, K>& full, const Need& need, const std::array<Shape, K>& shapes) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple{(need[I] ? (full[I].shape() == shapes[I] ? full[I] : sum_to_shape(full[I], shapes[I]))
                               : Tensor<T, D>())...};
  }(std::make_index_sequence<K>{});
}

/// The launch arguments of a generated kernel: the first `count` inputs at their strides over `shape` (0 where
/// broadcast); tg::pointwise passes all K, tg::pointwise_chain its program's number of inputs.
template <Element T, Device D, std::size_t K>
backend::cuda::PointwiseArgs pointwise_args(const std::array<Tensor<T, D>, K>& in, const Shape& shape, std::size_t count = K) {
  backend::cuda::PointwiseArgs a;
  a.n = shape.numel();
  a.nd = shape.size();
  for (int d = 0; d < shape.size(); ++d) a.size[d] = shape[d];
  for (std::size_t k = 0; k < count; ++k) {
    a.in[k] = in[k].data();
    const Shape st = in[k].expand(shape).strides();
    for (int d = 0; d < shape.size(); ++d) a.st[k][d] = st[d];
  }
  return a;
}

/// tg::pointwise on a GPU through one generated kernel each way (Note [pointwise kernels through NVRTC]);
/// undefined when the kernel is unavailable (said once on stderr): the caller runs tensor ops.
template <class E, FloatingElement T, Device D, std::size_t K>
Tensor<T, D> pointwise_cuda(const E& expr, const std::array<Tensor<T, D>, K>& xs) {
  const PointwiseInputs<T, D, K> p = pointwise_inputs(xs);
  const Shape& shape = p.shape;
  std::vector<double> lits;
  const std::string src =
      backend::cuda::pointwise_source(dtype_traits<T>::dtype, static_cast<int>(K), pw::source(expr, &lits));
  Tensor<T, D> out = Tensor<T, D>::empty(shape);
  backend::cuda::PointwiseArgs a = pointwise_args(p.x, shape);
  std::copy(lits.begin(), lits.end(), a.lit);
  a.out[0] = out.data();
  std::string why;
  // The forward's call loads both kernels (one module), so the backward below cannot fail to load.
  if (!backend::cuda::pointwise_run(src, false, a, &why)) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true))
      std::cerr << "tg::pointwise: no generated GPU kernel (" << why << "); running the expression as tensor ops\n";
    return Tensor<T, D>();
  }
  auto backward = [src, lits, in_shapes = p.shapes, shape](PointwiseSaved<T, K, D>& s, const Tensor<T, D>& dout, auto need) {
    const Tensor<T, D> g = dout.contiguous_raw();
    std::array<Tensor<T, D>, K> full;
    backend::cuda::PointwiseArgs b = pointwise_args(s.x, shape);
    std::copy(lits.begin(), lits.end(), b.lit);
    b.in[K] = g.data();
    for (std::size_t i = 0; i < K; ++i)
      if (need[i]) {
        full[i] = Tensor<T, D>::empty(shape);
        b.out[i] = full[i].data();
      }
    std::string why;
    TG_CHECK(backend::cuda::pointwise_run(src, true, b, &why), "pointwise backward: ", why);
    return pointwise_grads(full, need, in_shapes);
  };
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    autodiff::record("pointwise", out, PointwiseSaved<T, K, D>{p.x}, backward, xs[I]...);
  }(std::make_index_sequence<K>{});
  return out;
}
}  // namespace detail

/// expr over xs (broadcast to one shape), as one op: see Note [fused pointwise expressions]. expr reads _0 ...
/// _{K-1}, K = sizeof...(xs); every input has the same element type and device.
template <pw::Expr E, FloatingElement T, Device D, class... Rest>
Tensor<T, D> pointwise(const E& expr, const Tensor<T, D>& x0, const Rest&... rest) {
  constexpr std::size_t K = 1 + sizeof...(Rest);
  static_assert((std::is_same_v<Rest, Tensor<T, D>> && ...), "pointwise: every input must be a Tensor<T, D> of one T and D");
  static_assert(pw::arity_v<E> <= static_cast<int>(K), "pointwise: the expression reads an input that was not passed");
  const std::array<Tensor<T, D>, K> xs{x0, rest...};
  if constexpr (!std::is_same_v<D, cpu>) {
    if constexpr (K < static_cast<std::size_t>(backend::cuda::kPointwiseMaxOperands)) {
      if (Tensor<T, D> out = detail::pointwise_cuda(expr, xs); out.defined()) return out;
    }
    return pw::eval_ops(expr, xs);  // Note [pointwise kernels through NVRTC]: tensor ops when NVRTC is unavailable
  } else {
    const detail::PointwiseInputs<T, cpu, K> p = detail::pointwise_inputs(xs);
    const Shape& shape = p.shape;
    const std::array<Tensor<T, cpu>, K>& in = p.x;
    std::array<Shape, K> strides;
    for (std::size_t i = 0; i < K; ++i) strides[i] = in[i].expand(shape).strides();  // 0 where broadcast (a view)
    const detail::BroadcastWalk<K> walk(shape, strides);
    Tensor<T, cpu> out = Tensor<T, cpu>::empty(shape);
    using A = accum_t<T>;
    T* o = out.data();
    detail::pointwise_for(shape.numel(), [&](std::int64_t b, std::int64_t e) {
      std::array<A, K> v;
      walk.run(b, e, [&](std::int64_t j, const std::array<std::int64_t, K>& off) {
        for (std::size_t i = 0; i < K; ++i) v[i] = scalar_cast<A>(in[i].data()[off[i]]);
        o[j] = scalar_cast<T>(pw::eval(expr, v));
      });
    });
    auto backward = [expr, in_shapes = p.shapes, walk](detail::PointwiseSaved<T, K>& s, const Tensor<T, cpu>& dout,
                                                        auto need) {
      const Tensor<T, cpu> g = dout.contiguous_raw();
      std::array<Tensor<T, cpu>, K> full;  // each input's gradient over the output's shape
      for (std::size_t i = 0; i < K; ++i)
        if (need[i]) full[i] = Tensor<T, cpu>::empty(g.shape());
      detail::pointwise_for(g.numel(), [&](std::int64_t b, std::int64_t e) {
        std::array<pw::Dual<A, K>, K> v;
        walk.run(b, e, [&](std::int64_t j, const std::array<std::int64_t, K>& off) {
          for (std::size_t i = 0; i < K; ++i) {
            v[i].v = scalar_cast<A>(s.x[i].data()[off[i]]);
            v[i].d.fill(A(0));
            v[i].d[i] = A(1);
          }
          const pw::Dual<A, K> r = pw::eval(expr, v);
          const A gj = scalar_cast<A>(g.data()[j]);
          for (std::size_t i = 0; i < K; ++i)
            if (need[i]) full[i].data()[j] = scalar_cast<T>(gj * r.d[i]);
        });
      });
      return detail::pointwise_grads(full, need, in_shapes);
    };
    autodiff::record("pointwise", out, detail::PointwiseSaved<T, K>{in}, backward, x0, rest...);
    return out;
  }
}

}  // namespace tg

#undef TG_POINTWISE_HPP_IN_PROGRESS
#include "typegrad/ops/pointwise_chain.hpp"  // tg::pointwise_chain (the fusion rewrite's op), built on the above

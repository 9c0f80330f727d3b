// The op database: for every op, samples (odd sizes, broadcasting, size-1 dims, non-contiguous views),
// error inputs with their expected messages, per-precision tolerances and a plain fp64 reference.
//   TG_REGISTER_OP(make_entry("add", [](const auto& x, const auto&, const Sample&) { return tg::add(x[0], x[1]); })
//                      .sample("broadcast", {{{4, 3}}, {{3}}}).reference(...));
// The generic tests in test_op_db.cpp walk every entry (see docs/adding-an-op.md).
#pragma once

#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <typegrad/typegrad.hpp>

namespace tg::testing {

/// How a floating input is generated.
struct InputSpec {
  Shape shape;
  enum class Layout { contiguous, transposed, strided } layout = Layout::contiguous;
  // transposed: stored with its last two dims swapped and viewed back through transpose(-1, -2);
  // strided: every other element of a twice-as-long last dim (slice with step 2).
  double lo = -2.0, hi = 2.0;  // uniform value range (positive ranges for log, sqrt, ...)
  bool differentiable = true;  // gradchecked and compared in low precision
  InputSpec(Shape s) : shape(s) {}
  InputSpec(Shape s, Layout l) : shape(s), layout(l) {}
  InputSpec(Shape s, double lo_, double hi_, Layout l = Layout::contiguous) : shape(s), layout(l), lo(lo_), hi(hi_) {}
  InputSpec& constant() {
    differentiable = false;
    return *this;
  }
};

/// An integer input (indices, targets), uniform in [lo, hi).
struct IndexSpec {
  Shape shape;
  std::int64_t lo = 0, hi = 1;
};

struct Sample {
  std::string name;
  std::vector<InputSpec> inputs;
  std::vector<IndexSpec> indices;
  std::vector<double> args;  // op parameters (dims, eps, probabilities...), read by the entry's lambdas
};

template <class T, class D = cpu>
using OpFn = std::function<Tensor<T, D>(const std::vector<Tensor<T, D>>&, const std::vector<Tensor<std::int64_t>>&, const Sample&)>;
/// The plain reference: loops in fp64 over contiguous inputs (no typegrad ops).
using RefFn = std::function<Tensor<double>(const std::vector<Tensor<double>>&, const std::vector<Tensor<std::int64_t>>&,
                                           const Sample&)>;

struct Tol {
  double atol, rtol;
};
/// Per precision: fp64, fp32, bf16, fp16 (forward and gradient).
struct Tolerances {
  Tol fwd[4] = {{1e-12, 1e-12}, {1e-5, 1e-5}, {2e-2, 2e-2}, {4e-3, 4e-3}};
  Tol grad[4] = {{1e-12, 1e-12}, {1e-5, 1e-5}, {4e-2, 4e-2}, {8e-3, 8e-3}};
};

struct ErrorCase {
  std::string name;
  std::function<void()> run;
  std::string expected;  // substring of the tg::Error message
};

struct OpEntry {
  std::string name;  // the name the op records on the tape (or its public name, for composites)
  std::vector<Sample> samples;
  OpFn<fp64> f64;
  OpFn<fp32> f32;
  OpFn<bf16> bf;
  OpFn<fp16> h;
  // The same op on CUDA tensors (index inputs stay on the host), for the CPU-vs-CUDA tests.
  OpFn<fp32, cuda> cuda32;
  OpFn<bf16, cuda> cuda_bf;
  OpFn<fp16, cuda> cuda_h;
  RefFn ref;
  Tolerances tol;
  std::vector<ErrorCase> errors;
  bool differentiable = true;
  double gradcheck_eps = 1e-6;
  std::string golden_file;  // set by golden(): the PyTorch golden test_parity runs this entry on

  // Note [goldens from the op database]
  // golden() says tests/reference/goldens/<file>.tgg (default: the entry's name) holds PyTorch cases for
  // this op, written by make_goldens.py with the entry's conventions: the case's float inputs x<k> are the
  // entry's inputs (laid out as the case's `layout` asks), idx<k> its index inputs, and `args` its
  // Sample::args. test_parity then registers Parity.<file>, which calls the entry's fp32 function on each
  // case and compares the output and gradients with PyTorch's; Parity.every_golden_file_has_a_test counts
  // it. So an op's parity test is this one call, with no line in test_parity.cpp.
  OpEntry& golden(std::string file = {}) {
    golden_file = file.empty() ? name : std::move(file);
    return *this;
  }

  OpEntry& sample(std::string n, std::vector<InputSpec> in, std::vector<IndexSpec> idx = {}, std::vector<double> args = {}) {
    samples.push_back({std::move(n), std::move(in), std::move(idx), std::move(args)});
    return *this;
  }
  OpEntry& reference(RefFn f) {
    ref = std::move(f);
    return *this;
  }
  OpEntry& error(std::string n, std::function<void()> run, std::string expected) {
    errors.push_back({std::move(n), std::move(run), std::move(expected)});
    return *this;
  }
  OpEntry& tolerances(Tolerances t) {
    tol = t;
    return *this;
  }
  OpEntry& not_differentiable() {
    differentiable = false;
    return *this;
  }
};

/// One generic lambda `(const std::vector<Tensor<T, D>>&, const std::vector<Tensor<int64_t>>&, const Sample&)`
/// instantiated for every precision on the CPU and for fp32 / bf16 / fp16 on CUDA (so it must be generic over
/// the device too: see on_device_of).
template <class F>
OpEntry make_entry(std::string name, F op) {
  OpEntry e;
  e.name = std::move(name);
  e.f64 = op;
  e.f32 = op;
  e.bf = op;
  e.h = op;
  e.cuda32 = op;
  e.cuda_bf = op;
  e.cuda_h = op;
  return e;
}

/// Every entry, in registration order (filled by TG_REGISTER_OP's static initializers before main).
inline std::vector<OpEntry>& op_db() {
  static std::vector<OpEntry> db;
  return db;
}
struct Registrar {
  explicit Registrar(OpEntry e) { op_db().push_back(std::move(e)); }
};

#define TG_OPDB_CAT2(a, b) a##b
#define TG_OPDB_CAT(a, b) TG_OPDB_CAT2(a, b)
// __COUNTER__, not __LINE__: the entries compile as one unity source (Note [unity test sources]), where two
// files may register on the same line.
#define TG_REGISTER_OP(entry) static const ::tg::testing::Registrar TG_OPDB_CAT(tg_opdb_, __COUNTER__){entry}

/// `t` (a host tensor) on the device of `like`: for entries whose lambdas build extra tensors (masks).
template <class T, class D, class U>
Tensor<U, D> on_device_of(const Tensor<T, D>&, const Tensor<U, cpu>& t) {
  if constexpr (std::is_same_v<D, cpu>) return t;
  else return t.template to<D>();
}
template <class X>
using device_of = typename std::decay_t<X>::device_type;

// ---- helpers for behaviour tests ---------------------------------------------------------------
/// Whether two CPU tensors hold the same values bit for bit (same shape, any strides).
template <class T>
bool same_bits(const Tensor<T>& a, const Tensor<T>& b) {
  if (a.shape() != b.shape()) return false;
  const Tensor<T> ac = a.contiguous(), bc = b.contiguous();
  return std::memcmp(ac.data(), bc.data(), static_cast<std::size_t>(ac.numel()) * sizeof(T)) == 0;
}
/// A fresh leaf of type T holding `x`'s values (rounded once), requiring its gradient.
template <class T>
Tensor<T> leaf_as(const Tensor<float>& x) {
  Tensor<T> c = x.to<T>().detach();
  c.requires_grad_();
  return c;
}

// ---- helpers for references --------------------------------------------------------------------
/// Contiguous fp64 copy's raw data.
inline std::vector<double> values(const Tensor<double>& t) { return t.to_vector(); }
/// Row-major flat index -> multi-index.
inline std::vector<std::int64_t> unravel(std::int64_t flat, const Shape& s) {
  std::vector<std::int64_t> idx(static_cast<std::size_t>(s.size()));
  for (int d = s.size() - 1; d >= 0; --d) {
    idx[d] = s[d] ? flat % s[d] : 0;
    flat = s[d] ? flat / s[d] : 0;
  }
  return idx;
}
/// Element of a contiguous tensor at a broadcast multi-index of `out_shape`.
inline double at_broadcast(const Tensor<double>& t, const std::vector<std::int64_t>& out_idx) {
  const Tensor<double> c = t.contiguous_raw();
  const Shape st = contiguous_strides(c.shape());
  const int lead = static_cast<int>(out_idx.size()) - c.dim();
  std::int64_t off = 0;
  for (int d = 0; d < c.dim(); ++d) off += (c.shape()[d] == 1 ? 0 : out_idx[lead + d]) * st[d];
  return c.data()[off];
}
/// A function of one output index, evaluated over out_shape.
template <class F>
Tensor<double> tabulate(const Shape& out_shape, F f) {
  Tensor<double> out = Tensor<double>::empty(out_shape);
  for (std::int64_t i = 0; i < out_shape.numel(); ++i) out.data()[i] = f(unravel(i, out_shape));
  return out;
}

}  // namespace tg::testing

// tg::pointwise_chain: a chain of elementwise ops given as data (pw::ChainProgram) over broadcast inputs, as one op
// with one tape node ("pointwise_chain"): what tg::compile's fusion rewrite runs in place of a step's unfused
// elementwise ops (Note [fusion rewrites]).
//   pw::ChainProgram p;  p.inputs = 2;  p.constants = {0.5};
//   p.steps = {{math::Binary::mul, 0, 2}, {math::Binary::add, 3, 1}, {math::Unary::tanh, 4}};  // tanh(x0 * 0.5 + x1)
//   auto y = tg::pointwise_chain(p, std::vector{x, bias});
#pragma once

#include <array>
#include <atomic>
#include <iostream>
#include <string>
#include <vector>

#include "typegrad/detail/chain_program.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/kernels/launch_watch.hpp"
#include "typegrad/ops/fusion_hook.hpp"
#include "typegrad/ops/pointwise.hpp"

// Note [fusion rewrites] (the op; the rewrite itself is in compile/fusion.hpp)
// On the CPU the chain runs in one pass over the broadcast output in blocks of 256 elements: each input is
// gathered into a block of the accumulation type (fp32 for 16-bit storage), every step runs as a loop over the
// block with the unary kernels' own formulas, and the result is rounded once. In fp32 and fp64 the forward is
// the unfused ops' bit for bit where their kernels read their inputs contiguously in the last dimension, as the
// blocks are (a strided input takes the scalar formula there, a few ulp away); in 16-bit types it skips their
// intermediate roundings. The node keeps only the inputs; its backward recomputes each block and walks the
// steps in reverse (the gradients in the accumulation type, each input's rounded once), so the gradients differ
// from the unfused ops' by the order of their additions in fp32. On a GPU the chain prints itself as one
// expression for the generated kernels of tg::pointwise (Note [pointwise kernels through NVRTC]); a chain with
// the exact GELU (no erf there) or an expression past 16 KiB, or a GPU without NVRTC, runs as the
// corresponding tensor ops.

namespace tg {

namespace detail {
template <Element T, Device D>
struct ChainSaved {
  std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs> x;  // the inputs as given (views)
};

/// The chain as tensor ops, one node each (the GPU's fallback; the reference the rewrite is tested against).
template <FloatingElement T, Device D>
Tensor<T, D> chain_as_ops(const pw::ChainProgram& p, const std::vector<Tensor<T, D>>& xs) {
  fusion::Suspend plain;
  std::vector<Tensor<T, D>> slot(xs.begin(), xs.begin() + p.inputs);
  for (double c : p.constants) slot.push_back(Tensor<T, D>::full(Shape(), c));
  for (const pw::ChainStep& s : p.steps) {
    const Tensor<T, D>& a = slot[static_cast<std::size_t>(s.a)];
    if (s.binary) {
      const Tensor<T, D>& b = slot[static_cast<std::size_t>(s.c)];
      switch (s.b) {
        case math::Binary::add: slot.push_back(tg::add(a, b)); break;
        case math::Binary::sub: slot.push_back(tg::sub(a, b)); break;
        case math::Binary::mul: slot.push_back(tg::mul(a, b)); break;
        case math::Binary::div: slot.push_back(tg::div(a, b)); break;
      }
      continue;
    }
    switch (s.u) {
      case math::Unary::exp: slot.push_back(tg::exp(a)); break;
      case math::Unary::log: slot.push_back(tg::log(a)); break;
      case math::Unary::sqrt: slot.push_back(tg::sqrt(a)); break;
      case math::Unary::rsqrt: slot.push_back(tg::rsqrt(a)); break;
      case math::Unary::tanh: slot.push_back(tg::tanh(a)); break;
      case math::Unary::sigmoid: slot.push_back(tg::sigmoid(a)); break;
      case math::Unary::relu: slot.push_back(tg::relu(a)); break;
      case math::Unary::gelu_tanh: slot.push_back(tg::gelu_tanh(a)); break;
      case math::Unary::gelu_erf: slot.push_back(tg::gelu(a)); break;
      case math::Unary::silu: slot.push_back(tg::silu(a)); break;
    }
  }
  return slot.back();
}

/// The chain as one expression of tg::pointwise's generated kernels (x0 ... x{inputs-1}, literals in `lits`);
/// empty when a step has no form there (the exact GELU) or the expression grows past 16 KiB.
inline std::string chain_cuda_expression(const pw::ChainProgram& p, std::vector<double>* lits) {
  constexpr std::size_t kMaxSource = 16384;
  std::vector<std::string> slot;
  for (int k = 0; k < p.inputs; ++k) slot.push_back("x" + std::to_string(k));
  for (double c : p.constants) slot.push_back(pw::literal_source(c, lits));
  for (const pw::ChainStep& s : p.steps) {
    const std::string& a = slot[static_cast<std::size_t>(s.a)];
    std::string e;
    if (s.binary) {
      const char* sym = s.b == math::Binary::add ? " + " : s.b == math::Binary::sub ? " - " : s.b == math::Binary::mul ? " * " : " / ";
      e = "(" + a + sym + slot[static_cast<std::size_t>(s.c)] + ")";
    } else {
      switch (s.u) {
        case math::Unary::exp: e = "(tg_exp(" + a + "))"; break;
        case math::Unary::log: e = "(tg_log(" + a + "))"; break;
        case math::Unary::sqrt: e = "(tg_sqrt(" + a + "))"; break;
        case math::Unary::rsqrt: e = "(" + pw::literal_source(1.0, lits) + " / tg_sqrt(" + a + "))"; break;
        case math::Unary::tanh: e = "(tg_tanh(" + a + "))"; break;
        case math::Unary::sigmoid: e = "(tg_sigmoid(" + a + "))"; break;
        case math::Unary::relu: e = "(tg_relu(" + a + "))"; break;
        case math::Unary::silu: e = "(" + a + " * tg_sigmoid(" + a + "))"; break;
        case math::Unary::gelu_tanh:  // x·sigmoid(2√(2/π)(x + 0.044715x³)), the CPU kernels' form
          e = "(" + a + " * tg_sigmoid(" + pw::literal_source(2.0 * 0.7978845608028654, lits) + " * (" + a + " + " +
              pw::literal_source(0.044715, lits) + " * " + a + " * " + a + " * " + a + ")))";
          break;
        case math::Unary::gelu_erf: return {};
      }
    }
    if (e.size() > kMaxSource) return {};
    slot.push_back(std::move(e));
  }
  return slot.back();
}

/// The GPU's chain through one generated kernel each way; undefined when unavailable (the caller runs tensor ops).
template <FloatingElement T, Device D>
Tensor<T, D> chain_cuda(const pw::ChainProgram& p, const std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs>& in,
                        const std::vector<Tensor<T, D>>& xs, const Shape& shape) {
  std::vector<double> lits;
  const std::string expr = chain_cuda_expression(p, &lits);
  if (expr.empty()) return Tensor<T, D>();
  const std::string src = backend::cuda::pointwise_source(dtype_traits<T>::dtype, p.inputs, expr);
  // by value: the backward keeps it past this call (and past the program, which the rewrite reuses)
  auto args = [lits, shape, inputs = p.inputs](const std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs>& x) {
    backend::cuda::PointwiseArgs a = pointwise_args(x, shape, static_cast<std::size_t>(inputs));
    std::copy(lits.begin(), lits.end(), a.lit);
    return a;
  };
  Tensor<T, D> out = Tensor<T, D>::empty(shape);
  backend::cuda::PointwiseArgs a = args(in);
  a.out[0] = out.data();
  std::string why;
  if (!backend::cuda::pointwise_run(src, false, a, &why)) {
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) std::cerr << "tg::pointwise_chain: no generated GPU kernel (" << why << "); running the chain as tensor ops\n";
    return Tensor<T, D>();
  }
  std::array<Shape, pw::ChainProgram::kMaxInputs> shapes;
  for (int k = 0; k < p.inputs; ++k) shapes[static_cast<std::size_t>(k)] = in[static_cast<std::size_t>(k)].shape();
  const int K = p.inputs;
  auto backward = [src, args, K, shapes, shape](ChainSaved<T, D>& s, const Tensor<T, D>& dout, auto need) {
    const Tensor<T, D> g = dout.contiguous_raw();
    std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs> full;
    backend::cuda::PointwiseArgs b = args(s.x);
    b.in[K] = g.data();
    for (int k = 0; k < K; ++k)
      if (need[static_cast<std::size_t>(k)]) {
        full[static_cast<std::size_t>(k)] = Tensor<T, D>::empty(shape);
        b.out[k] = full[static_cast<std::size_t>(k)].data();
      }
    std::string why;
    TG_CHECK(backend::cuda::pointwise_run(src, true, b, &why), "pointwise_chain backward: ", why);
    return pointwise_grads(full, need, shapes);
  };
  std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs> x;
  std::copy(xs.begin(), xs.end(), x.begin());
  autodiff::record("pointwise_chain", out, ChainSaved<T, D>{in}, backward, x[0], x[1], x[2], x[3], x[4], x[5]);
  return out;
}
}  // namespace detail

/// The chain `p` over xs (p.inputs tensors of one type and device, broadcast to one shape) as one op: see Note
/// [fusion rewrites].
template <FloatingElement T, Device D>
Tensor<T, D> pointwise_chain(const pw::ChainProgram& p, const std::vector<Tensor<T, D>>& xs) {
  static_assert(pw::ChainProgram::kMaxInputs == 6, "the record below passes six inputs");
  p.validate("pointwise_chain");
  TG_CHECK(static_cast<int>(xs.size()) == p.inputs, "pointwise_chain: the program reads ", p.inputs, " inputs, ", xs.size(), " were given");
  Shape shape = xs[0].shape();
  for (std::size_t k = 1; k < xs.size(); ++k) shape = broadcast_shapes(shape, xs[k].shape(), "pointwise_chain");
  std::array<Tensor<T, D>, pw::ChainProgram::kMaxInputs> in;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    TG_CHECK(xs[k].defined(), "pointwise_chain: input ", k, " is undefined");
    in[k] = xs[k].detach();
  }
  if constexpr (!std::is_same_v<D, cpu>) {
    if (Tensor<T, D> out = detail::chain_cuda(p, in, xs, shape); out.defined()) return out;
    return detail::chain_as_ops(p, xs);
  } else {
    std::array<Shape, pw::ChainProgram::kMaxInputs> st, shapes;
    std::array<const T*, pw::ChainProgram::kMaxInputs> ptr{};
    for (int k = 0; k < p.inputs; ++k) {
      const auto i = static_cast<std::size_t>(k);
      st[i] = in[i].expand(shape).strides();  // 0 where broadcast
      shapes[i] = in[i].shape();
      ptr[i] = in[i].data();
    }
    Tensor<T, cpu> out = Tensor<T, cpu>::empty(shape);
    backend::report_launch("pointwise_chain_forward", false, p, ptr, st, out.data(), shape);  // Note [launch watch]: the tables' contents
    backend::cpu::pointwise_chain_forward<T>(p, ptr.data(), st.data(), out.data(), shape);
    auto backward = [p, st, shapes, shape](detail::ChainSaved<T, cpu>& s, const Tensor<T, cpu>& dout, auto need) {
      const Tensor<T, cpu> g = dout.contiguous_raw();
      std::array<Tensor<T, cpu>, pw::ChainProgram::kMaxInputs> full;
      std::array<const T*, pw::ChainProgram::kMaxInputs> x{};
      std::array<T*, pw::ChainProgram::kMaxInputs> dx{};
      for (int k = 0; k < p.inputs; ++k) {
        const auto i = static_cast<std::size_t>(k);
        x[i] = s.x[i].data();
        if (need[i]) {
          full[i] = Tensor<T, cpu>::empty(shape);
          dx[i] = full[i].data();
        }
      }
      backend::report_launch("pointwise_chain_backward", false, p, x, st, g.data(), dx, shape);  // Note [launch watch]
      backend::cpu::pointwise_chain_backward<T>(p, x.data(), st.data(), g.data(), dx.data(), shape);
      return detail::pointwise_grads(full, need, shapes);
    };
    std::array<Tensor<T, cpu>, pw::ChainProgram::kMaxInputs> x;
    std::copy(xs.begin(), xs.end(), x.begin());
    autodiff::record("pointwise_chain", out, detail::ChainSaved<T, cpu>{in}, backward, x[0], x[1], x[2], x[3], x[4], x[5]);
    return out;
  }
}

namespace detail {
template <FloatingElement T, Device D>
Tensor<T, D> run_fused_chain(fusion::Rewriter& r) {
  std::vector<Tensor<T, D>> xs;
  xs.reserve(r.inputs().size());
  for (const auto& h : r.inputs()) xs.push_back(*static_cast<const Tensor<T, D>*>(h.get()));
  Tensor<T, D> out;
  {
    fusion::Suspend plain;
    out = pointwise_chain(r.program(), xs);
    if (out.shape() != r.out_shape()) out = out.reshape(r.out_shape());  // the ops' leading ones (same elements)
  }
  r.done();
  return out;
}
}  // namespace detail

}  // namespace tg

// detail::run_fused_pair, which the ops above call (a pair rewrite's consumer; Note [pair rewrites])
#include "typegrad/ops/fused_pairs.hpp"

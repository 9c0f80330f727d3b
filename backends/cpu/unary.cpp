// Unary elementwise kernels (exp, log, ..., gelu, silu), dropout and masked_fill. Strided inputs,
// contiguous outputs; 16-bit storage is widened to fp32 in registers and rounded once on store.
// The scalar formulas are math::apply / math::grad (detail/math.hpp), shared with the CUDA backend.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "typegrad/core/random.hpp"
#include "typegrad/detail/chain_program.hpp"
#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/philox_block.hpp"
#include "typegrad/detail/cpu/row_pieces.hpp"
#include "typegrad/detail/cpu/vec_exp.hpp"

namespace tg::backend::cpu {

namespace {
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;
constexpr std::int64_t kParallelGrain = 1 << 15;

/// Calls f(first, off0, off1, len) for every piece of a row (last dim) of `shape`: `len` elements starting at
/// row-major element `first` of the (contiguous) output, whose offsets in two operands with strides s0 / s1
/// are off0 / off1. Rows, or pieces of long rows, are split across threads (for_row_pieces).
template <class F>
void for_each_row(const Shape& shape, const Shape& s0, const Shape& s1, F f) {
  const std::int64_t n = shape.numel();
  if (n == 0) return;
  const int rank = shape.size();
  const std::int64_t inner = rank ? shape[rank - 1] : 1, outer = n / inner;
  const std::int64_t l0 = rank ? s0[rank - 1] : 0, l1 = rank ? s1[rank - 1] : 0;
  for_row_pieces(outer, inner, kParallelGrain, [&](std::int64_t o, std::int64_t i0, std::int64_t i1) {
    const auto [a, b] = row_offsets(o, rank - 1, shape, s0, s1);
    f(o * inner + i0, a + i0 * l0, b + i0 * l1, i1 - i0);
  });
}
inline std::int64_t last_stride(const Shape& s) { return s.size() ? s[s.size() - 1] : 1; }

/// Calls f(std::integral_constant<Unary, op>) so the kernels' inner loops see a compile-time op.
template <class F>
void dispatch(math::Unary op, F f) {
  using U = math::Unary;
  switch (op) {
#define TG_CASE(name) \
  case U::name: f(std::integral_constant<U, U::name>{}); return;
    TG_CASE(exp) TG_CASE(log) TG_CASE(sqrt) TG_CASE(rsqrt) TG_CASE(tanh) TG_CASE(sigmoid) TG_CASE(relu)
    TG_CASE(gelu_tanh) TG_CASE(gelu_erf) TG_CASE(silu)
#undef TG_CASE
  }
}

// Note [vectorized unary ops]
// math::apply and math::grad call std::exp (behind a branch in sigmoid), so loops over them stay scalar: one
// libm call per element. For fp32, bf16 and fp16 storage the contiguous loops of exp, sigmoid, silu,
// gelu_tanh and tanh (forward; silu and gelu_tanh backward, the others' gradients need no exp) instead use
// vec::exp_f32 (Note [vectorizable exp]: within 1.18 ulp, saturating to 0 and inf like expf) in the same
// formulas, branch-free, which the compiler vectorizes (tanh: vec::tanh_f32, a polynomial near 0 and the
// exp form above 0.4, since 2026-12-06): sigmoid(z) = 1/(1 + e^-z) for z >= 0 and
// e^z/(1 + e^z) below (one exp of -|z| and a select, so no result underflows early), silu(x) = x·sigmoid(x),
// gelu_tanh(x) = x·sigmoid(2u) with u = √(2/π)(x + 0.044715x³). For 16-bit storage the result rounded to 16
// bits equals the scalar path's except, rarely, by one unit in the last place at a rounding boundary; in
// fp32 the two differ by a few ulp. (fp32 took these paths on 2026-12-04; before, only the 16-bit GELU did.)
// fp64 keeps the scalar formulas.
inline float sigmoid_vec(float z) {
  const float e = vec::exp_f32(z < 0.f ? z : -z);  // e^-|z|, in (0, 1]
  const float r = 1.f / (1.f + e);
  return z < 0.f ? e * r : r;
}
constexpr float kGeluK = 0.7978845608028654f, kGeluC = 0.044715f;
inline float gelu_tanh_vec(float x) { return x * sigmoid_vec(2.f * kGeluK * (x + kGeluC * x * x * x)); }
inline float gelu_tanh_grad_vec(float x) {
  const float s = sigmoid_vec(2.f * kGeluK * (x + kGeluC * x * x * x));
  return s + x * s * (1.f - s) * 2.f * kGeluK * (1.f + 3.f * kGeluC * x * x);
}
template <class T>
constexpr bool is_16bit = std::is_same_v<T, bf16> || std::is_same_v<T, fp16>;
/// Storage whose contiguous loops take the vectorized formulas (Note [vectorized unary ops]).
template <class T>
constexpr bool vector_storage = is_16bit<T> || std::is_same_v<T, float>;
template <math::Unary U>
constexpr bool vector_forward = U == math::Unary::exp || U == math::Unary::sigmoid || U == math::Unary::silu ||
                                U == math::Unary::gelu_tanh || U == math::Unary::tanh;
template <math::Unary U>
constexpr bool vector_backward = U == math::Unary::silu || U == math::Unary::gelu_tanh;
/// f(x) for the vector_forward ops.
template <math::Unary U>
inline float apply_vec(float x) {
  if constexpr (U == math::Unary::exp) return vec::exp_f32(x);
  else if constexpr (U == math::Unary::tanh) return vec::tanh_f32(x);
  else if constexpr (U == math::Unary::sigmoid) return sigmoid_vec(x);
  else if constexpr (U == math::Unary::silu) return x * sigmoid_vec(x);
  else return gelu_tanh_vec(x);
}
/// f'(x) for the vector_backward ops (both save x).
template <math::Unary U>
inline float grad_vec(float x) {
  if constexpr (U == math::Unary::silu) {
    const float s = sigmoid_vec(x);
    return s * (1.f + x * (1.f - s));
  } else {
    return gelu_tanh_grad_vec(x);
  }
}

/// out[i] = T(f(float(a[i]), float(b[i]))) over contiguous rows, in chunks: the 16-bit conversions (with
/// their NaN / subnormal branches) run in their own loops, so the fp32 loop calling f has no control flow
/// and vectorizes.
template <class T, class F>
void map2_chunked(const T* a, const T* b, T* out, std::int64_t n, F f) {
  constexpr std::int64_t kChunk = 128;
  alignas(64) float fa[kChunk], fb[kChunk];
  for (std::int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const std::int64_t m = n - i0 < kChunk ? n - i0 : kChunk;
    for (std::int64_t j = 0; j < m; ++j) fa[j] = scalar_cast<float>(a[i0 + j]);
    for (std::int64_t j = 0; j < m; ++j) fb[j] = scalar_cast<float>(b[i0 + j]);
    for (std::int64_t j = 0; j < m; ++j) fa[j] = f(fa[j], fb[j]);
    for (std::int64_t j = 0; j < m; ++j) out[i0 + j] = scalar_cast<T>(fa[j]);
  }
}
}  // namespace

template <class T>
void unary_forward(math::Unary op, const T* x, const Shape& sx, T* y, const Shape& shape) {
  using A = acc_t<T>;
  const std::int64_t ix = last_stride(sx);
  dispatch(op, [&](auto u) {
    constexpr math::Unary U = decltype(u)::value;
    for_each_row(shape, sx, sx, [&](std::int64_t first, std::int64_t ox, std::int64_t, std::int64_t len) {
      const T* px = x + ox;
      T* py = y + first;
      if constexpr (vector_storage<T> && vector_forward<U>) {
        if (ix == 1) {
          if constexpr (std::is_same_v<T, float>) {
            for (std::int64_t i = 0; i < len; ++i) py[i] = apply_vec<U>(px[i]);
          } else {
            map2_chunked(px, px, py, len, [=](float v, float) { return apply_vec<U>(v); });
          }
          return;
        }
      }
      if (ix == 1) {
        for (std::int64_t i = 0; i < len; ++i) py[i] = scalar_cast<T>(math::apply<A>(U, scalar_cast<A>(px[i])));
      } else {
        for (std::int64_t i = 0; i < len; ++i) py[i] = scalar_cast<T>(math::apply<A>(U, scalar_cast<A>(px[i * ix])));
      }
    });
  });
}

template <class T>
void unary_backward(math::Unary op, const T* saved, const Shape& ss, const T* dy, const Shape& sdy, T* dx,
                    const Shape& shape) {
  using A = acc_t<T>;
  const std::int64_t is = last_stride(ss), idy = last_stride(sdy);
  dispatch(op, [&](auto u) {
    constexpr math::Unary U = decltype(u)::value;
    for_each_row(shape, ss, sdy, [&](std::int64_t first, std::int64_t os, std::int64_t ody, std::int64_t len) {
      const T* ps = saved + os;
      const T* pg = dy + ody;
      T* pd = dx + first;
      if constexpr (vector_storage<T> && vector_backward<U>) {
        if (is == 1 && idy == 1) {
          if constexpr (std::is_same_v<T, float>) {
            for (std::int64_t i = 0; i < len; ++i) pd[i] = pg[i] * grad_vec<U>(ps[i]);
          } else {
            map2_chunked(ps, pg, pd, len, [=](float v, float g) { return g * grad_vec<U>(v); });
          }
          return;
        }
      }
      for (std::int64_t i = 0; i < len; ++i) {
        const A s = scalar_cast<A>(ps[i * is]);
        // the saved value goes in the slot math::grad reads (x or y); the other slot is unused
        const A d = math::uses_output(U) ? math::grad<A>(U, A(0), s) : math::grad<A>(U, s, A(0));
        pd[i] = scalar_cast<T>(scalar_cast<A>(pg[i * idy]) * d);
      }
    });
  });
}

template <class T>
void dropout_forward(const T* x, const Shape& sx, T* y, const Shape& shape, std::uint64_t seed, std::uint64_t offset,
                     const std::uint64_t* base, double p) {
  using A = acc_t<T>;
  if (base) offset += *base;  // Note [the Philox base in memory]
  const std::int64_t ix = last_stride(sx);
  const float pf = static_cast<float>(p);
  const A scale = static_cast<A>(1.0 / (1.0 - p));
  for_each_row(shape, sx, sx, [&](std::int64_t first, std::int64_t ox, std::int64_t, std::int64_t len) {
    const T* px = x + ox;
    T* py = y + first;
    bool keep[kDropoutBlock];  // Note [dropout masks in vectors]
    for (std::int64_t b = 0; b < len; b += kDropoutBlock) {
      const int n = static_cast<int>(std::min<std::int64_t>(kDropoutBlock, len - b));
      dropout_keep_block(seed, offset + static_cast<std::uint64_t>(first + b), n, pf, keep);
      if constexpr (!std::is_same_v<T, A>) {
        if (ix == 1) {  // 16-bit T: one conversion per loop, so that each loop vectorizes (the same roundings)
          alignas(64) A v[kDropoutBlock];
          for (int i = 0; i < n; ++i) v[i] = scalar_cast<A>(px[b + i]);
          for (int i = 0; i < n; ++i) v[i] = keep[i] ? v[i] * scale : A(0);
          for (int i = 0; i < n; ++i) py[b + i] = scalar_cast<T>(v[i]);
          continue;
        }
      }
      for (int i = 0; i < n; ++i) py[b + i] = scalar_cast<T>(keep[i] ? scalar_cast<A>(px[(b + i) * ix]) * scale : A(0));
    }
  });
}

template <class T>
void masked_fill(const T* x, const Shape& sx, const std::uint8_t* mask, const Shape& sm, T value, T* y,
                 const Shape& shape) {
  const std::int64_t ix = last_stride(sx), im = last_stride(sm);
  for_each_row(shape, sx, sm, [&](std::int64_t first, std::int64_t ox, std::int64_t om, std::int64_t len) {
    const T* px = x + ox;
    const std::uint8_t* pm = mask + om;
    T* py = y + first;
    for (std::int64_t i = 0; i < len; ++i) py[i] = pm[i * im] ? value : px[i * ix];
  });
}

// ---- pointwise chains (Note [fusion rewrites]) ------------------------------------------------------------
// The chain runs over blocks of kChainBlock output elements: each input's elements are gathered into a slot
// array in the accumulation type, every step runs as one loop over the block (the same formulas as the unary
// kernels above, vectorized alike), and the last slot is rounded once into the output. The backward recomputes
// the block's slots, then walks the steps in reverse, adding each step's gradient into its operands' slots
// (reverse mode over the block), and writes each input's gradient over the output's shape.
namespace {
constexpr int kChainBlock = 256;
constexpr int kChainSlots = pw::ChainProgram::kMaxInputs + pw::ChainProgram::kMaxConstants + pw::ChainProgram::kMaxSteps;

/// Gathers n inputs (strides st over `shape`, 0 where broadcast) for output elements [b, e) into slot[k][0, e - b),
/// a piece of a row at a time: a unit-stride piece is one converting copy, a broadcast one a fill.
template <class T, class A>
void chain_gather(const Shape& shape, const Shape* st, int n, const T* const* x, std::int64_t b, std::int64_t e,
                  A (*slot)[kChainBlock]) {
  const int nd = shape.size();
  const std::int64_t inner = nd ? shape[nd - 1] : 1;
  std::int64_t j = b;
  while (j < e) {
    const std::int64_t row = j / inner, col = j % inner, len = std::min(inner - col, e - j);
    const int i0 = static_cast<int>(j - b);
    for (int k = 0; k < n; ++k) {
      std::int64_t off = 0, rest = row;
      for (int d = nd - 2; d >= 0; --d) {  // the row's offset in input k
        off += (rest % shape[d]) * st[k][d];
        rest /= shape[d];
      }
      const std::int64_t step = nd ? st[k][nd - 1] : 0;
      const T* p = x[k] + off + col * step;
      A* out = slot[k] + i0;
      if (step == 1) {
        for (std::int64_t t = 0; t < len; ++t) out[t] = scalar_cast<A>(p[t]);
      } else if (step == 0) {
        const A v = scalar_cast<A>(p[0]);
        for (std::int64_t t = 0; t < len; ++t) out[t] = v;
      } else {
        for (std::int64_t t = 0; t < len; ++t) out[t] = scalar_cast<A>(p[t * step]);
      }
    }
    j += len;
  }
}

/// Runs body(b, e) over [0, n) in blocks of kChainBlock, on the OpenMP threads when there are many.
template <class Body>
void chain_for(std::int64_t n, Body body) {
  const std::int64_t blocks = (n + kChainBlock - 1) / kChainBlock;
#pragma omp parallel for schedule(static) if (blocks > 64)
  for (std::int64_t k = 0; k < blocks; ++k) body(k * kChainBlock, std::min(n, (k + 1) * kChainBlock));
}

/// Fills the input and constant slots of a block and runs every step: slot[k] holds m values.
template <class T, class A>
void chain_block_forward(const pw::ChainProgram& p, const T* const* x, const Shape* st, const Shape& shape, std::int64_t b,
                         std::int64_t e, A (*slot)[kChainBlock]) {
  const int m = static_cast<int>(e - b);
  chain_gather<T, A>(shape, st, p.inputs, x, b, e, slot);
  for (std::size_t c = 0; c < p.constants.size(); ++c) {
    const A v = static_cast<A>(p.constants[c]);
    for (int i = 0; i < m; ++i) slot[p.inputs + static_cast<int>(c)][i] = v;
  }
  for (std::size_t s = 0; s < p.steps.size(); ++s) {
    const pw::ChainStep& step = p.steps[s];
    A* o = slot[p.first_step_slot() + static_cast<int>(s)];
    const A* u = slot[step.a];
    if (step.binary) {
      const A* v = slot[step.c];
      switch (step.b) {
        case math::Binary::add: for (int i = 0; i < m; ++i) o[i] = u[i] + v[i]; break;
        case math::Binary::sub: for (int i = 0; i < m; ++i) o[i] = u[i] - v[i]; break;
        case math::Binary::mul: for (int i = 0; i < m; ++i) o[i] = u[i] * v[i]; break;
        case math::Binary::div: for (int i = 0; i < m; ++i) o[i] = u[i] / v[i]; break;
      }
      continue;
    }
    dispatch(step.u, [&](auto op) {
      constexpr math::Unary U = decltype(op)::value;
      if constexpr (std::is_same_v<A, float> && vector_forward<U>) {
        for (int i = 0; i < m; ++i) o[i] = apply_vec<U>(u[i]);
      } else {
        for (int i = 0; i < m; ++i) o[i] = math::apply<A>(U, u[i]);
      }
    });
  }
}
}  // namespace

template <class T>
void pointwise_chain_forward(const pw::ChainProgram& p, const T* const* x, const Shape* st, T* out, const Shape& shape) {
  using A = acc_t<T>;
  const int last = p.slots() - 1;
  chain_for(shape.numel(), [&](std::int64_t b, std::int64_t e) {
    alignas(64) A slot[kChainSlots][kChainBlock];
    chain_block_forward<T, A>(p, x, st, shape, b, e, slot);
    for (std::int64_t j = b; j < e; ++j) out[j] = scalar_cast<T>(slot[last][j - b]);
  });
}

template <class T>
void pointwise_chain_backward(const pw::ChainProgram& p, const T* const* x, const Shape* st, const T* dout, T* const* dx,
                              const Shape& shape) {
  using A = acc_t<T>;
  const int last = p.slots() - 1;
  chain_for(shape.numel(), [&](std::int64_t b, std::int64_t e) {
    alignas(64) A slot[kChainSlots][kChainBlock];
    alignas(64) A adj[kChainSlots][kChainBlock];
    const int m = static_cast<int>(e - b);
    chain_block_forward<T, A>(p, x, st, shape, b, e, slot);
    for (int k = 0; k < last; ++k) std::fill(adj[k], adj[k] + m, A(0));
    for (int i = 0; i < m; ++i) adj[last][i] = scalar_cast<A>(dout[b + i]);
    for (int s = static_cast<int>(p.steps.size()) - 1; s >= 0; --s) {
      const pw::ChainStep& step = p.steps[static_cast<std::size_t>(s)];
      const int own = p.first_step_slot() + s;
      const A* g = adj[own];
      const A* u = slot[step.a];
      A* du = adj[step.a];
      if (step.binary) {
        const A* v = slot[step.c];
        A* dv = adj[step.c];
        switch (step.b) {
          case math::Binary::add:
            for (int i = 0; i < m; ++i) du[i] += g[i];
            for (int i = 0; i < m; ++i) dv[i] += g[i];
            break;
          case math::Binary::sub:
            for (int i = 0; i < m; ++i) du[i] += g[i];
            for (int i = 0; i < m; ++i) dv[i] -= g[i];
            break;
          case math::Binary::mul:  // both reads before either write: x * x adds g·x twice
            for (int i = 0; i < m; ++i) {
              const A gu = g[i] * v[i], gv = g[i] * u[i];
              du[i] += gu;
              dv[i] += gv;
            }
            break;
          case math::Binary::div:  // d(u/v)/dv = -(g/v)·(u/v), as the div op's backward
            for (int i = 0; i < m; ++i) {
              const A q = g[i] / v[i], r = q * (u[i] / v[i]);
              du[i] += q;
              dv[i] -= r;
            }
            break;
        }
        continue;
      }
      const A* y = slot[own];
      dispatch(step.u, [&](auto op) {
        constexpr math::Unary U = decltype(op)::value;
        if constexpr (std::is_same_v<A, float> && vector_backward<U>) {
          for (int i = 0; i < m; ++i) du[i] += g[i] * grad_vec<U>(u[i]);
        } else {
          for (int i = 0; i < m; ++i) du[i] += g[i] * math::grad<A>(U, u[i], y[i]);
        }
      });
    }
    for (int k = 0; k < p.inputs; ++k)
      if (dx[k])
        for (int i = 0; i < m; ++i) dx[k][b + i] = scalar_cast<T>(adj[k][i]);
  });
}

#define TG_CHAIN_INSTANTIATE(T)                                                                                         \
  template void pointwise_chain_forward<T>(const pw::ChainProgram&, const T* const*, const Shape*, T*, const Shape&); \
  template void pointwise_chain_backward<T>(const pw::ChainProgram&, const T* const*, const Shape*, const T*, T* const*, const Shape&);
TG_CHAIN_INSTANTIATE(double)
TG_CHAIN_INSTANTIATE(float)
TG_CHAIN_INSTANTIATE(bf16)
TG_CHAIN_INSTANTIATE(fp16)
#undef TG_CHAIN_INSTANTIATE

TG_INSTANTIATE_KERNELS(TG_KERNELS_UNARY, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

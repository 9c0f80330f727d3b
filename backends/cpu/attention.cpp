// Fused causal scaled-dot-product attention (flash-attention style, Dao et al. 2022): per head, blocks of
// kBlock query rows against the keys they can see; scores live only in a per-thread [kBlock, Tn] scratch,
// and backward recomputes the probabilities from the saved per-row logsumexp. GEMMs in accum_t<T>
// (fp32 for 16-bit storage, whose inputs are widened once up front).
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "typegrad/detail/cpu/kernels.hpp"
#include "typegrad/detail/cpu/vec_exp.hpp"

namespace tg::backend::cpu {

namespace {
constexpr std::int64_t kBlock = 64;

/// The data as accum_t<T>: a pointer to it when T already is, else a widened copy in `buf`.
template <class A, class T>
const A* widen(const T* p, std::int64_t n, std::vector<A>& buf) {
  if constexpr (std::is_same_v<A, T>) {
    return p;
  } else {
    buf.resize(static_cast<std::size_t>(n));
#pragma omp parallel for schedule(static) if (n > (1 << 15))
    for (std::int64_t i = 0; i < n; ++i) buf[static_cast<std::size_t>(i)] = scalar_cast<A>(p[i]);
    return buf.data();
  }
}
}  // namespace

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH, std::int64_t Tn,
                       std::int64_t hs, double scale, bool causal) {
  using A = accum_t<T>;
  if (BH == 0 || Tn == 0) return;
  const std::int64_t n = BH * Tn * hs;
  std::vector<A> bq, bk, bv;
  const A* Q = widen(q, n, bq);
  const A* K = widen(k, n, bk);
  const A* Vv = widen(v, n, bv);
  const std::int64_t nblk = (Tn + kBlock - 1) / kBlock;
  const A sc = static_cast<A>(scale);
#pragma omp parallel
  {
    std::vector<A> S(static_cast<std::size_t>(kBlock * Tn)), O(static_cast<std::size_t>(kBlock * hs));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < BH * nblk; ++task) {
      const std::int64_t h = task / nblk, i0 = (task % nblk) * kBlock, i1 = std::min(Tn, i0 + kBlock);
      const std::int64_t rows = i1 - i0, kend = causal ? i1 : Tn;
      const A* Qh = Q + h * Tn * hs;
      const A* Kh = K + h * Tn * hs;
      const A* Vh = Vv + h * Tn * hs;
      if (hs > 0) {
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, Qh + i0 * hs, hs, Kh, hs, 0.f, S.data(), Tn);
      } else {
        std::fill(S.begin(), S.end(), A(0));
      }
      for (std::int64_t r = 0; r < rows; ++r) {
        A* s = S.data() + r * Tn;
        const std::int64_t last = causal ? i0 + r + 1 : Tn;  // keys [0, last) are visible
        A m = -std::numeric_limits<A>::infinity();
        for (std::int64_t j = 0; j < last; ++j) {
          s[j] *= sc;  // scaled here, not as the GEMM's fp32 alpha, so fp64 keeps its precision
          m = s[j] > m ? s[j] : m;
        }
        A l = 0;
        if constexpr (std::is_same_v<A, float>) {  // Note [vectorizable exp]
          l = vec::sum_exp(s, last, m);
          vec::exp_scaled(s, last, m, A(1) / l, s);
        } else {
          for (std::int64_t j = 0; j < last; ++j) {
            s[j] = std::exp(s[j] - m);
            l += s[j];
          }
          const A inv = A(1) / l;
          for (std::int64_t j = 0; j < last; ++j) s[j] *= inv;
        }
        for (std::int64_t j = last; j < kend; ++j) s[j] = 0;
        lse[h * Tn + i0 + r] = m + std::log(l);
      }
      if (hs == 0) continue;
      T* Oh = out + (h * Tn + i0) * hs;
      if constexpr (std::is_same_v<A, T>) {
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, S.data(), Tn, Vh, hs, 0.f, Oh, hs);
      } else {
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, S.data(), Tn, Vh, hs, 0.f, O.data(), hs);
        for (std::int64_t i = 0; i < rows * hs; ++i) Oh[i] = scalar_cast<T>(O[static_cast<std::size_t>(i)]);
      }
    }
  }
}

template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse, T* dq,
                        T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  using A = accum_t<T>;
  if (BH == 0 || Tn == 0 || hs == 0) return;
  const std::int64_t n = BH * Tn * hs;
  std::vector<A> bq, bk, bv, bo, bdo;
  const A* Q = widen(q, n, bq);
  const A* K = widen(k, n, bk);
  const A* Vv = widen(v, n, bv);
  const A* O = widen(out, n, bo);
  const A* dO = widen(dout, n, bdo);
  // Gradients accumulate in A: straight into the outputs when T is A, else into per-thread buffers.
  constexpr bool direct = std::is_same_v<A, T>;
  const A sc = static_cast<A>(scale);
#pragma omp parallel
  {
    std::vector<A> S(static_cast<std::size_t>(kBlock * Tn)), dP(static_cast<std::size_t>(kBlock * Tn)),
        Dr(static_cast<std::size_t>(kBlock));
    std::vector<A> gq, gk, gv;
    if (!direct) {
      gq.resize(static_cast<std::size_t>(Tn * hs));
      gk.resize(static_cast<std::size_t>(Tn * hs));
      gv.resize(static_cast<std::size_t>(Tn * hs));
    }
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t h = 0; h < BH; ++h) {
      const std::int64_t off = h * Tn * hs;
      const A *Qh = Q + off, *Kh = K + off, *Vh = Vv + off, *Oh = O + off, *dOh = dO + off;
      A *dQh, *dKh, *dVh;
      if constexpr (direct) {
        dQh = reinterpret_cast<A*>(dq) + off;
        dKh = reinterpret_cast<A*>(dk) + off;
        dVh = reinterpret_cast<A*>(dv) + off;
      } else {
        dQh = gq.data(), dKh = gk.data(), dVh = gv.data();
      }
      std::fill_n(dKh, Tn * hs, A(0));
      std::fill_n(dVh, Tn * hs, A(0));
      for (std::int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
        const std::int64_t i1 = std::min(Tn, i0 + kBlock), rows = i1 - i0, kend = causal ? i1 : Tn;
        // S = scale·Q·Kᵀ -> P = exp(S − lse); dP = dO·Vᵀ
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, Qh + i0 * hs, hs, Kh, hs, 0.f, S.data(), Tn);
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, dOh + i0 * hs, hs, Vh, hs, 0.f, dP.data(), Tn);
        for (std::int64_t r = 0; r < rows; ++r) {
          const A* o = Oh + (i0 + r) * hs;
          const A* g = dOh + (i0 + r) * hs;
          A d = 0;
          for (std::int64_t c = 0; c < hs; ++c) d += o[c] * g[c];
          Dr[static_cast<std::size_t>(r)] = d;
        }
        for (std::int64_t r = 0; r < rows; ++r) {
          A* s = S.data() + r * Tn;
          A* dp = dP.data() + r * Tn;
          const std::int64_t last = causal ? i0 + r + 1 : Tn;
          const A l = lse[h * Tn + i0 + r], d = Dr[static_cast<std::size_t>(r)];
          for (std::int64_t j = 0; j < last; ++j) {
            if constexpr (std::is_same_v<A, float>) {
              s[j] = vec::exp_f32(s[j] * sc - l);  // Note [vectorizable exp]
            } else {
              s[j] = std::exp(s[j] * sc - l);
            }
            dp[j] = sc * s[j] * (dp[j] - d);  // scale·dS
          }
          for (std::int64_t j = last; j < kend; ++j) s[j] = dp[j] = 0;
        }
        // dQ = scale·dS·K;  dK += scale·dSᵀ·Q;  dV += Pᵀ·dO
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, dP.data(), Tn, Kh, hs, 0.f,
                dQh + i0 * hs, hs);
        gemm<A>(Trans::T, Trans::N, kend, hs, rows, 1.f, dP.data(), Tn, Qh + i0 * hs, hs, 1.f,
                dKh, hs);
        gemm<A>(Trans::T, Trans::N, kend, hs, rows, 1.f, S.data(), Tn, dOh + i0 * hs, hs, 1.f, dVh, hs);
      }
      if constexpr (!direct) {
        for (std::int64_t i = 0; i < Tn * hs; ++i) {
          dq[off + i] = scalar_cast<T>(gq[static_cast<std::size_t>(i)]);
          dk[off + i] = scalar_cast<T>(gk[static_cast<std::size_t>(i)]);
          dv[off + i] = scalar_cast<T>(gv[static_cast<std::size_t>(i)]);
        }
      }
    }
  }
}

// ---- heads packed in a fused QKV projection's output ---------------------------------------------------------
namespace {
/// Copies part `part` (0 q, 1 k, 2 v) of qkv [B, Tn, 3, H, hs] into heads [B, H, Tn, hs] (scatter: the reverse,
/// into a [B, Tn, parts, H, hs] array, parts 3 for qkv and 1 for the attention's output).
template <class T>
void gather_heads(const T* src, std::int64_t parts, std::int64_t part, T* heads, std::int64_t B, std::int64_t H,
                  std::int64_t Tn, std::int64_t hs) {
#pragma omp parallel for collapse(2) schedule(static) if (B * H * Tn * hs > (1 << 15))
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < Tn; ++t)
        std::copy_n(src + (((b * Tn + t) * parts + part) * H + h) * hs, hs, heads + ((b * H + h) * Tn + t) * hs);
}
template <class T>
void scatter_heads(const T* heads, T* dst, std::int64_t parts, std::int64_t part, std::int64_t B, std::int64_t H,
                   std::int64_t Tn, std::int64_t hs) {
#pragma omp parallel for collapse(2) schedule(static) if (B * H * Tn * hs > (1 << 15))
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < Tn; ++t)
        std::copy_n(heads + ((b * H + h) * Tn + t) * hs, hs, dst + (((b * Tn + t) * parts + part) * H + h) * hs);
}
}  // namespace

// The heads are gathered into [B, H, Tn, hs] buffers and the kernels above run on them: the values are those
// of splitting the projection into contiguous heads first (the unfused path) bit for bit.
template <class T>
void attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H, std::int64_t Tn,
                           std::int64_t hs, double scale) {
  const std::int64_t n = B * H * Tn * hs;
  if (n == 0) return;
  std::vector<T> q(static_cast<std::size_t>(n)), k(q.size()), v(q.size()), o(q.size());
  gather_heads(qkv, 3, 0, q.data(), B, H, Tn, hs);
  gather_heads(qkv, 3, 1, k.data(), B, H, Tn, hs);
  gather_heads(qkv, 3, 2, v.data(), B, H, Tn, hs);
  attention_forward<T>(q.data(), k.data(), v.data(), o.data(), lse, B * H, Tn, hs, scale, true);
  scatter_heads(o.data(), out, 1, 0, B, H, Tn, hs);
}

template <class T>
void attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv, std::int64_t B,
                            std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale) {
  const std::int64_t n = B * H * Tn * hs;
  if (n == 0) return;
  const auto sz = static_cast<std::size_t>(n);
  std::vector<T> q(sz), k(sz), v(sz), o(sz), g(sz), dq(sz), dk(sz), dv(sz);
  gather_heads(qkv, 3, 0, q.data(), B, H, Tn, hs);
  gather_heads(qkv, 3, 1, k.data(), B, H, Tn, hs);
  gather_heads(qkv, 3, 2, v.data(), B, H, Tn, hs);
  gather_heads(out, 1, 0, o.data(), B, H, Tn, hs);
  gather_heads(dout, 1, 0, g.data(), B, H, Tn, hs);
  attention_backward<T>(q.data(), k.data(), v.data(), o.data(), g.data(), lse, dq.data(), dk.data(), dv.data(), B * H,
                        Tn, hs, scale, true);
  scatter_heads(dq.data(), dqkv, 3, 0, B, H, Tn, hs);
  scatter_heads(dk.data(), dqkv, 3, 1, B, H, Tn, hs);
  scatter_heads(dv.data(), dqkv, 3, 2, B, H, Tn, hs);
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ATTENTION, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

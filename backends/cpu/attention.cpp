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

/// Where heads' rows are: row t of head bh starts at off(bh) + t·ld elements from the base pointer, with
/// off(bh) = (bh / H)·batch + (bh % H)·head. Contiguous heads: {1, Tn·hs, 0, hs}; the q part of a fused QKV
/// projection's [B, Tn, 3, H, hs] output: {H, Tn·3C, hs, 3C}.
struct Heads {
  std::int64_t H, batch, head, ld;
  std::int64_t off(std::int64_t bh) const { return (bh / H) * batch + (bh % H) * head; }
};
Heads dense_heads(std::int64_t Tn, std::int64_t hs) { return {1, Tn * hs, 0, hs}; }

/// The heads as accum_t<T>: the data itself when T already is (layout unchanged), else a widened copy of
/// every head in `buf`, contiguous ([BH, Tn, hs]); `l` becomes the layout of what is returned.
template <class A, class T>
const A* widen(const T* p, Heads& l, std::int64_t BH, std::int64_t Tn, std::int64_t hs, std::vector<A>& buf) {
  if constexpr (std::is_same_v<A, T>) {
    return p;
  } else {
    buf.resize(static_cast<std::size_t>(BH * Tn * hs));
    const Heads src = l;
#pragma omp parallel for schedule(static) if (BH * Tn * hs > (1 << 15))
    for (std::int64_t r = 0; r < BH * Tn; ++r) {
      const T* row = p + src.off(r / Tn) + (r % Tn) * src.ld;
      A* dst = buf.data() + r * hs;
      for (std::int64_t c = 0; c < hs; ++c) dst[c] = scalar_cast<A>(row[c]);
    }
    l = dense_heads(Tn, hs);
    return buf.data();
  }
}

template <class T>
void forward_impl(const T* q, Heads lq, const T* k, Heads lk, const T* v, Heads lv, T* out, Heads lo, accum_t<T>* lse,
                  std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  using A = accum_t<T>;
  if (BH == 0 || Tn == 0) return;
  std::vector<A> bq, bk, bv;
  const A* Q = widen(q, lq, BH, Tn, hs, bq);
  const A* K = widen(k, lk, BH, Tn, hs, bk);
  const A* Vv = widen(v, lv, BH, Tn, hs, bv);
  const std::int64_t nblk = (Tn + kBlock - 1) / kBlock;
  const A sc = static_cast<A>(scale);
#pragma omp parallel
  {
    std::vector<A> S(static_cast<std::size_t>(kBlock * Tn)), O(static_cast<std::size_t>(kBlock * hs));
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t task = 0; task < BH * nblk; ++task) {
      const std::int64_t h = task / nblk, i0 = (task % nblk) * kBlock, i1 = std::min(Tn, i0 + kBlock);
      const std::int64_t rows = i1 - i0, kend = causal ? i1 : Tn;
      const A* Qh = Q + lq.off(h);
      const A* Kh = K + lk.off(h);
      const A* Vh = Vv + lv.off(h);
      if (hs > 0) {
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, Qh + i0 * lq.ld, lq.ld, Kh, lk.ld, 0.f, S.data(), Tn);
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
      T* Oh = out + lo.off(h) + i0 * lo.ld;
      if constexpr (std::is_same_v<A, T>) {
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, S.data(), Tn, Vh, lv.ld, 0.f, Oh, lo.ld);
      } else {
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, S.data(), Tn, Vh, lv.ld, 0.f, O.data(), hs);
        for (std::int64_t r = 0; r < rows; ++r)
          for (std::int64_t c = 0; c < hs; ++c) Oh[r * lo.ld + c] = scalar_cast<T>(O[static_cast<std::size_t>(r * hs + c)]);
      }
    }
  }
}

template <class T>
void backward_impl(const T* q, Heads lq, const T* k, Heads lk, const T* v, Heads lv, const T* out, Heads lo,
                   const T* dout, Heads ldo, const accum_t<T>* lse, T* dq, Heads ldq, T* dk, Heads ldk, T* dv, Heads ldv,
                   std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  using A = accum_t<T>;
  if (BH == 0 || Tn == 0 || hs == 0) return;
  std::vector<A> bq, bk, bv, bo, bdo;
  const A* Q = widen(q, lq, BH, Tn, hs, bq);
  const A* K = widen(k, lk, BH, Tn, hs, bk);
  const A* Vv = widen(v, lv, BH, Tn, hs, bv);
  const A* O = widen(out, lo, BH, Tn, hs, bo);
  const A* dO = widen(dout, ldo, BH, Tn, hs, bdo);
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
      const A *Qh = Q + lq.off(h), *Kh = K + lk.off(h), *Vh = Vv + lv.off(h), *Oh = O + lo.off(h), *dOh = dO + ldo.off(h);
      A *dQh, *dKh, *dVh;
      std::int64_t gq_ld = hs, gk_ld = hs, gv_ld = hs;
      if constexpr (direct) {
        dQh = reinterpret_cast<A*>(dq) + ldq.off(h);
        dKh = reinterpret_cast<A*>(dk) + ldk.off(h);
        dVh = reinterpret_cast<A*>(dv) + ldv.off(h);
        gq_ld = ldq.ld, gk_ld = ldk.ld, gv_ld = ldv.ld;
      } else {
        dQh = gq.data(), dKh = gk.data(), dVh = gv.data();
      }
      for (std::int64_t t = 0; t < Tn; ++t) {
        std::fill_n(dKh + t * gk_ld, hs, A(0));
        std::fill_n(dVh + t * gv_ld, hs, A(0));
      }
      for (std::int64_t i0 = 0; i0 < Tn; i0 += kBlock) {
        const std::int64_t i1 = std::min(Tn, i0 + kBlock), rows = i1 - i0, kend = causal ? i1 : Tn;
        // S = scale·Q·Kᵀ -> P = exp(S − lse); dP = dO·Vᵀ
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, Qh + i0 * lq.ld, lq.ld, Kh, lk.ld, 0.f, S.data(), Tn);
        gemm<A>(Trans::N, Trans::T, rows, kend, hs, 1.f, dOh + i0 * ldo.ld, ldo.ld, Vh, lv.ld, 0.f, dP.data(), Tn);
        for (std::int64_t r = 0; r < rows; ++r) {
          const A* o = Oh + (i0 + r) * lo.ld;
          const A* g = dOh + (i0 + r) * ldo.ld;
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
        gemm<A>(Trans::N, Trans::N, rows, hs, kend, 1.f, dP.data(), Tn, Kh, lk.ld, 0.f, dQh + i0 * gq_ld, gq_ld);
        gemm<A>(Trans::T, Trans::N, kend, hs, rows, 1.f, dP.data(), Tn, Qh + i0 * lq.ld, lq.ld, 1.f, dKh, gk_ld);
        gemm<A>(Trans::T, Trans::N, kend, hs, rows, 1.f, S.data(), Tn, dOh + i0 * ldo.ld, ldo.ld, 1.f, dVh, gv_ld);
      }
      if constexpr (!direct) {
        T *oq = dq + ldq.off(h), *ok = dk + ldk.off(h), *ov = dv + ldv.off(h);
        for (std::int64_t t = 0; t < Tn; ++t)
          for (std::int64_t c = 0; c < hs; ++c) {
            const auto i = static_cast<std::size_t>(t * hs + c);
            oq[t * ldq.ld + c] = scalar_cast<T>(gq[i]);
            ok[t * ldk.ld + c] = scalar_cast<T>(gk[i]);
            ov[t * ldv.ld + c] = scalar_cast<T>(gv[i]);
          }
      }
    }
  }
}
}  // namespace

template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH, std::int64_t Tn,
                       std::int64_t hs, double scale, bool causal) {
  const Heads l = dense_heads(Tn, hs);
  forward_impl(q, l, k, l, v, l, out, l, lse, BH, Tn, hs, scale, causal);
}

template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse, T* dq,
                        T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  const Heads l = dense_heads(Tn, hs);
  backward_impl(q, l, k, l, v, l, out, l, dout, l, lse, dq, l, dk, l, dv, l, BH, Tn, hs, scale, causal);
}

// ---- heads packed in a fused QKV projection's output ---------------------------------------------------------
// The same loops over the packed layouts (no gathering copy for fp32/fp64; 16-bit heads are widened into
// contiguous fp32 buffers as always), so the values are those of splitting into contiguous heads first.
template <class T>
void attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H, std::int64_t Tn,
                           std::int64_t hs, double scale) {
  const std::int64_t C = H * hs;
  const Heads in{H, Tn * 3 * C, hs, 3 * C}, io{H, Tn * C, hs, C};
  forward_impl(qkv, in, qkv + C, in, qkv + 2 * C, in, out, io, lse, B * H, Tn, hs, scale, true);
}

template <class T>
void attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv, std::int64_t B,
                            std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale) {
  const std::int64_t C = H * hs;
  const Heads in{H, Tn * 3 * C, hs, 3 * C}, io{H, Tn * C, hs, C};
  backward_impl(qkv, in, qkv + C, in, qkv + 2 * C, in, out, io, dout, io, lse, dqkv, in, dqkv + C, in, dqkv + 2 * C, in,
                B * H, Tn, hs, scale, true);
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_ATTENTION, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

// Strided batched matmul and linear launchers over the GEMM API (detail/cpu/gemm.hpp). Operands are used
// in place through Trans flags (no copies); batch dims that collapse become one gemm_batched call, or
// fold into the GEMM's M (a broadcast B) or K (a reduction over the batch, as in dB = Σ Aᵀ·dC).
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/detail/cpu/amx.hpp"
#include "typegrad/detail/cpu/kernels.hpp"

namespace tg::backend::cpu {

namespace {
// Note [AMX route for bf16]
// On CPUs with AMX-BF16 (Intel Sapphire Rapids and later) the AVX-512 vdpbf16ps kernel runs at about half
// the fp32 FMA rate, while a tile multiply does 16x16x32 products per instruction; bf16 GEMMs above a few
// MFLOP go to gemm_bf16_amx (amx_bf16.cpp) when amx_bf16_usable(). Everything else keeps gemm<T>'s own
// dispatch (TG_GEMM_KERNEL set, or TG_AMX=0, also keeps it).
template <class T>
bool use_amx(std::int64_t M, std::int64_t N, std::int64_t K) {
  if constexpr (!std::is_same_v<T, bf16>) {
    return false;
  } else {
    return M >= 16 && N >= 16 && K >= 32 &&
           2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K) >= 2e6 && amx_bf16_usable();
  }
}
template <class T>
void gemm_routed(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const T* A,
                 std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C, std::int64_t ldc,
                 const GemmEpilogue& ep = {}) {
  if constexpr (std::is_same_v<T, bf16>) {
    if (!ep.out_bf16 && use_amx<T>(M, N, K)) {
      gemm_bf16_amx(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ep.bias);
      return;
    }
  }
  gemm<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, ep);
}
template <class T>
void gemm_batched_routed(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                         const T* A, std::int64_t lda, std::int64_t stride_a, const T* B, std::int64_t ldb,
                         std::int64_t stride_b, float beta, T* C, std::int64_t ldc, std::int64_t stride_c,
                         std::int64_t batch) {
  if (batch == 1) {
    gemm_routed<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  gemm_batched<T>(ta, tb, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, beta, C, ldc, stride_c, batch);
}
/// Whether the batch dims (size > 1) of `st` chain with `base`: st[d] == base · prod(sizes inside d).
bool chains(const Shape& st, const Shape& batch, std::int64_t base) {
  std::int64_t expect = base;
  for (int d = batch.size() - 1; d >= 0; --d) {
    if (batch[d] == 1) continue;
    if (st[d] != expect) return false;
    expect *= batch[d];
  }
  return true;
}
bool all_zero(const Shape& st, const Shape& batch) {
  for (int d = 0; d < batch.size(); ++d)
    if (batch[d] > 1 && st[d] != 0) return false;
  return true;
}
}  // namespace

template <class T>
void matmul_strided(const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,
                    const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K) {
  const int nb = batch.size();
  const std::int64_t nbatch = batch.numel();
  if (M == 0 || N == 0 || nbatch == 0) return;
  const std::int64_t ldc = M > 1 ? sc[nb] : N;
  TG_CHECK(sc[nb + 1] == 1 || N == 1, "matmul_strided: C needs unit column stride");
  if (K == 0) {  // empty inner dim: C = 0 on every block it has
    for (std::int64_t i = 0; i < nbatch; ++i) {
      std::int64_t rem = i, oc = 0;
      for (int d = nb - 1; d >= 0; --d) {
        oc += (rem % batch[d]) * sc[d];
        rem /= batch[d];
      }
      for (std::int64_t m = 0; m < M; ++m)
        for (std::int64_t n = 0; n < N; ++n) c[oc + m * ldc + n] = scalar_cast<T>(0.0);
    }
    return;
  }
  const std::int64_t ars = sa[nb], acs = sa[nb + 1], brs = sb[nb], bcs = sb[nb + 1];
  Trans ta, tb;
  std::int64_t lda, ldb;
  if (nbatch > 1) {
    // Fold the batch into M: B is shared and A's and C's batch dims continue their rows.
    if (all_zero(sb, batch) && chains(sa, batch, ars * M) && chains(sc, batch, ldc * M) &&
        gemm_operand(M * nbatch, K, ars, acs, ta, lda) && gemm_operand(K, N, brs, bcs, tb, ldb)) {
      gemm_routed<T>(ta, tb, M * nbatch, N, K, 1.f, a, lda, b, ldb, 0.f, c, ldc);
      return;
    }
    // Fold the batch into K: C is shared (a reduction) and A's columns / B's rows continue over it.
    if (all_zero(sc, batch) && chains(sa, batch, acs * K) && chains(sb, batch, brs * K) &&
        gemm_operand(M, K * nbatch, ars, acs, ta, lda) && gemm_operand(K * nbatch, N, brs, bcs, tb, ldb)) {
      gemm_routed<T>(ta, tb, M, N, K * nbatch, 1.f, a, lda, b, ldb, 0.f, c, ldc);
      return;
    }
  }
  TG_CHECK(gemm_operand(M, K, ars, acs, ta, lda) && gemm_operand(K, N, brs, bcs, tb, ldb),
           "matmul_strided: an operand has no unit stride in its last two dims");
  // Collapse the innermost non-reduced batch dims into one gemm_batched call; loop over the rest.
  std::vector<int> dims;
  for (int d = 0; d < nb; ++d)
    if (batch[d] > 1) dims.push_back(d);
  int split = static_cast<int>(dims.size());
  std::int64_t count = 1, st_a = 0, st_b = 0, st_c = 0;
  for (int j = static_cast<int>(dims.size()) - 1; j >= 0; --j) {
    const int d = dims[static_cast<std::size_t>(j)];
    if (sc[d] == 0) break;
    if (count == 1) {
      st_a = sa[d], st_b = sb[d], st_c = sc[d], count = batch[d];
    } else if (sa[d] == st_a * count && sb[d] == st_b * count && sc[d] == st_c * count) {
      count *= batch[d];
    } else {
      break;
    }
    split = j;
  }
  std::int64_t outer = 1;
  for (int j = 0; j < split; ++j) outer *= batch[dims[static_cast<std::size_t>(j)]];
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t rem = o, oa = 0, ob = 0, oc = 0;
    bool first = true;  // first visit of this C block: every reduced index is 0
    for (int j = split - 1; j >= 0; --j) {
      const int d = dims[static_cast<std::size_t>(j)];
      const std::int64_t i = rem % batch[d];
      rem /= batch[d];
      oa += i * sa[d];
      ob += i * sb[d];
      oc += i * sc[d];
      if (sc[d] == 0 && i != 0) first = false;
    }
    gemm_batched_routed<T>(ta, tb, M, N, K, 1.f, a + oa, lda, st_a, b + ob, ldb, st_b, first ? 0.f : 1.f, c + oc, ldc, st_c,
                    count);
  }
}

template <class T>
void linear_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, std::int64_t wcs,
                    const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K) {
  if (M == 0 || N == 0) return;
  Trans tx, tw;
  std::int64_t ldx, ldw;
  // op(B) = Wᵀ: a [K, N] matrix whose strides are W's swapped.
  TG_CHECK(gemm_operand(M, K, xrs, xcs, tx, ldx) && gemm_operand(K, N, wcs, wrs, tw, ldw),
           "linear_forward: an operand has no unit stride");
  if (K == 0) {
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n) y[m * N + n] = bias ? bias[n] : scalar_cast<T>(0.0);
    return;
  }
  if (!bias) {
    gemm_routed<T>(tx, tw, M, N, K, 1.f, x, ldx, w, ldw, 0.f, y, N);
  } else if constexpr (std::is_same_v<T, double>) {
    // The epilogue's bias is fp32; fp64 adds it exactly afterwards.
    gemm<T>(tx, tw, M, N, K, 1.f, x, ldx, w, ldw, 0.f, y, N);
#pragma omp parallel for schedule(static) if (M * N > (1 << 15))
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
  } else if constexpr (std::is_same_v<T, float>) {
    GemmEpilogue ep;
    ep.bias = bias;
    gemm<T>(tx, tw, M, N, K, 1.f, x, ldx, w, ldw, 0.f, y, N, ep);
  } else {
    std::vector<float> fb(static_cast<std::size_t>(N));
    for (std::int64_t n = 0; n < N; ++n) fb[static_cast<std::size_t>(n)] = scalar_cast<float>(bias[n]);
    GemmEpilogue ep;
    ep.bias = fb.data();
    gemm_routed<T>(tx, tw, M, N, K, 1.f, x, ldx, w, ldw, 0.f, y, N, ep);
  }
}

template <class T>
void linear_gelu_tanh_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,
                              std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N,
                              std::int64_t K) {
  // The composite's kernels in the composite's order (no GELU in the CPU GEMM's epilogue yet): the GELU
  // reads the pre-activation as stored (rounded to T), as gelu_tanh(linear(x, w, b)) does.
  linear_forward<T>(x, xrs, xcs, w, wrs, wcs, bias, pre, M, N, K);
  if (M == 0 || N == 0) return;
  unary_forward<T>(math::Unary::gelu_tanh, pre, Shape{N, 1}, y, Shape{M, N});
}

template <class T>
void linear_weight_grad(const T* dy, const T* x, std::int64_t xrs, std::int64_t xcs, T* dw, T* db, std::int64_t M,
                        std::int64_t N, std::int64_t K) {
  // linear's backward as it was written before the kernel existed: the same GEMM and reduction, so the same bits.
  if (dw) matmul_strided<T>(dy, {1, N}, x, {xrs, xcs}, dw, {K, 1}, Shape(), N, K, M);
  if (db) reduce_sum<T>(dy, db, 1, M, N);
}

template <class T>
bool linear_gelu_input_grad(const T*, const T*, std::int64_t, std::int64_t, const T*, T*, T*, std::int64_t, std::int64_t,
                            std::int64_t) {
  return false;  // the op runs the composite's kernels (bit for bit the unfused ops)
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_MATMUL, TG_FLOATING_TYPES)

}  // namespace tg::backend::cpu

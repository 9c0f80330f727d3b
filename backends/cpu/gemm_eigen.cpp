// Eigen reference GEMM: the portable path and the ground truth for the optimized kernels.
#include <Eigen/Core>
#include <vector>

#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu {
namespace {

template <class S>
using RowMat = Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <class S>
using Map = Eigen::Map<const RowMat<S>, 0, Eigen::OuterStride<>>;
template <class S>
using MutMap = Eigen::Map<RowMat<S>, 0, Eigen::OuterStride<>>;

// Copies a 16-bit operand into fp32 (Eigen has no fast 16-bit GEMM).
template <class T>
RowMat<float> widen(const T* p, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
  RowMat<float> m(rows, cols);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j) m(i, j) = static_cast<float>(p[i * ld + j]);
  return m;
}

template <class S>
void eigen_gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, S alpha, const S* A,
                std::int64_t lda, const S* B, std::int64_t ldb, S beta, S* C, std::int64_t ldc) {
  MutMap<S> c(C, M, N, Eigen::OuterStride<>(ldc));
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (beta == S(0)) c.setZero(); else c *= beta;
    return;
  }
  const Map<S> a(A, ta == Trans::N ? M : K, ta == Trans::N ? K : M, Eigen::OuterStride<>(lda));
  const Map<S> b(B, tb == Trans::N ? K : N, tb == Trans::N ? N : K, Eigen::OuterStride<>(ldb));
  if (beta == S(0)) {
    c.setZero();
  } else if (beta != S(1)) {
    c *= beta;
  }
  if (ta == Trans::N && tb == Trans::N) c.noalias() += alpha * a * b;
  else if (ta == Trans::N) c.noalias() += alpha * a * b.transpose();
  else if (tb == Trans::N) c.noalias() += alpha * a.transpose() * b;
  else c.noalias() += alpha * a.transpose() * b.transpose();
}

}  // namespace

template <class T>
void gemm_reference(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                    const T* A, std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C,
                    std::int64_t ldc) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    eigen_gemm<T>(ta, tb, M, N, K, static_cast<T>(alpha), A, lda, B, ldb, static_cast<T>(beta), C, ldc);
  } else {
    const RowMat<float> a = widen(A, ta == Trans::N ? M : K, ta == Trans::N ? K : M, lda);
    const RowMat<float> b = widen(B, tb == Trans::N ? K : N, tb == Trans::N ? N : K, ldb);
    RowMat<float> c(M, N);
    if (beta != 0.f) c = widen(C, M, N, ldc);
    eigen_gemm<float>(ta, tb, M, N, K, alpha, a.data(), a.cols(), b.data(), b.cols(), beta, c.data(), N);
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = T(c(i, j));
  }
}

#define TG_INSTANTIATE(T)                                                                           \
  template void gemm_reference<T>(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float,  \
                                  const T*, std::int64_t, const T*, std::int64_t, float, T*,       \
                                  std::int64_t);
TG_INSTANTIATE(double)
TG_INSTANTIATE(float)
TG_INSTANTIATE(bf16)
TG_INSTANTIATE(fp16)
#undef TG_INSTANTIATE

}  // namespace tg::backend::cpu

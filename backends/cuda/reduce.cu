// Reductions over the middle dim of a contiguous [outer, n, inner] block: sum (in accum_t<T>, fixed order,
// no atomics: results do not change from run to run), max with the first argmax (NaN wins, as on the
// CPU), and max's backward scatter. Kernels first, launchers after.
#include "common.cuh"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

using detail::acc_t;
using detail::kThreads;

namespace {

// ---- kernels --------------------------------------------------------------------------------------------
/// inner == 1: one block per row, block-wide sum.
template <class T>
__global__ void sum_rows_kernel(const T* in, T* out, std::int64_t outer, std::int64_t n) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* p = in + r * n;
    A s = 0;
    for (std::int64_t k = threadIdx.x; k < n; k += blockDim.x) s += scalar_cast<A>(p[k]);
    s = detail::block_sum(s, shm);
    if (threadIdx.x == 0) out[r] = scalar_cast<T>(s);
  }
}

/// inner > 1, stage 1: part[o, c, i] = Σ_{k in chunk c} in[o, k, i] (consecutive threads take consecutive i).
template <class T, class P>
__global__ void sum_cols_partial_kernel(const T* in, P* part, std::int64_t outer, std::int64_t n, std::int64_t inner,
                                        std::int64_t chunks, std::int64_t chunk_len) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(t, outer * chunks * inner) {
    const std::int64_t i = t % inner, c = (t / inner) % chunks, o = t / (inner * chunks);
    const std::int64_t k0 = c * chunk_len, k1 = k0 + chunk_len < n ? k0 + chunk_len : n;
    const T* p = in + (o * n) * inner + i;
    A s = 0;
    for (std::int64_t k = k0; k < k1; ++k) s += scalar_cast<A>(p[k * inner]);
    part[t] = scalar_cast<P>(s);
  }
}
/// Stage 2: out[o, i] = Σ_c part[o, c, i] in chunk order.
template <class T, class P>
__global__ void sum_cols_final_kernel(const P* part, T* out, std::int64_t outer, std::int64_t chunks, std::int64_t inner) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(t, outer * inner) {
    const std::int64_t i = t % inner, o = t / inner;
    A s = 0;
    for (std::int64_t c = 0; c < chunks; ++c) s += scalar_cast<A>(part[(o * chunks + c) * inner + i]);
    out[t] = scalar_cast<T>(s);
  }
}

template <class T>
__global__ void max_kernel(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n,
                           std::int64_t inner) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(t, outer * inner) {
    const std::int64_t i = t % inner, o = t / inner;
    const T* p = in + o * n * inner + i;
    A best = scalar_cast<A>(p[0]);
    std::int64_t arg = 0;
    for (std::int64_t k = 1; k < n && !(best != best); ++k) {
      const A v = scalar_cast<A>(p[k * inner]);
      if (v > best || v != v) {
        best = v;
        arg = k;
      }
    }
    out[t] = scalar_cast<T>(best);
    if (index) index[t] = arg;
  }
}

template <class T>
__global__ void max_backward_kernel(const T* dout, const std::int64_t* index, T* din, std::int64_t outer, std::int64_t n,
                                    std::int64_t inner) {
  TG_GRID_STRIDE(t, outer * n * inner) {
    const std::int64_t i = t % inner, k = (t / inner) % n, o = t / (inner * n);
    din[t] = index[o * inner + i] == k ? dout[o * inner + i] : scalar_cast<T>(0.0f);
  }
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------------
template <class T>
void reduce_sum(const T* in, T* out, std::int64_t outer, std::int64_t n, std::int64_t inner) {
  using A = acc_t<T>;
  if (outer * inner == 0) return;
  if (n == 0) {
    TG_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<std::size_t>(outer * inner) * sizeof(T), detail::stream()));  // +0.0 in every type
    return;
  }
  if (inner == 1) {
    const int threads = detail::row_threads(n);
    sum_rows_kernel<T><<<static_cast<unsigned>(std::min<std::int64_t>(outer, 65535)), threads, 0, detail::stream()>>>(in, out, outer, n);
    TG_CUDA_LAUNCHED();
    return;
  }
  // Enough (o, chunk, i) work items to fill the GPU; chunks of at least 32 rows.
  const std::int64_t want = std::max<std::int64_t>(1, (std::int64_t{1} << 17) / (outer * inner));
  std::int64_t chunks = std::clamp<std::int64_t>(want, 1, std::max<std::int64_t>(1, n / 32));
  const std::int64_t chunk_len = (n + chunks - 1) / chunks;
  chunks = (n + chunk_len - 1) / chunk_len;
  if (chunks == 1) {
    sum_cols_partial_kernel<T, T><<<detail::grid_for(outer * inner), kThreads, 0, detail::stream()>>>(in, out, outer, n, inner, 1, n);
    TG_CUDA_LAUNCHED();
    return;
  }
  detail::Workspace ws(static_cast<std::size_t>(outer * chunks * inner) * sizeof(A));
  sum_cols_partial_kernel<T, A><<<detail::grid_for(outer * chunks * inner), kThreads, 0, detail::stream()>>>(in, ws.as<A>(), outer, n, inner,
                                                                                        chunks, chunk_len);
  TG_CUDA_LAUNCHED();
  sum_cols_final_kernel<T, A><<<detail::grid_for(outer * inner), kThreads, 0, detail::stream()>>>(ws.as<A>(), out, outer, chunks, inner);
  TG_CUDA_LAUNCHED();
}

template <class T>
void reduce_max(const T* in, T* out, std::int64_t* index, std::int64_t outer, std::int64_t n, std::int64_t inner) {
  if (outer * inner == 0) return;
  max_kernel<T><<<detail::grid_for(outer * inner), kThreads, 0, detail::stream()>>>(in, out, index, outer, n, inner);
  TG_CUDA_LAUNCHED();
}

template <class T>
void max_backward(const T* dout, const std::int64_t* index, T* din, std::int64_t outer, std::int64_t n,
                  std::int64_t inner) {
  if (outer * n * inner == 0) return;
  max_backward_kernel<T><<<detail::grid_for(outer * n * inner), kThreads, 0, detail::stream()>>>(dout, index, din, outer, n, inner);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_REDUCE, TG_FLOATING_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_REDUCE_GPU, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

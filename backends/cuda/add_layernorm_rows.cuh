// The one-block-per-row LayerNorm / RMSNorm forward (nn.cu's layernorm_forward and rmsnorm_forward, for rows that
// are not whole 16-byte packs) and the fused residual add + LayerNorm over the same rows (add_layernorm.cu, Note
// [fused residual add and LayerNorm] in ops/add_layernorm.hpp), side by side: h and y of the second are the
// elementwise add then the first, bit for bit, so the two keep the same block size, reductions and expressions.
// Included by nn.cu and add_layernorm.cu inside their anonymous namespaces (in tg::backend::cuda; each launches one of
// the two); it includes nothing itself (it sits inside a namespace): the includer supplies acc_t, detail::block_sum,
// scalar_cast, sqrt, <type_traits> and the CUDA built-ins (through common.cuh). tests/cuda/test_softmax_emulated.cpp
// supplies host versions of them and runs these kernels' bodies, unchanged, on the CPU.

/// mean == nullptr: RMSNorm (no centring, no bias).
template <class T>
__global__ void norm_forward_kernel(const T* x, const T* w, const T* b, T* y, acc_t<T>* mean, acc_t<T>* rstd,
                                    std::int64_t rows, std::int64_t n, acc_t<T> eps) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    A mu = 0;
    if (mean) {
      A s = 0;
      for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) s += scalar_cast<A>(xr[j]);
      mu = detail::block_sum(s, shm) / static_cast<A>(n);
    }
    A v = 0;  // two passes: the variance of centred values does not cancel
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A d = scalar_cast<A>(xr[j]) - mu;
      v += d * d;
    }
    const A rs = A(1) / sqrt(detail::block_sum(v, shm) / static_cast<A>(n) + eps);
    if (threadIdx.x == 0) {
      if (mean) mean[r] = mu;
      rstd[r] = rs;
    }
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A o = (scalar_cast<A>(xr[j]) - mu) * rs * scalar_cast<A>(w[j]);
      yr[j] = scalar_cast<T>(b ? o + scalar_cast<A>(b[j]) : o);
    }
  }
}

/// h = x + r (rounded to T, as the elementwise add rounds it), then norm_forward_kernel's LayerNorm of h.
template <class T>
__global__ void add_layernorm_kernel(const T* x, const T* r, const T* w, const T* b, T* h, T* y, acc_t<T>* mean,
                                     acc_t<T>* rstd, std::int64_t rows, std::int64_t n, acc_t<T> eps) {
  using E = std::conditional_t<std::is_same_v<T, double>, double, float>;  // the elementwise add's register type
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* xr = x + i * n;
    const T* rr = r + i * n;
    T* hr = h + i * n;
    T* yr = y + i * n;
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const T v = scalar_cast<T>(scalar_cast<E>(xr[j]) + scalar_cast<E>(rr[j]));
      hr[j] = v;
      s += scalar_cast<A>(v);
    }
    const A mu = detail::block_sum(s, shm) / static_cast<A>(n);
    A v = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A d = scalar_cast<A>(hr[j]) - mu;
      v += d * d;
    }
    const A rs = A(1) / sqrt(detail::block_sum(v, shm) / static_cast<A>(n) + eps);
    if (threadIdx.x == 0) {
      mean[i] = mu;
      rstd[i] = rs;
    }
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A o = (scalar_cast<A>(hr[j]) - mu) * rs * scalar_cast<A>(w[j]);
      yr[j] = scalar_cast<T>(o + scalar_cast<A>(b[j]));
    }
  }
}

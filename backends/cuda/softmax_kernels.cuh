// The softmax kernels (forward and backward) and the fused scale, mask and softmax (Note [fused scale, mask and
// softmax] in ops/scale_masked_softmax.hpp), which must equal the separate ops bit for bit: one block per row of a
// contiguous [rows, n] block, block reductions in a fixed order. Included by nn.cu inside its anonymous namespace (in
// tg::backend::cuda); it includes nothing itself (it sits inside a namespace): the includer supplies acc_t,
// detail::block_sum, detail::block_max, detail::Geo, scalar_cast, exp / log, the _rn intrinsics and the CUDA
// built-ins (nn.cu through common.cuh). tests/cuda/test_softmax_emulated.cpp supplies host versions of them and runs
// these kernels' bodies, unchanged, on the CPU.

template <class A, class T>
__device__ A row_max(const T* x, std::int64_t n, A* shm) {
  A m = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const A v = scalar_cast<A>(x[j]);
    m = (v > m || v != v) ? v : m;
  }
  return detail::block_max(m, shm);
}

// Rounding spelled out where two kernels must agree bit for bit (softmax and scale_masked_softmax): the _rn
// intrinsics are never contracted or split by the compiler, so the same expression rounds the same in both.
// mul_rn / div_rn: one rounded product or quotient (the separate ops round and store x·s before the softmax
// subtracts the maximum); fma_rn: the backward's Σ dy·y, one fused multiply-add per term in each kernel.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ inline float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ inline double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ inline float fma_rn(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ inline double fma_rn(double a, double b, double c) { return __fma_rn(a, b, c); }

// ---- softmax ---------------------------------------------------------------------------------------------
template <class T>
__global__ void softmax_forward_kernel(const T* x, T* y, std::int64_t rows, std::int64_t n, bool log) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    const A m = row_max<A>(xr, n, shm);
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) s += exp(scalar_cast<A>(xr[j]) - m);
    s = detail::block_sum(s, shm);
    if (log) {
      const A ls = m + ::log(s);
      for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) yr[j] = scalar_cast<T>(scalar_cast<A>(xr[j]) - ls);
    } else {
      const A inv = A(1) / s;
      for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) yr[j] = scalar_cast<T>(exp(scalar_cast<A>(xr[j]) - m) * inv);
    }
  }
}

template <class T>
__global__ void softmax_backward_kernel(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * n;
    const T* gr = dy + r * n;
    T* dr = dx + r * n;
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x)
      s = log ? s + scalar_cast<A>(gr[j]) : fma_rn(scalar_cast<A>(gr[j]), scalar_cast<A>(yr[j]), s);
    s = detail::block_sum(s, shm);
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A g = scalar_cast<A>(gr[j]), yv = scalar_cast<A>(yr[j]);
      dr[j] = scalar_cast<T>(log ? g - exp(yv) * s : yv * (g - s));
    }
  }
}

// ---- scale, mask and softmax (Note [fused scale, mask and softmax]) -----------------------------------------
// softmax_forward_kernel's loops over v_j instead of x_j: v_j (the scaled value rounded to T, or the fill) is
// recomputed in each pass, as cheap as reading it. `mask` row r starts at g.offset(r·n) (g: the mask's strides
// over the shape) and steps by ms.

template <class T>
__device__ T scaled_masked(const T* xr, std::int64_t j, acc_t<T> s, int how, const std::uint8_t* mr, std::int64_t ms, T fill) {
  using M = acc_t<T>;
  if (mr && mr[j * ms]) return fill;
  if (how == 0) return xr[j];
  return scalar_cast<T>(how == 1 ? mul_rn(scalar_cast<M>(xr[j]), s) : div_rn(scalar_cast<M>(xr[j]), s));
}

template <class T>
__global__ void scale_masked_softmax_forward_kernel(const T* x, const T* scale, int how, const std::uint8_t* mask,
                                                    detail::Geo g, std::int64_t ms, T fill, T* y, std::int64_t rows,
                                                    std::int64_t n) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  const A s = scale ? scalar_cast<A>(*scale) : A(1);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    T* yr = y + r * n;
    const std::uint8_t* mr = mask ? mask + g.offset(r * n, 0) : nullptr;
    A m = -INFINITY;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A v = scalar_cast<A>(scaled_masked(xr, j, s, how, mr, ms, fill));
      m = (v > m || v != v) ? v : m;
    }
    m = detail::block_max(m, shm);
    A sum = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) sum += exp(scalar_cast<A>(scaled_masked(xr, j, s, how, mr, ms, fill)) - m);
    sum = detail::block_sum(sum, shm);
    const A inv = A(1) / sum;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x)
      yr[j] = scalar_cast<T>(exp(scalar_cast<A>(scaled_masked(xr, j, s, how, mr, ms, fill)) - m) * inv);
  }
}

template <class T>
__global__ void scale_masked_softmax_backward_kernel(const T* y, const T* dy, const T* scale, int how, const std::uint8_t* mask,
                                                     detail::Geo g, std::int64_t ms, T* dx, std::int64_t rows, std::int64_t n) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  const A s = scale ? scalar_cast<A>(*scale) : A(1);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* yr = y + r * n;
    const T* gr = dy + r * n;
    T* dr = dx + r * n;
    const std::uint8_t* mr = mask ? mask + g.offset(r * n, 0) : nullptr;
    A sum = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) sum = fma_rn(scalar_cast<A>(gr[j]), scalar_cast<A>(yr[j]), sum);
    sum = detail::block_sum(sum, shm);  // softmax_backward_kernel's sum, term for term
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      T d = scalar_cast<T>(scalar_cast<A>(yr[j]) * (scalar_cast<A>(gr[j]) - sum));  // softmax's backward
      if (mr && mr[j * ms]) d = scalar_cast<T>(0.0);                                // masked_fill's
      if (how == 1) d = scalar_cast<T>(mul_rn(scalar_cast<A>(d), s));              // mul's (div's)
      else if (how == 2) d = scalar_cast<T>(div_rn(scalar_cast<A>(d), s));
      dr[j] = d;
    }
  }
}

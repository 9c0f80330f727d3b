// The cross-entropy kernels over rows of 16-byte packs (Note [cross-entropy in one pass over 16-byte packs]): the
// forward's online log-sum-exp and the backward's packed gradient. Included by nn.cu inside its anonymous namespace
// (in tg::backend::cuda), after norm_backward.cuh (its Pack16); it includes nothing itself: the includer supplies
// acc_t (nn.cu: using detail::acc_t), scalar_cast and the CUDA built-ins (nn.cu through common.cuh).
// tests/cuda/test_rows_emulated.cpp supplies host versions of them and runs these kernels' bodies, unchanged, on
// the CPU.

// Note [cross-entropy in one pass over 16-byte packs]
// The GPT-2 LM head's logits are the largest tensor of a step (B·T rows of 50257, 1.6 GB in bf16 at B=16,
// T=1024), and the loss reads them in both directions. When the rows are a multiple of 16 bytes apart and
// aligned (the padded vocabulary's 50304 columns are), the forward reads each row once, in 16-byte packs, with
// the running (max, Σ exp) pair of an online softmax (a new maximum rescales the sum), and the backward reads
// packs and writes packs of the gradient, zero past V. The pairs are merged over the block in a fixed order,
// so the result is deterministic; it differs from the two-pass kernel by rounding only. Other row layouts take
// the scalar kernels (nn.cu).

/// (m, s) := the (max, Σ exp(x − max)) pair of the union of the sets behind (m, s) and (om, os). NaN wins.
template <class A>
__device__ __forceinline__ void lse_merge(A& m, A& s, A om, A os) {
  if (om != om) {
    m = om;
    s = os;
  } else if (om == -INFINITY) {
    // adds nothing: its exponentials are zero against any maximum
  } else if (om > m) {  // m = −inf: s is 0 and exp(−inf) = 0
    s = s * exp(m - om) + os;
    m = om;
  } else {
    s += os * exp(om - m);  // m NaN: stays NaN
  }
}

template <class T>
__global__ void cross_entropy_forward_packed_kernel(const T* logits, const std::int64_t* targets, acc_t<T>* lse,
                                                    acc_t<T>* loss, std::int64_t rows, std::int64_t V, std::int64_t ld,
                                                    std::int64_t ignore_index) {
  using A = acc_t<T>;
  constexpr int N = 16 / sizeof(T);
  __shared__ A shm_m[32], shm_s[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const std::int64_t packs = V / N;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * ld;
    const auto* xp = reinterpret_cast<const Pack16<T>*>(xr);
    A m = -INFINITY, s = 0;
    for (std::int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
      const Pack16<T> v = xp[p];
#pragma unroll
      for (int k = 0; k < N; ++k) lse_merge(m, s, scalar_cast<A>(v.v[k]), A(1));
    }
    for (std::int64_t j = packs * N + threadIdx.x; j < V; j += blockDim.x) lse_merge(m, s, scalar_cast<A>(xr[j]), A(1));
    for (int o = 16; o > 0; o >>= 1) {
      const A om = __shfl_xor_sync(0xffffffffu, m, o), os = __shfl_xor_sync(0xffffffffu, s, o);
      lse_merge(m, s, om, os);
    }
    __syncthreads();  // the shared pairs may still be read for the previous row
    if (lane == 0) {
      shm_m[warp] = m;
      shm_s[warp] = s;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      A bm = shm_m[0], bs = shm_s[0];
      for (int q = 1; q < nw; ++q) lse_merge(bm, bs, shm_m[q], shm_s[q]);
      // An infinite maximum: the two-pass kernel and the CPU compute exp(±inf − (±inf)) = NaN there; the
      // running pair would give ±inf. So the row's lse is NaN, as theirs.
      const A l = (bm == A(INFINITY) || bm == A(-INFINITY)) ? A(NAN) : bm + ::log(bs);
      lse[r] = l;
      const std::int64_t t = targets[r];
      loss[r] = t == ignore_index ? A(0) : l - scalar_cast<A>(xr[t]);
    }
  }
}

template <class T>
__global__ void cross_entropy_backward_packed_kernel(const T* logits, const std::int64_t* targets, const acc_t<T>* lse,
                                                     const acc_t<T>* dloss, std::int64_t count, T* dlogits,
                                                     std::int64_t rows, std::int64_t V, std::int64_t ld,
                                                     std::int64_t ld_out, std::int64_t ignore_index) {
  using A = acc_t<T>;
  constexpr int N = 16 / sizeof(T);
  const A scale = static_cast<A>(count ? static_cast<double>(dloss[0]) / static_cast<double>(count) : 0.0);
  const std::int64_t full = V / N, out_packs = ld_out / N;
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * ld;
    const auto* xp = reinterpret_cast<const Pack16<T>*>(xr);
    auto* dp = reinterpret_cast<Pack16<T>*>(dlogits + r * ld_out);
    const std::int64_t t = targets[r];
    const A l = lse[r];
    const bool counted = t != ignore_index;
    for (std::int64_t p = threadIdx.x; p < out_packs; p += blockDim.x) {
      const std::int64_t j0 = p * N;
      Pack16<T> o;
      if (counted && p < full) {
        const Pack16<T> v = xp[p];
#pragma unroll
        for (int k = 0; k < N; ++k)
          o.v[k] = scalar_cast<T>(scale * (exp(scalar_cast<A>(v.v[k]) - l) - (j0 + k == t ? A(1) : A(0))));
      } else {
#pragma unroll
        for (int k = 0; k < N; ++k) {  // the row's last partial pack (read element by element) and the padding
          const std::int64_t j = j0 + k;
          A d = 0;
          if (counted && j < V) d = scale * (exp(scalar_cast<A>(xr[j]) - l) - (j == t ? A(1) : A(0)));
          o.v[k] = scalar_cast<T>(d);
        }
      }
      dp[p] = o;
    }
  }
}

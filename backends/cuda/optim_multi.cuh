// The multi-tensor optimizer kernels (Adam / AdamW with the weight copies, SGD, LAMB), the loss scaler's unscale,
// clipping's sum of squares and rescale, and the step boundary's one-thread kernels (Note [the step boundary on the
// device]). Included by optim.cu inside its anonymous namespace (in tg::backend::cuda, after its using declarations
// of detail::Chunk and detail::kChunk); it includes nothing itself (it sits inside a namespace): the includer
// supplies detail::block_sum, scalar_cast, __any_sync and the other CUDA built-ins (optim.cu through common.cuh).
// tests/cuda/test_optim_emulated.cpp supplies host versions of them and runs these kernels' bodies, unchanged, on
// the CPU.

/// Adam / AdamW over every chunk. kBoundary (Note [the step boundary on the device]): the step is read from
/// the boundary state `s.boundary` instead of `c`: each block resolves it once (skip, lr, the host's bias
/// corrections) and computes the constants as the host does (math::adam_consts_from, each fp64 operation
/// rounded on its own).
template <bool kBoundary>
__global__ void adam_multi_kernel(const AdamTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                  math::AdamConsts<float> c, AdamScalars s) {
  if constexpr (kBoundary) {
    __shared__ math::AdamConsts<float> resolved;
    __shared__ bool go;
    if (threadIdx.x == 0) {
      go = resolve_boundary(s);
      if (go) resolved = math::adam_consts_from<float>(s.lr, s.bc1, s.bc2, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled);
    }
    __syncthreads();
    if (!go) return;
    c = resolved;
  }
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const AdamTensor<float> t = tensors[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      float p = t.p[i], m = t.m[i], v = t.v[i];
      math::adam_update(p, t.g[i], m, v, c);
      t.p[i] = p;
      t.m[i] = m;
      t.v[i] = v;
      // Note [the optimizer writes the weight copies]: the copy's conversion (copy_strided's scalar_cast)
      if (t.copy_type == WeightCopyType::bf16) static_cast<bf16*>(t.copy)[i] = scalar_cast<bf16>(p);
      else if (t.copy_type == WeightCopyType::fp16) static_cast<fp16*>(t.copy)[i] = scalar_cast<fp16>(p);
    }
  }
}

/// g *= inv_scale over every chunk; an inf or NaN sets *found_inf (all write 1). With `state` (Note [the step
/// boundary on the device]) the scale is read from state[kScale] and the flag written to state[kFoundInf].
__global__ void unscale_kernel(float* const* grads, const std::int64_t* sizes, const Chunk* chunks,
                               std::int64_t n_chunks, float inv_scale, int* found_inf, double* state) {
  if (state) inv_scale = static_cast<float>(1.0 / state[kScale]);
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    float* g = grads[chunks[b].tensor];
    const std::int64_t n = sizes[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    bool bad = false;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      const float x = g[i];
      bad = bad || !math::is_finite(x);
      g[i] = x * inv_scale;
    }
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) {  // benign races: all write 1
      if (state) state[kFoundInf] = 1.0;
      else *found_inf = 1;
    }
  }
}

/// Σ x² of each chunk in fp64 (a fixed-order block sum), into partials[b].
__global__ void sum_squares_multi_kernel(const float* const* xs, const std::int64_t* sizes, const Chunk* chunks,
                                         std::int64_t n_chunks, double* partials) {
  __shared__ double shm[32];
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const float* x = xs[chunks[b].tensor];
    const std::int64_t n = sizes[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    double s = 0;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      const double v = static_cast<double>(x[i]);
      s += v * v;
    }
    s = detail::block_sum(s, shm);
    if (threadIdx.x == 0) partials[b] = s;
  }
}

/// x *= s over every chunk. With `state` (Note [the step boundary on the device]) s is the clipping factor
/// state[kCoef], applied when the step is taken and the factor is below 1.
__global__ void scale_multi_kernel(float* const* xs, const std::int64_t* sizes, const Chunk* chunks, std::int64_t n_chunks,
                                   float s, const double* state) {
  if (state) {
    if (state[kSkip] != 0 || !(state[kCoef] < 1.0)) return;
    s = static_cast<float>(state[kCoef]);
  }
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    float* x = xs[chunks[b].tensor];
    const std::int64_t n = sizes[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) x[i] *= s;
  }
}

template <bool kMomentum>
__global__ void sgd_multi_kernel(const SgdTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                 math::SgdConsts<float> c, SgdScalars s) {
  if (s.boundary) {  // Note [the step boundary on the device]: skip and lr from the state
    if (!resolve_boundary(s)) return;
    c.lr = static_cast<float>(s.lr);
  }
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const SgdTensor<float> t = tensors[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      float p = t.p[i], buf = kMomentum ? t.buf[i] : 0.f;
      math::sgd_update(p, t.g[i], buf, c);
      t.p[i] = p;
      if constexpr (kMomentum) t.buf[i] = buf;
    }
  }
}

/// LAMB's constants of a launch with the device boundary (Note [the step boundary on the device]): thread 0
/// resolves skip, lr and the bias corrections from the state once per block; false on every thread when the
/// step is skipped.
__device__ inline bool lamb_resolve_block(LambScalars& s, math::LambConsts<float>& c) {
  __shared__ math::LambConsts<float> resolved;
  __shared__ bool go;
  if (threadIdx.x == 0) {
    go = resolve_boundary(s);
    if (go) resolved = math::lamb_consts_from<float>(s.bc1, s.bc2, s.beta1, s.beta2, s.eps, s.weight_decay);
  }
  __syncthreads();
  if (!go) return false;
  c = resolved;
  return true;
}

/// LAMB pass 1 over every chunk: m, v updated; the chunk's sums of p² and u² into partials[2 b], [2 b + 1]
/// (a block-shape-fixed order: deterministic). kBoundary: the constants from the state, not `c`.
template <bool kBoundary>
__global__ void lamb_moments_multi_kernel(const LambTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                          math::LambConsts<float> c, LambScalars s, double* partials) {
  if constexpr (kBoundary)
    if (!lamb_resolve_block(s, c)) return;
  __shared__ double shm[32];
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {  // uniform over the block
    const LambTensor<float> t = tensors[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    double pn = 0, un = 0;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      const float p = t.p[i];
      float m = t.m[i], v = t.v[i];
      math::lamb_moments(t.g[i], m, v, c);
      t.m[i] = m;
      t.v[i] = v;
      const float u = math::lamb_direction(p, m, v, c);
      pn += static_cast<double>(p) * static_cast<double>(p);
      un += static_cast<double>(u) * static_cast<double>(u);
    }
    pn = detail::block_sum(pn, shm);
    un = detail::block_sum(un, shm);
    if (threadIdx.x == 0) {
      partials[2 * b] = pn;
      partials[2 * b + 1] = un;
    }
  }
}
/// LAMB's trust ratios, one thread per tensor: tensor t's chunks [first[t], first[t + 1]) add their partial
/// sums in chunk order (detail::sum_by_tensor's order, from 0), then ratio = ||p|| / ||u|| (lamb_trust_ratio)
/// and scales[t] = float(lr · ratio), the CPU kernel's `scale`; ratios[t] = ratio when ratios is set. With
/// s.boundary, lr is the state's and a skipped step writes nothing.
__global__ void lamb_trust_kernel(const std::int64_t* first, int count, const double* partials, LambScalars s, float* scales,
                                  double* ratios) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count) return;
  if (!resolve_boundary(s)) return;
  double pn = 0, un = 0;
  for (std::int64_t b = first[t]; b < first[t + 1]; ++b) {
    pn += partials[2 * b];
    un += partials[2 * b + 1];
  }
  const double trust = lamb_trust_ratio(pn, un);
  scales[t] = static_cast<float>(s.lr * trust);
  if (ratios) ratios[t] = trust;
}
/// LAMB pass 2: p -= scales[tensor]·u, scales[t] = lr·trust_t rounded to fp32 (the CPU kernel's `scale`).
template <bool kBoundary>
__global__ void lamb_apply_multi_kernel(const LambTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                        math::LambConsts<float> c, LambScalars s, const float* scales) {
  if constexpr (kBoundary)
    if (!lamb_resolve_block(s, c)) return;
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const LambTensor<float> t = tensors[chunks[b].tensor];
    const float scale = scales[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x)
      t.p[i] = t.p[i] - scale * math::lamb_direction(t.p[i], t.m[i], t.v[i], c);
  }
}

// ---- the step boundary on the device (Note [the step boundary on the device]) ----------------------------
__global__ void boundary_begin_kernel(double* state, float* loss_factor, const BoundaryStart* start) {
  boundary_begin_values(state, loss_factor, *start);  // the start in memory on the device (Note [graph blockers])
}

__global__ void boundary_note_loss_kernel(double* state, const float* loss, double n) {
  const double v = static_cast<double>(*loss);
  state[kLoss] += v / n;
  if (!boundary_finite(v) && state[kBadLoss] == 0) {
    state[kBadLoss] = 1;
    state[kBadLossValue] = v;
  }
}

/// The chunks' partial sums added in chunk order (sum_squares_multi's host loop), into the state.
__global__ void boundary_total_kernel(const double* partials, std::int64_t n, double* state) {
  double total = 0;
  for (std::int64_t i = 0; i < n; ++i) total += partials[i];
  state[kSumSquares] = total;
}

__global__ void boundary_decide_kernel(double* state, BoundaryRule rule) { boundary_decide_values(state, rule); }

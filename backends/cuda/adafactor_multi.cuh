// The multi-tensor Adafactor kernels (adafactor_step_multi's seven launches; the launcher is in
// optim_tensor.cu). Included by optim_tensor.cu inside its anonymous namespace (in tg::backend::cuda, after its
// using declarations of detail::Chunk and detail::kChunk); it includes nothing itself: the includer supplies
// detail::block_sum, detail::owner_of, TG_GRID_STRIDE and the CUDA built-ins (optim_tensor.cu through
// common.cuh). tests/cuda/test_optim_emulated.cpp supplies host versions of them and runs these kernels'
// bodies, unchanged, on the CPU.

// ---- Adafactor (adafactor_step_multi; the per-tensor forms are one-tensor calls) ------------------------------
// Items of all tensors are numbered in one range per launch (detail::prefix_starts; a tensor without items
// of that kind has an empty share) and each block or thread finds its tensor with detail::owner_of. The
// formulas are backends/cpu/optim.cpp's: fp64 row and column sums of g² + eps1, V̂ = R_i·(1/ΣR)·C_j in fp32,
// U = g / sqrt(V̂) (math::adafactor_u), fp64 sums of U² and X² for the step size and clipping, and the
// element functions math::adafactor_moment / adafactor_update.

/// The second-moment estimate of element k: factored R_i C_j / sum R, or the full v[k].
struct SecondMoment {
  const float* r;
  const float* c;
  const float* v;
  std::int64_t cols;
  float inv_total;
  __device__ float at(std::int64_t k) const { return v ? v[k] : (r[k / cols] * inv_total) * c[k % cols]; }
};

/// With the device boundary's state (Note [the step boundary on the device]): false when the step is skipped,
/// else β̂2_t from the state into b2.
__device__ inline bool adafactor_beta2_of(const double* state, double& b2) {
  if (!state) return true;
  if (state[kSkip] != 0) return false;
  b2 = state[kBiasCorrection1];
  return true;
}

/// Global row `row` of the factored tensors (one block per row, grid-stride over rows).
__global__ void adafactor_rows_multi_kernel(const AdafactorTensor<float>* tensors, int count, const std::int64_t* row_starts,
                                            double b2, double eps1, const double* state) {
  if (!adafactor_beta2_of(state, b2)) return;
  __shared__ double shm[32];
  const std::int64_t total = row_starts[count];
  for (std::int64_t row = blockIdx.x; row < total; row += gridDim.x) {  // uniform over the block
    const int t = detail::owner_of(row_starts, count, row);
    const AdafactorTensor<float> x = tensors[t];
    const std::int64_t i = row - row_starts[t];
    const float* gi = x.g + i * x.cols;
    double acc = 0;
    for (std::int64_t j = threadIdx.x; j < x.cols; j += blockDim.x) acc += static_cast<double>(gi[j]) * gi[j] + eps1;
    acc = detail::block_sum(acc, shm);
    if (threadIdx.x == 0) x.r[i] = static_cast<float>(b2 * static_cast<double>(x.r[i]) + (1.0 - b2) * acc);
  }
}
/// Global column `col` of the factored tensors (one thread per column, rows in order).
__global__ void adafactor_cols_multi_kernel(const AdafactorTensor<float>* tensors, int count, const std::int64_t* col_starts,
                                            double b2, double eps1, const double* state) {
  if (!adafactor_beta2_of(state, b2)) return;
  TG_GRID_STRIDE(col, col_starts[count]) {
    const int t = detail::owner_of(col_starts, count, col);
    const AdafactorTensor<float> x = tensors[t];
    const std::int64_t j = col - col_starts[t];
    double acc = 0;
    for (std::int64_t i = 0; i < x.rows; ++i) {
      const double gij = x.g[i * x.cols + j];
      acc += gij * gij + eps1;
    }
    x.c[j] = static_cast<float>(b2 * static_cast<double>(x.c[j]) + (1.0 - b2) * acc);
  }
}
/// The full second moments, over the chunks of the full tensors.
__global__ void adafactor_full_moment_multi_kernel(const AdafactorTensor<float>* tensors, const Chunk* chunks,
                                                   std::int64_t n_chunks, float b2, float one_b2, float eps1, const double* state) {
  if (state) {  // the host's float(β̂2_t) and float(1 − β̂2_t), from the state's β̂2_t
    double beta2 = 0;
    if (!adafactor_beta2_of(state, beta2)) return;
    b2 = static_cast<float>(beta2);
    one_b2 = static_cast<float>(1.0 - beta2);
  }
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const AdafactorTensor<float> x = tensors[chunks[b].tensor];
    const std::int64_t n = x.rows * x.cols, end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    for (std::int64_t k = chunks[b].start + threadIdx.x; k < end; k += blockDim.x)
      x.v[k] = math::adafactor_moment(x.v[k], x.g[k], b2, one_b2, eps1);
  }
}
/// inv_total[t] = 1 / sum of tensor t's row statistics, summed in row order in fp64 (one thread per tensor,
/// the CPU's order); 1 for a full tensor (unused there).
__global__ void adafactor_row_totals_kernel(const AdafactorTensor<float>* tensors, int count, float* inv_total) {
  const int t = static_cast<int>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count) return;
  const AdafactorTensor<float> x = tensors[t];
  if (!x.r) {
    inv_total[t] = 1.f;
    return;
  }
  double total = 0;
  for (std::int64_t i = 0; i < x.rows; ++i) total += static_cast<double>(x.r[i]);
  inv_total[t] = static_cast<float>(1.0 / total);
}
__device__ SecondMoment second_moment_of(const AdafactorTensor<float>& x, float inv_total) {
  return {x.r, x.c, x.v, x.cols, inv_total};
}
/// Per-chunk sums of U² and X² into partials[2 b], [2 b + 1] (fixed block shape: deterministic).
__global__ void adafactor_norms_multi_kernel(const AdafactorTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                             const float* inv_total, double* partials, const double* state) {
  if (state && state[kSkip] != 0) return;
  __shared__ double shm[32];
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {  // uniform over the block
    const int t = chunks[b].tensor;
    const AdafactorTensor<float> x = tensors[t];
    const SecondMoment sm = second_moment_of(x, inv_total[t]);
    const std::int64_t n = x.rows * x.cols, end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    double u_sq = 0, p_sq = 0;
    for (std::int64_t k = chunks[b].start + threadIdx.x; k < end; k += blockDim.x) {
      const float u = math::adafactor_u(x.g[k], sm.at(k));
      u_sq += static_cast<double>(u) * u;
      p_sq += static_cast<double>(x.p[k]) * x.p[k];
    }
    u_sq = detail::block_sum(u_sq, shm);
    p_sq = detail::block_sum(p_sq, shm);
    if (threadIdx.x == 0) {
      partials[2 * b] = u_sq;
      partials[2 * b + 1] = p_sq;
    }
  }
}
/// Each tensor's step size alpha[t] and 1 / clipping divisor inv_clip[t], one thread per tensor: its chunks
/// [first[t], first[t + 1]) add their sums of U² and X² in chunk order (detail::sum_by_tensor's order, from 0),
/// then adafactor_apply, as the host computed them; nothing is read back. With s.boundary, ρ and β̂2_t are
/// the state's and a skipped step writes nothing.
__global__ void adafactor_scales_kernel(const AdafactorTensor<float>* tensors, const std::int64_t* first, int count,
                                        const double* partials, AdafactorScalars s, float* alpha, float* inv_clip) {
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= count) return;
  if (!resolve_boundary(s)) return;
  const std::int64_t n = tensors[t].rows * tensors[t].cols;
  if (n == 0) {
    alpha[t] = 0.f;
    inv_clip[t] = 1.f;
    return;
  }
  double u_sq = 0, p_sq = 0;
  for (std::int64_t b = first[t]; b < first[t + 1]; ++b) {
    u_sq += partials[2 * b];
    p_sq += partials[2 * b + 1];
  }
  const AdafactorApply a = adafactor_apply(s, u_sq, p_sq, n);
  alpha[t] = static_cast<float>(a.alpha);
  inv_clip[t] = static_cast<float>(1.0 / a.clip_div);
}
/// The update (math::adafactor_update) with tensor t's step size alpha[t] and clipping 1 / clip_div as
/// inv_clip[t]; `c` holds the rest (its alpha and inv_clip are replaced per tensor).
__global__ void adafactor_apply_multi_kernel(const AdafactorTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                             const float* inv_total, const float* alpha, const float* inv_clip,
                                             math::AdafactorConsts<float> c, const double* state) {
  if (state && state[kSkip] != 0) return;
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const int t = chunks[b].tensor;
    const AdafactorTensor<float> x = tensors[t];
    const SecondMoment sm = second_moment_of(x, inv_total[t]);
    math::AdafactorConsts<float> ct = c;
    ct.alpha = alpha[t];
    ct.inv_clip = inv_clip[t];
    const std::int64_t n = x.rows * x.cols, end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    for (std::int64_t k = chunks[b].start + threadIdx.x; k < end; k += blockDim.x)
      math::adafactor_update(x.p[k], x.g[k], sm.at(k), x.m ? x.m + k : nullptr, ct);  // no m: no first moment
  }
}

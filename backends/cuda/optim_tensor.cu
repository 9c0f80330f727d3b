// Per-tensor SGD, LAMB and Adafactor kernels, declared once for both devices (detail/kernels/optim.hpp),
// so an optimizer dispatches them with TG_BACKEND like any op kernel, and the multi-tensor Adafactor step
// (the per-tensor Adafactor forms are its one-tensor case). The element math is shared with the CPU
// loops (math::sgd_update, math::lamb_moments / lamb_direction; the Adafactor formula is written out as in
// backends/cpu/optim.cpp), and so are the per-tensor scalars (LAMB's trust ratio, Adafactor's step size and
// clipping: lamb_trust_ratio, adafactor_apply). Reductions are deterministic: each block writes its fp64 partial
// sum, added in block order: by the host for the per-tensor LAMB step (one read-back: it returns the ratio), by
// one thread per tensor on the device for the multi-tensor Adafactor step (no read-back).
#include <array>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/cuda/multi_tensor.hpp"

namespace tg::backend::cuda {

namespace {

using detail::Chunk;
using detail::kChunk;

constexpr unsigned kMaxReduceBlocks = 1024;

unsigned reduce_blocks(std::int64_t n) { return std::min<unsigned>(detail::grid_for(n), kMaxReduceBlocks); }

/// Sums `k` interleaved fp64 partials per block (partials[b * k + j]) in block order on the host.
template <int K>
std::array<double, K> sum_partials(const detail::Workspace& ws, unsigned blocks) {
  std::vector<double> host(static_cast<std::size_t>(blocks) * K);
  detail::download(host.data(), ws.as<double>(), static_cast<std::int64_t>(host.size()));
  std::array<double, K> out{};
  for (unsigned b = 0; b < blocks; ++b)
    for (int j = 0; j < K; ++j) out[j] += host[static_cast<std::size_t>(b) * K + j];
  return out;
}

// ---- SGD ---------------------------------------------------------------------------------------------------
template <bool kMomentum>
__global__ void sgd_kernel(float* p, const float* g, float* buf, std::int64_t n, math::SgdConsts<float> c) {
  TG_GRID_STRIDE(i, n) {
    float pi = p[i], b = kMomentum ? buf[i] : 0.f;
    math::sgd_update(pi, g[i], b, c);
    p[i] = pi;
    if constexpr (kMomentum) buf[i] = b;
  }
}

// ---- LAMB --------------------------------------------------------------------------------------------------
/// Pass 1: m, v updated; per-block sums of p² and u² (u = lamb_direction) into partials[2 b], [2 b + 1].
__global__ void lamb_moments_kernel(const float* p, const float* g, float* m, float* v, std::int64_t n,
                                    math::LambConsts<float> c, double* partials) {
  __shared__ double shm[32];
  double pn = 0, un = 0;
  TG_GRID_STRIDE(i, n) {
    float mi = m[i], vi = v[i];
    math::lamb_moments(g[i], mi, vi, c);
    m[i] = mi;
    v[i] = vi;
    const float u = math::lamb_direction(p[i], mi, vi, c);
    pn += static_cast<double>(p[i]) * static_cast<double>(p[i]);
    un += static_cast<double>(u) * static_cast<double>(u);
  }
  pn = detail::block_sum(pn, shm);
  un = detail::block_sum(un, shm);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = pn;
    partials[2 * blockIdx.x + 1] = un;
  }
}
__global__ void lamb_apply_kernel(float* p, const float* m, const float* v, std::int64_t n, math::LambConsts<float> c,
                                  float scale) {
  TG_GRID_STRIDE(i, n) p[i] = p[i] - scale * math::lamb_direction(p[i], m[i], v[i], c);
}

#include "adafactor_multi.cuh"

}  // namespace

template <class T>
void sgd_step(T* p, const T* g, T* buf, std::int64_t n, const SgdScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::sgd_step: fp32 masters only");
  if (n <= 0) return;
  const auto c = math::sgd_consts<float>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
  if (c.use_mom) sgd_kernel<true><<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(p, g, buf, n, c);
  else sgd_kernel<false><<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(p, g, nullptr, n, c);
  TG_CUDA_LAUNCHED();
}

template <class T>
double lamb_step(T* p, const T* g, T* m, T* v, std::int64_t n, const LambScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::lamb_step: fp32 masters only");
  if (n <= 0) return 1.0;
  const auto c = math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  const unsigned blocks = reduce_blocks(n);
  detail::Workspace partials(static_cast<std::size_t>(blocks) * 2 * sizeof(double));
  lamb_moments_kernel<<<blocks, detail::kThreads, 0, detail::stream()>>>(p, g, m, v, n, c, partials.as<double>());
  TG_CUDA_LAUNCHED();
  const auto sums = sum_partials<2>(partials, blocks);
  const double trust = lamb_trust_ratio(sums[0], sums[1]);
  lamb_apply_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(p, m, v, n, c, static_cast<float>(s.lr * trust));
  TG_CUDA_LAUNCHED();
  return trust;
}

template <class T>
void adafactor_step_factored(T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,
                             const AdafactorScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adafactor_step_factored: fp32 masters only");
  if (rows <= 0 || cols <= 0) return;
  const AdafactorTensor<float> t{p, g, r, c, nullptr, m, rows, cols};
  adafactor_step_multi(&t, 1, s);
}

template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adafactor_step_full: fp32 masters only");
  if (n <= 0) return;
  const AdafactorTensor<float> t{p, g, nullptr, nullptr, v, m, 1, n};
  adafactor_step_multi(&t, 1, s);
}

template <class T>
void adafactor_step_multi(const AdafactorTensor<T>* tensors, int count, const AdafactorScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adafactor_step_multi: fp32 masters only");
  if (count <= 0) return;
  const auto n = static_cast<std::size_t>(count);
  std::vector<std::int64_t> rows(n, 0), cols(n, 0), full(n, 0), all(n, 0);
  std::int64_t max_cols = 1;
  for (std::size_t t = 0; t < n; ++t) {
    const AdafactorTensor<float>& x = tensors[t];
    TG_CHECK(x.rows >= 0 && x.cols >= 0, "adafactor_step_multi: tensor ", t, " has shape [", x.rows, ", ", x.cols, "]");
    TG_CHECK((x.v != nullptr) != (x.r != nullptr && x.c != nullptr) && (x.r == nullptr) == (x.c == nullptr),
             "adafactor_step_multi: tensor ", t, " must have either r and c (factored) or v (full)");
    all[t] = x.rows * x.cols;
    if (x.v) {
      full[t] = all[t];
    } else if (all[t] > 0) {
      rows[t] = x.rows;
      cols[t] = x.cols;
      max_cols = std::max(max_cols, x.cols);
    }
  }
  const std::vector<Chunk> chunks = detail::chunk_table(count, all.data());
  if (chunks.empty()) return;
  const std::vector<Chunk> full_chunks = detail::chunk_table(count, full.data());
  const std::vector<std::int64_t> row_starts = detail::prefix_starts(count, rows.data()),
                                  col_starts = detail::prefix_starts(count, cols.data());
  const auto n_chunks = static_cast<std::int64_t>(chunks.size()), n_full = static_cast<std::int64_t>(full_chunks.size());
  detail::Workspace wt(n * sizeof(AdafactorTensor<float>)), wr((n + 1) * sizeof(std::int64_t)), wc((n + 1) * sizeof(std::int64_t)),
      wch(chunks.size() * sizeof(Chunk)), wfull(full_chunks.size() * sizeof(Chunk)), wtot(n * sizeof(float)),
      wp(chunks.size() * 2 * sizeof(double)), wa(n * sizeof(float)), wi(n * sizeof(float)), wf((n + 1) * sizeof(std::int64_t));
  const AdafactorTensor<float>* dt = detail::upload(wt, tensors, count);
  const std::int64_t* drows = detail::upload(wr, row_starts.data(), count + 1);
  const std::int64_t* dcols = detail::upload(wc, col_starts.data(), count + 1);
  const Chunk* dch = detail::upload(wch, chunks.data(), n_chunks);
  const Chunk* dfull = detail::upload(wfull, full_chunks.data(), n_full);
  const unsigned max_blocks = 65535u * 4u;
  const double* state = s.boundary;  // Note [the step boundary on the device]: skip and β̂2_t read there
  if (row_starts.back() > 0) {
    adafactor_rows_multi_kernel<<<static_cast<unsigned>(std::min<std::int64_t>(row_starts.back(), max_blocks)),
                                  detail::row_threads(max_cols), 0, detail::stream()>>>(dt, count, drows, s.beta2, s.eps1, state);
    TG_CUDA_LAUNCHED();
    adafactor_cols_multi_kernel<<<detail::grid_for(col_starts.back()), detail::kThreads, 0, detail::stream()>>>(
        dt, count, dcols, s.beta2, s.eps1, state);
    TG_CUDA_LAUNCHED();
  }
  if (n_full > 0) {
    adafactor_full_moment_multi_kernel<<<static_cast<unsigned>(std::min<std::int64_t>(n_full, max_blocks)), detail::kThreads,
                                         0, detail::stream()>>>(dt, dfull, n_full, static_cast<float>(s.beta2),
                                                                static_cast<float>(1.0 - s.beta2), static_cast<float>(s.eps1), state);
    TG_CUDA_LAUNCHED();
  }
  adafactor_row_totals_kernel<<<static_cast<unsigned>((n + 127) / 128), 128, 0, detail::stream()>>>(dt, count, wtot.as<float>());
  TG_CUDA_LAUNCHED();
  const unsigned chunk_blocks = static_cast<unsigned>(std::min<std::int64_t>(n_chunks, max_blocks));
  adafactor_norms_multi_kernel<<<chunk_blocks, detail::kThreads, 0, detail::stream()>>>(dt, dch, n_chunks, wtot.as<float>(),
                                                                                         wp.as<double>(), state);
  TG_CUDA_LAUNCHED();
  // the step sizes on the device, in the stream's order: nothing is read back
  const std::vector<std::int64_t> first = detail::chunk_firsts(chunks, count);
  const std::int64_t* dfirst = detail::upload(wf, first.data(), static_cast<std::int64_t>(first.size()));
  adafactor_scales_kernel<<<static_cast<unsigned>((n + detail::kThreads - 1) / detail::kThreads), detail::kThreads, 0, detail::stream()>>>(
      dt, dfirst, count, wp.as<double>(), s, wa.as<float>(), wi.as<float>());
  TG_CUDA_LAUNCHED();
  adafactor_apply_multi_kernel<<<chunk_blocks, detail::kThreads, 0, detail::stream()>>>(
      dt, dch, n_chunks, wtot.as<float>(), wa.as<float>(), wi.as<float>(), math::adafactor_consts<float>(0.0, 1.0, s.weight_decay, s.beta1),
      state);
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_OPTIM, TG_FP32_TYPES)
template void adafactor_step_multi<float>(const AdafactorTensor<float>*, int, const AdafactorScalars&);

}  // namespace tg::backend::cuda

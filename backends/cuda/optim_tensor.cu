// Per-tensor SGD, LAMB and Adafactor kernels with the CPU backend's signatures (detail/cpu/optim_kernels.hpp),
// so an optimizer dispatches them with TG_BACKEND like any op kernel. The element math is shared with the CPU
// loops (math::sgd_update, math::lamb_moments / lamb_direction; the Adafactor formula is written out as in
// backends/cpu/optim.cpp), and the host-side scalars (LAMB's trust ratio, Adafactor's step size and clipping)
// are the CPU's functions. Reductions are deterministic: each block writes its fp64 partial sum, and the host
// adds the partials in block order (the read-back synchronizes, as the CPU's ratio needs the sums anyway).
#include <array>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

namespace {

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

// ---- Adafactor ---------------------------------------------------------------------------------------------
/// Row i (one block): r[i] = beta2 r[i] + (1 - beta2) sum_j (g_ij² + eps1).
__global__ void adafactor_rows_kernel(const float* g, float* r, std::int64_t cols, double b2, double eps1) {
  __shared__ double shm[32];
  const float* gi = g + static_cast<std::int64_t>(blockIdx.x) * cols;
  double acc = 0;
  for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) acc += static_cast<double>(gi[j]) * gi[j] + eps1;
  acc = detail::block_sum(acc, shm);
  if (threadIdx.x == 0) r[blockIdx.x] = static_cast<float>(b2 * static_cast<double>(r[blockIdx.x]) + (1.0 - b2) * acc);
}
/// Column j (one thread; consecutive threads read consecutive columns of a row): c[j] likewise.
__global__ void adafactor_cols_kernel(const float* g, float* c, std::int64_t rows, std::int64_t cols, double b2,
                                      double eps1) {
  TG_GRID_STRIDE(j, cols) {
    double acc = 0;
    for (std::int64_t i = 0; i < rows; ++i) {
      const double x = g[i * cols + j];
      acc += x * x + eps1;
    }
    c[j] = static_cast<float>(b2 * static_cast<double>(c[j]) + (1.0 - b2) * acc);
  }
}
/// The second-moment estimate of element k: factored R_i C_j / sum R, or the full v[k].
struct SecondMoment {
  const float* r;
  const float* c;
  const float* v;
  std::int64_t cols;
  float inv_total;
  __device__ float at(std::int64_t k) const { return v ? v[k] : (r[k / cols] * inv_total) * c[k % cols]; }
};
/// Per-block sums of U² (U = g / sqrt(V̂)) and X² into partials[2 b], [2 b + 1].
__global__ void adafactor_norms_kernel(const float* p, const float* g, SecondMoment sm, std::int64_t n,
                                       double* partials) {
  __shared__ double shm[32];
  double u_sq = 0, p_sq = 0;
  TG_GRID_STRIDE(k, n) {
    const float u = g[k] / sqrtf(sm.at(k));
    u_sq += static_cast<double>(u) * u;
    p_sq += static_cast<double>(p[k]) * p[k];
  }
  u_sq = detail::block_sum(u_sq, shm);
  p_sq = detail::block_sum(p_sq, shm);
  if (threadIdx.x == 0) {
    partials[2 * blockIdx.x] = u_sq;
    partials[2 * blockIdx.x + 1] = p_sq;
  }
}
__global__ void adafactor_apply_kernel(float* p, const float* g, SecondMoment sm, float* m, std::int64_t n, float alpha,
                                       float inv_clip, float wd, float b1, float one_b1) {
  TG_GRID_STRIDE(k, n) {
    float upd = g[k] / sqrtf(sm.at(k)) * inv_clip;
    if (m) upd = m[k] = b1 * m[k] + one_b1 * upd;
    p[k] = p[k] - alpha * wd * p[k] - alpha * upd;
  }
}
/// The full second moment's update: v = beta2 v + (1 - beta2) (g² + eps1).
__global__ void adafactor_full_moment_kernel(const float* g, float* v, std::int64_t n, float b2, float one_b2, float eps1) {
  TG_GRID_STRIDE(k, n) v[k] = b2 * v[k] + one_b2 * (g[k] * g[k] + eps1);
}

/// Norms, then the update (the shared tail of both Adafactor forms).
void adafactor_finish(float* p, const float* g, const SecondMoment& sm, float* m, std::int64_t n,
                      const AdafactorScalars& s) {
  const unsigned blocks = reduce_blocks(n);
  detail::Workspace partials(static_cast<std::size_t>(blocks) * 2 * sizeof(double));
  adafactor_norms_kernel<<<blocks, detail::kThreads, 0, detail::stream()>>>(p, g, sm, n, partials.as<double>());
  TG_CUDA_LAUNCHED();
  const auto sums = sum_partials<2>(partials, blocks);
  const cpu::AdafactorApply a = cpu::adafactor_apply(s, sums[0], sums[1], n);
  const bool use_m = s.beta1 != 0.0 && m != nullptr;
  adafactor_apply_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(
      p, g, sm, use_m ? m : nullptr, n, static_cast<float>(a.alpha), static_cast<float>(1.0 / a.clip_div),
      static_cast<float>(s.weight_decay), static_cast<float>(s.beta1), static_cast<float>(1.0 - s.beta1));
  TG_CUDA_LAUNCHED();
}

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
  const double trust = cpu::lamb_trust_ratio(sums[0], sums[1]);
  lamb_apply_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(p, m, v, n, c, static_cast<float>(s.lr * trust));
  TG_CUDA_LAUNCHED();
  return trust;
}

template <class T>
void adafactor_step_factored(T* p, const T* g, T* r, T* c, T* m, std::int64_t rows, std::int64_t cols,
                             const AdafactorScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adafactor_step_factored: fp32 masters only");
  if (rows <= 0 || cols <= 0) return;
  adafactor_rows_kernel<<<static_cast<unsigned>(rows), detail::row_threads(cols), 0, detail::stream()>>>(g, r, cols, s.beta2, s.eps1);
  TG_CUDA_LAUNCHED();
  adafactor_cols_kernel<<<detail::grid_for(cols), detail::kThreads, 0, detail::stream()>>>(g, c, rows, cols, s.beta2, s.eps1);
  TG_CUDA_LAUNCHED();
  // sum R on the host, in row order (rows are few: one per output feature).
  std::vector<float> r_host(static_cast<std::size_t>(rows));
  detail::download(r_host.data(), r, static_cast<std::int64_t>(r_host.size()));
  double r_total = 0;
  for (float x : r_host) r_total += static_cast<double>(x);
  const SecondMoment sm{r, c, nullptr, cols, static_cast<float>(1.0 / r_total)};
  adafactor_finish(p, g, sm, m, rows * cols, s);
}

template <class T>
void adafactor_step_full(T* p, const T* g, T* v, T* m, std::int64_t n, const AdafactorScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adafactor_step_full: fp32 masters only");
  if (n <= 0) return;
  adafactor_full_moment_kernel<<<detail::grid_for(n), detail::kThreads, 0, detail::stream()>>>(
      g, v, n, static_cast<float>(s.beta2), static_cast<float>(1.0 - s.beta2), static_cast<float>(s.eps1));
  TG_CUDA_LAUNCHED();
  const SecondMoment sm{nullptr, nullptr, v, 1, 1.f};
  adafactor_finish(p, g, sm, m, n, s);
}

template void sgd_step<float>(float*, const float*, float*, std::int64_t, const SgdScalars&);
template double lamb_step<float>(float*, const float*, float*, float*, std::int64_t, const LambScalars&);
template void adafactor_step_factored<float>(float*, const float*, float*, float*, float*, std::int64_t, std::int64_t,
                                             const AdafactorScalars&);
template void adafactor_step_full<float>(float*, const float*, float*, float*, std::int64_t, const AdafactorScalars&);

}  // namespace tg::backend::cuda

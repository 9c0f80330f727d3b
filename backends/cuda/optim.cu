// Multi-tensor optimizer kernels (declared once for both devices in detail/kernels/optim.hpp) and the loss
// scaler's unscale: one launch for every parameter of a group. The host
// cuts each tensor into kChunk-element chunks and uploads a (tensor, start) table (detail/cuda/
// multi_tensor.hpp, CPU-tested); block b handles chunk b. The element math is detail/math.hpp's
// (math::adam_update, sgd_update, lamb_moments / lamb_direction), the bodies of the CPU's loops.
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "typegrad/detail/cuda/kernels.hpp"
#include "typegrad/detail/cuda/multi_tensor.hpp"

namespace tg::backend::cuda {

namespace {

using detail::Chunk;
using detail::chunk_table;
using detail::kChunk;

// ---- kernels --------------------------------------------------------------------------------------------
__global__ void adam_multi_kernel(const AdamTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                  math::AdamConsts<float> c) {
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

__global__ void unscale_kernel(float* const* grads, const std::int64_t* sizes, const Chunk* chunks,
                               std::int64_t n_chunks, float inv_scale, int* found_inf) {
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
    if (__any_sync(0xffffffffu, bad) && (threadIdx.x & 31) == 0) *found_inf = 1;  // benign race: all write 1
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

__global__ void scale_multi_kernel(float* const* xs, const std::int64_t* sizes, const Chunk* chunks, std::int64_t n_chunks,
                                   float s) {
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    float* x = xs[chunks[b].tensor];
    const std::int64_t n = sizes[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < n ? chunks[b].start + kChunk : n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) x[i] *= s;
  }
}

template <bool kMomentum>
__global__ void sgd_multi_kernel(const SgdTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                 math::SgdConsts<float> c) {
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

/// LAMB pass 1 over every chunk: m, v updated; the chunk's sums of p² and u² into partials[2 b], [2 b + 1]
/// (a block-shape-fixed order: deterministic).
__global__ void lamb_moments_multi_kernel(const LambTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                          math::LambConsts<float> c, double* partials) {
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
/// LAMB pass 2: p -= scales[tensor]·u, scales[t] = lr·trust_t rounded to fp32 (the CPU kernel's `scale`).
__global__ void lamb_apply_multi_kernel(const LambTensor<float>* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                        math::LambConsts<float> c, const float* scales) {
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const LambTensor<float> t = tensors[chunks[b].tensor];
    const float scale = scales[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x)
      t.p[i] = t.p[i] - scale * math::lamb_direction(t.p[i], t.m[i], t.v[i], c);
  }
}

unsigned blocks_for(std::size_t chunks) { return static_cast<unsigned>(std::min<std::size_t>(chunks, 65535u * 4u)); }

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------------
template <class T>
void adam_step_multi(const AdamTensor<T>* tensors, int count, const AdamScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::adam_step_multi: fp32 masters only");
  if (count <= 0) return;
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(count));
  for (int t = 0; t < count; ++t) sizes[static_cast<std::size_t>(t)] = tensors[t].n;
  const std::vector<Chunk> chunks = chunk_table(count, sizes.data());
  if (chunks.empty()) return;
  detail::Workspace wt(static_cast<std::size_t>(count) * sizeof(AdamTensor<float>)), wc(chunks.size() * sizeof(Chunk));
  const AdamTensor<float>* dt = detail::upload(wt, tensors, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), static_cast<std::int64_t>(chunks.size()));
  adam_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(
      dt, dc, static_cast<std::int64_t>(chunks.size()),
      math::adam_consts<float>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step));
  TG_CUDA_LAUNCHED();
}

template <class T>
void sgd_step_multi(const SgdTensor<T>* tensors, int count, const SgdScalars& s) {
  static_assert(std::is_same_v<T, float>, "cuda::sgd_step_multi: fp32 masters only");
  if (count <= 0) return;
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(count));
  for (int t = 0; t < count; ++t) sizes[static_cast<std::size_t>(t)] = tensors[t].n;
  const std::vector<Chunk> chunks = chunk_table(count, sizes.data());
  if (chunks.empty()) return;
  const auto c = math::sgd_consts<float>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
  if (c.use_mom)
    for (int t = 0; t < count; ++t)
      TG_CHECK(tensors[t].buf != nullptr || tensors[t].n == 0, "sgd_step_multi: tensor ", t,
               " has no momentum buffer, and momentum is ", s.momentum);
  detail::Workspace wt(static_cast<std::size_t>(count) * sizeof(SgdTensor<float>)), wc(chunks.size() * sizeof(Chunk));
  const SgdTensor<float>* dt = detail::upload(wt, tensors, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), static_cast<std::int64_t>(chunks.size()));
  const auto n_chunks = static_cast<std::int64_t>(chunks.size());
  if (c.use_mom) sgd_multi_kernel<true><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c);
  else sgd_multi_kernel<false><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c);
  TG_CUDA_LAUNCHED();
}

template <class T>
void lamb_step_multi(const LambTensor<T>* tensors, int count, const LambScalars& s, double* trust_ratios) {
  static_assert(std::is_same_v<T, float>, "cuda::lamb_step_multi: fp32 masters only");
  if (count <= 0) return;
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(count));
  for (int t = 0; t < count; ++t) sizes[static_cast<std::size_t>(t)] = tensors[t].n;
  const std::vector<Chunk> chunks = chunk_table(count, sizes.data());
  const auto n_chunks = static_cast<std::int64_t>(chunks.size());
  std::vector<double> partials(chunks.size() * 2);
  const auto c = math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  detail::Workspace wt(static_cast<std::size_t>(count) * sizeof(LambTensor<float>)), wc(chunks.size() * sizeof(Chunk)),
      wp(partials.size() * sizeof(double)), ws(static_cast<std::size_t>(count) * sizeof(float));
  const LambTensor<float>* dt = detail::upload(wt, tensors, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), n_chunks);
  if (n_chunks > 0) {
    lamb_moments_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, wp.as<double>());
    TG_CUDA_LAUNCHED();
    detail::download(partials.data(), wp.as<double>(), static_cast<std::int64_t>(partials.size()));
  }
  const auto sums = detail::sum_by_tensor<2>(chunks, partials.data(), count);
  std::vector<float> scales(static_cast<std::size_t>(count));
  for (std::size_t t = 0; t < sums.size(); ++t) {
    const double trust = lamb_trust_ratio(sums[t][0], sums[t][1]);
    scales[t] = static_cast<float>(s.lr * trust);
    if (trust_ratios) trust_ratios[t] = trust;
  }
  if (n_chunks == 0) return;
  const float* dscales = detail::upload(ws, scales.data(), count);
  lamb_apply_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, dscales);
  TG_CUDA_LAUNCHED();
}

bool unscale_and_check(float* const* grads, const std::int64_t* sizes, int count, float inv_scale) {
  if (count <= 0) return false;
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  if (chunks.empty()) return false;
  detail::Workspace wg(static_cast<std::size_t>(count) * sizeof(float*)),
      ws(static_cast<std::size_t>(count) * sizeof(std::int64_t)), wc(chunks.size() * sizeof(Chunk)), wf(sizeof(int));
  float* const* dg = detail::upload(wg, grads, count);
  const std::int64_t* ds = detail::upload(ws, sizes, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), static_cast<std::int64_t>(chunks.size()));
  TG_CUDA_CHECK(cudaMemsetAsync(wf.as<int>(), 0, sizeof(int), detail::stream()));
  unscale_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dg, ds, dc, static_cast<std::int64_t>(chunks.size()),
                                                                  inv_scale, wf.as<int>());
  TG_CUDA_LAUNCHED();
  int found = 0;
  detail::download(&found, wf.as<int>(), 1);
  return found != 0;
}

double sum_squares_multi(const float* const* xs, const std::int64_t* sizes, int count) {
  if (count <= 0) return 0.0;
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  if (chunks.empty()) return 0.0;
  const auto n_chunks = static_cast<std::int64_t>(chunks.size());
  detail::Workspace wx(static_cast<std::size_t>(count) * sizeof(float*)), ws(static_cast<std::size_t>(count) * sizeof(std::int64_t)),
      wc(chunks.size() * sizeof(Chunk)), wp(chunks.size() * sizeof(double));
  const float* const* dx = detail::upload(wx, xs, count);
  const std::int64_t* ds = detail::upload(ws, sizes, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), n_chunks);
  sum_squares_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dx, ds, dc, n_chunks, wp.as<double>());
  TG_CUDA_LAUNCHED();
  std::vector<double> partials(chunks.size());
  detail::download(partials.data(), wp.as<double>(), n_chunks);
  double total = 0;  // chunk order: tensor order, then position
  for (double p : partials) total += p;
  return total;
}

void scale_multi(float* const* xs, const std::int64_t* sizes, int count, float s) {
  if (count <= 0) return;
  const std::vector<Chunk> chunks = chunk_table(count, sizes);
  if (chunks.empty()) return;
  const auto n_chunks = static_cast<std::int64_t>(chunks.size());
  detail::Workspace wx(static_cast<std::size_t>(count) * sizeof(float*)), ws(static_cast<std::size_t>(count) * sizeof(std::int64_t)),
      wc(chunks.size() * sizeof(Chunk));
  float* const* dx = detail::upload(wx, xs, count);
  const std::int64_t* ds = detail::upload(ws, sizes, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), n_chunks);
  scale_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dx, ds, dc, n_chunks, s);
  TG_CUDA_LAUNCHED();
}

// adafactor_step_multi is in optim_tensor.cu, next to the per-tensor Adafactor kernels it generalizes.
template void adam_step_multi<float>(const AdamTensor<float>*, int, const AdamScalars&);
template void sgd_step_multi<float>(const SgdTensor<float>*, int, const SgdScalars&);
template void lamb_step_multi<float>(const LambTensor<float>*, int, const LambScalars&, double*);

}  // namespace tg::backend::cuda

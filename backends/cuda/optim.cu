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

// ---- the step boundary on the device (Note [the step boundary on the device]) ----------------------------
__global__ void boundary_begin_kernel(double* state, float* loss_factor, BoundaryStart start) {
  boundary_begin_values(state, loss_factor, start);
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
  if (s.boundary)  // Note [the step boundary on the device]: skip, lr and t read on the device
    adam_multi_kernel<true><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(
        dt, dc, static_cast<std::int64_t>(chunks.size()), math::AdamConsts<float>{}, s);
  else
    adam_multi_kernel<false><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(
        dt, dc, static_cast<std::int64_t>(chunks.size()),
        math::adam_consts<float>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step), s);
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
  if (c.use_mom) sgd_multi_kernel<true><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s);
  else sgd_multi_kernel<false><<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s);
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
                                                                  inv_scale, wf.as<int>(), nullptr);
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
  scale_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads, 0, detail::stream()>>>(dx, ds, dc, n_chunks, s, nullptr);
  TG_CUDA_LAUNCHED();
}

// ---- the device boundary's launchers (Note [the step boundary on the device]) -----------------------------
namespace {
/// The chunk table of `count` gradients and their pointer and size arrays, uploaded.
struct GradTables {
  std::vector<Chunk> chunks;
  detail::Workspace wg, ws, wc;
  float* const* grads = nullptr;
  const std::int64_t* sizes = nullptr;
  const Chunk* table = nullptr;
  GradTables(const float* const* g, const std::int64_t* n, int count)
      : chunks(chunk_table(count, n)),
        wg(static_cast<std::size_t>(count) * sizeof(float*)),
        ws(static_cast<std::size_t>(count) * sizeof(std::int64_t)),
        wc(std::max<std::size_t>(chunks.size(), 1) * sizeof(Chunk)) {
    grads = detail::upload(wg, const_cast<float* const*>(g), count);
    sizes = detail::upload(ws, n, count);
    if (!chunks.empty()) table = detail::upload(wc, chunks.data(), static_cast<std::int64_t>(chunks.size()));
  }
  std::int64_t n_chunks() const { return static_cast<std::int64_t>(chunks.size()); }
};
}  // namespace

template <class T>
void boundary_begin(double* state, T* loss_factor, const BoundaryStart& start) {
  boundary_begin_kernel<<<1, 1, 0, detail::stream()>>>(state, loss_factor, start);
  TG_CUDA_LAUNCHED();
}
template <class T>
void boundary_note_loss(double* state, const T* loss, double n) {
  boundary_note_loss_kernel<<<1, 1, 0, detail::stream()>>>(state, loss, n);
  TG_CUDA_LAUNCHED();
}
template <class T>
void boundary_unscale(T* const* grads, const std::int64_t* sizes, int count, double* state) {
  if (count <= 0) return;
  const GradTables t(grads, sizes, count);
  if (t.chunks.empty()) return;
  unscale_kernel<<<blocks_for(t.chunks.size()), detail::kThreads, 0, detail::stream()>>>(t.grads, t.sizes, t.table, t.n_chunks(),
                                                                                        1.f, nullptr, state);
  TG_CUDA_LAUNCHED();
}
template <class T>
void boundary_sum_squares(const T* const* grads, const std::int64_t* sizes, int count, double* state) {
  if (count <= 0) {  // no gradient: Σ g² = 0
    boundary_total_kernel<<<1, 1, 0, detail::stream()>>>(nullptr, 0, state);
    TG_CUDA_LAUNCHED();
    return;
  }
  const GradTables t(grads, sizes, count);
  detail::Workspace wp(std::max<std::size_t>(t.chunks.size(), 1) * sizeof(double));
  if (!t.chunks.empty()) {
    sum_squares_multi_kernel<<<blocks_for(t.chunks.size()), detail::kThreads, 0, detail::stream()>>>(t.grads, t.sizes, t.table,
                                                                                                    t.n_chunks(), wp.as<double>());
    TG_CUDA_LAUNCHED();
  }
  boundary_total_kernel<<<1, 1, 0, detail::stream()>>>(wp.as<double>(), t.n_chunks(), state);
  TG_CUDA_LAUNCHED();
}
template <class T>
void boundary_decide(double* state, const BoundaryRule& rule) {
  boundary_decide_kernel<<<1, 1, 0, detail::stream()>>>(state, rule);
  TG_CUDA_LAUNCHED();
}
template <class T>
void boundary_clip(T* const* grads, const std::int64_t* sizes, int count, const double* state) {
  if (count <= 0) return;
  const GradTables t(grads, sizes, count);
  if (t.chunks.empty()) return;
  scale_multi_kernel<<<blocks_for(t.chunks.size()), detail::kThreads, 0, detail::stream()>>>(t.grads, t.sizes, t.table, t.n_chunks(),
                                                                                            1.f, state);
  TG_CUDA_LAUNCHED();
}
TG_INSTANTIATE_KERNELS(TG_KERNELS_BOUNDARY, TG_FP32_TYPES)

// adafactor_step_multi is in optim_tensor.cu, next to the per-tensor Adafactor kernels it generalizes.
template void adam_step_multi<float>(const AdamTensor<float>*, int, const AdamScalars&);
template void sgd_step_multi<float>(const SgdTensor<float>*, int, const SgdScalars&);
template void lamb_step_multi<float>(const LambTensor<float>*, int, const LambScalars&, double*);

}  // namespace tg::backend::cuda

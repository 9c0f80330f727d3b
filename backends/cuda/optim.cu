// Multi-tensor optimizer and loss-scaler kernels: one launch for every parameter of a group. The host
// cuts each tensor into kChunk-element chunks and uploads a (tensor, start) table; block b handles chunk b.
// The element math is math::adam_update (detail/math.hpp), the body of the CPU's Adam loop.
#include <vector>

#include "common.cuh"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

namespace {

constexpr std::int64_t kChunk = std::int64_t{1} << 16;

struct Chunk {
  std::int32_t tensor;
  std::int64_t start;
};

// ---- kernels --------------------------------------------------------------------------------------------
__global__ void adam_multi_kernel(const AdamTensor* tensors, const Chunk* chunks, std::int64_t n_chunks,
                                  math::AdamConsts<float> c) {
  for (std::int64_t b = blockIdx.x; b < n_chunks; b += gridDim.x) {
    const AdamTensor t = tensors[chunks[b].tensor];
    const std::int64_t end = chunks[b].start + kChunk < t.n ? chunks[b].start + kChunk : t.n;
    for (std::int64_t i = chunks[b].start + threadIdx.x; i < end; i += blockDim.x) {
      float p = t.p[i], m = t.m[i], v = t.v[i];
      math::adam_update(p, t.g[i], m, v, c);
      t.p[i] = p;
      t.m[i] = m;
      t.v[i] = v;
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

std::vector<Chunk> chunk_table(int count, const std::int64_t* sizes) {
  std::vector<Chunk> out;
  for (int t = 0; t < count; ++t)
    for (std::int64_t s = 0; s < sizes[t]; s += kChunk) out.push_back({t, s});
  return out;
}

unsigned blocks_for(std::size_t chunks) { return static_cast<unsigned>(std::min<std::size_t>(chunks, 65535u * 4u)); }

}  // namespace

// ---- launchers ------------------------------------------------------------------------------------------
void adam_step_multi(const AdamTensor* tensors, int count, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool decoupled, long long step) {
  if (count <= 0) return;
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(count));
  for (int t = 0; t < count; ++t) sizes[static_cast<std::size_t>(t)] = tensors[t].n;
  const std::vector<Chunk> chunks = chunk_table(count, sizes.data());
  if (chunks.empty()) return;
  detail::Workspace wt(static_cast<std::size_t>(count) * sizeof(AdamTensor)), wc(chunks.size() * sizeof(Chunk));
  const AdamTensor* dt = detail::upload(wt, tensors, count);
  const Chunk* dc = detail::upload(wc, chunks.data(), static_cast<std::int64_t>(chunks.size()));
  adam_multi_kernel<<<blocks_for(chunks.size()), detail::kThreads>>>(
      dt, dc, static_cast<std::int64_t>(chunks.size()),
      math::adam_consts<float>(lr, beta1, beta2, eps, weight_decay, decoupled, step));
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
  TG_CUDA_CHECK(cudaMemsetAsync(wf.as<int>(), 0, sizeof(int)));
  unscale_kernel<<<blocks_for(chunks.size()), detail::kThreads>>>(dg, ds, dc, static_cast<std::int64_t>(chunks.size()),
                                                                  inv_scale, wf.as<int>());
  TG_CUDA_LAUNCHED();
  int found = 0;
  TG_CUDA_CHECK(cudaMemcpy(&found, wf.as<int>(), sizeof(int), cudaMemcpyDeviceToHost));
  return found != 0;
}

}  // namespace tg::backend::cuda

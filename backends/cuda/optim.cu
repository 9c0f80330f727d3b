// Multi-tensor optimizer kernels (declared once for both devices in detail/kernels/optim.hpp) and the loss
// scaler's unscale: one launch for every parameter of a group. The host
// cuts each tensor into kChunk-element chunks and uploads a (tensor, start) table (detail/cuda/
// multi_tensor.hpp, CPU-tested); block b handles chunk b. The element math is detail/math.hpp's
// (math::adam_update, sgd_update, lamb_moments / lamb_direction), the bodies of the CPU's loops. The kernels are in
// optim_multi.cuh, which tests/cuda/test_optim_emulated.cpp also compiles as host code; the launchers are here.
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
#include "optim_multi.cuh"

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
  const std::vector<std::int64_t> first = detail::chunk_firsts(chunks, count);  // tensor t: chunks [first[t], first[t + 1])
  // Without a boundary the constants are the host's; with one each block resolves them (Note [the step boundary on the device])
  const auto c = s.boundary ? math::LambConsts<float>{} : math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  detail::Workspace wt(static_cast<std::size_t>(count) * sizeof(LambTensor<float>)), wc(std::max<std::size_t>(chunks.size(), 1) * sizeof(Chunk)),
      wf(first.size() * sizeof(std::int64_t)), wp(std::max<std::size_t>(chunks.size(), 1) * 2 * sizeof(double)),
      ws(static_cast<std::size_t>(count) * sizeof(float));
  const LambTensor<float>* dt = detail::upload(wt, tensors, count);
  const Chunk* dc = n_chunks > 0 ? detail::upload(wc, chunks.data(), n_chunks) : nullptr;
  const std::int64_t* df = detail::upload(wf, first.data(), static_cast<std::int64_t>(first.size()));
  const unsigned grid = blocks_for(chunks.size());
  if (n_chunks > 0) {
    if (s.boundary) lamb_moments_multi_kernel<true><<<grid, detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s, wp.as<double>());
    else lamb_moments_multi_kernel<false><<<grid, detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s, wp.as<double>());
    TG_CUDA_LAUNCHED();
  }
  // the ratios on the device, in the stream's order: nothing is read back (Note [LAMB on the device], optim/lamb.hpp)
  lamb_trust_kernel<<<static_cast<unsigned>((count + detail::kThreads - 1) / detail::kThreads), detail::kThreads, 0, detail::stream()>>>(
      df, count, wp.as<double>(), s, ws.as<float>(), trust_ratios);
  TG_CUDA_LAUNCHED();
  if (n_chunks == 0) return;
  if (s.boundary) lamb_apply_multi_kernel<true><<<grid, detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s, ws.as<float>());
  else lamb_apply_multi_kernel<false><<<grid, detail::kThreads, 0, detail::stream()>>>(dt, dc, n_chunks, c, s, ws.as<float>());
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
void boundary_begin(double* state, T* loss_factor, const BoundaryStart* start) {
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

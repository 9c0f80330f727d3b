// Row kernels of the nn ops on the GPU: softmax / log_softmax, layernorm / rmsnorm (forward and backward),
// embedding, cross-entropy. One block per row of a contiguous [rows, n] block (a warp per row for the norms'
// forward over rows of whole 16-byte packs: norm_forward.cuh; their backward: Note [one-pass norm backward] in
// norm_backward.cuh), math in accum_t<T> (fp32 for 16-bit storage) with the CPU kernels' formulas
// (backends/cpu/nn.cpp); block reductions in a fixed order. Column sums (dweight, dbias, embedding rows) are
// two-pass or per-row loops without atomics, so every result is deterministic. Kernels first (the norms' backward
// and the packed cross-entropy in norm_backward.cuh and cross_entropy_packed.cuh, which
// tests/cuda/test_rows_emulated.cpp also runs on the CPU; softmax and scale_masked_softmax in softmax_kernels.cuh,
// the one-block-per-row norm forward in add_layernorm_rows.cuh, which tests/cuda/test_softmax_emulated.cpp runs),
// launchers after.
#include <atomic>

#include "common.cuh"
#include "norm_forward.cuh"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

using detail::acc_t;
using detail::kThreads;

namespace {

constexpr unsigned kMaxRowBlocks = 65535u * 8u;

/// The current device's streaming multiprocessors (queried once per device).
int sm_count() {
  static std::atomic<int> cached[64] = {};
  int dev = 0;
  TG_CUDA_CHECK(cudaGetDevice(&dev));
  const bool cache = dev >= 0 && dev < 64;  // higher ordinals ask every time
  if (cache)
    if (const int n = cached[dev].load(std::memory_order_relaxed); n > 0) return n;
  int n = 0;
  TG_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
  if (cache) cached[dev].store(n, std::memory_order_relaxed);
  return n;
}
unsigned row_blocks(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, kMaxRowBlocks)); }

// The softmax kernels and the fused scale, mask and softmax (Note [fused scale, mask and softmax]).
#include "softmax_kernels.cuh"

// ---- layernorm / rmsnorm ---------------------------------------------------------------------------------
// The one-block-per-row forward (next to add_layernorm.cu's fused add + LayerNorm, which must equal it bit for bit).
#include "add_layernorm_rows.cuh"

/// dx = rstd·(g − mean(g) − x̂·mean(g∘x̂)), g = dy∘w (no mean(g) term for RMSNorm).
template <class T>
__global__ void norm_backward_dx_kernel(const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy,
                                        T* dx, std::int64_t rows, std::int64_t n) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = x + r * n;
    const T* gr = dy + r * n;
    const A mu = mean ? mean[r] : A(0), rs = rstd[r];
    A mg = 0, mgx = 0;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A xh = (scalar_cast<A>(xr[j]) - mu) * rs;
      const A g = scalar_cast<A>(gr[j]) * scalar_cast<A>(w[j]);
      mg += g;
      mgx += g * xh;
    }
    mg = mean ? detail::block_sum(mg, shm) / static_cast<A>(n) : A(0);
    mgx = detail::block_sum(mgx, shm) / static_cast<A>(n);
    T* dr = dx + r * n;
    for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
      const A xh = (scalar_cast<A>(xr[j]) - mu) * rs;
      const A g = scalar_cast<A>(gr[j]) * scalar_cast<A>(w[j]);
      dr[j] = scalar_cast<T>(rs * (g - mg - xh * mgx));
    }
  }
}

// The one-pass backward (Note [one-pass norm backward]) and the dweight / dbias column sums.
#include "norm_backward.cuh"

// ---- embedding ---------------------------------------------------------------------------------------------
template <class T>
__global__ void embedding_forward_kernel(const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C) {
  TG_GRID_STRIDE(t, n * C) {
    const std::int64_t i = t / C, j = t % C;
    out[t] = w[idx[i] * C + j];
  }
}
// The device sort of the positions by id and the row sums (Note [embedding rows sorted on the device]).
#include "embedding_order.cuh"

// ---- cross-entropy -------------------------------------------------------------------------------------------
template <class T>
__global__ void cross_entropy_forward_kernel(const T* logits, const std::int64_t* targets, acc_t<T>* lse,
                                             acc_t<T>* loss, std::int64_t rows, std::int64_t V, std::int64_t ld,
                                             std::int64_t ignore_index) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * ld;
    const A m = row_max<A>(xr, V, shm);
    A s = 0;
    for (std::int64_t j = threadIdx.x; j < V; j += blockDim.x) s += exp(scalar_cast<A>(xr[j]) - m);
    s = detail::block_sum(s, shm);
    if (threadIdx.x == 0) {
      const A l = m + ::log(s);
      lse[r] = l;
      const std::int64_t t = targets[r];
      loss[r] = t == ignore_index ? A(0) : l - scalar_cast<A>(xr[t]);
    }
  }
}

// The packed forward and backward (Note [cross-entropy in one pass over 16-byte packs]).
#include "cross_entropy_packed.cuh"

/// loss[0] = (Σ_r row_loss[r] over counted rows, fp64, a fixed order: each thread sums a strided share, then
/// the block sums the shares) / count: one block, so the mean is written without a read-back.
template <class T>
__global__ void cross_entropy_mean_kernel(const acc_t<T>* row_loss, const std::int64_t* targets, acc_t<T>* loss,
                                          std::int64_t rows, std::int64_t ignore_index, std::int64_t count) {
  __shared__ double shm[32];
  double s = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x)
    if (targets[r] != ignore_index) s += static_cast<double>(row_loss[r]);
  s = detail::block_sum(s, shm);
  if (threadIdx.x == 0) loss[0] = static_cast<acc_t<T>>(count ? s / static_cast<double>(count) : ::nan(""));
}

template <class T>
__global__ void cross_entropy_backward_kernel(const T* logits, const std::int64_t* targets, const acc_t<T>* lse,
                                              const acc_t<T>* dloss, std::int64_t count, T* dlogits,
                                              std::int64_t rows, std::int64_t V, std::int64_t ld, std::int64_t ld_out,
                                              std::int64_t ignore_index) {
  using A = acc_t<T>;
  // the CPU's scale: the upstream gradient over the count in fp64, rounded once
  const A scale = static_cast<A>(count ? static_cast<double>(dloss[0]) / static_cast<double>(count) : 0.0);
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * ld;
    T* dr = dlogits + r * ld_out;
    const std::int64_t t = targets[r];
    const A l = lse[r];
    for (std::int64_t j = threadIdx.x; j < ld_out; j += blockDim.x) {  // columns [V, ld_out): the padding, zero
      A d = 0;
      if (t != ignore_index && j < V) d = scale * (exp(scalar_cast<A>(xr[j]) - l) - (j == t ? A(1) : A(0)));
      dr[j] = scalar_cast<T>(d);
    }
  }
}

}  // namespace

/// Rows of `ld` elements from `p` that are whole 16-byte packs, aligned: the packed kernels' layout.
template <class T>
bool packed_rows(const T* p, std::int64_t ld) {
  constexpr std::int64_t N = 16 / sizeof(T);
  return ld % N == 0 && reinterpret_cast<std::uintptr_t>(p) % 16 == 0;
}

// ---- launchers ------------------------------------------------------------------------------------------
template <class T>
void softmax_forward(const T* x, T* y, std::int64_t rows, std::int64_t n, bool log) {
  if (rows * n == 0) return;
  softmax_forward_kernel<T><<<row_blocks(rows), detail::row_threads(n), 0, detail::stream()>>>(x, y, rows, n, log);
  TG_CUDA_LAUNCHED();
}

template <class T>
void softmax_backward(const T* y, const T* dy, T* dx, std::int64_t rows, std::int64_t n, bool log) {
  if (rows * n == 0) return;
  softmax_backward_kernel<T><<<row_blocks(rows), detail::row_threads(n), 0, detail::stream()>>>(y, dy, dx, rows, n, log);
  TG_CUDA_LAUNCHED();
}

namespace {
struct RowGeometry {
  std::int64_t n, rows, ms;
  detail::Geo g;
};
RowGeometry row_geometry(const std::uint8_t* mask, const Shape& sm, const Shape& shape) {
  const int rank = shape.size();
  RowGeometry rg{rank ? shape[rank - 1] : 1, 0, mask && rank ? sm[rank - 1] : 0, {}};
  rg.rows = rg.n ? shape.numel() / rg.n : 0;
  if (mask) rg.g = detail::make_geo(shape, sm);
  return rg;
}
}  // namespace

template <class T>
void scale_masked_softmax_forward(const T* x, const T* scale, bool divide, const std::uint8_t* mask, const Shape& sm, T fill,
                                  T* y, const Shape& shape) {
  const RowGeometry rg = row_geometry(mask, sm, shape);
  if (rg.rows * rg.n == 0) return;
  const int how = scale ? (divide ? 2 : 1) : 0;
  scale_masked_softmax_forward_kernel<T><<<row_blocks(rg.rows), detail::row_threads(rg.n), 0, detail::stream()>>>(
      x, scale, how, mask, rg.g, rg.ms, fill, y, rg.rows, rg.n);
  TG_CUDA_LAUNCHED();
}

template <class T>
void scale_masked_softmax_backward(const T* y, const T* dy, const T* scale, bool divide, const std::uint8_t* mask, const Shape& sm,
                                   T* dx, const Shape& shape) {
  const RowGeometry rg = row_geometry(mask, sm, shape);
  if (rg.rows * rg.n == 0) return;
  const int how = scale ? (divide ? 2 : 1) : 0;
  scale_masked_softmax_backward_kernel<T><<<row_blocks(rg.rows), detail::row_threads(rg.n), 0, detail::stream()>>>(
      y, dy, scale, how, mask, rg.g, rg.ms, dx, rg.rows, rg.n);
  TG_CUDA_LAUNCHED();
}

template <class T>
void layernorm_forward(const T* x, const T* w, const T* b, T* y, accum_t<T>* mean, accum_t<T>* rstd,
                       std::int64_t rows, std::int64_t n, double eps) {
  if (rows * n == 0) return;
  if (detail::norm_rows_in_packs<T>(n, {x, w, b, y})) {  // Note [norm forward in packs]
    detail::launch_norm_forward_packed<T, false>(x, nullptr, true, w, b, nullptr, y, mean, rstd, rows, n, eps);
    return;
  }
  norm_forward_kernel<T><<<row_blocks(rows), detail::row_threads(n), 0, detail::stream()>>>(x, w, b, y, mean, rstd, rows, n,
                                                                       static_cast<acc_t<T>>(eps));
  TG_CUDA_LAUNCHED();
}

template <class T>
void rmsnorm_forward(const T* x, const T* w, T* y, accum_t<T>* rstd, std::int64_t rows, std::int64_t n, double eps) {
  if (rows * n == 0) return;
  if (detail::norm_rows_in_packs<T>(n, {x, w, y})) {  // Note [norm forward in packs]
    detail::launch_norm_forward_packed<T, false>(x, nullptr, true, w, nullptr, nullptr, y, nullptr, rstd, rows, n, eps);
    return;
  }
  norm_forward_kernel<T><<<row_blocks(rows), detail::row_threads(n), 0, detail::stream()>>>(x, w, nullptr, y, nullptr, rstd, rows, n,
                                                                       static_cast<acc_t<T>>(eps));
  TG_CUDA_LAUNCHED();
}

template <class T>
void layernorm_backward(const T* x, const T* w, const accum_t<T>* mean, const accum_t<T>* rstd, const T* dy, T* dx,
                        T* dw, T* db, std::int64_t rows, std::int64_t n) {
  using A = acc_t<T>;
  if (n == 0) return;
  // Note [one-pass norm backward]
  constexpr int V = 16 / sizeof(T);
  const std::size_t smem = static_cast<std::size_t>(kNormWarps) * 2 * static_cast<std::size_t>(n) * sizeof(A);
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  if ((dw || db) && rows > 0 && n % V == 0 && smem <= 48 * 1024 && aligned(x) && aligned(w) && aligned(dy) &&
      aligned(dx)) {
    const std::int64_t blocks = std::clamp<std::int64_t>((rows + kNormWarps - 1) / kNormWarps, 1, 4 * sm_count());
    detail::Workspace ws(2 * static_cast<std::size_t>(blocks * n) * sizeof(A));
    A* pw = ws.as<A>();
    A* pb = pw + blocks * n;
    norm_backward_fused_kernel<T><<<static_cast<unsigned>(blocks), 32 * kNormWarps, smem, detail::stream()>>>(
        x, w, mean, rstd, dy, dx, pw, pb, rows, n);
    TG_CUDA_LAUNCHED();
    norm_backward_dwdb_final_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(pw, pb, dw, db, n, blocks);
    TG_CUDA_LAUNCHED();
    return;
  }
  if (dx && rows > 0) {
    norm_backward_dx_kernel<T><<<row_blocks(rows), detail::row_threads(n), 0, detail::stream()>>>(x, w, mean, rstd, dy, dx, rows, n);
    TG_CUDA_LAUNCHED();
  }
  if (dw || db) {
    // chunks of at least 16 rows, enough (chunk, column) items to fill the GPU
    const std::int64_t want = std::max<std::int64_t>(1, (std::int64_t{1} << 17) / n);
    std::int64_t chunks = std::clamp<std::int64_t>(want, 1, std::max<std::int64_t>(1, rows / 16));
    const std::int64_t chunk_len = rows > 0 ? (rows + chunks - 1) / chunks : 1;
    chunks = rows > 0 ? (rows + chunk_len - 1) / chunk_len : 1;
    detail::Workspace ws(2 * static_cast<std::size_t>(chunks * n) * sizeof(A));
    A* pw = ws.as<A>();
    A* pb = pw + chunks * n;
    norm_backward_dwdb_partial_kernel<T><<<detail::grid_for(chunks * n), kThreads, 0, detail::stream()>>>(x, mean, rstd, dy, pw, pb, rows, n,
                                                                                     chunks, chunk_len);
    TG_CUDA_LAUNCHED();
    norm_backward_dwdb_final_kernel<T><<<detail::grid_for(n), kThreads, 0, detail::stream()>>>(pw, pb, dw, db, n, chunks);
    TG_CUDA_LAUNCHED();
  }
}

template <class T>
void embedding_forward(const T* w, const std::int64_t* idx, T* out, std::int64_t n, std::int64_t C) {
  if (n * C == 0) return;
  detail::Workspace wi(static_cast<std::size_t>(n) * sizeof(std::int64_t));
  const std::int64_t* didx = detail::upload(wi, idx, n);
  embedding_forward_kernel<T><<<detail::grid_for(n * C), kThreads, 0, detail::stream()>>>(w, didx, out, n, C);
  TG_CUDA_LAUNCHED();
}

template <class T>
void embedding_backward(const T* dout, const std::int64_t* idx, T* dw, std::int64_t n, std::int64_t V, std::int64_t C) {
  if (V * C == 0) return;
  TG_CHECK(n < (std::int64_t{1} << 31), "embedding backward on the GPU: ", n, " positions (at most 2^31 - 1)");
  // The positions sorted by id on the device (Note [embedding rows sorted on the device]); the ids uploaded again.
  const std::int64_t chunks = (n + kOrderChunk - 1) / kOrderChunk;
  const std::size_t nb = static_cast<std::size_t>(n) * sizeof(std::int64_t);
  detail::Workspace wi(nb), wk0(nb), wv0(nb), wk1(nb), wv1(nb);
  detail::Workspace wc(static_cast<std::size_t>(kOrderBuckets * chunks) * sizeof(int));
  detail::Workspace ws(static_cast<std::size_t>(V + 1) * sizeof(std::int64_t));
  const std::int64_t* keys = n > 0 ? detail::upload(wi, idx, n) : nullptr;
  const std::int64_t* vals = nullptr;
  std::int64_t* const kout[2] = {wk0.as<std::int64_t>(), wk1.as<std::int64_t>()};
  std::int64_t* const vout[2] = {wv0.as<std::int64_t>(), wv1.as<std::int64_t>()};
  int* const counts = wc.as<int>();
  const int passes = n > 0 ? order_passes(V) : 0;
  for (int p = 0; p < passes; ++p) {
    const int shift = p * kOrderBits;
    order_count_kernel<<<static_cast<unsigned>(chunks), kOrderChunk, 0, detail::stream()>>>(keys, n, shift, counts, chunks);
    TG_CUDA_LAUNCHED();
    order_scan_kernel<<<1, kOrderScanThreads, 0, detail::stream()>>>(counts, kOrderBuckets * chunks);
    TG_CUDA_LAUNCHED();
    order_scatter_kernel<<<static_cast<unsigned>(chunks), kOrderChunk, 0, detail::stream()>>>(
        keys, vals, n, shift, counts, chunks, kout[p % 2], vout[p % 2]);
    TG_CUDA_LAUNCHED();
    keys = kout[p % 2];
    vals = vout[p % 2];
  }
  std::int64_t* const start = ws.as<std::int64_t>();
  order_start_kernel<<<detail::grid_for(V + 1), kThreads, 0, detail::stream()>>>(keys, n, start, V);
  TG_CUDA_LAUNCHED();
  embedding_backward_kernel<T><<<row_blocks(V), detail::row_threads(C), 0, detail::stream()>>>(dout, start, vals, dw, V, C);
  TG_CUDA_LAUNCHED();
}

template <class T>
void cross_entropy_forward(const T* logits, const std::int64_t* targets, accum_t<T>* lse, accum_t<T>* loss,
                           std::int64_t rows, std::int64_t V, std::int64_t ld, std::int64_t ignore_index,
                           std::int64_t count) {
  using A = acc_t<T>;
  if (rows == 0) {
    cross_entropy_mean_kernel<T><<<1, 32, 0, detail::stream()>>>(nullptr, nullptr, loss, 0, ignore_index, 0);  // NaN
    TG_CUDA_LAUNCHED();
    return;
  }
  detail::Workspace wt(static_cast<std::size_t>(rows) * sizeof(std::int64_t)), wl(static_cast<std::size_t>(rows) * sizeof(A));
  const std::int64_t* dt = detail::upload(wt, targets, rows);
  if (packed_rows<T>(logits, ld)) {  // Note [cross-entropy in one pass over 16-byte packs]
    cross_entropy_forward_packed_kernel<T><<<row_blocks(rows), detail::row_threads(V / (16 / sizeof(T)) + 1), 0,
                                             detail::stream()>>>(logits, dt, lse, wl.as<A>(), rows, V, ld, ignore_index);
  } else {
    cross_entropy_forward_kernel<T><<<row_blocks(rows), detail::row_threads(V), 0, detail::stream()>>>(
        logits, dt, lse, wl.as<A>(), rows, V, ld, ignore_index);
  }
  TG_CUDA_LAUNCHED();
  // Note [the loss stays on the device]: the mean is reduced on the GPU; nothing is read back here
  cross_entropy_mean_kernel<T><<<1, 1024, 0, detail::stream()>>>(wl.as<A>(), dt, loss, rows, ignore_index, count);
  TG_CUDA_LAUNCHED();
}

template <class T>
void cross_entropy_backward(const T* logits, const std::int64_t* targets, const accum_t<T>* lse, const accum_t<T>* dloss,
                            std::int64_t count, T* dlogits, std::int64_t rows, std::int64_t V, std::int64_t ld,
                            std::int64_t ld_out, std::int64_t ignore_index) {
  if (rows * ld_out == 0) return;
  detail::Workspace wt(static_cast<std::size_t>(rows) * sizeof(std::int64_t));
  const std::int64_t* dt = detail::upload(wt, targets, rows);
  if (packed_rows<T>(logits, ld) && packed_rows<T>(dlogits, ld_out)) {  // Note [cross-entropy in one pass ...]
    cross_entropy_backward_packed_kernel<T><<<row_blocks(rows), detail::row_threads(ld_out / (16 / sizeof(T))), 0,
                                              detail::stream()>>>(logits, dt, lse, dloss, count, dlogits, rows, V, ld,
                                                                  ld_out, ignore_index);
  } else {
    cross_entropy_backward_kernel<T><<<row_blocks(rows), detail::row_threads(V), 0, detail::stream()>>>(
        logits, dt, lse, dloss, count, dlogits, rows, V, ld, ld_out, ignore_index);
  }
  TG_CUDA_LAUNCHED();
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_NN, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

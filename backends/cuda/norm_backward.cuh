// The one-pass LayerNorm / RMSNorm backward (Note [one-pass norm backward]) and the two column-sum kernels of
// dweight / dbias (the two-kernel path's per-chunk partial sums, and the final sum both paths end with). Included by
// nn.cu inside its anonymous namespace (in tg::backend::cuda); it includes nothing itself (it sits inside a
// namespace): the includer supplies acc_t (nn.cu: using detail::acc_t), detail::warp_sum, scalar_cast,
// TG_GRID_STRIDE and the CUDA built-ins (nn.cu through common.cuh). tests/cuda/test_rows_emulated.cpp supplies host
// versions of them and runs these kernels' bodies, unchanged, on the CPU.

// Note [one-pass norm backward]
// The two-kernel backward (dx per row, then dw / db per column chunk) reads x and dy from memory twice. When
// every row is a whole number of 16-byte packs (n a multiple of 16 / sizeof(T), the pointers 16-byte aligned)
// and a block's four warps can keep per-column sums in shared memory, one kernel does both: a warp per row,
// 16-byte loads, the row's two reductions with warp shuffles, dx written from a second read of the row (which
// the warp has just loaded: cached), and each warp adding dy∘x̂ and dy to its own shared slice of the columns
// (a lane owns the same columns in every row, so no two lanes touch one slot). At the end the block adds its
// warps' slices in warp order into pw[block, :], pb[block, :], which the final kernel sums in block order:
// deterministic for a given grid: the grid is a fixed multiple of the SM count the device reports (a MIG
// slice reports its own), so results repeat run to run on one device configuration, and a 16-byte aligned
// call and a misaligned view of the same values (which takes the two-kernel path) may round dw / db
// differently. Other shapes take the two-kernel path.
template <class T>
struct alignas(16) Pack16 {
  T v[16 / sizeof(T)];
};
constexpr int kNormWarps = 4;
template <class T>
__global__ void norm_backward_fused_kernel(const T* x, const T* w, const acc_t<T>* mean, const acc_t<T>* rstd,
                                           const T* dy, T* dx, acc_t<T>* pw, acc_t<T>* pb, std::int64_t rows,
                                           std::int64_t n) {
  using A = acc_t<T>;
  constexpr int V = 16 / sizeof(T);
  extern __shared__ __align__(16) unsigned char norm_smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const std::int64_t packs = n / V;
  // this warp's sums, column j = p·V + k at k·packs + p (consecutive lanes, consecutive banks)
  A* sw = reinterpret_cast<A*>(norm_smem) + static_cast<std::int64_t>(warp) * 2 * n;
  A* sb = sw + n;
  for (std::int64_t j = lane; j < n; j += 32) sw[j] = sb[j] = A(0);
  __syncwarp();
  const auto* wp = reinterpret_cast<const Pack16<T>*>(w);
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * warps + warp; r < rows;
       r += static_cast<std::int64_t>(gridDim.x) * warps) {
    const auto* xp = reinterpret_cast<const Pack16<T>*>(x + r * n);
    const auto* gp = reinterpret_cast<const Pack16<T>*>(dy + r * n);
    const A mu = mean ? mean[r] : A(0), rs = rstd[r];
    A mg = 0, mgx = 0;
    for (std::int64_t p = lane; p < packs; p += 32) {
      const Pack16<T> xv = xp[p], gv = gp[p], wv = wp[p];
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A xh = (scalar_cast<A>(xv.v[k]) - mu) * rs, d = scalar_cast<A>(gv.v[k]);
        const A g = d * scalar_cast<A>(wv.v[k]);
        mg += g;
        mgx += g * xh;
        sw[k * packs + p] += d * xh;
        sb[k * packs + p] += d;
      }
    }
    mg = mean ? detail::warp_sum(mg) / static_cast<A>(n) : A(0);
    mgx = detail::warp_sum(mgx) / static_cast<A>(n);
    if (!dx) continue;
    auto* dp = reinterpret_cast<Pack16<T>*>(dx + r * n);
    for (std::int64_t p = lane; p < packs; p += 32) {
      const Pack16<T> xv = xp[p], gv = gp[p], wv = wp[p];
      Pack16<T> o;
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const A xh = (scalar_cast<A>(xv.v[k]) - mu) * rs;
        const A g = scalar_cast<A>(gv.v[k]) * scalar_cast<A>(wv.v[k]);
        o.v[k] = scalar_cast<T>(rs * (g - mg - xh * mgx));
      }
      dp[p] = o;
    }
  }
  __syncthreads();
  const A* all = reinterpret_cast<const A*>(norm_smem);
  for (std::int64_t j = threadIdx.x; j < n; j += blockDim.x) {
    const std::int64_t slot = (j % V) * packs + j / V;
    A aw = 0, ab = 0;
    for (int q = 0; q < warps; ++q) {
      aw += all[static_cast<std::int64_t>(q) * 2 * n + slot];
      ab += all[static_cast<std::int64_t>(q) * 2 * n + n + slot];
    }
    pw[static_cast<std::int64_t>(blockIdx.x) * n + j] = aw;
    pb[static_cast<std::int64_t>(blockIdx.x) * n + j] = ab;
  }
}

/// Stage 1 of dw / db: per chunk c of rows, pw[c, j] = Σ dy∘x̂, pb[c, j] = Σ dy.
template <class T>
__global__ void norm_backward_dwdb_partial_kernel(const T* x, const acc_t<T>* mean, const acc_t<T>* rstd, const T* dy,
                                                  acc_t<T>* pw, acc_t<T>* pb, std::int64_t rows, std::int64_t n,
                                                  std::int64_t chunks, std::int64_t chunk_len) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(t, chunks * n) {
    const std::int64_t j = t % n, c = t / n;
    const std::int64_t r0 = c * chunk_len, r1 = r0 + chunk_len < rows ? r0 + chunk_len : rows;
    A aw = 0, ab = 0;
    for (std::int64_t r = r0; r < r1; ++r) {
      const A g = scalar_cast<A>(dy[r * n + j]);
      aw += g * (scalar_cast<A>(x[r * n + j]) - (mean ? mean[r] : A(0))) * rstd[r];
      ab += g;
    }
    pw[t] = aw;
    pb[t] = ab;
  }
}
/// Stage 2: dw[j] = Σ_c pw[c, j], db[j] = Σ_c pb[c, j] in chunk order.
template <class T>
__global__ void norm_backward_dwdb_final_kernel(const acc_t<T>* pw, const acc_t<T>* pb, T* dw, T* db, std::int64_t n,
                                                std::int64_t chunks) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(j, n) {
    A aw = 0, ab = 0;
    for (std::int64_t c = 0; c < chunks; ++c) {
      aw += pw[c * n + j];
      ab += pb[c * n + j];
    }
    if (dw) dw[j] = scalar_cast<T>(aw);
    if (db) db[j] = scalar_cast<T>(ab);
  }
}

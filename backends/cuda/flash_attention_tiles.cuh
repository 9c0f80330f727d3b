// The WMMA attention kernels ("tiles", Note [flash attention on the GPU] in flash_attention.cu): the heads'
// layout, the tile loads and products, and the forward, dK/dV and dQ kernels. Included by flash_attention.cu
// inside its anonymous namespace, after <mma.h>; it includes nothing itself. With TG_MMA_EMULATED defined the
// includer supplies nvcuda::wmma, the shuffles and the barriers on the host: tests/cuda/test_flash_emulated.cpp
// runs these kernels' bodies, unchanged, on the CPU.
using namespace nvcuda;

template <class T>
struct WmmaType;
template <>
struct WmmaType<bf16> {
  using type = __nv_bfloat16;
};
template <>
struct WmmaType<fp16> {
  using type = __half;
};

constexpr int kWarps = 4;               // warps per block; each owns 16 rows of the block's tile
constexpr int kRows = 16 * kWarps;      // rows per block (queries in forward and dQ, keys in dK/dV)

// Note [attention grid]: every attention kernel runs on a 1-D grid of B·H·tiles blocks, tiles = ceil(Tn / kRows),
// numbered tile-fastest within a head: the order in which the hardware ran the former 2-D grid (tiles, B·H), whose
// y dimension bounded B·H by 65535 (more ran the composite). gridDim.x allows 2^31 - 1 blocks.
struct HeadTile {
  std::int64_t head, tile, tiles;
};
/// This block's (head, row tile) and the tiles per head.
__device__ __forceinline__ HeadTile head_tile(std::int64_t Tn) {
  const std::int64_t tiles = (Tn + kRows - 1) / kRows, b = blockIdx.x;
  return {b / tiles, b % tiles, tiles};
}
constexpr int kBlockThreads = 32 * kWarps;

/// Byte offsets into dynamic shared memory, each buffer 128-byte aligned (WMMA needs 32).
constexpr std::size_t align128(std::size_t b) { return (b + 127) / 128 * 128; }

/// Where the heads' rows are: row t of head (b, h) starts at b·batch + h·head + t·row elements from the base
/// pointer (contiguous [B·H, Tn, hs] heads: {Tn·hs, 0, hs} with H = 1; a fused QKV projection's q part:
/// {Tn·3C, hs, 3C}).
struct Heads {
  std::int64_t batch, head, row;
};

__device__ __forceinline__ std::int64_t head_offset(const Heads& l, std::int64_t bh, std::int64_t H) {
  return (bh / H) * l.batch + (bh % H) * l.head;
}

/// Copies rows [r0, r0 + rows) of a head (rows `ld` elements apart) into a [rows, HS] tile (16-byte vectors),
/// zeros past Tn.
template <class T, int HS>
__device__ void load_tile(T* dst, const T* src, std::int64_t ld, std::int64_t r0, int rows, std::int64_t Tn) {
  constexpr int kVec = 16 / sizeof(T);  // elements per 16-byte vector
  constexpr int kPerRow = HS / kVec;
  const int n = rows * kPerRow;
  for (int idx = threadIdx.x; idx < n; idx += blockDim.x) {
    const int r = idx / kPerRow, c = idx % kPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < Tn) v = reinterpret_cast<const uint4*>(src + (r0 + r) * ld)[c];
    reinterpret_cast<uint4*>(dst + r * HS)[c] = v;
  }
}

template <class T>
using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, typename WmmaType<T>::type, wmma::row_major>;
template <class T>
using FragBRow = wmma::fragment<wmma::matrix_b, 16, 16, 16, typename WmmaType<T>::type, wmma::row_major>;
template <class T>
using FragBCol = wmma::fragment<wmma::matrix_b, 16, 16, 16, typename WmmaType<T>::type, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

template <class T>
__device__ const typename WmmaType<T>::type* wp(const T* p) {
  return reinterpret_cast<const typename WmmaType<T>::type*>(p);
}

/// C[16, N] (fp32, row-major, ld ldc) = A[16, HS] · Bᵀ with B [N, HS] row-major: A's 16 rows against N rows
/// of B (N a multiple of 16), both tiles in shared memory with leading dimension HS.
template <class T, int HS, int N>
__device__ void rows_times_rows_t(const T* a, const T* b, float* c, int ldc) {
  FragA<T> fa;
  FragBCol<T> fb;
  FragC fc;
#pragma unroll
  for (int n = 0; n < N / 16; ++n) {
    wmma::fill_fragment(fc, 0.f);
#pragma unroll
    for (int k = 0; k < HS / 16; ++k) {
      wmma::load_matrix_sync(fa, wp(a + k * 16), HS);
      wmma::load_matrix_sync(fb, wp(b + n * 16 * HS + k * 16), HS);  // Bᵀ(k, n) = B[n][k]: column-major
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(c + n * 16, fc, ldc, wmma::mem_row_major);
  }
}

/// C[16, HS] (fp32, row-major, ld HS, in shared memory) += A[16, K] (T, row-major, ld K) · B[K, HS] (T,
/// row-major, ld HS).
template <class T, int HS, int K>
__device__ void accumulate_rows(const T* a, const T* b, float* c) {
  FragA<T> fa;
  FragBRow<T> fb;
  FragC fc;
#pragma unroll
  for (int n = 0; n < HS / 16; ++n) {
    wmma::load_matrix_sync(fc, c + n * 16, HS, wmma::mem_row_major);
#pragma unroll
    for (int k = 0; k < K / 16; ++k) {
      wmma::load_matrix_sync(fa, wp(a + k * 16), K);
      wmma::load_matrix_sync(fb, wp(b + k * 16 * HS + n * 16), HS);
      wmma::mma_sync(fc, fa, fb, fc);
    }
    wmma::store_matrix_sync(c + n * 16, fc, HS, wmma::mem_row_major);
  }
}

// ---- forward ------------------------------------------------------------------------------------------------
template <int HS>
struct FwdSmem {
  static constexpr int kCols = 64;  // keys per step
  static constexpr std::size_t q = 0;
  static constexpr std::size_t k = q + align128(kRows * HS * 2);
  static constexpr std::size_t v = k + align128(kCols * HS * 2);
  static constexpr std::size_t s = v + align128(kCols * HS * 2);
  static constexpr std::size_t p = s + align128(kRows * kCols * 4);
  static constexpr std::size_t o = p + align128(kRows * kCols * 2);
  static constexpr std::size_t stats = o + align128(kRows * HS * 4);  // m, l per row
  static constexpr std::size_t bytes = stats + align128(2 * kRows * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_forward_kernel(const T* q, const T* k, const T* v, Heads in,
                                                                      T* out, Heads io, float* lse, std::int64_t H,
                                                                      std::int64_t Tn, float scale, bool causal) {
  using L = FwdSmem<HS>;
  constexpr int C = L::kCols;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  float* ss = reinterpret_cast<float*>(smem + L::s);
  T* ps = reinterpret_cast<T*>(smem + L::p);
  float* os = reinterpret_cast<float*>(smem + L::o);
  float* ms = reinterpret_cast<float*>(smem + L::stats);
  float* ls = ms + kRows;

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head, q0 = ht.tile * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(qs, q + base, in.row, q0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) os[i] = 0.f;
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
    ms[i] = -INFINITY;
    ls[i] = 0.f;
  }
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  for (std::int64_t k0 = 0; k0 < kend; k0 += C) {
    __syncthreads();  // the previous step's K, V are no longer read
    load_tile<T, HS>(ks, k + base, in.row, k0, C, Tn);
    load_tile<T, HS>(vs, v + base, in.row, k0, C, Tn);
    __syncthreads();
    rows_times_rows_t<T, HS, C>(qs + r0 * HS, ks, ss + r0 * C, C);
    __syncwarp();
    for (int rr = 0; rr < 16; ++rr) {
      const int row = r0 + rr;
      const std::int64_t i = q0 + row;
      float sv[C / 32];
      float mx = -INFINITY;
#pragma unroll
      for (int t = 0; t < C / 32; ++t) {
        const int c = lane + 32 * t;
        const std::int64_t j = k0 + c;
        const bool ok = j < Tn && (!causal || j <= i);
        sv[t] = ok ? ss[row * C + c] * scale : -INFINITY;
        mx = (sv[t] > mx || sv[t] != sv[t]) ? sv[t] : mx;  // NaN wins and stays (fmaxf would drop it)
      }
      mx = detail::warp_max(mx);
      // A NaN score makes the row NaN, as in the composite and on the CPU: with fmaxf a NaN in a row whose
      // other keys are masked gave m_new = -inf, and the row was treated as having no valid key (output 0).
      const float m_old = ms[row], m_new = (mx != mx || m_old != m_old) ? NAN : fmaxf(m_old, mx);
      // a row with no valid key so far (only rows past Tn): keep everything at zero
      const float alpha = m_new == -INFINITY ? 1.f : __expf(m_old - m_new);
      float sum = 0.f;  // of the unrounded values: lse is the exact log-sum-exp, as the composite's
#pragma unroll
      for (int t = 0; t < C / 32; ++t) {
        const float pv = m_new == -INFINITY ? 0.f : __expf(sv[t] - m_new);
        ps[row * C + lane + 32 * t] = scalar_cast<T>(pv);
        sum += pv;
      }
      sum = detail::warp_sum(sum);
#pragma unroll
      for (int c = lane; c < HS; c += 32) os[row * HS + c] *= alpha;
      __syncwarp();
      if (lane == 0) {
        ms[row] = m_new;
        ls[row] = ls[row] * alpha + sum;
      }
    }
    __syncwarp();
    accumulate_rows<T, HS, C>(ps + r0 * C, vs, os + r0 * HS);
    __syncwarp();
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const int row = r0 + rr;
    const std::int64_t i = q0 + row;
    if (i >= Tn) break;
    const float l = ls[row], inv = l > 0.f ? 1.f / l : 0.f;
    for (int c = lane; c < HS; c += 32) out[obase + i * io.row + c] = scalar_cast<T>(os[row * HS + c] * inv);
    if (lane == 0) lse[head * Tn + i] = ms[row] + logf(l);
  }
}

// ---- backward -----------------------------------------------------------------------------------------------
/// D[bh·Tn + t] = Σ_c dout[t, c]·out[t, c] over the rows of every head (layout io), one warp per row.
template <class T>
__global__ void row_dot_kernel(const T* dout, const T* out, Heads io, float* d, std::int64_t H, std::int64_t Tn,
                               std::int64_t rows, int hs) {
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x >> 5);
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
    const std::int64_t off = head_offset(io, r / Tn, H) + (r % Tn) * io.row;
    float s = 0.f;
    for (int c = threadIdx.x & 31; c < hs; c += 32) s += scalar_cast<float>(dout[off + c]) * scalar_cast<float>(out[off + c]);
    s = detail::warp_sum(s);
    if ((threadIdx.x & 31) == 0) d[r] = s;
  }
}

/// dK/dV: one block per (head, 64 keys); query tiles of BQ rows.
template <int HS>
struct DkvSmem {
  static constexpr int kQ = HS == 64 ? 64 : 32;  // queries per step
  static constexpr std::size_t k = 0;
  static constexpr std::size_t v = k + align128(kRows * HS * 2);
  static constexpr std::size_t q = v + align128(kRows * HS * 2);
  static constexpr std::size_t dout = q + align128(kQ * HS * 2);
  static constexpr std::size_t st = dout + align128(kQ * HS * 2);   // Sᵀ [64 keys, kQ] fp32
  static constexpr std::size_t dpt = st + align128(kRows * kQ * 4);  // dPᵀ
  static constexpr std::size_t pt = dpt + align128(kRows * kQ * 4);  // Pᵀ in T
  static constexpr std::size_t dst = pt + align128(kRows * kQ * 2);  // dSᵀ in T
  static constexpr std::size_t dk = dst + align128(kRows * kQ * 2);  // fp32 accumulators
  static constexpr std::size_t dv = dk + align128(kRows * HS * 4);
  static constexpr std::size_t rows = dv + align128(kRows * HS * 4);  // lse, D of the query tile
  static constexpr std::size_t bytes = rows + align128(2 * kQ * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_backward_dkdv_kernel(
    const T* q, const T* k, const T* v, Heads in, const T* dout, Heads io, const float* lse, const float* dvec, T* dk,
    T* dv, std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  using L = DkvSmem<HS>;
  constexpr int Q = L::kQ;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  float* st = reinterpret_cast<float*>(smem + L::st);
  float* dpt = reinterpret_cast<float*>(smem + L::dpt);
  T* pt = reinterpret_cast<T*>(smem + L::pt);
  T* dst = reinterpret_cast<T*>(smem + L::dst);
  float* dks = reinterpret_cast<float*>(smem + L::dk);
  float* dvs = reinterpret_cast<float*>(smem + L::dv);
  float* lses = reinterpret_cast<float*>(smem + L::rows);
  float* ds = lses + Q;

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head, k0 = ht.tile * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(ks, k + base, in.row, k0, kRows, Tn);
  load_tile<T, HS>(vs, v + base, in.row, k0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) dks[i] = dvs[i] = 0.f;
  const std::int64_t qstart = causal ? k0 / Q * Q : 0;
  for (std::int64_t q0 = qstart; q0 < Tn; q0 += Q) {
    __syncthreads();  // the previous step's Q, dO tiles are no longer read
    load_tile<T, HS>(qs, q + base, in.row, q0, Q, Tn);
    load_tile<T, HS>(dos, dout + obase, io.row, q0, Q, Tn);
    for (int i = threadIdx.x; i < Q; i += blockDim.x) {
      const bool inside = q0 + i < Tn;
      lses[i] = inside ? lse[head * Tn + q0 + i] : 0.f;
      ds[i] = inside ? dvec[head * Tn + q0 + i] : 0.f;
    }
    __syncthreads();
    rows_times_rows_t<T, HS, Q>(ks + r0 * HS, qs, st + r0 * Q, Q);     // Sᵀ = K·Qᵀ (unscaled)
    rows_times_rows_t<T, HS, Q>(vs + r0 * HS, dos, dpt + r0 * Q, Q);   // dPᵀ = V·dOᵀ
    __syncwarp();
    for (int e = lane; e < 16 * Q; e += 32) {
      const int rr = e / Q, c = e % Q, row = r0 + rr;
      const std::int64_t j = k0 + row, i = q0 + c;
      const bool ok = i < Tn && j < Tn && (!causal || j <= i);
      const float p = ok ? __expf(st[row * Q + c] * scale - lses[c]) : 0.f;
      const T pr = scalar_cast<T>(p);
      pt[row * Q + c] = pr;
      dst[row * Q + c] = scalar_cast<T>(ok ? scale * scalar_cast<float>(pr) * (dpt[row * Q + c] - ds[c]) : 0.f);
    }
    __syncwarp();
    accumulate_rows<T, HS, Q>(pt + r0 * Q, dos, dvs + r0 * HS);   // dV += Pᵀ·dO
    accumulate_rows<T, HS, Q>(dst + r0 * Q, qs, dks + r0 * HS);   // dK += dSᵀ·Q
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kRows * HS; idx += blockDim.x) {
    const int row = idx / HS;
    if (k0 + row >= Tn) continue;
    dk[base + (k0 + row) * in.row + idx % HS] = scalar_cast<T>(dks[idx]);
    dv[base + (k0 + row) * in.row + idx % HS] = scalar_cast<T>(dvs[idx]);
  }
}

/// dQ: one block per (head, 64 queries); key tiles of 64.
template <int HS>
struct DqSmem {
  static constexpr int kCols = 64;
  static constexpr std::size_t q = 0;
  static constexpr std::size_t dout = q + align128(kRows * HS * 2);
  static constexpr std::size_t k = dout + align128(kRows * HS * 2);
  static constexpr std::size_t v = k + align128(kCols * HS * 2);
  static constexpr std::size_t s = v + align128(kCols * HS * 2);    // S [64 queries, 64 keys] fp32
  static constexpr std::size_t dp = s + align128(kRows * kCols * 4);
  static constexpr std::size_t ds = dp + align128(kRows * kCols * 4);  // dS in T
  static constexpr std::size_t dq = ds + align128(kRows * kCols * 2);
  static constexpr std::size_t rows = dq + align128(kRows * HS * 4);
  static constexpr std::size_t bytes = rows + align128(2 * kRows * 4);
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) flash_backward_dq_kernel(
    const T* q, const T* k, const T* v, Heads in, const T* dout, Heads io, const float* lse, const float* dvec, T* dq,
    std::int64_t H, std::int64_t Tn, float scale, bool causal) {
  using L = DqSmem<HS>;
  constexpr int C = L::kCols;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  float* ss = reinterpret_cast<float*>(smem + L::s);
  float* dps = reinterpret_cast<float*>(smem + L::dp);
  T* dss = reinterpret_cast<T*>(smem + L::ds);
  float* dqs = reinterpret_cast<float*>(smem + L::dq);
  float* lses = reinterpret_cast<float*>(smem + L::rows);
  float* dsum = lses + kRows;

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head, q0 = ht.tile * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = warp * 16;
  load_tile<T, HS>(qs, q + base, in.row, q0, kRows, Tn);
  load_tile<T, HS>(dos, dout + obase, io.row, q0, kRows, Tn);
  for (int i = threadIdx.x; i < kRows * HS; i += blockDim.x) dqs[i] = 0.f;
  for (int i = threadIdx.x; i < kRows; i += blockDim.x) {
    const bool inside = q0 + i < Tn;
    lses[i] = inside ? lse[head * Tn + q0 + i] : 0.f;
    dsum[i] = inside ? dvec[head * Tn + q0 + i] : 0.f;
  }
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  for (std::int64_t k0 = 0; k0 < kend; k0 += C) {
    __syncthreads();
    load_tile<T, HS>(ks, k + base, in.row, k0, C, Tn);
    load_tile<T, HS>(vs, v + base, in.row, k0, C, Tn);
    __syncthreads();
    rows_times_rows_t<T, HS, C>(qs + r0 * HS, ks, ss + r0 * C, C);    // S = Q·Kᵀ (unscaled)
    rows_times_rows_t<T, HS, C>(dos + r0 * HS, vs, dps + r0 * C, C);  // dP = dO·Vᵀ
    __syncwarp();
    for (int e = lane; e < 16 * C; e += 32) {
      const int rr = e / C, c = e % C, row = r0 + rr;
      const std::int64_t i = q0 + row, j = k0 + c;
      const bool ok = i < Tn && j < Tn && (!causal || j <= i);
      const float p = ok ? scalar_cast<float>(scalar_cast<T>(__expf(ss[row * C + c] * scale - lses[row]))) : 0.f;
      dss[row * C + c] = scalar_cast<T>(ok ? scale * p * (dps[row * C + c] - dsum[row]) : 0.f);
    }
    __syncwarp();
    accumulate_rows<T, HS, C>(dss + r0 * C, ks, dqs + r0 * HS);  // dQ += dS·K
  }
  __syncwarp();
  for (int rr = 0; rr < 16; ++rr) {
    const std::int64_t i = q0 + r0 + rr;
    if (i >= Tn) break;
    for (int c = lane; c < HS; c += 32) dq[base + i * in.row + c] = scalar_cast<T>(dqs[(r0 + rr) * HS + c]);
  }
}

// The register-resident fused attention kernels (Note [flash attention in registers]): mma.sync m16n8k16 on
// fragments loaded with ldmatrix from swizzled shared-memory tiles that cp.async fills one step ahead.
// Included by flash_attention.cu inside its anonymous namespace: it uses that file's Heads, head_offset,
// kRows and kBlockThreads, and its launchers choose between these and the WMMA kernels. It includes nothing
// itself (it sits inside a namespace): flash_attention.cu includes cuda_bf16.h, cuda_fp16.h and
// detail/cuda/mma_layout.hpp first. With TG_MMA_EMULATED defined, the device primitives below (cp.async,
// ldmatrix, mma.sync, packing and rounding) are left out: tests/cuda/test_flash_emulated.cpp supplies host
// emulations of them and runs these kernels' bodies, unchanged, on the CPU.

// Note [flash attention in registers]
// The same computation as Note [flash attention on the GPU] (the same masks, the same roundings to T of P
// and dS before their products, lse = m + log l of the unrounded exponentials, D = Σ dO∘O from
// row_dot_kernel, a fixed summation order and no atomics), scheduled as FlashAttention-2 does:
// - Each of a block's 4 warps owns 16 rows (queries in the forward and dQ kernels, keys in the dK/dV
//   kernel). Its operand that stays (Q, or Q and dO) is loaded once into A fragments; the scores, the
//   probabilities and every accumulator (O, dQ, dK, dV) live in registers as mma.sync m16n8k16 fragments
//   (fp32 accumulate). The accumulator layout of a 16x16 product is the A layout of the next product, so P
//   and dS go from one GEMM to the next without shared memory (mma::a_from_c).
// - The streamed tiles (K and V, or Q and dO with their lse and D) are copied by cp.async into one of two
//   buffers while the warps compute on the other: one barrier per step.
// - Tiles are [rows, hs] row-major with 16-byte chunks swizzled by row (mma::swizzled), so ldmatrix's eight
//   row addresses hit eight bank groups; B operands are read with ldmatrix (Kᵀ-like: stored [n][k]) or
//   ldmatrix.trans (V-like: stored [k][n]).
// - Row statistics: each lane holds two rows (g and g + 8 of its warp's 16); a row's max and sum are over
//   the 4 lanes of a quad (shuffles by 1 and 2). The sum l is kept per lane and reduced once at the end
//   (every partial is rescaled by the same factor), in a fixed order.
// - Causal grids start with the query blocks that read the most keys (forward, dQ); the dK/dV grid's first
//   blocks are already its longest.
// Steps: forward 64 keys; dK/dV 64 queries (hs 64) or 32 (hs 128); dQ 64 keys (hs 64) or 32 (hs 128), so
// that the accumulators fit in registers without spills (checked with -Xptxas -v for sm_80 and sm_90).
// The index arithmetic (swizzle, ldmatrix sources, fragment elements) is in detail/cuda/mma_layout.hpp and
// checked on the CPU against an emulation of ldmatrix and mma.sync (tests/cuda/test_cuda_mma_layout.cpp).

namespace mmak {

namespace lay = ::tg::backend::cuda::detail::mma;

#ifndef TG_MMA_EMULATED
__device__ __forceinline__ unsigned smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

/// 16 bytes from global to shared memory without a register round trip; `valid` false zero-fills them.
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

/// d += a·b for one m16n8k16 tile, fp32 accumulators.
template <class T>
__device__ __forceinline__ void mma16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same_v<T, bf16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

/// Two values rounded to T (to nearest even) in one register, `lo` in the low half (the lower column).
template <class T>
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
  unsigned u;
  if constexpr (std::is_same_v<T, bf16>) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &h, 4);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    memcpy(&u, &h, 4);
  }
  return u;
}

/// x rounded to T (to nearest even) and back: the value a product in T sees.
template <class T>
__device__ __forceinline__ float rounded(float x) {
  if constexpr (std::is_same_v<T, bf16>) return __bfloat162float(__float2bfloat16_rn(x));
  else return __half2float(__float2half_rn(x));
}
#endif  // TG_MMA_EMULATED

/// The larger of two values, NaN winning (a NaN score makes its row NaN, as in the composite).
__device__ __forceinline__ float nan_max(float a, float b) { return (b > a || b != b) ? b : a; }

/// The max over the quad of lanes that hold one row, NaN winning.
__device__ __forceinline__ float quad_max(float v) {
  v = nan_max(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return nan_max(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

/// Queues the copy of rows [r0, r0 + ROWS) of a head (rows `ld` elements apart) into a swizzled [ROWS, HS]
/// tile, zeros past Tn (the caller commits the group).
template <int HS, int ROWS, class T>
__device__ __forceinline__ void load_tile_async(T* dst, const T* src, std::int64_t ld, std::int64_t r0, std::int64_t Tn) {
  constexpr int kChunks = HS / 8;
  for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += kBlockThreads) {
    const int r = idx / kChunks, c = idx % kChunks;
    const bool ok = r0 + r < Tn;
    cp_async16(dst + lay::swizzled<HS>(r, c * 8), ok ? src + (r0 + r) * ld + c * 8 : src, ok);
  }
}

/// The A fragments of a warp's 16 rows [w0, w0 + 16) of a swizzled [rows, HS] tile, all HS columns.
template <int HS, class T>
__device__ __forceinline__ void load_a_rows(unsigned (&f)[HS / 16][4], const T* tile, int w0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kc = 0; kc < HS / 16; ++kc) {
    const lay::RowCol at = lay::a_source(lane, w0, kc * 16);
    ldsm_x4(f[kc], tile + lay::swizzled<HS>(at.row, at.col));
  }
}

/// acc[N/8 n-tiles] += A (a warp's 16 rows, HS columns, as A fragments) · Bᵀ with B the N rows of a swizzled
/// [N, HS] tile: 16 rows of S = Q·Kᵀ from Q's fragments and a K tile.
template <class T, int HS, int N>
__device__ __forceinline__ void rows_times_tile_t(float (&acc)[N / 8][4], const unsigned (&a)[HS / 16][4], const T* tile) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kc = 0; kc < HS / 16; ++kc) {
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      unsigned b[4];
      const lay::RowCol at = lay::bt_source(lane, np * 16, kc * 16);
      ldsm_x4(b, tile + lay::swizzled<HS>(at.row, at.col));
      mma16816<T>(acc[2 * np], a[kc], b[0], b[1]);
      mma16816<T>(acc[2 * np + 1], a[kc], b[2], b[3]);
    }
  }
}

/// acc[HS/8 n-tiles] += P · B with P a warp's 16 x K block held as accumulators (K/8 n-tiles, already
/// rounded to T) and B the K rows of a swizzled [K, HS] tile: O += P·V, dQ += dS·K, dV += Pᵀ·dO, dK += dSᵀ·Q.
template <class T, int HS, int K>
__device__ __forceinline__ void acc_times_tile(float (&acc)[HS / 8][4], const float (&p)[K / 8][4], const T* tile) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    unsigned a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const lay::ASourceOfC s = lay::a_from_c(kk, i);
      a[i] = pack2<T>(p[s.tile][s.lo], p[s.tile][s.lo + 1]);
    }
#pragma unroll
    for (int dp = 0; dp < HS / 16; ++dp) {
      unsigned b[4];
      const lay::RowCol at = lay::b_source_trans(lane, kk * 16, dp * 16);
      ldsm_x4_trans(b, tile + lay::swizzled<HS>(at.row, at.col));
      mma16816<T>(acc[2 * dp], a, b[0], b[1]);
      mma16816<T>(acc[2 * dp + 1], a, b[2], b[3]);
    }
  }
}

/// Writes a warp's 16 x HS accumulators (times `mul[r]` for the lane's rows g and g + 8) as T to rows
/// first + row of a head (`ld` apart), rows at or past Tn skipped.
template <class T, int HS>
__device__ __forceinline__ void store_rows(T* dst, std::int64_t ld, std::int64_t first, std::int64_t Tn,
                                           const float (&acc)[HS / 8][4], const float (&mul)[2]) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t row = first + (lane >> 2) + 8 * r;
    if (row >= Tn) continue;
    T* p = dst + row * ld + (lane & 3) * 2;
#pragma unroll
    for (int n = 0; n < HS / 8; ++n)
      *reinterpret_cast<unsigned*>(p + n * 8) = pack2<T>(acc[n][2 * r] * mul[r], acc[n][2 * r + 1] * mul[r]);
  }
}

template <class A, int N>
__device__ __forceinline__ void zero(A (&x)[N][4]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) x[n][e] = 0;
}

// ---- forward ------------------------------------------------------------------------------------------------
template <int HS>
struct FwdSmem {
  static constexpr int kKeys = 64;                                 // keys per step
  static constexpr std::size_t q = 0;                              // [64 queries, HS]
  static constexpr std::size_t k = q + kRows * HS * 2;             // two [kKeys, HS] buffers
  static constexpr std::size_t v = k + 2 * kKeys * HS * 2;         // two [kKeys, HS] buffers
  static constexpr std::size_t bytes = v + 2 * kKeys * HS * 2;
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) forward_kernel(const T* q, const T* k, const T* v, Heads in, T* out,
                                                                Heads io, float* lse, std::int64_t H, std::int64_t Tn,
                                                                float scale, bool causal) {
  using L = FwdSmem<HS>;
  constexpr int C = L::kKeys, NT = C / 8, DT = HS / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head;
  const std::int64_t q0 = (ht.tiles - 1 - ht.tile) * kRows;  // longest rows first
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int lane = threadIdx.x & 31, w0 = (threadIdx.x >> 5) * 16;
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  const int tiles = static_cast<int>((kend + C - 1) / C);
  load_tile_async<HS, kRows>(qs, q + base, in.row, q0, Tn);
  load_tile_async<HS, C>(ks, k + base, in.row, 0, Tn);
  load_tile_async<HS, C>(vs, v + base, in.row, 0, Tn);
  cp_async_commit();

  unsigned qf[HS / 16][4];
  float o[DT][4];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  for (int j = 0; j < tiles; ++j) {
    cp_async_wait_all();
    __syncthreads();  // tile j is in; every warp is done with the buffers of step j - 1
    if (j + 1 < tiles) {
      const std::int64_t next = static_cast<std::int64_t>(j + 1) * C;
      load_tile_async<HS, C>(ks + ((j + 1) & 1) * C * HS, k + base, in.row, next, Tn);
      load_tile_async<HS, C>(vs + ((j + 1) & 1) * C * HS, v + base, in.row, next, Tn);
      cp_async_commit();
    }
    if (j == 0) load_a_rows<HS>(qf, qs, w0);
    const T* kt = ks + (j & 1) * C * HS;
    const T* vt = vs + (j & 1) * C * HS;
    float s[NT][4];
    zero(s);
    rows_times_tile_t<T, HS, C>(s, qf, kt);  // S = Q·Kᵀ (unscaled)

    const std::int64_t k0 = static_cast<std::int64_t>(j) * C;
    const bool edge = k0 + C > Tn || (causal && k0 + C - 1 > q0 + w0);  // some key of the tile is masked
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float x = s[n][e] * scale;
        if (edge) {
          const lay::RowCol c = lay::c_element(lane, e);
          const std::int64_t i = q0 + w0 + c.row, key = k0 + n * 8 + c.col;
          if (key >= Tn || (causal && key > i)) x = -INFINITY;
        }
        s[n][e] = x;
        mx[e >> 1] = nan_max(mx[e >> 1], x);
      }
    float alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float tile_max = quad_max(mx[r]);
      const float m_new = (tile_max != tile_max || m[r] != m[r]) ? NAN : fmaxf(m[r], tile_max);
      // a row with no valid key so far (only rows past Tn): everything stays zero
      alpha[r] = m_new == -INFINITY ? 1.f : __expf(m[r] - m_new);
      m[r] = m_new;
      l[r] *= alpha[r];
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e >> 1;
        const float p = m[r] == -INFINITY ? 0.f : __expf(s[n][e] - m[r]);
        l[r] += p;  // of the unrounded values: lse is the exact log-sum-exp, as the composite's
        s[n][e] = rounded<T>(p);
      }
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e >> 1];
    acc_times_tile<T, HS, C>(o, s, vt);  // O += P·V
  }
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] = quad_sum(l[r]);
    inv[r] = l[r] > 0.f ? 1.f / l[r] : 0.f;
  }
  store_rows<T, HS>(out + obase, io.row, q0 + w0, Tn, o, inv);
  if ((lane & 3) == 0)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int64_t i = q0 + w0 + (lane >> 2) + 8 * r;
      if (i < Tn) lse[head * Tn + i] = m[r] + logf(l[r]);
    }
}

// ---- backward: dK, dV ---------------------------------------------------------------------------------------
template <int HS>
struct DkvSmem {
  static constexpr int kQ = HS == 64 ? 64 : 32;                    // queries per step
  static constexpr std::size_t k = 0;                              // [64 keys, HS]
  static constexpr std::size_t v = k + kRows * HS * 2;
  static constexpr std::size_t q = v + kRows * HS * 2;             // two [kQ, HS] buffers
  static constexpr std::size_t dout = q + 2 * kQ * HS * 2;         // two [kQ, HS] buffers
  static constexpr std::size_t rows = dout + 2 * kQ * HS * 2;      // two buffers of lse[kQ], D[kQ]
  static constexpr std::size_t bytes = rows + 2 * 2 * kQ * 4;
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) backward_dkdv_kernel(const T* q, const T* k, const T* v, Heads in,
                                                                      const T* dout, Heads io, const float* lse,
                                                                      const float* dvec, T* dk, T* dv, std::int64_t H,
                                                                      std::int64_t Tn, float scale, bool causal) {
  using L = DkvSmem<HS>;
  constexpr int Q = L::kQ, QT = Q / 8, DT = HS / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  float* rs = reinterpret_cast<float*>(smem + L::rows);

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head, k0 = ht.tile * kRows;
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int lane = threadIdx.x & 31, w0 = (threadIdx.x >> 5) * 16;
  load_tile_async<HS, kRows>(ks, k + base, in.row, k0, Tn);
  load_tile_async<HS, kRows>(vs, v + base, in.row, k0, Tn);
  const std::int64_t qstart = causal ? k0 / Q * Q : 0;  // the first query tile that sees one of the keys
  const int tiles = static_cast<int>((Tn - qstart + Q - 1) / Q);
  auto prefetch = [&](int t) {
    const std::int64_t q0 = qstart + static_cast<std::int64_t>(t) * Q;
    const int b = t & 1;
    load_tile_async<HS, Q>(qs + b * Q * HS, q + base, in.row, q0, Tn);
    load_tile_async<HS, Q>(dos + b * Q * HS, dout + obase, io.row, q0, Tn);
    cp_async_commit();
    for (int i = threadIdx.x; i < Q; i += kBlockThreads) {
      const bool inside = q0 + i < Tn;
      rs[b * 2 * Q + i] = inside ? lse[head * Tn + q0 + i] : 0.f;
      rs[b * 2 * Q + Q + i] = inside ? dvec[head * Tn + q0 + i] : 0.f;
    }
  };
  prefetch(0);  // its group also holds the K and V tiles

  float dka[DT][4], dva[DT][4];
  zero(dka);
  zero(dva);
  for (int t = 0; t < tiles; ++t) {
    cp_async_wait_all();
    __syncthreads();  // tile t is in; every warp is done with the buffers of step t - 1
    if (t + 1 < tiles) prefetch(t + 1);
    const int b = t & 1;
    const T* qt = qs + b * Q * HS;
    const T* dt = dos + b * Q * HS;
    const float* lt = rs + b * 2 * Q;
    const float* dd = lt + Q;
    const std::int64_t q0 = qstart + static_cast<std::int64_t>(t) * Q;

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ for the warp's 16 keys (K and V fragments read from shared memory each
    // step: kept in registers they would not leave room for the accumulators at hs 128)
    float st[QT][4], dpt[QT][4];
    zero(st);
    zero(dpt);
#pragma unroll
    for (int kc = 0; kc < HS / 16; ++kc) {
      unsigned ka[4], va[4];
      const lay::RowCol a = lay::a_source(lane, w0, kc * 16);
      ldsm_x4(ka, ks + lay::swizzled<HS>(a.row, a.col));
      ldsm_x4(va, vs + lay::swizzled<HS>(a.row, a.col));
#pragma unroll
      for (int np = 0; np < QT / 2; ++np) {
        unsigned bq[4], bd[4];
        const lay::RowCol at = lay::bt_source(lane, np * 16, kc * 16);
        ldsm_x4(bq, qt + lay::swizzled<HS>(at.row, at.col));
        ldsm_x4(bd, dt + lay::swizzled<HS>(at.row, at.col));
        mma16816<T>(st[2 * np], ka, bq[0], bq[1]);
        mma16816<T>(st[2 * np + 1], ka, bq[2], bq[3]);
        mma16816<T>(dpt[2 * np], va, bd[0], bd[1]);
        mma16816<T>(dpt[2 * np + 1], va, bd[2], bd[3]);
      }
    }
    // Pᵀ = exp(scale·Sᵀ − lse) and dSᵀ = scale·Pᵀ∘(dPᵀ − D), each rounded to T for its product
    const bool edge = q0 + Q > Tn || k0 + w0 + 16 > Tn || (causal && k0 + w0 + 15 > q0);
#pragma unroll
    for (int n = 0; n < QT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const lay::RowCol c = lay::c_element(lane, e);
        const int col = n * 8 + c.col;
        bool ok = true;
        if (edge) {
          const std::int64_t key = k0 + w0 + c.row, i = q0 + col;
          ok = i < Tn && key < Tn && (!causal || key <= i);
        }
        const float p = ok ? rounded<T>(__expf(st[n][e] * scale - lt[col])) : 0.f;
        st[n][e] = p;
        dpt[n][e] = ok ? rounded<T>(scale * p * (dpt[n][e] - dd[col])) : 0.f;
      }
    acc_times_tile<T, HS, Q>(dva, st, dt);   // dV += Pᵀ·dO
    acc_times_tile<T, HS, Q>(dka, dpt, qt);  // dK += dSᵀ·Q
  }
  const float one[2] = {1.f, 1.f};
  store_rows<T, HS>(dk + base, in.row, k0 + w0, Tn, dka, one);
  store_rows<T, HS>(dv + base, in.row, k0 + w0, Tn, dva, one);
}

// ---- backward: dQ -------------------------------------------------------------------------------------------
template <int HS>
struct DqSmem {
  static constexpr int kKeys = HS == 64 ? 64 : 32;                 // keys per step
  static constexpr std::size_t q = 0;                              // [64 queries, HS]
  static constexpr std::size_t dout = q + kRows * HS * 2;
  static constexpr std::size_t k = dout + kRows * HS * 2;          // two [kKeys, HS] buffers
  static constexpr std::size_t v = k + 2 * kKeys * HS * 2;         // two [kKeys, HS] buffers
  static constexpr std::size_t bytes = v + 2 * kKeys * HS * 2;
};

template <class T, int HS>
__global__ void __launch_bounds__(kBlockThreads) backward_dq_kernel(const T* q, const T* k, const T* v, Heads in,
                                                                    const T* dout, Heads io, const float* lse,
                                                                    const float* dvec, T* dq, std::int64_t H,
                                                                    std::int64_t Tn, float scale, bool causal) {
  using L = DqSmem<HS>;
  constexpr int C = L::kKeys, NT = C / 8, DT = HS / 8;
  extern __shared__ __align__(128) unsigned char smem[];
  T* qs = reinterpret_cast<T*>(smem + L::q);
  T* dos = reinterpret_cast<T*>(smem + L::dout);
  T* ks = reinterpret_cast<T*>(smem + L::k);
  T* vs = reinterpret_cast<T*>(smem + L::v);

  const HeadTile ht = head_tile(Tn);  // Note [attention grid]
  const std::int64_t head = ht.head;
  const std::int64_t q0 = (ht.tiles - 1 - ht.tile) * kRows;  // longest rows first
  const std::int64_t base = head_offset(in, head, H), obase = head_offset(io, head, H);
  const int lane = threadIdx.x & 31, w0 = (threadIdx.x >> 5) * 16;
  const std::int64_t kend = causal && q0 + kRows < Tn ? q0 + kRows : Tn;
  const int tiles = static_cast<int>((kend + C - 1) / C);
  load_tile_async<HS, kRows>(qs, q + base, in.row, q0, Tn);
  load_tile_async<HS, kRows>(dos, dout + obase, io.row, q0, Tn);
  load_tile_async<HS, C>(ks, k + base, in.row, 0, Tn);
  load_tile_async<HS, C>(vs, v + base, in.row, 0, Tn);
  cp_async_commit();
  float lr[2], dr[2];  // lse and D of the lane's rows g and g + 8
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = q0 + w0 + (lane >> 2) + 8 * r;
    lr[r] = i < Tn ? lse[head * Tn + i] : 0.f;
    dr[r] = i < Tn ? dvec[head * Tn + i] : 0.f;
  }

  unsigned qf[HS / 16][4], df[HS / 16][4];
  float dqa[DT][4];
  zero(dqa);
  for (int j = 0; j < tiles; ++j) {
    cp_async_wait_all();
    __syncthreads();
    if (j + 1 < tiles) {
      const std::int64_t next = static_cast<std::int64_t>(j + 1) * C;
      load_tile_async<HS, C>(ks + ((j + 1) & 1) * C * HS, k + base, in.row, next, Tn);
      load_tile_async<HS, C>(vs + ((j + 1) & 1) * C * HS, v + base, in.row, next, Tn);
      cp_async_commit();
    }
    if (j == 0) {
      load_a_rows<HS>(qf, qs, w0);
      load_a_rows<HS>(df, dos, w0);
    }
    const T* kt = ks + (j & 1) * C * HS;
    const T* vt = vs + (j & 1) * C * HS;
    float s[NT][4], dp[NT][4];
    zero(s);
    zero(dp);
    rows_times_tile_t<T, HS, C>(s, qf, kt);   // S = Q·Kᵀ (unscaled)
    rows_times_tile_t<T, HS, C>(dp, df, vt);  // dP = dO·Vᵀ
    const std::int64_t k0 = static_cast<std::int64_t>(j) * C;
    const bool edge = k0 + C > Tn || (causal && k0 + C - 1 > q0 + w0);
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const lay::RowCol c = lay::c_element(lane, e);
        const int r = e >> 1;
        bool ok = true;
        if (edge) {
          const std::int64_t i = q0 + w0 + c.row, key = k0 + n * 8 + c.col;
          ok = i < Tn && key < Tn && (!causal || key <= i);
        }
        const float p = ok ? rounded<T>(__expf(s[n][e] * scale - lr[r])) : 0.f;
        s[n][e] = ok ? rounded<T>(scale * p * (dp[n][e] - dr[r])) : 0.f;  // dS
      }
    acc_times_tile<T, HS, C>(dqa, s, kt);  // dQ += dS·K
  }
  const float one[2] = {1.f, 1.f};
  store_rows<T, HS>(dq + base, in.row, q0 + w0, Tn, dqa, one);
}

}  // namespace mmak

// GEMMs on the GPU through cuBLASLt (cuBLAS's GemmEx when Lt offers no algorithm for a layout), for
// matmul (batched, broadcast and reduced batch dims), linear (bias epilogue), linear + GELU (the GELU_AUX
// epilogues, Note [fused linear + GELU] in ops/linear_gelu.hpp) and causal attention as a composite:
// S = scale·QKᵀ (fp32 out), a masked-softmax kernel, O = P·V; backward recomputes P from lse.
//
// Note [row-major GEMMs on column-major cuBLAS]
// typegrad's matrices are row-major. A row-major C[M,N] (row stride ldc) is the column-major C'[N,M]
// with the same ld, and C = A·B is C' = B'·A'. A row-major operand given by backend::cpu::gemm_operand
// as (Trans t, ld): t == N is the column-major [cols, rows] matrix with ld used as is (op N); t == T is
// stored as the transpose, the column-major [rows, cols] matrix (op T). So cuBLAS's first operand is B
// and its second is A, with their Trans flags unchanged.
//
// Precision: fp16/bf16 operands with fp32 compute and fp32 alpha/beta (CUBLAS_COMPUTE_32F); fp32 with
// CUBLAS_COMPUTE_32F, or _FAST_TF32 after set_allow_tf32(true); fp64 with CUBLAS_COMPUTE_64F.
#include <cublasLt.h>
#include <cublas_v2.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common.cuh"
#include "cublaslt.cuh"
#include "flash_attention.cuh"
#include "typegrad/detail/cpu/kernels.hpp"  // gemm_operand (host-only geometry, shared with the CPU)
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::backend::cuda {

using detail::acc_t;
using Trans = ::tg::backend::cpu::Trans;

namespace {

std::atomic<bool> g_allow_tf32{false};
std::atomic<std::int64_t> g_gelu_epilogue_calls{0};
std::atomic<std::int64_t> g_bgrad_epilogue_calls{0};
std::atomic<std::int64_t> g_dgelu_epilogue_calls{0};
std::atomic<std::int64_t> g_padded_gemm_calls{0};  // Note [16-byte aligned GEMM operands]

// ---- handles and workspaces (one device, created on first use) ----------------------------------------
// GEMMs run on the current stream (Note [CUDA streams], runtime.hpp). A cuBLAS workspace may be used by
// one stream at a time, so each stream that has run a GEMM owns one: two streams never share scratch
// memory while their GEMMs overlap. Workspaces live as long as the process (not in allocator stats); a
// stream handle the driver reuses after a Stream is destroyed reuses its workspace, which is then idle.
constexpr std::size_t kLtWorkspace = std::size_t{32} << 20;
struct Blas {
  cublasLtHandle_t lt = nullptr;
  cublasHandle_t blas = nullptr;
  std::mutex blas_mutex;  // cublasSetStream/SetWorkspace + GemmEx on the shared cublasHandle_t
  std::mutex workspace_mutex;
  std::map<cudaStream_t, void*> workspaces;
};
Blas& blas() {
  static Blas b;
  static std::once_flag once;
  std::call_once(once, [] {
    TG_CUBLAS_CHECK(cublasLtCreate(&b.lt));
    TG_CUBLAS_CHECK(cublasCreate(&b.blas));
  });
  return b;
}
void* workspace_for(cudaStream_t stream) {
  Blas& b = blas();
  std::lock_guard<std::mutex> lock(b.workspace_mutex);
  void*& ws = b.workspaces[stream];
  if (!ws) TG_CUDA_CHECK(cudaMalloc(&ws, kLtWorkspace));
  return ws;
}

template <class T>
constexpr cudaDataType_t cuda_type() {
  if constexpr (std::is_same_v<T, double>) return CUDA_R_64F;
  else if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
  else if constexpr (std::is_same_v<T, fp16>) return CUDA_R_16F;
  else return CUDA_R_16BF;
}
template <class T>
cublasComputeType_t compute_type() {
  if constexpr (std::is_same_v<T, double>) return CUBLAS_COMPUTE_64F;
  else if constexpr (std::is_same_v<T, float>) return g_allow_tf32.load() ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  else return CUBLAS_COMPUTE_32F;
}

/// Largest power of two (up to 256) dividing the address and the batch stride in bytes.
std::uint32_t alignment(const void* p, std::int64_t stride_bytes) {
  std::uint64_t a = reinterpret_cast<std::uintptr_t>(p) | 256u;
  if (stride_bytes) a |= static_cast<std::uint64_t>(stride_bytes);
  return static_cast<std::uint32_t>(a & (~a + 1));
}

/// One row-major (batched, strided) GEMM: C[M,N] = alpha·A[M,K]·B[K,N] + beta·C (+ bias[N]). A and B of
/// element type T given by (Trans, ld, batch stride); C of element type TC with column stride 1.
struct Gemm {
  std::int64_t M = 0, N = 0, K = 0;
  Trans ta = Trans::N, tb = Trans::N;
  std::int64_t lda = 1, ldb = 1, ldc = 1;
  std::int64_t sa = 0, sb = 0, sc = 0, batch = 1;  // batch strides in elements
};

/// Epilogue work only cuBLASLt does. With one, run_gemm returns false (having written nothing) when Lt has no
/// algorithm for the call or the call would need realigning copies, and the caller runs the composite.
///   gelu_aux: D = gelu_tanh(A·B (+ bias)) and aux = A·B (+ bias)                       (GELU_AUX(_BIAS))
///   dgelu:    D = (A·B) · gelu_tanh'(aux), and bias_grad[n] = Σ_m D[m, n] if given      (DGELU(_BGRAD))
///   bgradb:   D = A·B and bias_grad = the sums over cuBLAS's k of its B operand, which is our A: in
///             dW = dYᵀ·X (A = dYᵀ [N, M]), bias_grad[n] = Σ_m dY[m, n]                  (BGRADB)
/// aux has leading dim `ld` in the column-major view (Note [row-major GEMMs on column-major cuBLAS]: the
/// row-major [M, N] buffer is the column-major [N, M] matrix with ld N); bias_grad has N elements of C's type.
struct Epilogue {
  enum class Kind { gelu_aux, dgelu, bgradb };
  Kind kind = Kind::gelu_aux;
  void* aux = nullptr;
  std::int64_t ld = 0;
  void* bias_grad = nullptr;
};

// Note [cached GEMM algorithms]
// cublasLtMatmulAlgoGetHeuristic costs tens of microseconds of host time; a training step issues the same
// few hundred GEMM configurations every step. The key holds every input of the descriptors and preferences
// (types, ops, sizes, leading dims, batch strides and count, operand alignments, the epilogue and the
// alignments of the bias and aux pointers the heuristic inspects, the aux ld), so a cached algorithm is
// exactly the heuristic's answer for that call. An algorithm that declines when run (cublasLtMatmul's "not
// supported", "invalid value" or "arch mismatch": detail::lt_run_declined; nothing is written) is replaced by "no
// algorithm", so that configuration takes the cuBLAS path (or, for an epilogue, the caller's composite) from then
// on, instead of throwing.
using AlgoCache = detail::LtAlgoCache<22>;
AlgoCache& algo_cache() {
  static AlgoCache cache;
  return cache;
}

// Note [cached GEMM descriptors]
// A call's cuBLASLt descriptors (the matmul descriptor and the three matrix layouts) are fixed by the same inputs
// as its algorithm, so they are kept too, under the algorithm cache's key (Note [cached GEMM algorithms]),
// instead of being created, given their attributes and destroyed around every GEMM: a launch-bound step on the
// GPU issues a few hundred GEMMs, each of which spent a dozen cuBLASLt calls of host time on its descriptors. What
// changes from call to call with the same key, the bias and aux pointers, is set on the kept descriptor before
// the call (cublasLtMatmul reads its attributes when called; a captured launch keeps the values it was given).
// The cache is per thread, so no two threads set one descriptor's pointers at once, and holds at most
// kMaxDescs configurations (a full cache is emptied). The heuristic's preference is made only when the
// algorithm cache asks the heuristic.
struct LtDescs {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t l1 = nullptr, l2 = nullptr, lc = nullptr;
  LtDescs() = default;
  LtDescs(const LtDescs&) = delete;
  LtDescs& operator=(const LtDescs&) = delete;
  ~LtDescs() {
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (l2) cublasLtMatrixLayoutDestroy(l2);
    if (l1) cublasLtMatrixLayoutDestroy(l1);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};
constexpr std::size_t kMaxDescs = 1024;
/// The calling thread's descriptors for `key`, made by make(LtDescs&) the first time (a throw leaves none kept).
template <class Make>
const LtDescs& lt_descs(const AlgoCache::Key& key, Make&& make) {
  thread_local std::map<AlgoCache::Key, std::unique_ptr<LtDescs>> kept;
  if (auto it = kept.find(key); it != kept.end()) return *it->second;
  auto d = std::make_unique<LtDescs>();
  make(*d);
  if (kept.size() >= kMaxDescs) kept.clear();
  return *kept.emplace(key, std::move(d)).first->second;
}

template <class T>
__global__ void add_bias_kernel(T* c, const T* bias, std::int64_t M, std::int64_t N, std::int64_t ldc) {
  using A = acc_t<T>;
  TG_GRID_STRIDE(t, M * N) {
    const std::int64_t m = t / N, n = t % N;
    c[m * ldc + n] = scalar_cast<T>(scalar_cast<A>(c[m * ldc + n]) + scalar_cast<A>(bias[n]));
  }
}

// Note [16-byte aligned GEMM operands]
// cuBLASLt's Hopper kernels want every matrix at a 16-byte aligned address with a row stride that is a
// multiple of 16 bytes (8 bf16/fp16 elements). Otherwise its heuristic falls back to kernels of an older
// generation that load 2 bytes at a time: on an H200 the GPT-2 LM head (vocabulary 50257, so the logits'
// row stride is odd) ran its three GEMMs (logits, dX, dW) through cutlass_75 "align1" kernels at about
// 100 TFLOP/s, 21% of the training step's GPU time (docs/performance.md). Realigning the row strides alone
// (copies with 16-byte row strides) moved the dW GEMM to an aligned kernel (10.6 -> 3.1 ms) but not the
// logits and dX GEMMs: an extent that is a row's width (the contiguous dimension) of an operand or of C
// counts too, and 50257 is N of the logits GEMM and K of dX. So a 16-bit GEMM (not batched, no GELU
// epilogue) with a misaligned operand or such an extent not a multiple of 8 runs on copies: each operand
// whose stored shape or alignment changes goes into a block with the padded shape and a 16-byte row stride
// whose padding is zero (cudaMemcpy2DAsync on the copy engine, cudaMemset2DAsync for the padding), so the
// padded K terms add 0·0 and the padded rows and columns of C are computed and dropped; C is computed in
// a padded block and its [M, N] part copied back (copied in first when beta != 0: beta times the block's
// uninitialised padding lands only in the dropped part); a bias is padded with zeros to the padded N. The
// copies, one read and one write of each matrix, cost far less than the slow kernel. Only GEMMs of at
// least 2^30 multiply-adds do this: for small ones the extra launches and allocations cost more than a
// faster kernel saves. (In the H200 run where every misaligned 16-bit GEMM went through realigning copies,
// its 1215 CPU-vs-CUDA op tests passed with tiny odd shapes taking this path, and the tiny trainer of
// tests/trainer/train_gpt_cuda.sh ran at 44.6 ms/step against 32.5 and 34.8 before: a slowdown the copies
// may explain, not isolated.) padded_gemm_calls() counts the GEMMs that took this path. The zero padding of
// the extents (2026-12-04) has compiled and its tests (tests/cuda/test_cuda_gemm.cpp) have skipped on the
// build machines, but it has not yet run on a GPU: scripts/gpu-check.sh runs those tests and the GPT-2
// benchmark whose LM head it targets.
// The blocks are Workspaces (common.cuh): back to the caching allocator's per-stream free list as soon as
// the work is enqueued.

bool aligned16(const void* p, std::int64_t ld, std::size_t elem) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && (static_cast<std::size_t>(ld) * elem) % 16 == 0;
}
std::int64_t round_up(std::int64_t v, std::int64_t q) { return (v + q - 1) / q * q; }
std::int64_t ld_rounded_to_16_bytes(std::int64_t width, std::size_t elem) {
  return round_up(width, static_cast<std::int64_t>(16 / elem));
}
/// Copies the row-major [rows, width] matrix with row stride from_ld into one with row stride to_ld.
void copy_rows(void* to, std::int64_t to_ld, const void* from, std::int64_t from_ld, std::int64_t rows,
               std::int64_t width, std::size_t elem, cudaStream_t stream) {
  if (rows == 1) from_ld = std::max(from_ld, width);  // one row: its stride is never used
  TG_CUDA_CHECK(cudaMemcpy2DAsync(to, static_cast<std::size_t>(to_ld) * elem, from, static_cast<std::size_t>(from_ld) * elem,
                                  static_cast<std::size_t>(width) * elem, static_cast<std::size_t>(rows),
                                  cudaMemcpyDeviceToDevice, stream));
}
/// Copies the row-major [rows, width] matrix into the [padded_rows, padded_width] block `to` (row stride
/// to_ld) and zeroes the block's padding: columns [width, padded_width) of the first rows and the rows after.
void copy_rows_zero_padded(void* to, std::int64_t to_ld, std::int64_t padded_rows, std::int64_t padded_width,
                           const void* from, std::int64_t from_ld, std::int64_t rows, std::int64_t width,
                           std::size_t elem, cudaStream_t stream) {
  copy_rows(to, to_ld, from, from_ld, rows, width, elem, stream);
  char* const base = static_cast<char*>(to);
  const std::size_t pitch = static_cast<std::size_t>(to_ld) * elem;
  if (padded_width > width)
    TG_CUDA_CHECK(cudaMemset2DAsync(base + static_cast<std::size_t>(width) * elem, pitch, 0,
                                    static_cast<std::size_t>(padded_width - width) * elem,
                                    static_cast<std::size_t>(rows), stream));
  if (padded_rows > rows)
    TG_CUDA_CHECK(cudaMemsetAsync(base + static_cast<std::size_t>(rows) * pitch, 0,
                                  static_cast<std::size_t>(padded_rows - rows) * pitch, stream));
}

/// Runs the GEMM; with an epilogue `ep` only through cuBLASLt, returning false (having written nothing) when
/// it cannot (see Epilogue), so the caller can run the composite. Without one it always completes (cuBLAS
/// and a bias kernel when Lt has no algorithm) and returns true.
template <class T, class TC>
bool run_gemm(const Gemm& g, const T* a, const T* b, TC* c, double alpha, double beta, const T* bias = nullptr,
              const Epilogue* ep = nullptr) {
  if (ep && (g.M == 0 || g.N == 0 || g.K == 0 || g.batch != 1 || std::is_same_v<T, double> || beta != 0))
    return false;
  if (g.M == 0 || g.N == 0 || g.batch == 0) return true;
  if (g.K == 0) {  // C = beta·C; only beta = 0 occurs here
    const cudaStream_t stream = detail::stream();
    for (std::int64_t i = 0; i < g.batch; ++i)
      TG_CUDA_CHECK(cudaMemset2DAsync(c + i * g.sc, static_cast<std::size_t>(g.ldc) * sizeof(TC), 0,
                                      static_cast<std::size_t>(g.N) * sizeof(TC), static_cast<std::size_t>(g.M), stream));
    if (bias) {
      add_bias_kernel<TC><<<detail::grid_for(g.M * g.N), detail::kThreads, 0, stream>>>(c, reinterpret_cast<const TC*>(bias),
                                                                                        g.M, g.N, g.ldc);
      TG_CUDA_LAUNCHED();
    }
    return true;
  }
  static_assert(std::is_same_v<T, TC> || std::is_same_v<TC, acc_t<T>>);
  if constexpr (sizeof(T) == 2) {  // Note [16-byte aligned GEMM operands]
    const bool large = static_cast<double>(g.M) * static_cast<double>(g.N) * static_cast<double>(g.K) >= 0x1p30;
    if (g.batch == 1 && large) {
      // Extents that are a row's width of a stored matrix (Trans::T keeps the transpose): N of C always, M
      // of a transposed A, K of a plain A or a transposed B. Those round up to 8 elements.
      constexpr std::int64_t kQuantum = 16 / sizeof(T);
      Gemm r = g;
      r.N = round_up(g.N, kQuantum);
      if (g.ta == Trans::T) r.M = round_up(g.M, kQuantum);
      if (g.ta == Trans::N || g.tb == Trans::T) r.K = round_up(g.K, kQuantum);
      // stored row-major shapes before and after the padding
      const auto stored = [](Trans t, std::int64_t rows, std::int64_t cols) {
        return t == Trans::N ? std::pair{rows, cols} : std::pair{cols, rows};
      };
      const auto [a_rows, a_width] = stored(g.ta, g.M, g.K);
      const auto [b_rows, b_width] = stored(g.tb, g.K, g.N);
      const auto [pa_rows, pa_width] = stored(g.ta, r.M, r.K);
      const auto [pb_rows, pb_width] = stored(g.tb, r.K, r.N);
      const bool fix_a = !aligned16(a, g.lda, sizeof(T)) || pa_rows != a_rows || pa_width != a_width;
      const bool fix_b = !aligned16(b, g.ldb, sizeof(T)) || pb_rows != b_rows || pb_width != b_width;
      const bool fix_c = !aligned16(c, g.ldc, sizeof(TC)) || r.M != g.M || r.N != g.N;
      if (fix_a || fix_b || fix_c) {
        if (ep) return false;  // the composite's GEMM realigns; an epilogue would need its aux and bias padded too
        const cudaStream_t stream = detail::stream();
        if (fix_a) r.lda = ld_rounded_to_16_bytes(pa_width, sizeof(T));
        if (fix_b) r.ldb = ld_rounded_to_16_bytes(pb_width, sizeof(T));
        if (fix_c) r.ldc = ld_rounded_to_16_bytes(r.N, sizeof(TC));
        const bool pad_bias = bias && r.N != g.N;
        const detail::Workspace sa(fix_a ? static_cast<std::size_t>(pa_rows * r.lda) * sizeof(T) : 0),
            sb(fix_b ? static_cast<std::size_t>(pb_rows * r.ldb) * sizeof(T) : 0),
            sc(fix_c ? static_cast<std::size_t>(r.M * r.ldc) * sizeof(TC) : 0),
            sbias(pad_bias ? static_cast<std::size_t>(r.N) * sizeof(TC) : 0);
        if (fix_a)
          copy_rows_zero_padded(sa.as<void>(), r.lda, pa_rows, pa_width, a, g.lda, a_rows, a_width, sizeof(T), stream);
        if (fix_b)
          copy_rows_zero_padded(sb.as<void>(), r.ldb, pb_rows, pb_width, b, g.ldb, b_rows, b_width, sizeof(T), stream);
        if (fix_c && beta != 0) copy_rows(sc.as<void>(), r.ldc, c, g.ldc, g.M, g.N, sizeof(TC), stream);
        if (pad_bias) copy_rows_zero_padded(sbias.as<void>(), r.N, 1, r.N, bias, g.N, 1, g.N, sizeof(TC), stream);
        run_gemm<T, TC>(r, fix_a ? sa.as<const T>() : a, fix_b ? sb.as<const T>() : b, fix_c ? sc.as<TC>() : c, alpha,
                        beta, pad_bias ? sbias.as<const T>() : bias, nullptr);
        if (fix_c) copy_rows(c, g.ldc, sc.as<void>(), r.ldc, g.M, g.N, sizeof(TC), stream);
        g_padded_gemm_calls.fetch_add(1);
        return true;
      }
    }
  }
  Blas& h = blas();
  const cudaStream_t stream = detail::stream();
  const cudaDataType_t ab_type = cuda_type<T>(), c_type = cuda_type<TC>();
  const cublasComputeType_t ct = compute_type<T>();
  const bool dbl = std::is_same_v<T, double>;
  const cudaDataType_t scale_type = dbl ? CUDA_R_64F : CUDA_R_32F;
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  const void* alpha_p = dbl ? static_cast<const void*>(&alpha) : static_cast<const void*>(&alpha_f);
  const void* beta_p = dbl ? static_cast<const void*>(&beta) : static_cast<const void*>(&beta_f);
  const cublasOperation_t op1 = g.tb == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;  // cuBLAS's A is our B
  const cublasOperation_t op2 = g.ta == Trans::N ? CUBLAS_OP_N : CUBLAS_OP_T;  // cuBLAS's B is our A
  // stored column-major shapes (Note [row-major GEMMs on column-major cuBLAS])
  const std::uint64_t r1 = g.tb == Trans::N ? g.N : g.K, c1 = g.tb == Trans::N ? g.K : g.N;
  const std::uint64_t r2 = g.ta == Trans::N ? g.K : g.M, c2 = g.ta == Trans::N ? g.M : g.K;

  // A broadcast operand (batch stride 0) goes straight to cuBLAS, whose strided-batched GEMM documents
  // stride 0; everything else asks cuBLASLt first.
  const bool broadcast_batch = g.batch > 1 && (g.sa == 0 || g.sb == 0);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_DEFAULT;
  using Kind = Epilogue::Kind;
  if (ep && ep->kind == Kind::gelu_aux) epi = bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  else if (ep && ep->kind == Kind::dgelu) epi = ep->bias_grad ? CUBLASLT_EPILOGUE_DGELU_BGRAD : CUBLASLT_EPILOGUE_DGELU;
  else if (ep && ep->kind == Kind::bgradb) epi = CUBLASLT_EPILOGUE_BGRADB;
  else if (bias) epi = CUBLASLT_EPILOGUE_BIAS;
  TG_CHECK(!(bias && ep && ep->kind != Kind::gelu_aux), "cuda gemm: a bias with a gradient epilogue");
  // The bias pointer attribute holds the bias (read) or, with a gradient epilogue, the bias gradient (written).
  const void* bias_attr = ep && ep->kind != Kind::gelu_aux ? ep->bias_grad : bias;
  const bool uses_aux = ep && ep->kind != Kind::bgradb;
  if (!broadcast_batch) {
    // A batch stride counts only where there is a second matrix (an odd stride of a single product, which the
    // attention's one-head calls pass, would otherwise keep the heuristic from its 16-byte kernels).
    const auto stride_bytes = [&](std::int64_t s, std::size_t size) { return g.batch > 1 ? s * static_cast<std::int64_t>(size) : 0; };
    const std::uint32_t al1 = alignment(b, stride_bytes(g.sb, sizeof(T))), al2 = alignment(a, stride_bytes(g.sa, sizeof(T))),
                        alc = alignment(c, stride_bytes(g.sc, sizeof(TC)));
    // The heuristic's answer depends only on the descriptors and alignments, so it is asked once per
    // configuration (Note [cached GEMM algorithms]), and the descriptors are kept under the same key (Note
    // [cached GEMM descriptors]). "No algorithm" is an answer here, not an error: the cuBLAS path below takes
    // any layout.
    const AlgoCache::Key key = {ab_type, c_type, ct, op1, op2, static_cast<std::int64_t>(g.M), static_cast<std::int64_t>(g.N),
                         static_cast<std::int64_t>(g.K), g.lda, g.ldb, g.ldc, g.sa, g.sb, g.sc, g.batch, al1, al2, alc,
                         static_cast<std::int64_t>(epi), bias_attr ? alignment(bias_attr, 0) : 0,
                         uses_aux ? alignment(ep->aux, 0) : 0, uses_aux ? ep->ld : 0};
    const LtDescs& d = lt_descs(key, [&](LtDescs& n) {
      TG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&n.desc, ct, scale_type));
      TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(n.desc, CUBLASLT_MATMUL_DESC_TRANSA, &op1, sizeof op1));
      TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(n.desc, CUBLASLT_MATMUL_DESC_TRANSB, &op2, sizeof op2));
      if (epi != CUBLASLT_EPILOGUE_DEFAULT)
        TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(n.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
      if (bias_attr)  // the bias (or its gradient) in C's type; its pointer is set per call
        TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(n.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &c_type, sizeof c_type));
      if (uses_aux)  // the GELU input's ld (in C's type: EPILOGUE_AUX_DATA_TYPE left unset); its pointer is set per call
        TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(n.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &ep->ld, sizeof ep->ld));
      TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&n.l1, ab_type, r1, c1, g.ldb));
      TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&n.l2, ab_type, r2, c2, g.lda));
      TG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&n.lc, c_type, static_cast<std::uint64_t>(g.N), static_cast<std::uint64_t>(g.M), g.ldc));
      if (g.batch > 1) {
        const std::int32_t count = static_cast<std::int32_t>(g.batch);
        const std::int64_t s1 = g.sb, s2 = g.sa, s3 = g.sc;
        for (auto [l, s] : {std::pair{n.l1, s1}, std::pair{n.l2, s2}, std::pair{n.lc, s3}}) {
          TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof count));
          TG_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &s, sizeof s));
        }
      }
    });
    if (bias_attr)  // bias[row of C'] = bias[n] (before the GELU, with GELU_AUX_BIAS), or its gradient
      TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias_attr, sizeof bias_attr));
    if (uses_aux)  // the GELU input (A·B + bias), written or read
      TG_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ep->aux, sizeof ep->aux));
    algo_cache().get(key, result, found, [&](cublasLtMatmulHeuristicResult_t& r, int& f) {
      cublasLtMatmulPreference_t pref = nullptr;
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
      struct Drop {
        cublasLtMatmulPreference_t p;
        ~Drop() { cublasLtMatmulPreferenceDestroy(p); }
      } drop{pref};
      const std::uint64_t ws = kLtWorkspace;
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al1, sizeof al1));
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al2, sizeof al2));
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &alc, sizeof alc));
      TG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &alc, sizeof alc));
      return detail::ask_status(cublasLtMatmulAlgoGetHeuristic(h.lt, d.desc, d.l1, d.l2, d.lc, d.lc, pref, 1, &r, &f), f);
    });
    if (found > 0) {
      const cublasStatus_t st = cublasLtMatmul(h.lt, d.desc, alpha_p, b, d.l1, a, d.l2, beta_p, c, d.lc, c, d.lc,
                                               &result.algo, workspace_for(stream), kLtWorkspace, stream);
      if (st != CUBLAS_STATUS_SUCCESS) {
        if (!detail::lt_run_declined(st)) TG_CUBLAS_CHECK(st);
        algo_cache().decline(key);  // nothing was written: the paths below, for this call and the next
        found = 0;
      }
    }
  }
  if (found > 0) return true;
  if (ep) return false;  // cuBLAS has no such epilogue: the caller runs the composite

  // The cuBLAS handle carries a stream and a workspace: set both, under a lock, for this call.
  std::lock_guard<std::mutex> lock(h.blas_mutex);
  TG_CUBLAS_CHECK(cublasSetStream(h.blas, stream));
  TG_CUBLAS_CHECK(cublasSetWorkspace(h.blas, workspace_for(stream), kLtWorkspace));
  TG_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h.blas, op1, op2, static_cast<int>(g.N), static_cast<int>(g.M),
                                             static_cast<int>(g.K), alpha_p, b, ab_type, static_cast<int>(g.ldb), g.sb, a,
                                             ab_type, static_cast<int>(g.lda), g.sa, beta_p, c, c_type,
                                             static_cast<int>(g.ldc), g.sc, static_cast<int>(g.batch), ct,
                                             CUBLAS_GEMM_DEFAULT));
  if (bias) {
    for (std::int64_t i = 0; i < g.batch; ++i) {
      add_bias_kernel<TC><<<detail::grid_for(g.M * g.N), detail::kThreads, 0, stream>>>(
          c + i * g.sc, reinterpret_cast<const TC*>(bias), g.M, g.N, g.ldc);
      TG_CUDA_LAUNCHED();
    }
  }
  return true;
}

/// (Trans, ld) of a row-major [rows, cols] operand with strides (rs, cs); throws when it needs a copy
/// (the ops pass gemm_ready operands, so this is an internal error).
void operand(std::int64_t rows, std::int64_t cols, std::int64_t rs, std::int64_t cs, Trans& t, std::int64_t& ld,
             const char* what) {
  TG_CHECK(::tg::backend::cpu::gemm_operand(rows, cols, rs, cs, t, ld), "cuda matmul: operand ", what, " [", rows, ",",
           cols, "] with strides (", rs, ",", cs, ") is not a GEMM operand");
}

// ---- attention kernels ---------------------------------------------------------------------------------------
/// Row r = (head, i) of S [BH·Tn, Tn] (already scaled): P = exp(S − lse) over j ≤ i (all j if !causal), 0 above.
/// With `write_lse` the row's logsumexp is computed and stored; otherwise it is read.
template <class T>
__global__ void attention_probs_kernel(const acc_t<T>* s, T* p, acc_t<T>* lse, std::int64_t rows, std::int64_t Tn,
                                       bool causal, bool write_lse) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const std::int64_t i = r % Tn, valid = causal ? i + 1 : Tn;
    const A* sr = s + r * Tn;
    T* pr = p + r * Tn;
    A l;
    if (write_lse) {
      A m = -INFINITY;
      for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) m = sr[j] > m ? sr[j] : m;
      m = detail::block_max(m, shm);
      A sum = 0;
      for (std::int64_t j = threadIdx.x; j < valid; j += blockDim.x) sum += exp(sr[j] - m);
      l = m + ::log(detail::block_sum(sum, shm));
      if (threadIdx.x == 0) lse[r] = l;
    } else {
      l = lse[r];
    }
    for (std::int64_t j = threadIdx.x; j < Tn; j += blockDim.x) pr[j] = scalar_cast<T>(j < valid ? exp(sr[j] - l) : A(0));
  }
}

/// dS = scale·P∘(dP − D_i), D_i = Σ_c dO[i, c]·O[i, c]; written over P (same element, same thread).
template <class T>
__global__ void attention_dscores_kernel(T* p, const acc_t<T>* dp, const T* out, const T* dout, std::int64_t rows,
                                         std::int64_t Tn, std::int64_t hs, acc_t<T> scale) {
  using A = acc_t<T>;
  __shared__ A shm[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    A d = 0;
    for (std::int64_t c = threadIdx.x; c < hs; c += blockDim.x) d += scalar_cast<A>(dout[r * hs + c]) * scalar_cast<A>(out[r * hs + c]);
    d = detail::block_sum(d, shm);
    for (std::int64_t j = threadIdx.x; j < Tn; j += blockDim.x) {
      const A pv = scalar_cast<A>(p[r * Tn + j]);
      p[r * Tn + j] = scalar_cast<T>(scale * pv * (dp[r * Tn + j] - d));
    }
  }
}

unsigned row_blocks(std::int64_t rows) { return static_cast<unsigned>(std::min<std::int64_t>(rows, 65535LL * 8)); }

}  // namespace

void set_allow_tf32(bool allow) { g_allow_tf32.store(allow); }
bool allow_tf32() { return g_allow_tf32.load(); }
std::int64_t gelu_epilogue_calls() { return g_gelu_epilogue_calls.load(); }
std::int64_t bgrad_epilogue_calls() { return g_bgrad_epilogue_calls.load(); }
std::int64_t dgelu_epilogue_calls() { return g_dgelu_epilogue_calls.load(); }
std::int64_t padded_gemm_calls() { return g_padded_gemm_calls.load(); }

// ---- matmul ---------------------------------------------------------------------------------------------------
template <class T>
void matmul_strided(const T* a, const Shape& sa, const T* b, const Shape& sb, T* c, const Shape& sc,
                    const Shape& batch, std::int64_t M, std::int64_t N, std::int64_t K) {
  const int nb = batch.size();
  Gemm g;
  g.M = M;
  g.N = N;
  g.K = K;
  operand(M, K, sa[nb], sa[nb + 1], g.ta, g.lda, "a");
  operand(K, N, sb[nb], sb[nb + 1], g.tb, g.ldb, "b");
  TG_CHECK(N <= 1 || sc[nb + 1] == 1, "cuda matmul: the output needs column stride 1");
  g.ldc = std::max<std::int64_t>({sc[nb], N, 1});
  // Batch dims as strided-batched calls (detail::plan_batches, tested on the CPU); reduced dims accumulate.
  const detail::BatchPlan plan = detail::plan_batches(batch, sa, sb, sc);
  g.batch = plan.inner.n;
  g.sa = plan.inner.a;
  g.sb = plan.inner.b;
  g.sc = plan.inner.c;
  plan.for_each([&](std::int64_t oa, std::int64_t ob, std::int64_t oc, bool first) {
    run_gemm<T, T>(g, a + oa, b + ob, c + oc, 1.0, first ? 0.0 : 1.0);
  });
}

template <class T>
void linear_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs, std::int64_t wcs,
                    const T* bias, T* y, std::int64_t M, std::int64_t N, std::int64_t K) {
  Gemm g;
  g.M = M;
  g.N = N;
  g.K = K;
  operand(M, K, xrs, xcs, g.ta, g.lda, "x");
  operand(K, N, wcs, wrs, g.tb, g.ldb, "weight");  // wᵀ [K, N] has strides (wcs, wrs)
  g.ldc = std::max<std::int64_t>(N, 1);
  run_gemm<T, T>(g, x, w, y, 1.0, 0.0, bias);
}

template <class T>
void linear_gelu_tanh_forward(const T* x, std::int64_t xrs, std::int64_t xcs, const T* w, std::int64_t wrs,
                              std::int64_t wcs, const T* bias, T* y, T* pre, std::int64_t M, std::int64_t N,
                              std::int64_t K) {
  if (M == 0 || N == 0) return;
  // One GEMM whose epilogue adds the bias, writes the GELU input to `pre` (aux) and gelu_tanh of it to `y`.
  // cuBLASLt requires the aux ld to be a multiple of 8 (and >= N, the rows of the column-major D'); `pre`
  // is contiguous, so its ld is N. fp64 keeps the composite (a numerical-check precision, not a fast path).
  if constexpr (!std::is_same_v<T, double>) {
    if (K > 0 && N % 8 == 0) {
      Gemm g;
      g.M = M;
      g.N = N;
      g.K = K;
      operand(M, K, xrs, xcs, g.ta, g.lda, "x");
      operand(K, N, wcs, wrs, g.tb, g.ldb, "weight");  // wᵀ [K, N] has strides (wcs, wrs)
      g.ldc = N;
      const Epilogue aux{Epilogue::Kind::gelu_aux, pre, N, nullptr};
      if (run_gemm<T, T>(g, x, w, y, 1.0, 0.0, bias, &aux)) {
        g_gelu_epilogue_calls.fetch_add(1);
        return;
      }
    }
  }
  // The composite: the GEMM (bias epilogue) into pre, then the gelu_tanh kernel gelu_tanh(x) runs.
  linear_forward<T>(x, xrs, xcs, w, wrs, wcs, bias, pre, M, N, K);
  unary_forward<T>(math::Unary::gelu_tanh, pre, Shape{N, 1}, y, Shape{M, N});
}

// Note [bias gradients in the weight GEMM]
// linear's backward needs dW = dYᵀ·X and db = Σ_rows dY: two passes over dY (the GEMM's and reduce_sum's).
// cuBLASLt's BGRADB epilogue sums the GEMM's B operand over its k dimension while the GEMM reads it; in the
// column-major call dW' = X'·dY'ᵀ that operand is dY with k = the rows M, so the sums are db (N values, in
// C's type, summed in the epilogue's fp32). Used for every linear with a bias (linear, linear_gelu_tanh on
// dpre) when the element type is 16-bit or fp32, the operands need no realigning copies (Note [16-byte
// aligned GEMM operands]) and the heuristic has an algorithm; otherwise, and always on the CPU, the GEMM
// then reduce_sum. bgrad_epilogue_calls() counts the calls that took the epilogue. The sums are the
// epilogue's own order, so db differs from reduce_sum's by rounding (fp32 accumulation both ways).
template <class T>
void linear_weight_grad(const T* dy, const T* x, std::int64_t xrs, std::int64_t xcs, T* dw, T* db, std::int64_t M,
                        std::int64_t N, std::int64_t K) {
  if (N == 0) return;
  if (dw) {
    Gemm g;  // dW [N, K] = dYᵀ [N, M] · X [M, K]
    g.M = N;
    g.N = K;
    g.K = M;
    operand(N, M, 1, N, g.ta, g.lda, "dy");
    operand(M, K, xrs, xcs, g.tb, g.ldb, "x");
    g.ldc = std::max<std::int64_t>(K, 1);
    if (db) {
      const Epilogue bgrad{Epilogue::Kind::bgradb, nullptr, 0, db};
      if (run_gemm<T, T>(g, dy, x, dw, 1.0, 0.0, nullptr, &bgrad)) {
        g_bgrad_epilogue_calls.fetch_add(1);
        return;
      }
    }
    run_gemm<T, T>(g, dy, x, dw, 1.0, 0.0);
  }
  if (db) reduce_sum<T>(dy, db, 1, M, N);
}

template <class T>
bool linear_gelu_input_grad(const T* dy, const T* w, std::int64_t wrs, std::int64_t wcs, const T* pre, T* dpre, T* db,
                            std::int64_t M, std::int64_t N, std::int64_t K) {
  // cuBLASLt: the aux (GELU input) ld a multiple of 8 and >= N, the rows of the column-major D'; pre is
  // contiguous, so its ld is N. fp64 keeps the composite.
  if constexpr (std::is_same_v<T, double>) {
    return false;
  } else {
    if (M == 0 || N == 0 || K == 0 || N % 8 != 0) return false;
    Gemm g;  // dh [M, N] = dY [M, K] · W [K, N]
    g.M = M;
    g.N = N;
    g.K = K;
    operand(M, K, K, 1, g.ta, g.lda, "dy");
    operand(K, N, wrs, wcs, g.tb, g.ldb, "weight");
    g.ldc = N;
    const Epilogue dgelu{Epilogue::Kind::dgelu, const_cast<T*>(pre), N, db};
    if (!run_gemm<T, T>(g, dy, w, dpre, 1.0, 0.0, nullptr, &dgelu)) return false;
    g_dgelu_epilogue_calls.fetch_add(1);
    return true;
  }
}

// ---- attention ------------------------------------------------------------------------------------------------
template <class T>
void attention_forward(const T* q, const T* k, const T* v, T* out, accum_t<T>* lse, std::int64_t BH, std::int64_t Tn,
                       std::int64_t hs, double scale, bool causal) {
  using A = acc_t<T>;
  if (BH * Tn == 0) return;
  if (flash_attention_forward<T>(q, k, v, out, lse, BH, Tn, hs, scale, causal)) return;  // Note [flash attention on the GPU]
  const std::int64_t tt = Tn * Tn;
  detail::Workspace ws(static_cast<std::size_t>(BH * tt) * sizeof(A)), wp(static_cast<std::size_t>(BH * tt) * sizeof(T));
  A* s = ws.as<A>();
  T* p = wp.as<T>();
  Gemm g;  // S = scale·Q·Kᵀ per head: Q [Tn,hs] (N, ld hs), Kᵀ [hs,Tn] = K stored row-major (T, ld hs)
  g.M = Tn; g.N = Tn; g.K = hs; g.ta = Trans::N; g.lda = std::max<std::int64_t>(hs, 1); g.tb = Trans::T; g.ldb = g.lda;
  g.ldc = Tn; g.batch = BH; g.sa = Tn * hs; g.sb = Tn * hs; g.sc = tt;
  run_gemm<T, A>(g, q, k, s, scale, 0.0);
  attention_probs_kernel<T><<<row_blocks(BH * Tn), detail::row_threads(Tn), 0, detail::stream()>>>(s, p, lse, BH * Tn, Tn, causal, true);
  TG_CUDA_LAUNCHED();
  Gemm o;  // O = P·V: P [Tn,Tn] (N, ld Tn), V [Tn,hs] (N, ld hs)
  o.M = Tn; o.N = hs; o.K = Tn; o.ta = Trans::N; o.lda = Tn; o.tb = Trans::N; o.ldb = std::max<std::int64_t>(hs, 1);
  o.ldc = o.ldb; o.batch = BH; o.sa = tt; o.sb = Tn * hs; o.sc = Tn * hs;
  run_gemm<T, T>(o, p, v, out, 1.0, 0.0);
}

template <class T>
void attention_backward(const T* q, const T* k, const T* v, const T* out, const T* dout, const accum_t<T>* lse, T* dq,
                        T* dk, T* dv, std::int64_t BH, std::int64_t Tn, std::int64_t hs, double scale, bool causal) {
  using A = acc_t<T>;
  if (BH * Tn == 0) return;
  if (flash_attention_backward<T>(q, k, v, out, dout, lse, dq, dk, dv, BH, Tn, hs, scale, causal)) return;
  const std::int64_t tt = Tn * Tn, th = Tn * hs, lh = std::max<std::int64_t>(hs, 1);
  detail::Workspace ws(static_cast<std::size_t>(BH * tt) * sizeof(A)), wp(static_cast<std::size_t>(BH * tt) * sizeof(T));
  A* s = ws.as<A>();
  T* p = wp.as<T>();
  auto gemm = [&](std::int64_t M, std::int64_t N, std::int64_t K, Trans ta, std::int64_t lda, std::int64_t sa, Trans tb,
                  std::int64_t ldb, std::int64_t sb, std::int64_t ldc, std::int64_t sc) {
    Gemm g;
    g.M = M; g.N = N; g.K = K; g.ta = ta; g.lda = lda; g.sa = sa; g.tb = tb; g.ldb = ldb; g.sb = sb; g.ldc = ldc; g.sc = sc;
    g.batch = BH;
    return g;
  };
  // P again, from S = scale·QKᵀ and the saved lse
  run_gemm<T, A>(gemm(Tn, Tn, hs, Trans::N, lh, th, Trans::T, lh, th, Tn, tt), q, k, s, scale, 0.0);
  attention_probs_kernel<T><<<row_blocks(BH * Tn), detail::row_threads(Tn), 0, detail::stream()>>>(s, p, const_cast<A*>(lse), BH * Tn, Tn,
                                                                              causal, false);
  TG_CUDA_LAUNCHED();
  // dV = Pᵀ·dO
  run_gemm<T, T>(gemm(Tn, hs, Tn, Trans::T, Tn, tt, Trans::N, lh, th, lh, th), p, dout, dv, 1.0, 0.0);
  // dP = dO·Vᵀ (fp32, over S)
  run_gemm<T, A>(gemm(Tn, Tn, hs, Trans::N, lh, th, Trans::T, lh, th, Tn, tt), dout, v, s, 1.0, 0.0);
  // dS = scale·P∘(dP − D), over P
  attention_dscores_kernel<T><<<row_blocks(BH * Tn), detail::row_threads(std::max(Tn, hs)), 0, detail::stream()>>>(
      p, s, out, dout, BH * Tn, Tn, hs, static_cast<A>(scale));
  TG_CUDA_LAUNCHED();
  // dQ = dS·K, dK = dSᵀ·Q
  run_gemm<T, T>(gemm(Tn, hs, Tn, Trans::N, Tn, tt, Trans::N, lh, th, lh, th), p, k, dq, 1.0, 0.0);
  run_gemm<T, T>(gemm(Tn, hs, Tn, Trans::T, Tn, tt, Trans::N, lh, th, lh, th), p, q, dk, 1.0, 0.0);
}

// ---- attention over a fused QKV projection's heads -------------------------------------------------------------
// The fused kernels read and write the packed layouts directly (Note [flash attention on the GPU]); otherwise
// the heads are copied into contiguous [B, H, Tn, hs] buffers for the composite, and the results copied back.
namespace {
/// Part `part` of a [B, Tn, parts, H, hs] array seen as [B, H, Tn, hs]: its sizes and element strides.
std::pair<Shape, Shape> packed_heads(std::int64_t B, std::int64_t H, std::int64_t Tn, std::int64_t hs, std::int64_t parts) {
  const std::int64_t C = H * hs;
  return {Shape{B, H, Tn, hs}, Shape{Tn * parts * C, hs, parts * C, 1}};
}
}  // namespace

template <class T>
void attention_qkv_forward(const T* qkv, T* out, accum_t<T>* lse, std::int64_t B, std::int64_t H, std::int64_t Tn,
                           std::int64_t hs, double scale) {
  const std::int64_t n = B * H * Tn * hs, C = H * hs;
  if (n == 0) return;
  if (flash_attention_qkv_forward<T>(qkv, out, lse, B, H, Tn, hs, scale)) return;
  const auto [sizes, packed3] = packed_heads(B, H, Tn, hs, 3);
  const Shape packed1 = packed_heads(B, H, Tn, hs, 1).second, dense = contiguous_strides(sizes);
  detail::Workspace wq(static_cast<std::size_t>(4 * n) * sizeof(T));
  T* q = wq.as<T>();
  T *k = q + n, *v = k + n, *o = v + n;
  copy_strided<T, T>(qkv, packed3, q, dense, sizes);
  copy_strided<T, T>(qkv + C, packed3, k, dense, sizes);
  copy_strided<T, T>(qkv + 2 * C, packed3, v, dense, sizes);
  attention_forward<T>(q, k, v, o, lse, B * H, Tn, hs, scale, true);
  copy_strided<T, T>(o, dense, out, packed1, sizes);
}

template <class T>
void attention_qkv_backward(const T* qkv, const T* out, const T* dout, const accum_t<T>* lse, T* dqkv, std::int64_t B,
                            std::int64_t H, std::int64_t Tn, std::int64_t hs, double scale) {
  const std::int64_t n = B * H * Tn * hs, C = H * hs;
  if (n == 0) return;
  if (flash_attention_qkv_backward<T>(qkv, out, dout, lse, dqkv, B, H, Tn, hs, scale)) return;
  const auto [sizes, packed3] = packed_heads(B, H, Tn, hs, 3);
  const Shape packed1 = packed_heads(B, H, Tn, hs, 1).second, dense = contiguous_strides(sizes);
  detail::Workspace ws(static_cast<std::size_t>(8 * n) * sizeof(T));
  T* q = ws.as<T>();
  T *k = q + n, *v = k + n, *o = v + n, *g = o + n, *dq = g + n, *dk = dq + n, *dv = dk + n;
  copy_strided<T, T>(qkv, packed3, q, dense, sizes);
  copy_strided<T, T>(qkv + C, packed3, k, dense, sizes);
  copy_strided<T, T>(qkv + 2 * C, packed3, v, dense, sizes);
  copy_strided<T, T>(out, packed1, o, dense, sizes);
  copy_strided<T, T>(dout, packed1, g, dense, sizes);
  attention_backward<T>(q, k, v, o, g, lse, dq, dk, dv, B * H, Tn, hs, scale, true);
  copy_strided<T, T>(dq, dense, dqkv, packed3, sizes);
  copy_strided<T, T>(dk, dense, dqkv + C, packed3, sizes);
  copy_strided<T, T>(dv, dense, dqkv + 2 * C, packed3, sizes);
}

TG_INSTANTIATE_KERNELS(TG_KERNELS_MATMUL, TG_FLOATING_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_ATTENTION, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

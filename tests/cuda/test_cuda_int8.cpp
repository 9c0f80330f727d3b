// The GPU int8 path (detail/cuda/gemm_int8.hpp, Note [int8 GEMM on the GPU]) against the CPU, bit for bit:
// gemm_s8s8s32_nt (cuBLASLt's IMMA kernels, through zero-padded copies where an operand misses their
// requirements) and its plain kernel equal backend::cpu::gemm_s8s8s32_reference for K not a multiple of 4,
// odd M and N, M = 1, K = 1, K = 0, row strides above the row widths, misaligned pointers and the int8 extremes
// at K = 65536, and never write C's row padding; gemm_s8_dequant equals backend::cpu::gemm_s8_packed_dequant
// with and without a bias; the quantizers equal tg::quant::quantize_rows / quantize_with_scale (ties to even,
// zero rows, subnormal scales, saturation). Size errors are tg::Errors. Every test skips without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"
#include "typegrad/detail/cpu/gemm_int8.hpp"
#include "typegrad/detail/cuda/gemm_int8.hpp"
#include "typegrad/detail/cuda/runtime.hpp"
#include "typegrad/quant/int8.hpp"

namespace test_cuda_int8_cpp {  // the file's own names (Note [unity test sources])

namespace {

namespace cuda = tg::backend::cuda;
using tg::backend::cpu::Trans;
using i64 = std::int64_t;

class CudaInt8Gemm : public tg::testing::GpuTest {};
class CudaInt8Dequant : public tg::testing::GpuTest {};
class CudaInt8Quantize : public tg::testing::GpuTest {};

/// Device memory from the caching allocator, with room for an offset of up to 16 elements (misaligned views).
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(std::size_t n) : bytes_((n + 16) * sizeof(T)) { p_ = tg::allocator<tg::cuda>().allocate(bytes_); }
  ~DeviceBuffer() { tg::allocator<tg::cuda>().deallocate(p_, bytes_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* at(std::size_t offset = 0) const { return static_cast<T*>(p_) + offset; }
  void upload(const std::vector<T>& h, std::size_t offset = 0) {
    if (!h.empty()) cuda::copy_host_to_device(at(offset), h.data(), h.size() * sizeof(T));
  }
  std::vector<T> download(std::size_t n, std::size_t offset = 0) const {
    std::vector<T> h(n);
    if (n) cuda::copy_device_to_host(h.data(), at(offset), n * sizeof(T));
    return h;
  }

 private:
  std::size_t bytes_;
  void* p_;
};

/// The first index where a and b differ bit for bit, or -1.
template <class T>
i64 first_mismatch(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<i64>(i);
  return -1;
}

// ---- gemm_s8s8s32_nt ------------------------------------------------------------------------------------

enum class Fill { random, sym127, min, max, mixed };

/// rows x width int8 values in a buffer of row stride ld; the bytes past the width are random too, so a
/// kernel that read them would (almost surely) give different sums.
std::vector<std::int8_t> int8_matrix(i64 rows, i64 width, i64 ld, Fill fill, std::mt19937& rng) {
  std::vector<std::int8_t> v(static_cast<std::size_t>(rows * ld));
  std::uniform_int_distribution<int> u(-128, 127), sign(0, 1);
  for (auto& x : v) x = static_cast<std::int8_t>(u(rng));
  for (i64 r = 0; r < rows; ++r)
    for (i64 k = 0; k < width; ++k) {
      std::int8_t& x = v[static_cast<std::size_t>(r * ld + k)];
      switch (fill) {
        case Fill::random: break;
        case Fill::sym127: x = sign(rng) ? std::int8_t(127) : std::int8_t(-127); break;
        case Fill::min: x = -128; break;
        case Fill::max: x = 127; break;
        case Fill::mixed: x = (r + k) % 3 == 0 ? std::int8_t(127) : std::int8_t(-128); break;
      }
    }
  return v;
}

struct GemmCase {
  i64 M, N, K, lda, ldw, ldc;
  std::size_t off_a = 0, off_w = 0, off_c = 0;  // elements past a 256-byte aligned block
  bool padded = true;                           // expected to go through realigned copies
  Fill fa = Fill::random, fw = Fill::random;
};

std::string describe(const GemmCase& c) {
  return "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + " K=" + std::to_string(c.K) + " lda=" +
         std::to_string(c.lda) + " ldw=" + std::to_string(c.ldw) + " ldc=" + std::to_string(c.ldc) + " offsets=(" +
         std::to_string(c.off_a) + "," + std::to_string(c.off_w) + "," + std::to_string(c.off_c) + ")";
}

/// Runs the case on the GPU (cuBLASLt path, or the plain kernel) and on the CPU reference; C starts as a
/// sentinel, so the row padding past N must come back untouched.
void check_gemm(const GemmCase& c, bool plain_kernel) {
  SCOPED_TRACE(describe(c) + (plain_kernel ? " (plain kernel)" : " (cuBLASLt)"));
  std::mt19937 rng(static_cast<unsigned>(c.M * 1000003 + c.N * 1009 + c.K));
  const auto A = int8_matrix(c.M, c.K, c.lda, c.fa, rng);
  const auto W = int8_matrix(c.N, c.K, c.ldw, c.fw, rng);
  std::vector<std::int32_t> expect(static_cast<std::size_t>(c.M * c.ldc), 0x5A5A5A5A);
  tg::backend::cpu::gemm_s8s8s32_reference(Trans::N, Trans::T, c.M, c.N, c.K, A.data(), c.lda, W.data(), c.ldw,
                                           expect.data(), c.ldc);

  DeviceBuffer<std::int8_t> da(A.size()), dw(W.size());
  DeviceBuffer<std::int32_t> dc(expect.size());
  da.upload(A, c.off_a);
  dw.upload(W, c.off_w);
  dc.upload(std::vector<std::int32_t>(expect.size(), 0x5A5A5A5A), c.off_c);
  const i64 padded = cuda::int8_padded_gemm_calls(), fallbacks = cuda::int8_gemm_fallback_calls();
  if (plain_kernel)
    cuda::gemm_s8s8s32_nt_reference(c.M, c.N, c.K, da.at(c.off_a), c.lda, dw.at(c.off_w), c.ldw, dc.at(c.off_c), c.ldc);
  else
    cuda::gemm_s8s8s32_nt(c.M, c.N, c.K, da.at(c.off_a), c.lda, dw.at(c.off_w), c.ldw, dc.at(c.off_c), c.ldc);
  const auto got = dc.download(expect.size(), c.off_c);
  const i64 bad = first_mismatch(got, expect);
  EXPECT_EQ(bad, -1) << "C[" << bad << "] (row " << (bad < 0 ? 0 : bad / c.ldc) << ", column " << (bad < 0 ? 0 : bad % c.ldc)
                     << ") is " << (bad < 0 ? 0 : got[bad]) << ", expected " << (bad < 0 ? 0 : expect[bad]);
  if (!plain_kernel && c.K > 0) {
    EXPECT_EQ(cuda::int8_gemm_fallback_calls(), fallbacks) << "cuBLASLt found no int8 algorithm: the plain kernel ran";
    EXPECT_EQ(cuda::int8_padded_gemm_calls(), padded + (c.padded ? 1 : 0))
        << (c.padded ? "expected realigned copies" : "expected the operands as given");
  }
}

/// Shapes: aligned ones cuBLASLt takes as given (row strides above the widths included), and every way of
/// missing a requirement: K % 4, N % 4, row strides not multiples of 16 bytes, misaligned pointers.
std::vector<GemmCase> gemm_cases() {
  return {
      {64, 64, 64, 64, 64, 64, 0, 0, 0, false},
      {128, 96, 768, 768, 768, 96, 0, 0, 0, false},
      {16, 8, 32, 48, 64, 12, 0, 0, 0, false},   // strides above the widths, all 16-byte multiples
      {5, 12, 20, 32, 32, 12, 0, 0, 0, false},   // K % 16 != 0 but K % 4 == 0 with aligned strides
      {7, 5, 13, 13, 13, 5},                     // K % 4, odd M and N
      {1, 33, 100, 100, 100, 33},                // M = 1 (a decoding step), ld not a multiple of 16
      {1, 1, 1, 1, 1, 1},
      {3, 4, 1, 1, 1, 4},                        // K = 1
      {5, 1, 16, 16, 16, 1},                     // N = 1
      {9, 11, 40, 43, 45, 17},                   // every row stride above its width, none aligned
      {12, 8, 64, 64, 64, 8, 1, 3, 1},           // misaligned pointers only
      {12, 8, 64, 64, 64, 8, 0, 0, 2},           // C 8-byte aligned only
      {33, 250, 768, 768, 768, 250},             // N % 4 = 2: W padded with zero rows, C copied out
      {100, 1001, 333, 340, 333, 1003, 4, 0, 3},
      {3, 5, 0, 1, 1, 5, 0, 0, 0, false},        // K = 0: C = 0
  };
}

TEST_F(CudaInt8Gemm, CublasLtMatchesTheCpuReferenceBitForBit) {
  for (const GemmCase& c : gemm_cases()) check_gemm(c, false);
}

TEST_F(CudaInt8Gemm, PlainKernelMatchesTheCpuReferenceBitForBit) {
  for (const GemmCase& c : gemm_cases()) check_gemm(c, true);
}

// |Σ| reaches 65536 · 128 · 128 = 2^30 with every entry -128: exact in int32 whatever the summation order.
TEST_F(CudaInt8Gemm, ExactAtTheInt8ExtremesUpToTheLargestK) {
  const i64 K = tg::backend::cpu::kInt8MaxK;
  for (bool plain : {false, true}) {
    check_gemm({2, 4, K, K, K, 4, 0, 0, 0, false, Fill::min, Fill::min}, plain);
    check_gemm({2, 4, K, K, K, 4, 0, 0, 0, false, Fill::max, Fill::min}, plain);
    check_gemm({3, 5, K, K, K, 5, 0, 0, 0, true, Fill::mixed, Fill::min}, plain);
    check_gemm({3, 4, K, K, K, 4, 0, 0, 0, false, Fill::sym127, Fill::sym127}, plain);
    check_gemm({2, 3, K - 3, K, K, 3, 0, 0, 0, true, Fill::min, Fill::min}, plain);  // K padded up to 65536
  }
}

TEST_F(CudaInt8Gemm, BadSizesAreErrors) {
  DeviceBuffer<std::int8_t> a(16), w(16);
  DeviceBuffer<std::int32_t> c(16);
  const i64 K = tg::backend::cpu::kInt8MaxK + 1;
  try {
    cuda::gemm_s8s8s32_nt(1, 1, K, a.at(), K, w.at(), K, c.at(), 1);
    FAIL() << "K = 65537 was accepted";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("K = 65537 exceeds kInt8MaxK = 65536"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cuda::gemm_s8s8s32_nt_reference(1, 1, K, a.at(), K, w.at(), K, c.at(), 1), tg::Error);
  EXPECT_THROW(cuda::gemm_s8_dequant(1, 1, K, a.at(), K, nullptr, w.at(), K, nullptr, nullptr, nullptr, 1), tg::Error);
  EXPECT_THROW(cuda::gemm_s8s8s32_nt(-1, 1, 4, a.at(), 4, w.at(), 4, c.at(), 1), tg::Error);
  EXPECT_THROW(cuda::gemm_s8s8s32_nt(2, 2, 8, a.at(), 7, w.at(), 8, c.at(), 2), tg::Error);  // lda < K
  EXPECT_THROW(cuda::gemm_s8s8s32_nt(2, 4, 8, a.at(), 8, w.at(), 8, c.at(), 3), tg::Error);  // ldc < N
}

// ---- gemm_s8_dequant ------------------------------------------------------------------------------------

/// y = dequantized A·Wᵀ (+ bias) on the GPU and with the CPU's packed kernel, compared bit for bit; y starts
/// as a sentinel so its row padding must come back untouched.
void check_dequant(i64 M, i64 N, i64 K, i64 lda, i64 ldw, i64 ldy, bool with_bias) {
  SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N) + " K=" + std::to_string(K) +
               (with_bias ? " with bias" : " without bias"));
  std::mt19937 rng(static_cast<unsigned>(M * 7919 + N * 31 + K));
  const auto A = int8_matrix(M, K, lda, Fill::random, rng);
  const auto W = int8_matrix(N, K, ldw, Fill::random, rng);
  // Scales as the quantizers make them (absmax / 127 over several magnitudes), a bias of either sign.
  std::uniform_real_distribution<float> mag(-6.f, 3.f);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> a_scale(static_cast<std::size_t>(M)), w_scale(static_cast<std::size_t>(N)), bias(static_cast<std::size_t>(N));
  for (auto& s : a_scale) s = std::exp2(mag(rng)) / 127.f;
  for (auto& s : w_scale) s = std::exp2(mag(rng)) / 127.f;
  for (auto& b : bias) b = normal(rng);
  std::vector<float> expect(static_cast<std::size_t>(M * ldy), -1234.5f);
  const tg::backend::cpu::PackedInt8Weights packed(W.data(), N, K, ldw);
  tg::backend::cpu::gemm_s8_packed_dequant(M, A.data(), lda, a_scale.data(), packed, w_scale.data(),
                                           with_bias ? bias.data() : nullptr, expect.data(), ldy);

  DeviceBuffer<std::int8_t> da(A.size()), dw(W.size());
  DeviceBuffer<float> das(a_scale.size()), dws(w_scale.size()), db(bias.size()), dy(expect.size());
  da.upload(A);
  dw.upload(W);
  das.upload(a_scale);
  dws.upload(w_scale);
  db.upload(bias);
  dy.upload(std::vector<float>(expect.size(), -1234.5f));
  const i64 fallbacks = cuda::int8_gemm_fallback_calls();
  cuda::gemm_s8_dequant(M, N, K, da.at(), lda, das.at(), dw.at(), ldw, dws.at(), with_bias ? db.at() : nullptr, dy.at(), ldy);
  const auto got = dy.download(expect.size());
  const i64 bad = first_mismatch(got, expect);
  EXPECT_EQ(bad, -1) << "y[" << bad << "] is " << (bad < 0 ? 0.f : got[bad]) << ", expected " << (bad < 0 ? 0.f : expect[bad]);
  EXPECT_EQ(cuda::int8_gemm_fallback_calls(), fallbacks) << "cuBLASLt found no int8 algorithm: the plain kernel ran";
}

TEST_F(CudaInt8Dequant, MatchesTheCpuPackedKernelBitForBit) {
  for (bool with_bias : {true, false}) {
    check_dequant(7, 5, 13, 13, 13, 5, with_bias);
    check_dequant(1, 50, 100, 100, 100, 50, with_bias);
    check_dequant(64, 96, 768, 768, 768, 96, with_bias);
    check_dequant(5, 17, 3072, 3072, 3080, 20, with_bias);
    check_dequant(33, 2304, 768, 768, 768, 2304, with_bias);  // GPT-2's c_attn
  }
}

// ---- quantizers ---------------------------------------------------------------------------------------

/// x [M,K] with row stride ldx: random rows over many magnitudes, and rows that pin the rules down. The
/// padding past K holds 1e30, so a quantizer that read it would get another scale.
struct Rows {
  i64 M, K, ldx;
  std::vector<float> x;
};
Rows test_rows() {
  const i64 M = 12, K = 37, ldx = 41;
  Rows r{M, K, ldx, std::vector<float>(static_cast<std::size_t>(M * ldx), 1e30f)};
  std::mt19937 rng(2026);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::uniform_real_distribution<float> mag(-20.f, 20.f);
  auto at = [&](i64 m, i64 k) -> float& { return r.x[static_cast<std::size_t>(m * ldx + k)]; };
  for (i64 m = 0; m < M; ++m) {
    const float s = std::exp2(mag(rng));
    for (i64 k = 0; k < K; ++k) at(m, k) = normal(rng) * s;
  }
  for (i64 k = 0; k < K; ++k) at(0, k) = k % 2 ? -0.f : 0.f;  // a zero row: scale 1, q = 0
  // max |x| = 127, so s = 1 and the quotients are the values: ties go to the even neighbour.
  const float ties[] = {127.f, 2.5f, -3.5f, 0.5f, -0.5f, 1.5f, 126.5f, -126.5f, -127.f, 0.f};
  for (i64 k = 0; k < K; ++k) at(1, k) = k < 10 ? ties[k] : static_cast<float>(k) - 0.5f;
  for (i64 k = 0; k < K; ++k) at(2, k) = static_cast<float>(k % 3 - 1) * 1e-39f * static_cast<float>(k + 1);  // subnormal scale
  for (i64 k = 0; k < K; ++k) at(3, k) = k == 5 ? -3e38f : 1.f;  // one huge value, the rest quantize to 0
  return r;
}

TEST_F(CudaInt8Quantize, RowsMatchTheCpuBitForBit) {
  const Rows r = test_rows();
  const i64 M = r.M, K = r.K;
  std::vector<std::int8_t> q_cpu(static_cast<std::size_t>(M * K));
  std::vector<float> s_cpu(static_cast<std::size_t>(M));
  tg::quant::quantize_rows(r.x.data(), M, K, r.ldx, q_cpu.data(), s_cpu.data());

  DeviceBuffer<float> dx(r.x.size()), ds(static_cast<std::size_t>(M));
  DeviceBuffer<std::int8_t> dq(q_cpu.size());
  dx.upload(r.x);
  cuda::quantize_rows_int8(dx.at(), M, K, r.ldx, dq.at(), ds.at());
  const auto q = dq.download(q_cpu.size());
  const auto s = ds.download(s_cpu.size());
  EXPECT_EQ(first_mismatch(s, s_cpu), -1);
  const i64 bad = first_mismatch(q, q_cpu);
  EXPECT_EQ(bad, -1) << "q[" << bad << "] is " << (bad < 0 ? 0 : int(q[bad])) << ", the CPU's " << (bad < 0 ? 0 : int(q_cpu[bad]));
  // The rules themselves, on the rows built for them.
  EXPECT_EQ(s[0], 1.f);
  EXPECT_EQ(s[1], 1.f);
  const int even[] = {127, 2, -4, 0, 0, 2, 126, -126, -127, 0};
  for (int k = 0; k < 10; ++k) EXPECT_EQ(int(q[static_cast<std::size_t>(K + k)]), even[k]) << "tie " << k;
  EXPECT_GT(s[2], 0.f);
  EXPECT_LT(s[2], std::numeric_limits<float>::min()) << "the row meant to have a subnormal scale does not";
}

TEST_F(CudaInt8Quantize, EmptyRowsGetScaleOne) {
  DeviceBuffer<float> ds(3), dx(1);
  DeviceBuffer<std::int8_t> dq(1);
  ds.upload({-1.f, -1.f, -1.f});
  cuda::quantize_rows_int8(dx.at(), 3, 0, 0, dq.at(), ds.at());
  EXPECT_EQ(ds.download(3), (std::vector<float>{1.f, 1.f, 1.f}));
}

TEST_F(CudaInt8Quantize, WithScaleMatchesTheCpuBitForBit) {
  const Rows r = test_rows();
  const i64 M = r.M, K = r.K;
  DeviceBuffer<float> dx(r.x.size());
  DeviceBuffer<std::int8_t> dq(static_cast<std::size_t>(M * K));
  dx.upload(r.x);
  // Saturating (most rows exceed 127·s), ties (s = 0.5 turns 0.25, 0.75, -1.25 into 0.5, 1.5, -2.5), subnormal.
  for (float scale : {0.05f, 0.5f, 3.7f, 1e-39f, 1e30f}) {
    SCOPED_TRACE("scale " + std::to_string(scale));
    std::vector<std::int8_t> q_cpu(static_cast<std::size_t>(M * K));
    tg::quant::quantize_with_scale(r.x.data(), M, K, r.ldx, scale, q_cpu.data());
    cuda::quantize_int8_with_scale(dx.at(), M, K, r.ldx, scale, dq.at());
    const auto q = dq.download(q_cpu.size());
    const i64 bad = first_mismatch(q, q_cpu);
    EXPECT_EQ(bad, -1) << "q[" << bad << "] is " << (bad < 0 ? 0 : int(q[bad])) << ", the CPU's " << (bad < 0 ? 0 : int(q_cpu[bad]));
  }
  const std::vector<float> ties = {0.25f, 0.75f, -1.25f, 1e6f, -1e6f};
  DeviceBuffer<float> dt(ties.size());
  dt.upload(ties);
  cuda::quantize_int8_with_scale(dt.at(), 1, 5, 5, 0.5f, dq.at());
  const auto q = dq.download(5);
  EXPECT_EQ((std::vector<int>{q[0], q[1], q[2], q[3], q[4]}), (std::vector<int>{0, 2, -2, 127, -127}));
  EXPECT_THROW(cuda::quantize_int8_with_scale(dt.at(), 1, 5, 5, 0.f, dq.at()), tg::Error);
  EXPECT_THROW(cuda::quantize_int8_with_scale(dt.at(), 1, 5, 5, std::numeric_limits<float>::quiet_NaN(), dq.at()), tg::Error);
  EXPECT_THROW(cuda::quantize_int8_with_scale(dt.at(), 1, 5, 5, std::numeric_limits<float>::infinity(), dq.at()), tg::Error);
}

}  // namespace

namespace {

class CudaQuantizedGpt : public tg::testing::GpuTest {};

// The int8 GPT on the GPU against the same model on the CPU: each int8 product is equal bit for bit (the tests
// above), the fp32 parts (LayerNorm, attention, GELU) round differently per device, so the logits agree to fp32
// accuracy; dynamic and static scales, with and without the int8 LM head.
TEST_F(CudaQuantizedGpt, MatchesTheCpuModel) {
  tg::nn::GPTConfig c = tg::nn::GPTConfig::preset("tiny", 61);
  c.n_layer = 2;
  c.n_embd = 64;
  c.n_head = 4;
  c.block_size = 24;
  tg::Generator gen(21);
  const tg::nn::GPT model(c, gen);
  tg::Generator tok(22);
  auto tokens = [&](std::int64_t B, std::int64_t T) {
    auto t = tg::Tensor<std::int64_t>::empty({B, T});
    for (std::int64_t i = 0; i < B * T; ++i) t.data()[i] = static_cast<std::int64_t>(tok.next_u64() % 61);
    return t;
  };
  const auto idx = tokens(3, 24);
  for (bool is_static : {false, true}) {
    const auto q = tg::quant::quantize(
        model,
        {.activations = is_static ? tg::quant::ActivationScheme::static_per_tensor : tg::quant::ActivationScheme::dynamic_per_token,
         .lm_head = is_static},
        {tokens(2, 24)});
    const tg::quant::CudaQuantizedGPT gq(q);
    const auto want = q.forward<float>(idx).to_vector();
    const auto got = gq.forward<float>(idx).to<tg::cpu>().to_vector();
    ASSERT_EQ(got.size(), want.size());
    double worst = 0;
    for (std::size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(static_cast<double>(got[i]) - want[i]));
    // A quantized activation can round the other way after a last-bit difference upstream: one step of the
    // activation's scale in one product, far below the logits' spread (~1), but far above fp32 rounding.
    EXPECT_LT(worst, 2e-2) << (is_static ? "static" : "dynamic");
  }
}

}  // namespace

}  // namespace test_cuda_int8_cpp

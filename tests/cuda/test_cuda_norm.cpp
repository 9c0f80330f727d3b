// The GPU's LayerNorm forward kernels (Note [norm forward in packs]): add_layernorm equals `add` then `layernorm` on
// the GPU bit for bit, forward and every gradient, on rows that take the warp-per-row kernel (whole 16-byte packs,
// with x and r read in packs or, from a misaligned view, element by element) and on rows that take the
// block-per-row kernels. The op database's CPU-vs-CUDA entries (`packed_rows` samples) compare each kernel with the
// CPU. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <typegrad/ops/add_layernorm.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_norm_cpp {  // the file's own names (Note [unity test sources])

namespace {

template <class T>
tg::Tensor<T, tg::cuda> leaf(const tg::Tensor<float>& host) {
  tg::Tensor<T, tg::cuda> t = host.to<T>().template to<tg::cuda>();
  t.requires_grad_();
  return t;
}

/// rows x n values on the GPU as a contiguous view starting one element into its storage (a misaligned pointer).
template <class T>
tg::Tensor<T, tg::cuda> misaligned_leaf(const tg::Tensor<float>& host) {
  const std::int64_t count = host.numel();
  tg::Tensor<float> wide = tg::Tensor<float>::zeros({count + 1});
  std::memcpy(wide.data() + 1, host.contiguous().data(), static_cast<std::size_t>(count) * sizeof(float));
  tg::Tensor<T, tg::cuda> t = wide.to<T>().template to<tg::cuda>().narrow(0, 1, count).view(host.shape());
  t.requires_grad_();
  return t;
}

template <class T>
bool same_bits(const tg::Tensor<T, tg::cuda>& a, const tg::Tensor<T, tg::cuda>& b) {
  const auto av = a.detach().template to<tg::cpu>().contiguous().to_vector();
  const auto bv = b.detach().template to<tg::cpu>().contiguous().to_vector();
  return av.size() == bv.size() && std::memcmp(av.data(), bv.data(), av.size() * sizeof(T)) == 0;
}

template <class T>
void check_against_unfused(std::int64_t rows, std::int64_t n, bool misaligned_x) {
  tg::Generator gen(7);
  const auto x0 = tg::Tensor<float>::normal({rows, n}, 0.f, 1.f, gen), r0 = tg::Tensor<float>::normal({rows, n}, 0.f, 1.f, gen);
  const auto w0 = tg::Tensor<float>::normal({n}, 1.f, 0.2f, gen), b0 = tg::Tensor<float>::normal({n}, 0.f, 0.2f, gen);
  const auto u0 = tg::Tensor<float>::normal({rows, n}, 0.f, 1.f, gen);
  auto xf = misaligned_x ? misaligned_leaf<T>(x0) : leaf<T>(x0), xu = misaligned_x ? misaligned_leaf<T>(x0) : leaf<T>(x0);
  auto rf = leaf<T>(r0), ru = leaf<T>(r0), wf = leaf<T>(w0), wu = leaf<T>(w0), bf = leaf<T>(b0), bu = leaf<T>(b0);
  const auto u = u0.to<T>().template to<tg::cuda>();
  const auto f = tg::add_layernorm(xf, rf, wf, bf);
  const auto hu = tg::add(xu, ru), yu = tg::layernorm(hu, wu, bu);
  const std::string what = std::string(tg::dtype_traits<T>::name) + " [" + std::to_string(rows) + "," + std::to_string(n) + "]" +
                           (misaligned_x ? " misaligned x" : "");
  EXPECT_TRUE(same_bits(f.sum, hu)) << "the sum, " << what;
  EXPECT_TRUE(same_bits(f.out, yu)) << "the LayerNorm, " << what;
  tg::add(f.sum, f.out * u).backward(u);
  tg::add(hu, yu * u).backward(u);
  EXPECT_TRUE(same_bits(xf.grad(), xu.grad())) << "dx, " << what;
  EXPECT_TRUE(same_bits(rf.grad(), ru.grad())) << "dbranch, " << what;
  EXPECT_TRUE(same_bits(wf.grad(), wu.grad())) << "dweight, " << what;
  EXPECT_TRUE(same_bits(bf.grad(), bu.grad())) << "dbias, " << what;
}

TEST(CudaNorm, AddLayerNormEqualsAddThenLayerNormBitForBit) {
  TG_SKIP_WITHOUT_GPU();
  for (const bool misaligned : {false, true}) {
    check_against_unfused<float>(64, 768, misaligned);  // packed rows (GPT-2's width)
    check_against_unfused<tg::bf16>(64, 768, misaligned);
    check_against_unfused<tg::fp16>(5, 256, misaligned);  // one pack per lane
    check_against_unfused<double>(3, 128, misaligned);
  }
  check_against_unfused<float>(6, 37, false);      // the block-per-row kernels
  check_against_unfused<tg::bf16>(9, 128, false);  // under one bf16 pack per lane: the block-per-row kernels
}

// The packed forward and the block-per-row one (a misaligned input forces the latter) against the CPU in fp64, for
// LayerNorm and RMSNorm in every precision: the same function, each in its own summation order.
template <class T>
void check_packed_and_block(std::int64_t rows, std::int64_t n, double tol) {
  tg::Generator gen(11);
  const auto x0 = tg::Tensor<float>::normal({rows, n}, 0.5f, 2.f, gen), w0 = tg::Tensor<float>::normal({n}, 1.f, 0.2f, gen),
             b0 = tg::Tensor<float>::normal({n}, 0.f, 0.2f, gen);
  const auto x = x0.to<T>().template to<tg::cuda>(), xm = misaligned_leaf<T>(x0).detach();
  const auto w = w0.to<T>().template to<tg::cuda>(), b = b0.to<T>().template to<tg::cuda>();
  // the reference: the same (rounded) values through the CPU op in fp64
  const auto x64 = x0.to<T>().template to<double>(), w64 = w0.to<T>().template to<double>(), b64 = b0.to<T>().template to<double>();
  const std::string what = std::string(tg::dtype_traits<T>::name) + " [" + std::to_string(rows) + "," + std::to_string(n) + "]";
  for (const bool rms : {false, true}) {
    const auto run = [&](const tg::Tensor<T, tg::cuda>& in) {
      return (rms ? tg::rmsnorm(in, w) : tg::layernorm(in, w, b)).template to<tg::cpu>().template to<double>().to_vector();
    };
    const auto packed = run(x), block = run(xm);
    const auto ref = (rms ? tg::rmsnorm(x64, w64) : tg::layernorm(x64, w64, b64)).to_vector();
    ASSERT_EQ(packed.size(), ref.size());
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_NEAR(packed[i], ref[i], tol * (1.0 + std::abs(ref[i]))) << (rms ? "rmsnorm" : "layernorm") << " packed, " << what << ", element " << i;
      ASSERT_NEAR(block[i], ref[i], tol * (1.0 + std::abs(ref[i]))) << (rms ? "rmsnorm" : "layernorm") << " block, " << what << ", element " << i;
    }
  }
}

TEST(CudaNorm, PackedForwardAgreesWithTheBlockKernelAndTheCpu) {
  TG_SKIP_WITHOUT_GPU();
  check_packed_and_block<float>(33, 768, 2e-5);
  check_packed_and_block<double>(7, 128, 1e-12);
  check_packed_and_block<tg::bf16>(33, 768, 1e-2);  // one rounding of the output to bf16
  check_packed_and_block<tg::fp16>(9, 256, 2e-3);
}

}  // namespace

}  // namespace test_cuda_norm_cpp

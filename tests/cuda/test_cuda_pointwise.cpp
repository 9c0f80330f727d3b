// tg::pointwise's GPU half (Note [pointwise kernels through NVRTC]): the expression printed as CUDA source, the
// generated translation units compiled by NVRTC for every element type (no GPU needed: this runs in CI), and,
// on a GPU, the generated kernels against the CPU's fused loop, forward and gradients.
#include <gtest/gtest.h>
#include <nvrtc.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <typegrad/detail/cuda/pointwise.hpp>
#include <typegrad/ops/pointwise.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_pointwise_cpp {  // the file's own names (Note [unity test sources])

namespace {

using namespace tg::pw;
namespace cu = tg::backend::cuda;

const auto kExpr = tanh(_0 * 0.5 + _1) * _2 + sigmoid(_0) / (1.0 + exp(-_1)) - sqrt(_2) * relu(_0) + log(_2) / 3.0;

TEST(PointwiseNvrtc, AnExpressionPrintsAsCudaSource) {
  std::vector<double> lits;
  EXPECT_EQ(source(tanh(_0 * 0.5 + _1), &lits), "(tg_tanh(((x0 * tg_lit<S>(L[0])) + x1)))");
  EXPECT_EQ(source(-_2 / 3.0, &lits), "((-(x2)) / tg_lit<S>(L[1]))");
  EXPECT_EQ(lits, (std::vector<double>{0.5, 3.0}));  // the launch's table, in printing order
  EXPECT_EQ(source(relu(_0) - sigmoid(_1)), "((tg_relu(x0)) - (tg_sigmoid(x1)))");
  // without a table (or past its 16 entries): the exact bits, -0.0 and non-finite values included
  EXPECT_EQ(source(_0 * 0.1), "(x0 * tg_lit<S>(__longlong_as_double((long long)0x3fb999999999999aULL)))");
  EXPECT_EQ(source(_0 + -0.0), "(x0 + tg_lit<S>(__longlong_as_double((long long)0x8000000000000000ULL)))");
  EXPECT_NE(source(_0 + std::numeric_limits<double>::infinity()).find("0x7ff0000000000000ULL"), std::string::npos);
  std::vector<double> many;
  const std::string s = source(_0 * 1.0 + 2.0 + 3.0 + 4.0 + 5.0 + 6.0 + 7.0 + 8.0 + 9.0 + 10.0 + 11.0 + 12.0 + 13.0 + 14.0 +
                               15.0 + 16.0 + 17.0, &many);
  EXPECT_EQ(many.size(), 16u);
  EXPECT_NE(s.find("L[15]"), std::string::npos);
  EXPECT_EQ(s.find("L[16]"), std::string::npos);
  EXPECT_NE(s.find("0x4031000000000000ULL"), std::string::npos) << "17.0 as bits";
}

TEST(PointwiseNvrtc, GeneratedKernelsCompileForEveryFloatingType) {
  for (const tg::DType d : {tg::DType::f32, tg::DType::f64, tg::DType::bf16, tg::DType::f16}) {
    std::vector<double> lits;
    const std::string src = cu::pointwise_source(d, 3, source(kExpr, &lits));
    std::string ptx;
    ASSERT_NO_THROW(ptx = cu::pointwise_ptx(src)) << tg::dtype_name(d);
    EXPECT_NE(ptx.find("tg_pw_fwd"), std::string::npos) << tg::dtype_name(d);
    EXPECT_NE(ptx.find("tg_pw_bwd"), std::string::npos) << tg::dtype_name(d);
  }
  // one input, non-finite and negative-zero literals written as bits, the largest operand count
  EXPECT_NO_THROW(cu::pointwise_ptx(
      cu::pointwise_source(tg::DType::f32, 1, source(exp(_0) + -std::numeric_limits<double>::infinity() + -0.0))));
  EXPECT_NO_THROW(cu::pointwise_ptx(cu::pointwise_source(tg::DType::f16, 7, source(_0 + _1 * _2 - _3 / _4 + _5))));
}

TEST(PointwiseNvrtc, BadSourceIsAnErrorWithTheCompilersLog) {
  try {
    cu::pointwise_ptx("extern \"C\" __global__ void tg_pw_fwd() { undeclared_name(); }");
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("NVRTC could not compile"), std::string::npos) << what;
    EXPECT_NE(what.find("undeclared_name"), std::string::npos) << what;
    EXPECT_NE(what.find("source:\nextern"), std::string::npos) << "the log's terminating NUL ended the message: " << what;
  }
  EXPECT_THROW(cu::pointwise_source(tg::DType::i64, 1, "x0"), tg::Error);
  EXPECT_THROW(cu::pointwise_source(tg::DType::f32, 8, "x0"), tg::Error);
}

// The architecture NVRTC builds for (Note [pointwise kernels through NVRTC]): the GPU's own, an earlier one of its
// major as a cubin, PTX for a GPU newer than the toolkit, nothing for one older than every known architecture.
TEST(PointwiseNvrtc, TargetArchitectureFallsBackWithinAMajorThenToPtx) {
  const std::vector<int> known = {75, 80, 86, 87, 89, 90, 100, 120, 121};
  using P = std::pair<std::string, bool>;
  EXPECT_EQ(cu::pointwise_target(90, known), (P{"sm_90", true}));
  EXPECT_EQ(cu::pointwise_target(86, known), (P{"sm_86", true}));
  EXPECT_EQ(cu::pointwise_target(88, known), (P{"sm_87", true}));    // a minor this NVRTC does not know
  EXPECT_EQ(cu::pointwise_target(103, known), (P{"sm_100", true}));
  EXPECT_EQ(cu::pointwise_target(130, known), (P{"compute_121", false}));  // newer than the toolkit: PTX
  EXPECT_EQ(cu::pointwise_target(70, known), (P{"", false}));        // older than all: the tensor ops run
  // and this NVRTC's own list builds a cubin for the architectures CI compiles for
  int count = 0;
  ASSERT_EQ(nvrtcGetNumSupportedArchs(&count), NVRTC_SUCCESS);
  std::vector<int> mine(static_cast<std::size_t>(count));
  ASSERT_EQ(nvrtcGetSupportedArchs(mine.data()), NVRTC_SUCCESS);
  EXPECT_EQ(cu::pointwise_target(80, mine), (P{"sm_80", true}));
  EXPECT_EQ(cu::pointwise_target(90, mine), (P{"sm_90", true}));
}

template <class T>
void compare_with_cpu(double tol) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(5);
  const tg::Tensor<float> a0 = tg::Tensor<float>::uniform({3, 40, 24}, -2.f, 2.f, gen),
                          b0 = tg::Tensor<float>::uniform({24}, -1.f, 1.f, gen),
                          c0 = tg::Tensor<float>::uniform({3, 40, 1}, 0.5f, 2.f, gen),
                          u0 = tg::Tensor<float>::normal({3, 40, 24}, 0.f, 1.f, gen);
  auto run = [&](auto device) {
    using D = decltype(device);
    tg::Tensor<T, D> a = a0.to<T>().template to<D>(), b = b0.to<T>().template to<D>(), c = c0.to<T>().template to<D>();
    a.requires_grad_();
    b.requires_grad_();
    c.requires_grad_();
    const tg::Tensor<T, D> y = tg::pointwise(kExpr, a, b, c);
    EXPECT_STREQ(y.autograd_meta()->producer->op(), "pointwise");  // the generated kernel, not tensor ops
    y.backward(u0.to<T>().template to<D>());
    auto host = [](const tg::Tensor<T, D>& t) { return t.detach().template to<tg::fp32>().template to<tg::cpu>().to_vector(); };
    return std::vector<std::vector<float>>{host(y), host(a.grad()), host(b.grad()), host(c.grad())};
  };
  const auto cpu = run(tg::cpu{}), gpu = run(tg::cuda{});
  const char* what[] = {"y", "da", "db", "dc"};
  for (std::size_t t = 0; t < cpu.size(); ++t) {
    ASSERT_EQ(cpu[t].size(), gpu[t].size());
    double scale = 1e-30;
    for (float v : cpu[t]) scale = std::max(scale, std::abs(double(v)));
    for (std::size_t i = 0; i < cpu[t].size(); ++i)
      ASSERT_NEAR(gpu[t][i], cpu[t][i], tol * scale) << what[t] << " at " << i << " in " << tg::dtype_traits<T>::name;
  }
}
TEST(PointwiseCuda, GeneratedKernelsMatchTheCpuInFp32) { compare_with_cpu<float>(1e-5); }
TEST(PointwiseCuda, GeneratedKernelsMatchTheCpuInBf16) { compare_with_cpu<tg::bf16>(2e-2); }
TEST(PointwiseCuda, GeneratedKernelsMatchTheCpuInFp16) { compare_with_cpu<tg::fp16>(4e-3); }
TEST(PointwiseCuda, GeneratedKernelsMatchTheCpuInFp64) { compare_with_cpu<double>(1e-12); }

// The literals are launch arguments: one expression with a new constant each call compiles once, and each
// call uses its own constant; fp16 stores round like the CPU's conversion, bit for bit.
TEST(PointwiseCuda, NewConstantsReuseTheCompiledKernel) {
  TG_SKIP_WITHOUT_GPU();
  const auto x = tg::Tensor<float>::ones({1000}).to<tg::cuda>();
  const std::int64_t before = cu::pointwise_compiles();
  for (int step = 1; step <= 5; ++step) {
    const double t = 0.1 * step;
    const auto y = tg::pointwise(_0 * t + -0.0, x).to<tg::cpu>().to_vector();
    for (float v : y) ASSERT_EQ(v, static_cast<float>(t)) << "step " << step;
  }
  EXPECT_LE(cu::pointwise_compiles() - before, 1);
  tg::Generator gen(3);
  const auto h = tg::Tensor<float>::normal({4096}, 0.f, 3000.f, gen);  // subnormals to overflow after the product
  const auto scale = tg::Tensor<float>::full({1}, 1e-5f);
  const auto cpu = tg::pointwise(_0 * _1, h.to<tg::fp16>(), scale.to<tg::fp16>()).to_vector();
  const auto gpu = tg::pointwise(_0 * _1, h.to<tg::fp16>().to<tg::cuda>(), scale.to<tg::fp16>().to<tg::cuda>()).to<tg::cpu>().to_vector();
  ASSERT_EQ(cpu.size(), gpu.size());
  for (std::size_t i = 0; i < cpu.size(); ++i) ASSERT_EQ(cpu[i].bits, gpu[i].bits) << "element " << i;
}

// The generated kernels' relu and sigmoid are the tensor ops' at the edges (NaN and -0 through relu, no early
// underflow in sigmoid), so a fused chain (Note [fusion rewrites]) computes what its separate ops compute.
TEST(PointwiseCuda, ReluAndSigmoidMatchTheTensorOpsAtTheEdges) {
  TG_SKIP_WITHOUT_GPU();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const auto x = tg::Tensor<float>::from_vector({8}, {nan, -0.f, 0.f, -3.f, 2.f, -95.f, -100.f, 40.f}).to<tg::cuda>();
  const auto r = tg::pointwise(relu(_0), x).to<tg::cpu>().to_vector(), rt = tg::relu(x).to<tg::cpu>().to_vector();
  const auto s = tg::pointwise(sigmoid(_0), x).to<tg::cpu>().to_vector(), st = tg::sigmoid(x).to<tg::cpu>().to_vector();
  for (std::size_t i = 0; i < r.size(); ++i) {
    EXPECT_EQ(std::memcmp(&r[i], &rt[i], sizeof(float)), 0) << "relu, element " << i << ": " << r[i] << " vs " << rt[i];
    if (std::isnan(st[i])) EXPECT_TRUE(std::isnan(s[i])) << "sigmoid, element " << i << ": " << s[i];  // a NaN's sign is not kept
    else EXPECT_EQ(std::memcmp(&s[i], &st[i], sizeof(float)), 0) << "sigmoid, element " << i << ": " << s[i] << " vs " << st[i];
  }
}

}  // namespace

}  // namespace test_cuda_pointwise_cpp

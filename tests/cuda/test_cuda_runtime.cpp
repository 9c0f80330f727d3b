// CUDA backend basics: device allocator statistics and caching, host<->device copies, device fill.
// Every test skips with the reason when no CUDA device is present (the build machines have none).
#include <gtest/gtest.h>

#include <typegrad/typegrad.hpp>

namespace {

class CudaRuntime : public ::testing::Test {
 protected:
  void SetUp() override {
    if (tg::backend::cuda::device_count() == 0)
      GTEST_SKIP() << "no CUDA device (" << tg::backend::cuda::device_description() << ")";
  }
};

TEST_F(CudaRuntime, CopiesRoundTripEveryPrecision) {
  const auto host = tg::Tensor<float>::normal({7, 33});
  const auto back = host.to<tg::cuda>().to<tg::cpu>();
  EXPECT_EQ(back.to_vector(), host.to_vector());
  const auto hb = host.to<tg::bf16>();
  const auto bb = hb.to<tg::cuda>().to<tg::cpu>().to_vector();
  const auto hv = hb.to_vector();
  for (std::size_t i = 0; i < hv.size(); ++i) EXPECT_EQ(bb[i].bits, hv[i].bits);
}

TEST_F(CudaRuntime, FactoriesMatchTheHost) {
  tg::Generator g1(7), g2(7);
  const auto d = tg::Tensor<float, tg::cuda>::normal({1000}, 0.f, 1.f, g1);
  const auto h = tg::Tensor<float>::normal({1000}, 0.f, 1.f, g2);
  EXPECT_EQ(d.to_vector(), h.to_vector());
  const auto z = tg::Tensor<tg::bf16, tg::cuda>::full({5, 5}, 2.5).to_vector();
  for (auto v : z) EXPECT_EQ(static_cast<float>(v), 2.5f);
}

TEST_F(CudaRuntime, AllocatorCachesBlocksInTheSteadyState) {
  auto& a = tg::allocator<tg::cuda>();
  { auto warm = tg::Tensor<float, tg::cuda>::zeros({1024, 1024}); }
  const auto before = a.stats();
  for (int i = 0; i < 20; ++i) {
    auto t = tg::Tensor<float, tg::cuda>::zeros({1024, 1024});
    EXPECT_GE(a.stats().bytes_in_use, before.bytes_in_use + 4 * 1024 * 1024);
  }
  const auto after = a.stats();
  EXPECT_EQ(after.system_allocations, before.system_allocations);
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use);
  a.empty_cache();
  EXPECT_LT(a.stats().bytes_reserved, after.bytes_reserved);
}

TEST_F(CudaRuntime, GradientFlowsBackThroughADeviceCopy) {
  auto x = tg::Tensor<float>::normal({3, 4}).requires_grad_();
  auto y = x.to<tg::cuda>().to<tg::cpu>();
  tg::sum(y * y).backward();
  const auto g = x.grad().to_vector(), xv = x.to_vector();
  for (std::size_t i = 0; i < g.size(); ++i) EXPECT_FLOAT_EQ(g[i], 2 * xv[i]);
}

}  // namespace

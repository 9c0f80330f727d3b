// CUDA backend basics: device allocator statistics and caching, host<->device copies, device fill, streams
// and events (Note [CUDA streams]).
// Every test skips with the reason when no CUDA device is present (the build machines have none).
#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_runtime_cpp {  // the file's own names (Note [unity test sources])

namespace {

class CudaRuntime : public tg::testing::GpuTest {};

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

// A device tensor prints its values from a host copy (the header names the device).
TEST_F(CudaRuntime, PrintingADeviceTensorShowsItsValues) {
  const auto host = tg::Tensor<float>::arange(0, 12).reshape({3, 4}).transpose(0, 1);
  std::ostringstream h, d;
  h << host;
  d << host.to<tg::cuda>();
  std::string want = h.str();
  want.replace(want.find(", cpu>"), 6, ", cuda>");
  EXPECT_EQ(d.str(), want);
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

// ---- streams (Note [CUDA streams]) ----------------------------------------------------------------------
namespace cuda = tg::backend::cuda;

TEST_F(CudaRuntime, StreamGuardSelectsAndRestoresTheCurrentStream) {
  EXPECT_EQ(cuda::current_stream(), nullptr);
  cuda::Stream a, b;
  EXPECT_NE(a.handle(), nullptr);
  EXPECT_NE(a.handle(), b.handle());
  {
    cuda::StreamGuard on_a(a);
    EXPECT_EQ(cuda::current_stream(), a.handle());
    {
      cuda::StreamGuard on_b(b);
      EXPECT_EQ(cuda::current_stream(), b.handle());
    }
    EXPECT_EQ(cuda::current_stream(), a.handle());
  }
  EXPECT_EQ(cuda::current_stream(), nullptr);
}

/// A chain of ops (GEMM, GELU, softmax, row sums) on the current stream, read back to the host.
tg::Tensor<float> chain(const tg::Tensor<float>& xh, const tg::Tensor<float>& wh) {
  const auto x = xh.to<tg::cuda>(), w = wh.to<tg::cuda>();
  const auto h = tg::gelu_tanh(tg::matmul(x, w));
  return tg::sum(tg::softmax(h), {-1}).to<tg::cpu>();
}

TEST_F(CudaRuntime, OpsOnASideStreamGiveTheDefaultStreamsResults) {
  const auto x = tg::Tensor<float>::normal({64, 96}), w = tg::Tensor<float>::normal({96, 80});
  const auto on_default = chain(x, w).to_vector();
  cuda::Stream side;
  std::vector<float> on_side;
  {
    cuda::StreamGuard guard(side);
    on_side = chain(x, w).to_vector();  // the copy back synchronizes `side`
  }
  EXPECT_EQ(on_side, on_default);
}

/// linear with bias (the GEMM's bias path) and causal attention, forward and backward, on the current
/// stream; returns the output and the input gradients, read back to the host.
std::vector<std::vector<float>> linear_attention_step(const tg::Tensor<tg::bf16>& xh, const tg::Tensor<tg::bf16>& wh,
                                                      const tg::Tensor<tg::bf16>& bh) {
  auto x = xh.to<tg::cuda>().requires_grad_();
  const auto w = wh.to<tg::cuda>(), b = bh.to<tg::cuda>();
  const std::int64_t B = 2, H = 4, T = 48, hs = 16;
  const auto qkv = tg::linear(x, w, b);  // [B, T, 3·H·hs]
  auto head = [&](std::int64_t i) {
    return qkv.narrow(2, i * H * hs, H * hs).reshape({B, T, H, hs}).transpose(1, 2);
  };
  const auto y = tg::causal_attention(head(0), head(1), head(2));
  tg::sum((y * y).to<float>()).backward();
  return {y.to<float>().to<tg::cpu>().to_vector(), x.grad().to<float>().to<tg::cpu>().to_vector()};
}

TEST_F(CudaRuntime, GemmsAndAttentionOnSideStreamsGiveTheDefaultStreamsResults) {
  const auto x = tg::Tensor<float>::normal({2, 48, 64}).to<tg::bf16>();
  const auto w = (tg::Tensor<float>::normal({3 * 64, 64}) * 0.125f).to<tg::bf16>();
  const auto b = tg::Tensor<float>::normal({3 * 64}).to<tg::bf16>();
  const auto on_default = linear_attention_step(x, w, b);
  // Two streams, each with its own cuBLAS workspace, running the same step back to back without a
  // synchronization between them: both must reproduce the default stream's values bit for bit.
  cuda::Stream s1, s2;
  std::vector<std::vector<float>> on_s1, on_s2;
  {
    cuda::StreamGuard on(s1);
    on_s1 = linear_attention_step(x, w, b);
  }
  {
    cuda::StreamGuard on(s2);
    on_s2 = linear_attention_step(x, w, b);
  }
  EXPECT_EQ(on_s1, on_default);
  EXPECT_EQ(on_s2, on_default);
}

TEST_F(CudaRuntime, AllocatorReusesABlockOnlyOnItsOwnStream) {
  auto& a = tg::allocator<tg::cuda>();
  cuda::Stream s1, s2;
  const std::size_t bytes = 3 << 20;
  {
    cuda::StreamGuard on(s1);
    a.deallocate(a.allocate(bytes), bytes);  // cached on s1's list
  }
  const auto cached = a.stats();
  {
    cuda::StreamGuard on(s2);  // s1's block is not handed to s2
    void* p = a.allocate(bytes);
    EXPECT_EQ(a.stats().system_allocations, cached.system_allocations + 1);
    a.deallocate(p, bytes);
  }
  {
    cuda::StreamGuard on(s1);  // s1 gets its own block back
    void* p = a.allocate(bytes);
    EXPECT_EQ(a.stats().system_allocations, cached.system_allocations + 1);
    a.deallocate(p, bytes);
  }
}

// allocate_exact (tg::compile's arenas, Note [step memory plan]): only a cached block of the request's own size
// class serves it, as on the CPU (CachingHostAllocator.AllocateExactTakesNoLargerCachedBlock).
TEST_F(CudaRuntime, AllocateExactTakesNoLargerCachedBlock) {
  auto& a = tg::allocator<tg::cuda>();
  a.empty_cache();
  const std::size_t big_bytes = 8 << 20, bytes = 4 << 20;
  void* big = a.allocate(big_bytes);
  a.deallocate(big, big_bytes);
  const auto cached = a.stats();
  void* exact = a.allocate_exact(bytes);  // allocate() would hand out the 8 MiB block
  EXPECT_NE(exact, big);
  EXPECT_EQ(a.stats().system_allocations, cached.system_allocations + 1);
  EXPECT_EQ(a.stats().bytes_in_use, cached.bytes_in_use + static_cast<std::int64_t>(bytes));
  a.deallocate(exact, bytes);
  void* same = a.allocate_exact(bytes);  // its own class: the cached block
  EXPECT_EQ(same, exact);
  EXPECT_EQ(a.stats().system_allocations, cached.system_allocations + 1);
  a.deallocate(same, bytes);
  a.empty_cache();
}

TEST_F(CudaRuntime, AnEventOrdersWorkAcrossStreams) {
  cuda::Stream producer, consumer;
  cuda::Event ready, start, end;
  const std::int64_t n = 1 << 24;
  auto buf = tg::Tensor<float, tg::cuda>::empty({n});
  {
    cuda::StreamGuard on(producer);
    start.record();
    for (int i = 1; i <= 8; ++i) cuda::fill(buf.data(), n, static_cast<float>(i));  // the last fill wins
    ready.record();
    end.record();
  }
  std::vector<float> got(static_cast<std::size_t>(n));
  {
    cuda::StreamGuard on(consumer);
    ready.wait();
    cuda::copy_device_to_host(got.data(), buf.data(), got.size() * sizeof(float));
  }
  EXPECT_EQ(got.front(), 8.f);
  EXPECT_EQ(got.back(), 8.f);
  end.synchronize();
  EXPECT_GT(end.elapsed_ms_since(start), 0.f);
  producer.synchronize();
}

}  // namespace

}  // namespace test_cuda_runtime_cpp

// The CUDA optimizer kernels (multi-tensor AdamW, SGD and LAMB; per-tensor SGD, LAMB, Adafactor), the
// optimizers on CUDA (BasicSgd, BasicLamb, BasicAdafactor<cuda> against the same classes on the CPU) and the
// loss scaler's unscale + inf/NaN check. The shared element formulas (math::adam_update, sgd_update,
// lamb_moments / lamb_direction) and the multi-tensor chunking (detail/cuda/multi_tensor.hpp) are checked
// here on every machine; the device kernels are compared with the CPU on a GPU and skip with the reason
// elsewhere.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include <map>
#include <memory>
#include <string>

#include <typegrad/detail/cpu/optim_kernels.hpp>
#include <typegrad/detail/cuda/multi_tensor.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_optim_cpp {  // the file's own names (Note [unity test sources])

namespace {

std::vector<float> random_values(std::int64_t n, std::uint64_t seed, float lo, float hi) {
  tg::Generator gen(seed);
  return tg::Tensor<float>::uniform({n}, lo, hi, gen).to_vector();
}

struct State {
  std::vector<float> p, g, m, v;
};
State make_state(std::int64_t n, std::uint64_t seed) {
  return {random_values(n, seed, -1.f, 1.f), random_values(n, seed + 1, -0.1f, 0.1f), random_values(n, seed + 2, -0.01f, 0.01f),
          random_values(n, seed + 3, 0.f, 1e-3f)};
}

tg::backend::cpu::AdamScalars scalars(bool decoupled, std::int64_t step) {
  tg::backend::cpu::AdamScalars s;
  s.lr = 3e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.95;
  s.eps = 1e-8;
  s.weight_decay = 0.1;
  s.decoupled = decoupled;
  s.step = step;
  return s;
}

/// |a - b| <= 4 ulp-ish relative to the magnitude (FMA contraction differs between translation units).
void expect_close_all(const std::vector<float>& got, const std::vector<float>& want, float floor, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i)
    ASSERT_NEAR(got[i], want[i], 5e-7f * (floor + std::abs(want[i]))) << what << " element " << i;
}

// The shared element update is the CPU kernel's loop body: same fp32 constants, same operation order. The
// library may be compiled with FMA contraction (-march=native) and this test without, so the results
// agree to a few ulps rather than bit for bit.
TEST(SharedAdamMath, MatchesTheCpuAdamStep) {
  for (const bool decoupled : {true, false}) {
    for (const std::int64_t step : {std::int64_t{1}, std::int64_t{7}}) {
      State ref = make_state(1003, 11), mine = ref;
      const auto s = scalars(decoupled, step);
      tg::backend::cpu::adam_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), ref.v.data(), 1003, s);
      const auto c = tg::math::adam_consts<float>(s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, s.decoupled, s.step);
      for (std::size_t i = 0; i < mine.p.size(); ++i) tg::math::adam_update(mine.p[i], mine.g[i], mine.m[i], mine.v[i], c);
      SCOPED_TRACE(std::string("decoupled ") + (decoupled ? "yes" : "no") + ", step " + std::to_string(step));
      expect_close_all(mine.p, ref.p, 1.f, "p");
      expect_close_all(mine.m, ref.m, 1e-2f, "m");  // g + wd·p may cancel: an ulp of g is the floor
      expect_close_all(mine.v, ref.v, 1e-4f, "v");
      // and the update is not trivially zero: p moved by about lr
      double moved = 0;
      for (std::size_t i = 0; i < ref.p.size(); ++i) moved += std::abs(ref.p[i] - make_state(1003, 11).p[i]);
      EXPECT_GT(moved / 1003, 1e-4);
    }
  }
}

tg::backend::cpu::SgdScalars sgd_scalars(double momentum, bool nesterov, bool first) {
  tg::backend::cpu::SgdScalars s;
  s.lr = 0.05;
  s.momentum = momentum;
  s.dampening = nesterov ? 0.0 : 0.1;
  s.weight_decay = 0.01;
  s.nesterov = nesterov;
  s.first_step = first;
  return s;
}
tg::backend::cpu::LambScalars lamb_scalars(std::int64_t step) {
  tg::backend::cpu::LambScalars s;
  s.lr = 2e-3;
  s.beta1 = 0.9;
  s.beta2 = 0.999;
  s.eps = 1e-6;
  s.weight_decay = 0.01;
  s.step = step;
  return s;
}
tg::backend::cpu::AdafactorScalars adafactor_scalars(double beta1) {
  tg::backend::cpu::AdafactorScalars s;
  s.rho = 1e-2;
  s.beta2 = 1.0 - std::pow(3.0, -0.8);  // beta2_t at t = 3
  s.beta1 = beta1;
  s.weight_decay = 0.01;
  return s;
}

TEST(SharedSgdMath, MatchesTheCpuSgdStep) {
  for (const double momentum : {0.0, 0.9})
    for (const bool nesterov : {false, true})
      for (const bool first : {true, false}) {
        if (nesterov && momentum == 0.0) continue;
        State ref = make_state(1003, 21), mine = ref;
        const auto s = sgd_scalars(momentum, nesterov, first);
        tg::backend::cpu::sgd_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), 1003, s);
        const auto c = tg::math::sgd_consts<float>(s.lr, s.momentum, s.dampening, s.weight_decay, s.nesterov, s.first_step);
        for (std::size_t i = 0; i < mine.p.size(); ++i) tg::math::sgd_update(mine.p[i], mine.g[i], mine.m[i], c);
        SCOPED_TRACE("momentum " + std::to_string(momentum) + (nesterov ? " nesterov" : "") + (first ? " first" : ""));
        expect_close_all(mine.p, ref.p, 1.f, "p");
        expect_close_all(mine.m, ref.m, 1e-2f, "momentum buffer");
        if (momentum == 0.0) EXPECT_EQ(mine.m, make_state(1003, 21).m) << "no momentum: the buffer is not touched";
        EXPECT_NE(mine.p, make_state(1003, 21).p);
      }
}

TEST(SharedLambMath, MatchesTheCpuLambStep) {
  State ref = make_state(2001, 31), mine = ref;
  const auto s = lamb_scalars(4);
  const double trust = tg::backend::cpu::lamb_step<float>(ref.p.data(), ref.g.data(), ref.m.data(), ref.v.data(), 2001, s);
  const auto c = tg::math::lamb_consts<float>(s.beta1, s.beta2, s.eps, s.weight_decay, s.step);
  double pn = 0, un = 0;
  for (std::size_t i = 0; i < mine.p.size(); ++i) {
    tg::math::lamb_moments(mine.g[i], mine.m[i], mine.v[i], c);
    const float u = tg::math::lamb_direction(mine.p[i], mine.m[i], mine.v[i], c);
    pn += static_cast<double>(mine.p[i]) * mine.p[i];
    un += static_cast<double>(u) * u;
  }
  const double my_trust = tg::backend::cpu::lamb_trust_ratio(pn, un);
  EXPECT_NEAR(my_trust, trust, 1e-6 * trust);
  EXPECT_GT(trust, 0.0);
  EXPECT_NE(trust, 1.0) << "both norms are nonzero: the ratio is not the fallback";
  const float scale = static_cast<float>(s.lr * my_trust);
  for (std::size_t i = 0; i < mine.p.size(); ++i) mine.p[i] -= scale * tg::math::lamb_direction(mine.p[i], mine.m[i], mine.v[i], c);
  expect_close_all(mine.p, ref.p, 1.f, "p");
  expect_close_all(mine.m, ref.m, 1e-2f, "m");
  expect_close_all(mine.v, ref.v, 1e-4f, "v");
  EXPECT_EQ(tg::backend::cpu::lamb_trust_ratio(0.0, 4.0), 1.0);
  EXPECT_EQ(tg::backend::cpu::lamb_trust_ratio(4.0, 1.0), 2.0);
}

TEST(SharedAdamMath, IsFiniteSeparatesInfAndNan) {
  EXPECT_TRUE(tg::math::is_finite(0.f));
  EXPECT_TRUE(tg::math::is_finite(-3.4e38f));
  EXPECT_FALSE(tg::math::is_finite(std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(tg::math::is_finite(-std::numeric_limits<float>::infinity()));
  EXPECT_FALSE(tg::math::is_finite(std::numeric_limits<float>::quiet_NaN()));
}

// The chunk table of every multi-tensor launch: each element of each tensor in exactly one chunk, chunks
// in tensor then start order, empty tensors without chunks; per-tensor sums in chunk order.
TEST(MultiTensorChunks, CoverEveryElementOnceAndSumPerTensor) {
  using tg::backend::cuda::detail::kChunk;
  const std::vector<std::int64_t> sizes = {0, 1, kChunk, kChunk + 1, 3 * kChunk - 1, 0};
  const auto chunks = tg::backend::cuda::detail::chunk_table(static_cast<int>(sizes.size()), sizes.data());
  std::vector<std::int64_t> covered(sizes.size(), 0);
  std::vector<double> partials;
  for (std::size_t b = 0; b < chunks.size(); ++b) {
    const auto& c = chunks[b];
    if (b > 0) {
      ASSERT_TRUE(c.tensor > chunks[b - 1].tensor || (c.tensor == chunks[b - 1].tensor && c.start > chunks[b - 1].start));
    }
    const std::int64_t n = sizes[static_cast<std::size_t>(c.tensor)];
    ASSERT_EQ(c.start, covered[static_cast<std::size_t>(c.tensor)]) << "chunk " << b << " leaves a gap or overlaps";
    covered[static_cast<std::size_t>(c.tensor)] = std::min(n, c.start + kChunk);
    partials.push_back(static_cast<double>(b + 1));  // two partials per chunk
    partials.push_back(0.5 * static_cast<double>(b + 1));
  }
  EXPECT_EQ(covered, sizes);
  EXPECT_EQ(chunks.size(), 0u + 1 + 1 + 2 + 3);
  const auto sums = tg::backend::cuda::detail::sum_by_tensor<2>(chunks, partials.data(), static_cast<int>(sizes.size()));
  ASSERT_EQ(sums.size(), sizes.size());
  EXPECT_EQ(sums[0][0], 0.0);  // no chunks
  EXPECT_EQ(sums[1][0], 1.0);
  EXPECT_EQ(sums[2][0], 2.0);
  EXPECT_EQ(sums[3][0], 3.0 + 4.0);
  EXPECT_EQ(sums[4][0], 5.0 + 6.0 + 7.0);
  EXPECT_EQ(sums[4][1], 0.5 * (5.0 + 6.0 + 7.0));
  EXPECT_EQ(sums[5][1], 0.0);
}

TEST(MultiTensorChunks, PrefixStartsAndOwnerOfNumberItemsAcrossTensors) {
  namespace d = tg::backend::cuda::detail;
  const std::vector<std::int64_t> rows = {0, 3, 0, 0, 1, 5, 0};  // empty tensors between, before and after
  const auto starts = d::prefix_starts(static_cast<int>(rows.size()), rows.data());
  EXPECT_EQ(starts, (std::vector<std::int64_t>{0, 0, 3, 3, 3, 4, 9, 9}));
  std::vector<int> owners;
  for (std::int64_t i = 0; i < starts.back(); ++i) owners.push_back(d::owner_of(starts.data(), static_cast<int>(rows.size()), i));
  EXPECT_EQ(owners, (std::vector<int>{1, 1, 1, 4, 5, 5, 5, 5, 5}));
  // every item's owner has it in its range, for many tensors of mixed sizes
  std::vector<std::int64_t> sizes;
  for (int t = 0; t < 97; ++t) sizes.push_back((t * 37) % 11 == 0 ? 0 : (t * 13) % 29 + 1);
  const auto s2 = d::prefix_starts(static_cast<int>(sizes.size()), sizes.data());
  for (std::int64_t i = 0; i < s2.back(); ++i) {
    const int t = d::owner_of(s2.data(), static_cast<int>(sizes.size()), i);
    ASSERT_TRUE(s2[static_cast<std::size_t>(t)] <= i && i < s2[static_cast<std::size_t>(t) + 1]) << "item " << i << " -> " << t;
  }
}

class CudaOptim : public tg::testing::GpuTest {};

tg::Tensor<float, tg::cuda> on_gpu(const std::vector<float>& v) {
  return tg::Tensor<float>::from_vector({static_cast<std::int64_t>(v.size())}, v).to<tg::cuda>();
}

TEST_F(CudaOptim, MultiTensorAdamWMatchesTheCpuPerTensor) {
  const std::vector<std::int64_t> sizes = {1, 1000, (1 << 16) + 3, 70001};  // chunk edges and a one-element tensor
  for (const bool decoupled : {true, false}) {
    std::vector<State> host;
    std::vector<tg::Tensor<float, tg::cuda>> p, g, m, v;
    std::vector<tg::backend::AdamTensor<float>> list;
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      host.push_back(make_state(sizes[k], 100 + 10 * k));
      p.push_back(on_gpu(host[k].p));
      g.push_back(on_gpu(host[k].g));
      m.push_back(on_gpu(host[k].m));
      v.push_back(on_gpu(host[k].v));
      list.push_back({p[k].data(), g[k].data(), m[k].data(), v[k].data(), sizes[k]});
    }
    const auto s = scalars(decoupled, 3);
    tg::backend::cuda::adam_step_multi(list.data(), static_cast<int>(list.size()), s);
    for (std::size_t k = 0; k < sizes.size(); ++k) {
      State& h = host[k];
      tg::backend::cpu::adam_step<float>(h.p.data(), h.g.data(), h.m.data(), h.v.data(), sizes[k], s);
      const auto gp = p[k].to<tg::cpu>().to_vector(), gm = m[k].to<tg::cpu>().to_vector(), gv = v[k].to<tg::cpu>().to_vector();
      for (std::int64_t i = 0; i < sizes[k]; ++i) {  // the device may contract to FMA: a few ulps
        EXPECT_NEAR(gp[i], h.p[i], 1e-6f * (1 + std::abs(h.p[i]))) << "tensor " << k << " element " << i;
        EXPECT_NEAR(gm[i], h.m[i], 1e-6f * (1e-2f + std::abs(h.m[i])));  // g + wd·p may cancel
        EXPECT_NEAR(gv[i], h.v[i], 1e-6f * (1e-4f + std::abs(h.v[i])));
        if (::testing::Test::HasFailure()) return;
      }
    }
  }
}

// Note [the optimizer writes the weight copies]: the GPU's Adam step writes each tensor's bf16 / fp16 copy
// from its updated p (the conversion copy_strided runs); p equals the step without copies bit for bit.
TEST_F(CudaOptim, MultiTensorAdamWWritesTheWeightCopies) {
  using tg::backend::WeightCopyType;
  const std::vector<std::int64_t> sizes = {1, 1000, (1 << 16) + 3, 70001};
  const std::vector<WeightCopyType> types = {WeightCopyType::bf16, WeightCopyType::fp16, WeightCopyType::none,
                                             WeightCopyType::bf16};
  std::vector<tg::Tensor<float, tg::cuda>> p, g, m, v, p2, m2, v2;
  std::vector<tg::Tensor<tg::bf16, tg::cuda>> b16;
  std::vector<tg::Tensor<tg::fp16, tg::cuda>> f16;
  std::vector<tg::backend::AdamTensor<float>> with, without;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const State h = make_state(sizes[k], 300 + 10 * k);
    p.push_back(on_gpu(h.p)), g.push_back(on_gpu(h.g)), m.push_back(on_gpu(h.m)), v.push_back(on_gpu(h.v));
    p2.push_back(on_gpu(h.p)), m2.push_back(on_gpu(h.m)), v2.push_back(on_gpu(h.v));
    b16.push_back(tg::Tensor<tg::bf16, tg::cuda>::empty({sizes[k]}));
    f16.push_back(tg::Tensor<tg::fp16, tg::cuda>::empty({sizes[k]}));
    void* copy = types[k] == WeightCopyType::bf16 ? static_cast<void*>(b16[k].data())
                 : types[k] == WeightCopyType::fp16 ? static_cast<void*>(f16[k].data())
                                                    : nullptr;
    with.push_back({p[k].data(), g[k].data(), m[k].data(), v[k].data(), sizes[k], copy, types[k]});
    without.push_back({p2[k].data(), g[k].data(), m2[k].data(), v2[k].data(), sizes[k], nullptr, WeightCopyType::none});
  }
  const auto s = scalars(true, 2);
  tg::backend::cuda::adam_step_multi(with.data(), static_cast<int>(with.size()), s);
  tg::backend::cuda::adam_step_multi(without.data(), static_cast<int>(without.size()), s);
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    ASSERT_EQ(p[k].to<tg::cpu>().to_vector(), p2[k].to<tg::cpu>().to_vector()) << "tensor " << k;
    if (types[k] == WeightCopyType::bf16) {
      const auto got = b16[k].to<tg::cpu>(), want = p[k].to<tg::bf16>().to<tg::cpu>();
      for (std::int64_t i = 0; i < sizes[k]; ++i) ASSERT_EQ(got.data()[i].bits, want.data()[i].bits) << "tensor " << k << " element " << i;
    }
    if (types[k] == WeightCopyType::fp16) {
      const auto got = f16[k].to<tg::cpu>(), want = p[k].to<tg::fp16>().to<tg::cpu>();
      for (std::int64_t i = 0; i < sizes[k]; ++i) ASSERT_EQ(got.data()[i].bits, want.data()[i].bits) << "tensor " << k << " element " << i;
    }
  }
}

TEST_F(CudaOptim, UnscaleScalesEveryTensorAndFindsInfAndNan) {
  std::vector<tg::Tensor<float, tg::cuda>> gs = {on_gpu(random_values(5, 1, -4.f, 4.f)),
                                                 on_gpu(random_values((1 << 16) + 9, 2, -4.f, 4.f))};
  const std::vector<float> before0 = gs[0].to<tg::cpu>().to_vector(), before1 = gs[1].to<tg::cpu>().to_vector();
  std::vector<float*> ptrs = {gs[0].data(), gs[1].data()};
  std::vector<std::int64_t> sizes = {gs[0].numel(), gs[1].numel()};
  EXPECT_FALSE(tg::backend::cuda::unscale_and_check(ptrs.data(), sizes.data(), 2, 0.25f));
  const auto after1 = gs[1].to<tg::cpu>().to_vector();
  for (std::size_t i = 0; i < after1.size(); ++i) ASSERT_EQ(after1[i], before1[i] * 0.25f) << i;  // exact: a power of 2
  EXPECT_EQ(gs[0].to<tg::cpu>().to_vector()[4], before0[4] * 0.25f);

  for (const float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    auto h = gs[1].to<tg::cpu>().to_vector();
    h[(1 << 16) + 8] = bad;  // the last element of the second chunk
    gs[1] = on_gpu(h);
    ptrs[1] = gs[1].data();
    EXPECT_TRUE(tg::backend::cuda::unscale_and_check(ptrs.data(), sizes.data(), 2, 1.f)) << bad;
  }
}

// Clipping's global norm on the GPU: one multi-tensor Σ g² launch and one rescale launch, against the CPU's
// per-tensor fp64 sums (equal up to the order of the fp64 partials) and its rescale (bit for bit: x·float(coef)).
TEST_F(CudaOptim, ClipGradNormMultiTensorMatchesTheCpu) {
  const std::vector<std::int64_t> sizes{5, (1 << 16) + 9, 1, 3000};
  std::vector<tg::optim::BasicParam<tg::cpu>> host;
  std::vector<tg::optim::BasicParam<tg::cuda>> dev;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<float> v = random_values(sizes[i], 10 + i, -2.f, 2.f);
    const std::vector<double> w(v.begin(), v.end());
    const tg::Tensor<float> u = tg::Tensor<float>::from_values({sizes[i]}, w);
    tg::Tensor<float> p = tg::Tensor<float>::zeros({sizes[i]});
    p.requires_grad_();
    tg::sum(p * u).backward();  // the gradient is u
    tg::Tensor<float, tg::cuda> q = tg::Tensor<float>::zeros({sizes[i]}).to<tg::cuda>();
    q.requires_grad_();
    tg::sum(q * u.to<tg::cuda>()).backward();
    host.push_back({"p" + std::to_string(i), p});
    dev.push_back({"p" + std::to_string(i), q});
  }
  const double want = tg::optim::clip_grad_norm(host, 1.0), got = tg::optim::clip_grad_norm(dev, 1.0);
  EXPECT_NEAR(got, want, 1e-12 * want);
  for (std::size_t i = 0; i < sizes.size(); ++i)
    EXPECT_EQ(dev[i].tensor.grad().to<tg::cpu>().to_vector(), host[i].tensor.grad().to_vector()) << "gradient " << i;
}

/// Copies device results back and compares them with the CPU's within a few ulps (the device may contract
/// to FMA differently and sums its fp64 partials in another order).
void expect_gpu_close(const tg::Tensor<float, tg::cuda>& got, const std::vector<float>& want, float floor, const char* what) {
  expect_close_all(got.to<tg::cpu>().to_vector(), want, floor, what);
}

TEST_F(CudaOptim, SgdMatchesTheCpu) {
  for (const double momentum : {0.0, 0.9})
    for (const bool nesterov : {false, true}) {
      if (nesterov && momentum == 0.0) continue;
      State h = make_state(70001, 41);
      auto p = on_gpu(h.p), g = on_gpu(h.g), buf = on_gpu(h.m);
      const auto s = sgd_scalars(momentum, nesterov, false);
      tg::backend::cuda::sgd_step<float>(p.data(), g.data(), buf.data(), 70001, s);
      tg::backend::cpu::sgd_step<float>(h.p.data(), h.g.data(), h.m.data(), 70001, s);
      expect_gpu_close(p, h.p, 1.f, "sgd p");
      expect_gpu_close(buf, h.m, 1e-2f, "sgd momentum buffer");
    }
}

TEST_F(CudaOptim, LambMatchesTheCpuIncludingTheTrustRatio) {
  State h = make_state(300007, 51);  // several reduction blocks
  auto p = on_gpu(h.p), g = on_gpu(h.g), m = on_gpu(h.m), v = on_gpu(h.v);
  const auto s = lamb_scalars(2);
  const double gpu_trust = tg::backend::cuda::lamb_step<float>(p.data(), g.data(), m.data(), v.data(), 300007, s);
  const double cpu_trust = tg::backend::cpu::lamb_step<float>(h.p.data(), h.g.data(), h.m.data(), h.v.data(), 300007, s);
  EXPECT_NEAR(gpu_trust, cpu_trust, 1e-6 * cpu_trust);
  expect_gpu_close(p, h.p, 1.f, "lamb p");
  expect_gpu_close(m, h.m, 1e-2f, "lamb m");
  expect_gpu_close(v, h.v, 1e-4f, "lamb v");
}

TEST_F(CudaOptim, AdafactorFactoredAndFullMatchTheCpu) {
  for (const double beta1 : {0.0, 0.9}) {
    const std::int64_t rows = 96, cols = 1027;
    State h = make_state(rows * cols, 61);
    std::vector<float> r = random_values(rows, 62, 0.5f, 2.f), c = random_values(cols, 63, 0.5f, 2.f);
    auto p = on_gpu(h.p), g = on_gpu(h.g), m = on_gpu(h.m), gr = on_gpu(r), gc = on_gpu(c);
    const auto s = adafactor_scalars(beta1);
    tg::backend::cuda::adafactor_step_factored<float>(p.data(), g.data(), gr.data(), gc.data(), m.data(), rows, cols, s);
    tg::backend::cpu::adafactor_step_factored<float>(h.p.data(), h.g.data(), r.data(), c.data(), h.m.data(), rows, cols, s);
    expect_gpu_close(gr, r, 1e-3f, "adafactor row moments");
    expect_gpu_close(gc, c, 1e-3f, "adafactor column moments");
    expect_gpu_close(p, h.p, 1.f, "adafactor factored p");
    if (beta1 != 0.0) expect_gpu_close(m, h.m, 1e-2f, "adafactor m");

    State f = make_state(5003, 71);
    auto fp = on_gpu(f.p), fg = on_gpu(f.g), fv = on_gpu(f.v), fm = on_gpu(f.m);
    tg::backend::cuda::adafactor_step_full<float>(fp.data(), fg.data(), fv.data(), fm.data(), 5003, s);
    tg::backend::cpu::adafactor_step_full<float>(f.p.data(), f.g.data(), f.v.data(), f.m.data(), 5003, s);
    expect_gpu_close(fv, f.v, 1e-4f, "adafactor full v");
    expect_gpu_close(fp, f.p, 1.f, "adafactor full p");
  }
}

// Several tensors of different sizes (chunk edges, one element, a zero tensor for LAMB's fallback ratio)
// through one multi-tensor launch, against the CPU kernel per tensor.
const std::vector<std::int64_t> kMultiSizes = {1, 1000, (1 << 16) + 3, 70001};

TEST_F(CudaOptim, MultiTensorSgdMatchesTheCpuPerTensor) {
  for (const double momentum : {0.0, 0.9})
    for (const bool nesterov : {false, true})
      for (const bool first : {true, false}) {
        if (nesterov && momentum == 0.0) continue;
        SCOPED_TRACE("momentum " + std::to_string(momentum) + (nesterov ? " nesterov" : "") + (first ? " first" : ""));
        std::vector<State> host;
        std::vector<tg::Tensor<float, tg::cuda>> p, g, buf;
        std::vector<tg::backend::SgdTensor<float>> list;
        for (std::size_t k = 0; k < kMultiSizes.size(); ++k) {
          host.push_back(make_state(kMultiSizes[k], 200 + 10 * k));
          p.push_back(on_gpu(host[k].p));
          g.push_back(on_gpu(host[k].g));
          buf.push_back(on_gpu(host[k].m));
          list.push_back({p[k].data(), g[k].data(), momentum != 0.0 ? buf[k].data() : nullptr, kMultiSizes[k]});
        }
        const auto s = sgd_scalars(momentum, nesterov, first);
        tg::backend::cuda::sgd_step_multi(list.data(), static_cast<int>(list.size()), s);
        for (std::size_t k = 0; k < kMultiSizes.size(); ++k) {
          tg::backend::cpu::sgd_step<float>(host[k].p.data(), host[k].g.data(), host[k].m.data(), kMultiSizes[k], s);
          expect_gpu_close(p[k], host[k].p, 1.f, "multi sgd p");
          expect_gpu_close(buf[k], host[k].m, 1e-2f, "multi sgd momentum buffer");
        }
      }
}

TEST_F(CudaOptim, MultiTensorLambMatchesTheCpuPerTensorWithEachTrustRatio) {
  std::vector<std::int64_t> sizes = kMultiSizes;
  sizes.push_back(300007);  // several chunks
  sizes.push_back(17);      // all-zero weights: the ratio falls back to 1
  std::vector<State> host;
  std::vector<tg::Tensor<float, tg::cuda>> p, g, m, v;
  std::vector<tg::backend::LambTensor<float>> list;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    host.push_back(make_state(sizes[k], 300 + 10 * k));
    if (k + 1 == sizes.size()) host[k].p.assign(host[k].p.size(), 0.f);
    p.push_back(on_gpu(host[k].p));
    g.push_back(on_gpu(host[k].g));
    m.push_back(on_gpu(host[k].m));
    v.push_back(on_gpu(host[k].v));
    list.push_back({p[k].data(), g[k].data(), m[k].data(), v[k].data(), sizes[k]});
  }
  const auto s = lamb_scalars(3);
  // the ratios stay on the device (Note [LAMB on the device]); read back here to compare
  auto dtrust = tg::Tensor<double, tg::cuda>::full({static_cast<std::int64_t>(sizes.size())}, -1.0);
  tg::backend::cuda::lamb_step_multi(list.data(), static_cast<int>(list.size()), s, dtrust.data());
  const std::vector<double> trust = dtrust.to_vector();
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    State& h = host[k];
    const double cpu_trust = tg::backend::cpu::lamb_step<float>(h.p.data(), h.g.data(), h.m.data(), h.v.data(), sizes[k], s);
    EXPECT_NEAR(trust[k], cpu_trust, 1e-6 * cpu_trust) << "tensor " << k;
    expect_gpu_close(p[k], h.p, 1.f, "multi lamb p");
    expect_gpu_close(m[k], h.m, 1e-2f, "multi lamb m");
    expect_gpu_close(v[k], h.v, 1e-4f, "multi lamb v");
  }
  EXPECT_EQ(trust.back(), 1.0);
  EXPECT_NE(trust[1], 1.0);
}

// The device optimizers on CUDA against their host optimizers over a decay matrix, a 3-D weight, a bias
// and a LayerNorm gain for 4 steps (one parameter skipped on step 1), then a state round trip through the
// host optimizer. The backends differ by FMA contraction and summation order only.
std::vector<tg::optim::Param> host_params(std::uint64_t seed) {
  std::vector<tg::optim::Param> out;
  const std::vector<std::pair<std::string, tg::Shape>> specs = {{"h.0.mlp.c_fc.weight", {64, 1031}},
                                                                 {"h.0.attn.c_attn.weight", {3, 5, 7}},
                                                                 {"h.0.mlp.c_fc.bias", {64}},
                                                                 {"h.0.ln_1.weight", {70001}}};
  for (std::size_t i = 0; i < specs.size(); ++i) {
    tg::Generator gen(seed + i);
    out.emplace_back(specs[i].first, tg::Tensor<float>::uniform(specs[i].second, -1.f, 1.f, gen));
  }
  return out;
}
std::vector<tg::optim::BasicParam<tg::cuda>> to_gpu(const std::vector<tg::optim::Param>& ps) {
  std::vector<tg::optim::BasicParam<tg::cuda>> out;
  for (const auto& p : ps) out.emplace_back(p.name, p.tensor.detach().to<tg::cuda>().detach());
  return out;
}
double max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num = std::max(num, static_cast<double>(std::abs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::abs(b[i])));
  }
  return den == 0 ? num : num / den;
}

template <class Host, class Dev, class Options>
void compare_device_optimizer(const Options& o, float weight_decay) {
  auto cpu_params = host_params(5);
  auto gpu_params = to_gpu(cpu_params);
  Host cpu_opt(tg::optim::default_groups(cpu_params, weight_decay), o);
  Dev gpu_opt(tg::optim::default_groups(gpu_params, weight_decay), o);
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < cpu_params.size(); ++i) {
      if (step == 1 && i == 3) continue;
      tg::Generator gen(1000 + 10 * step + i);
      const auto gr = tg::Tensor<float>::normal(cpu_params[i].tensor.shape(), 0.f, 0.1f, gen);
      cpu_params[i].tensor.zero_grad();
      cpu_params[i].tensor.backward(gr);
      gpu_params[i].tensor.zero_grad();
      gpu_params[i].tensor.backward(gr.to<tg::cuda>());
    }
    cpu_opt.set_lr(o.lr * (1.f + static_cast<float>(step)) / 4.f);
    gpu_opt.set_lr(o.lr * (1.f + static_cast<float>(step)) / 4.f);
    cpu_opt.step();
    gpu_opt.step();
    cpu_opt.zero_grad();
    gpu_opt.zero_grad();
    for (std::size_t i = 0; i < cpu_params.size(); ++i)
      EXPECT_LT(max_rel(gpu_params[i].tensor.to<tg::cpu>().to_vector(), cpu_params[i].tensor.to_vector()), 1e-5)
          << cpu_opt.name() << " " << cpu_params[i].name << " step " << step;
  }
  std::map<std::string, std::vector<float>> want;
  for (const auto& e : cpu_opt.state_tensors()) want[e.name] = e.tensor.to_vector();
  const auto got = gpu_opt.state_tensors();
  ASSERT_EQ(got.size(), want.size());
  for (const auto& e : got) {
    ASSERT_TRUE(want.count(e.name)) << e.name;
    EXPECT_LT(max_rel(e.tensor.to_vector(), want[e.name]), 1e-4) << e.name;
  }
  // GPU state -> CPU optimizer -> fresh GPU optimizer (a checkpoint across devices): the same state, exactly.
  auto other = host_params(9);
  Host host(tg::optim::default_groups(other, weight_decay), o);
  host.load_state(gpu_opt.state_tensors());
  Dev resumed(tg::optim::default_groups(to_gpu(other), weight_decay), o);
  resumed.load_state(host.state_tensors());
  const auto again = resumed.state_tensors();
  ASSERT_EQ(again.size(), got.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(again[i].tensor.to_vector(), got[i].tensor.to_vector()) << got[i].name;
}

TEST_F(CudaOptim, SgdOnCudaMatchesSgdOnTheCpu) {
  compare_device_optimizer<tg::optim::Sgd, tg::optim::BasicSgd<tg::cuda>>(
      tg::optim::SgdOptions{.lr = 0.05f, .momentum = 0.9f, .nesterov = true, .weight_decay = 0.01f}, 0.01f);
  compare_device_optimizer<tg::optim::Sgd, tg::optim::BasicSgd<tg::cuda>>(
      tg::optim::SgdOptions{.lr = 0.05f, .weight_decay = 0.01f}, 0.01f);  // no momentum: no state slots
}
TEST_F(CudaOptim, LambOnCudaMatchesLambOnTheCpu) {
  compare_device_optimizer<tg::optim::Lamb, tg::optim::BasicLamb<tg::cuda>>(
      tg::optim::LambOptions{.lr = 2e-2f, .weight_decay = 0.1f}, 0.1f);
}
TEST_F(CudaOptim, AdafactorOnCudaMatchesAdafactorOnTheCpu) {
  tg::optim::AdafactorOptions o;
  o.lr = 3e-2f;
  o.relative_step = false;
  o.beta1 = 0.9f;
  o.weight_decay = 0.05f;
  compare_device_optimizer<tg::optim::Adafactor, tg::optim::BasicAdafactor<tg::cuda>>(o, 0.05f);
  // the defaults: relative steps with parameter scaling, no first moment (no m slot), no decay
  compare_device_optimizer<tg::optim::Adafactor, tg::optim::BasicAdafactor<tg::cuda>>(tg::optim::AdafactorOptions{}, 0.f);
}

}  // namespace

}  // namespace test_cuda_optim_cpp

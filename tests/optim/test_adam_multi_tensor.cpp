// Adam / AdamW's multi-tensor path (Note [device optimizers]: the updates of one step grouped by lr, decay
// and step count, one adam_step_multi call per run; the code the GPU runs except for the element kernel)
// against the same optimizer over one group per parameter: bit for bit, the same state under the same
// names, clipping like clip_grad_norm over a list of parameters, and GradAccumRuntime driven the same way.
// The CUDA side is tests/cuda/test_cuda_train.cpp.
#include <gtest/gtest.h>

#include <limits>
#include <map>
#include <string>
#include <vector>

#include <typegrad/amp/scaler.hpp>
#include <typegrad/detail/cpu/optim_kernels.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>

#include "optim/optim_test_util.hpp"

namespace test_adam_multi_tensor_cpp {  // the file's own names (Note [unity test sources])

namespace {

using tg::optim::testing::make_param;
using tg::optim::testing::random_like;
using tg::optim::testing::set_grad;
using tg::optim::testing::by_name;
using tg::optim::testing::group_per_param;

std::vector<tg::optim::Param> three_params(std::uint64_t seed) {
  return {make_param("h.0.mlp.c_fc.weight", {5, 7}, seed), make_param("h.0.mlp.c_fc.bias", {5}, seed + 1),
          make_param("h.0.ln_1.weight", {7}, seed + 2)};
}

void expect_same_adam(bool decoupled) {
  const tg::optim::AdamWOptions o{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  auto ref_params = three_params(1), dev_params = three_params(1);
  std::unique_ptr<tg::optim::Optimizer> ref, dev_ptr;
  const tg::optim::AdamOptions l2{o.lr, o.beta1, o.beta2, o.eps, 0.f};
  if (decoupled) {
    ref = std::make_unique<tg::optim::AdamW>(group_per_param(ref_params, o.weight_decay), o);
    dev_ptr = std::make_unique<tg::optim::AdamW>(tg::optim::default_groups(dev_params, o.weight_decay), o);
  } else {
    ref = std::make_unique<tg::optim::Adam>(group_per_param(ref_params, o.weight_decay), l2);
    dev_ptr = std::make_unique<tg::optim::Adam>(tg::optim::default_groups(dev_params, o.weight_decay), l2);
  }
  tg::optim::Optimizer& dev = *dev_ptr;
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < ref_params.size(); ++i) {
      if (step == 1 && i == 2) continue;  // no gradient: skipped, its step count lags the others
      set_grad(ref_params[i], random_like(ref_params[i], 100 + 10 * step + i));
      set_grad(dev_params[i], random_like(dev_params[i], 100 + 10 * step + i));
    }
    ref->set_lr(o.lr * (1.f + static_cast<float>(step)) / 4.f);
    dev.set_lr(o.lr * (1.f + static_cast<float>(step)) / 4.f);
    ref->step();
    dev.step();
    ref->zero_grad();
    dev.zero_grad();
    for (std::size_t i = 0; i < ref_params.size(); ++i)
      EXPECT_EQ(dev_params[i].tensor.to_vector(), ref_params[i].tensor.to_vector()) << ref_params[i].name << " step " << step;
  }
  EXPECT_EQ(dev.step_count(), ref->step_count());
  EXPECT_EQ(by_name(dev.state_tensors()), by_name(ref->state_tensors()));
  EXPECT_EQ(by_name(dev.state_tensors()).at("h.0.ln_1.weight.step"), std::vector<float>{3.f});
}

TEST(AdamMultiTensor, MatchesAdamWPerTensorBitForBit) { expect_same_adam(true); }
TEST(AdamMultiTensor, MatchesAdamWithL2DecayPerTensorBitForBit) { expect_same_adam(false); }

TEST(AdamMultiTensor, StateMovesBetweenGroupLayouts) {
  const tg::optim::AdamWOptions o{.lr = 1e-2f, .weight_decay = 0.1f};
  auto a_params = three_params(3), b_params = three_params(3);
  tg::optim::AdamW a(tg::optim::default_groups(a_params, o.weight_decay), o);
  tg::optim::AdamW host(group_per_param(b_params, o.weight_decay), o);
  for (int step = 0; step < 2; ++step) {
    for (auto& p : a_params) set_grad(p, random_like(p, 7 + step));
    a.step();
    a.zero_grad();
  }
  host.load_state(a.state_tensors());  // state names do not depend on the groups
  EXPECT_EQ(by_name(host.state_tensors()), by_name(a.state_tensors()));
  tg::optim::AdamW c(tg::optim::default_groups(b_params, o.weight_decay), o);
  c.load_state(host.state_tensors());  // as a resume does
  EXPECT_EQ(by_name(c.state_tensors()), by_name(a.state_tensors()));
  EXPECT_EQ(c.step_count(), 2);

  auto bad = a.state_tensors();
  bad.push_back({"h.9.attn.c_attn.weight.exp_avg", tg::Tensor<tg::fp32>::zeros({2})});
  EXPECT_THROW(
      {
        try {
          c.load_state(bad);
        } catch (const tg::Error& e) {
          EXPECT_NE(std::string(e.what()).find("unknown entry 'h.9.attn.c_attn.weight.exp_avg'"), std::string::npos) << e.what();
          throw;
        }
      },
      tg::Error);
  auto misshapen = a.state_tensors();
  misshapen[0].tensor = tg::Tensor<tg::fp32>::zeros({3});
  EXPECT_THROW(c.load_state(misshapen), tg::Error);
}

TEST(AdamMultiTensor, ClippingTheOptimizerMatchesClippingItsParameters) {
  for (double max_norm : {0.5, 1e6}) {
    auto a = three_params(5), b = three_params(5);
    for (std::size_t i = 0; i < a.size(); ++i) {
      set_grad(a[i], random_like(a[i], 50 + i, 3.f));
      set_grad(b[i], random_like(b[i], 50 + i, 3.f));
    }
    tg::optim::AdamW opt(tg::optim::default_groups(a, 0.1f), {});
    const double na = tg::optim::clip_grad_norm(opt, max_norm);
    const double nb = tg::optim::clip_grad_norm(std::span<const tg::optim::Param>(b), max_norm);
    EXPECT_NEAR(na, nb, 1e-12 * nb);
    for (std::size_t i = 0; i < a.size(); ++i)
      EXPECT_LT(tg::optim::testing::rel_err_inf(a[i].tensor.grad(), b[i].tensor.grad()), 1e-6) << a[i].name;
  }
}

// fp16's loss scaler (amp::detail::unscale_grads, generic over the optimizer) on the multi-tensor path: the
// same unscaled step as per tensor, and the same skip (nothing changes, the scale halves) on an inf gradient.
TEST(AdamMultiTensor, DynamicScalerUnscalesAndSkipsLikePerTensor) {
  const tg::optim::AdamWOptions o{.lr = 1e-2f, .weight_decay = 0.1f};
  auto ref_params = three_params(21), dev_params = three_params(21);
  tg::optim::AdamW ref(group_per_param(ref_params, o.weight_decay), o);
  tg::optim::AdamW dev(tg::optim::default_groups(dev_params, o.weight_decay), o);
  tg::amp::DynamicScaler ref_scaler(tg::amp::DynamicScalerOptions{.init_scale = 1024.0}),
      dev_scaler(tg::amp::DynamicScalerOptions{.init_scale = 1024.0});
  tg::optim::Schedule ref_sched = tg::optim::Constant{1e-2f}, dev_sched = tg::optim::Constant{1e-2f};
  tg::optim::GradAccumRuntime ref_acc(1), dev_acc(1);
  for (int step = 0; step < 3; ++step) {
    for (std::size_t i = 0; i < ref_params.size(); ++i) {
      tg::Tensor<tg::fp32> g = random_like(ref_params[i], 300 + 10 * step + i, 1024.f);  // gradients of a scaled loss
      if (step == 1 && i == 0) g.data()[3] = std::numeric_limits<float>::infinity();
      set_grad(ref_params[i], g);
      set_grad(dev_params[i], g.clone());
    }
    const auto before = dev_params[1].tensor.to_vector();
    ref_acc.micro_step(ref, ref_sched, 1.0, ref_scaler);
    dev_acc.micro_step(dev, dev_sched, 1.0, dev_scaler);
    EXPECT_EQ(dev_acc.last_step_skipped(), step == 1);
    EXPECT_EQ(dev_scaler.state(), ref_scaler.state());
    if (step == 1) EXPECT_EQ(dev_params[1].tensor.to_vector(), before) << "a skipped step must change nothing";
    for (std::size_t i = 0; i < ref_params.size(); ++i)
      EXPECT_EQ(dev_params[i].tensor.to_vector(), ref_params[i].tensor.to_vector()) << ref_params[i].name << " step " << step;
  }
  EXPECT_EQ(dev.step_count(), 2);
  EXPECT_EQ(dev_scaler.scale(), 512.0);
}

TEST(CopyParameterValues, CopiesByNameAndRejectsAMismatch) {
  const auto cfg = tg::nn::GPTConfig{64, 16, 2, 2, 32, 0.f};
  tg::Generator g1(1), g2(2);
  const tg::nn::GPT a(cfg, g1), b(cfg, g2);
  const auto pa = a.named_parameters(), pb = b.named_parameters();
  ASSERT_NE(pa[0].tensor.to_vector(), pb[0].tensor.to_vector());
  tg::nn::copy_parameter_values(pa, pb);
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_EQ(pa[i].tensor.to_vector(), pb[i].tensor.to_vector()) << pa[i].name;
  std::vector<tg::optim::Param> fewer(pb.begin(), pb.end() - 1);
  EXPECT_THROW(tg::nn::copy_parameter_values(pa, fewer), tg::Error);
}

// The trainer's step (AdamW + clipping through GradAccumRuntime) with the multi-tensor path against the
// per-tensor one, on a tiny GPT with 2 micro-batches per step: the same losses, norms and weights.
TEST(AdamMultiTensor, DrivesGradAccumulationLikePerTensor) {
  const auto cfg = tg::nn::GPTConfig{64, 16, 2, 2, 32, 0.f};
  tg::Generator g1(11), g2(11);
  const tg::nn::GPT ref_model(cfg, g1), dev_model(cfg, g2);
  const auto ref_params = ref_model.named_parameters(), dev_params = dev_model.named_parameters();
  const tg::optim::AdamWOptions o{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  tg::optim::AdamW ref_opt(group_per_param(ref_params, o.weight_decay), o);
  tg::optim::AdamW dev_opt(tg::optim::default_groups(dev_params, o.weight_decay), o);
  auto schedule = [] { return tg::optim::Schedule(tg::optim::Warmup{2}.then(tg::optim::Cosine{3e-3f, 4, 3e-4f})); };
  tg::optim::Schedule ref_sched = schedule(), dev_sched = schedule();
  tg::optim::GradAccumRuntime ref_acc(2), dev_acc(2);
  tg::amp::NoScaler ref_scaler, dev_scaler;
  tg::Generator data(5);
  for (int micro = 0; micro < 12; ++micro) {
    auto x = tg::Tensor<std::int64_t>::empty({2, 16}), y = tg::Tensor<std::int64_t>::empty({2, 16});
    for (std::int64_t i = 0; i < 32; ++i) {
      x.data()[i] = static_cast<std::int64_t>(data.next_u64() % 64);
      y.data()[i] = static_cast<std::int64_t>(data.next_u64() % 64);
    }
    const auto ref_loss = tg::cross_entropy(ref_model.forward<tg::fp32>(x), y);
    const auto dev_loss = tg::cross_entropy(dev_model.forward<tg::fp32>(x), y);
    EXPECT_NEAR(dev_loss.item(), ref_loss.item(), 1e-5) << "micro-batch " << micro;
    ref_acc.scale(ref_loss, ref_scaler).backward();
    dev_acc.scale(dev_loss, dev_scaler).backward();
    EXPECT_EQ(ref_acc.micro_step(ref_opt, ref_sched, 0.5, ref_scaler), dev_acc.micro_step(dev_opt, dev_sched, 0.5, dev_scaler));
    EXPECT_NEAR(dev_acc.last_grad_norm(), ref_acc.last_grad_norm(), 1e-6 * ref_acc.last_grad_norm());
  }
  EXPECT_EQ(dev_opt.step_count(), 6);
  EXPECT_EQ(dev_sched.step(), ref_sched.step());
  for (std::size_t i = 0; i < ref_params.size(); ++i)
    EXPECT_LT(tg::optim::testing::rel_err_inf(dev_params[i].tensor, ref_params[i].tensor), 1e-4) << ref_params[i].name;
}

}  // namespace

namespace {
// The CPU's multi-tensor kernel runs a group as one parallel region over its elements laid end to end (Note
// [one parallel region per multi-tensor step]): tensors of odd sizes, their concatenation split between the
// threads inside tensors, against the per-tensor kernel: p, m and v equal bit for bit over three steps.
TEST(AdamMultiTensor, OneParallelRegionEqualsThePerTensorKernel) {
  const std::vector<std::int64_t> sizes{7, 40000, 3, 12345, 1, 65537};
  struct Buffers {
    std::vector<std::vector<float>> p, g, m, v;
  };
  auto fill = [&](std::uint64_t seed) {
    Buffers b;
    tg::Generator gen(seed);
    for (std::int64_t n : sizes) {
      b.p.push_back(tg::Tensor<float>::normal({n}, 0.f, 1.f, gen).to_vector());
      b.g.push_back(tg::Tensor<float>::normal({n}, 0.f, 1.f, gen).to_vector());
      b.m.push_back(tg::Tensor<float>::normal({n}, 0.f, 0.1f, gen).to_vector());
      b.v.push_back(tg::Tensor<float>::uniform({n}, 0.f, 0.1f, gen).to_vector());
    }
    return b;
  };
  Buffers multi = fill(42), single = fill(42);
  tg::backend::AdamScalars s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.decoupled = true;
  for (std::int64_t step = 1; step <= 3; ++step) {
    s.step = step;
    std::vector<tg::backend::AdamTensor<float>> list;
    for (std::size_t i = 0; i < sizes.size(); ++i)
      list.push_back({multi.p[i].data(), multi.g[i].data(), multi.m[i].data(), multi.v[i].data(), sizes[i]});
    tg::backend::cpu::adam_step_multi<float>(list.data(), static_cast<int>(list.size()), s);
    for (std::size_t i = 0; i < sizes.size(); ++i)
      tg::backend::cpu::adam_step<float>(single.p[i].data(), single.g[i].data(), single.m[i].data(), single.v[i].data(),
                                         sizes[i], s);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    EXPECT_EQ(multi.p[i], single.p[i]) << "p of tensor " << i;
    EXPECT_EQ(multi.m[i], single.m[i]) << "m of tensor " << i;
    EXPECT_EQ(multi.v[i], single.v[i]) << "v of tensor " << i;
  }
}

// Note [the optimizer writes the weight copies]: with a copy, each updated element is also written rounded to
// bf16 or fp16 (the refresh's scalar_cast), across tensors that one thread's share spans; p, m and v are those
// of the step without copies, bit for bit.
TEST(AdamMultiTensor, WritesEachTensorsWeightCopyWithItsUpdate) {
  using tg::backend::WeightCopyType;
  const std::vector<std::int64_t> sizes{7, 40000, 3, 12345, 1, 65537};
  const std::vector<WeightCopyType> types{WeightCopyType::bf16, WeightCopyType::fp16, WeightCopyType::none,
                                          WeightCopyType::bf16, WeightCopyType::fp16, WeightCopyType::bf16};
  auto fill = [&](std::uint64_t seed) {
    std::vector<std::vector<float>> b(4 * sizes.size());
    tg::Generator gen(seed);
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      b[4 * i] = tg::Tensor<float>::normal({sizes[i]}, 0.f, 1.f, gen).to_vector();
      b[4 * i + 1] = tg::Tensor<float>::normal({sizes[i]}, 0.f, 1.f, gen).to_vector();
      b[4 * i + 2] = tg::Tensor<float>::normal({sizes[i]}, 0.f, 0.1f, gen).to_vector();
      b[4 * i + 3] = tg::Tensor<float>::uniform({sizes[i]}, 0.f, 0.1f, gen).to_vector();
    }
    return b;
  };
  auto with = fill(7), without = fill(7);
  std::vector<std::vector<tg::bf16>> b16(sizes.size());
  std::vector<std::vector<tg::fp16>> f16(sizes.size());
  tg::backend::AdamScalars s;
  s.lr = 1e-2, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8, s.weight_decay = 0.1, s.decoupled = true;
  for (std::int64_t step = 1; step <= 2; ++step) {
    s.step = step;
    std::vector<tg::backend::AdamTensor<float>> a, b;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      const auto n = static_cast<std::size_t>(sizes[i]);
      b16[i].resize(n);
      f16[i].resize(n);
      void* copy = types[i] == WeightCopyType::bf16 ? static_cast<void*>(b16[i].data())
                   : types[i] == WeightCopyType::fp16 ? static_cast<void*>(f16[i].data())
                                                      : nullptr;
      a.push_back({with[4 * i].data(), with[4 * i + 1].data(), with[4 * i + 2].data(), with[4 * i + 3].data(), sizes[i],
                   copy, types[i]});
      b.push_back({without[4 * i].data(), without[4 * i + 1].data(), without[4 * i + 2].data(), without[4 * i + 3].data(),
                   sizes[i], nullptr, WeightCopyType::none});
    }
    tg::backend::cpu::adam_step_multi<float>(a.data(), static_cast<int>(a.size()), s);
    tg::backend::cpu::adam_step_multi<float>(b.data(), static_cast<int>(b.size()), s);
  }
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    for (int k = 0; k < 4; ++k) ASSERT_EQ(with[4 * i + k], without[4 * i + k]) << "buffer " << k << " of tensor " << i;
    const std::vector<float>& p = with[4 * i];
    for (std::size_t j = 0; j < p.size(); ++j) {
      if (types[i] == WeightCopyType::bf16) ASSERT_EQ(b16[i][j].bits, tg::bf16(p[j]).bits) << "tensor " << i << " element " << j;
      if (types[i] == WeightCopyType::fp16) ASSERT_EQ(f16[i][j].bits, tg::fp16(p[j]).bits) << "tensor " << i << " element " << j;
    }
  }
  // fp64 masters have no 16-bit copies to write: asking is an error, not a silent skip
  std::vector<double> p(4, 1.0), g(4, 0.5), m(4, 0.0), v(4, 0.0);
  std::vector<tg::bf16> copy(4);
  const tg::backend::AdamTensor<double> t{p.data(), g.data(), m.data(), v.data(), 4, copy.data(), WeightCopyType::bf16};
  try {
    tg::backend::cpu::adam_step_multi<double>(&t, 1, s);
    FAIL() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("copies are written from fp32 masters only"), std::string::npos) << e.what();
  }
}
}  // namespace

}  // namespace test_adam_multi_tensor_cpp

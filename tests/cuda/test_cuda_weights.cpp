// Per-step 16-bit weight copies on CUDA (amp::WeightCopies<T, cuda>, Note [master weights and per-step
// copies]): the copies equal the CPU's conversion bit for bit after construction and after refresh()
// (which writes in place), a bf16 forward + backward through the copies gives the fp32 masters the
// gradients of one without copies, an AdamW step makes the copies stale until after_step(), each copy
// is attached to its GPU master (one owner at a time) and detached at destruction, and a checkpoint
// region's recompute reads the forward's copies (Note [regions see the copies]).
// Every test skips with the reason when there is no GPU; the CPU halves are in tests/amp/test_amp.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <typegrad/amp/amp.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

#include "cuda/gpu_skip.hpp"

namespace test_cuda_weights_cpp {  // the file's own names (Note [unity test sources])

namespace {

const tg::nn::GPTConfig kTiny{64, 16, 2, 2, 32, 0.f};

std::pair<tg::Tensor<std::int64_t>, tg::Tensor<std::int64_t>> batch(std::uint64_t seed, std::int64_t B = 2,
                                                                    std::int64_t T = 16) {
  tg::Generator gen(seed);
  auto x = tg::Tensor<std::int64_t>::empty({B, T}), y = tg::Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) {
    x.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
    y.data()[i] = static_cast<std::int64_t>(gen.next_u64() % 64);
  }
  return {x, y};
}

/// The raw bits of a 16-bit tensor, read back to the host.
template <class T, class D>
std::vector<std::uint16_t> bits_of(const tg::Tensor<T, D>& t) {
  tg::Tensor<T> h;
  if constexpr (std::is_same_v<D, tg::cpu>) h = t.detach().contiguous();
  else h = t.detach().template to<tg::cpu>();
  std::vector<std::uint16_t> out(static_cast<std::size_t>(h.numel()));
  for (std::int64_t i = 0; i < h.numel(); ++i) out[static_cast<std::size_t>(i)] = h.data()[i].bits;
  return out;
}
/// fp32 values read back to the host.
template <class D>
std::vector<float> floats_of(const tg::Tensor<float, D>& t) {
  if constexpr (std::is_same_v<D, tg::cpu>) return t.detach().to_vector();
  else return t.detach().template to<tg::cpu>().to_vector();
}

/// Values that test the rounding: ties to even, the largest finite fp16 and what overflows it, fp16 and
/// bf16 subnormals, signed zeros, a large bf16-only value, and ordinary ones.
std::vector<float> rounding_probes() {
  return {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, -(1.0f + 0x1p-8f),
          65504.f,         65519.f,            65520.f,         -70000.f,           0x1p-24f,
          0x1p-25f,        0x1.8p-25f,         1e-30f,          0.f,                -0.f,
          3.0e38f,         0.1f,               -2.5f,           1.0f / 3.0f,        123.456f};
}

template <class T>
void expect_copies_match_the_cpu() {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(11);
  const tg::nn::GPT cpu_model(kTiny, gen);
  const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
  const auto cpu_params = cpu_model.named_parameters();
  const auto gpu_params = gpu_model.named_parameters();
  tg::amp::WeightCopies<T, tg::cuda> gpu_copies(gpu_params);
  ASSERT_EQ(gpu_copies.size(), gpu_params.size());
  const char* name = tg::dtype_traits<T>::name.data();
  {
    const tg::amp::WeightCopies<T, tg::cpu> cpu_copies(cpu_params);  // other masters: attaches alongside
    EXPECT_EQ(gpu_copies.nbytes(), cpu_copies.nbytes());
    for (std::size_t i = 0; i < gpu_params.size(); ++i) {
      const tg::Tensor<T, tg::cuda> copy = gpu_copies.copy_of(gpu_params[i].tensor);
      ASSERT_TRUE(copy.defined()) << gpu_params[i].name;
      EXPECT_EQ(bits_of(copy), bits_of(cpu_copies.copy_of(cpu_params[i].tensor)))
          << name << " copy of " << gpu_params[i].name << " at construction";
    }
  }  // detached: cpu_fresh below attaches new copies to the same CPU masters

  // New masters on both devices (rounding probes at the front of the first parameter), then refresh():
  // same bits again, written into the same storage without allocating.
  std::vector<const void*> storage;
  for (const auto& p : gpu_params) storage.push_back(gpu_copies.copy_of(p.tensor).data());
  tg::Generator noise(12);
  const std::vector<float> probes = rounding_probes();
  for (std::size_t i = 0; i < cpu_params.size(); ++i) {
    const tg::Tensor<float>& m = cpu_params[i].tensor;
    for (std::int64_t k = 0; k < m.numel(); ++k)
      m.data()[k] = static_cast<float>(3.0 * (noise.uniform() - 0.5));
    for (std::size_t k = 0; i == 0 && k < probes.size() && static_cast<std::int64_t>(k) < m.numel(); ++k)
      m.data()[k] = probes[k];
  }
  ASSERT_GE(cpu_params[0].tensor.numel(), static_cast<std::int64_t>(probes.size()));
  tg::nn::copy_parameter_values(cpu_params, gpu_params);
  const auto before = tg::allocator<tg::cuda>().stats();
  gpu_copies.refresh();
  const auto after = tg::allocator<tg::cuda>().stats();
  EXPECT_EQ(after.bytes_in_use, before.bytes_in_use) << "refresh() allocated";
  EXPECT_EQ(after.system_allocations, before.system_allocations);
  tg::amp::WeightCopies<T, tg::cpu> cpu_fresh(cpu_params);
  for (std::size_t i = 0; i < gpu_params.size(); ++i) {
    const tg::Tensor<T, tg::cuda> copy = gpu_copies.copy_of(gpu_params[i].tensor);
    EXPECT_EQ(copy.data(), storage[i]) << "refresh() moved the copy of " << gpu_params[i].name;
    const auto got = bits_of(copy);
    EXPECT_EQ(got, bits_of(cpu_fresh.copy_of(cpu_params[i].tensor))) << name << " copy of " << gpu_params[i].name
                                                                      << " after refresh()";
    EXPECT_EQ(got, bits_of(gpu_params[i].tensor.detach().template to<T>()))
        << "the copy of " << gpu_params[i].name << " is what Tensor::to<" << name << ">() gives";
  }
  // The probes really probed: ties went to even, and fp16 overflowed where it must.
  const auto probe_bits = bits_of(gpu_copies.copy_of(gpu_params[0].tensor));
  if constexpr (std::is_same_v<T, tg::bf16>) {
    EXPECT_EQ(probe_bits[0], T(1.0f).bits) << "1 + 2^-8 (a bf16 tie) rounds to even: 1";
    EXPECT_EQ(probe_bits[1], T(1.0f + 0x1p-6f).bits) << "1 + 3·2^-8 (a bf16 tie) rounds to even: 1 + 2^-6";
  } else {
    EXPECT_EQ(probe_bits[2], T(1.0f).bits) << "1 + 2^-11 (an fp16 tie) rounds to even: 1";
    EXPECT_EQ(probe_bits[3], T(1.0f + 0x1p-9f).bits) << "1 + 3·2^-11 (an fp16 tie) rounds to even: 1 + 2^-9";
    EXPECT_EQ(probe_bits[7], T(std::numeric_limits<float>::infinity()).bits) << "65520 overflows fp16";
    EXPECT_EQ(probe_bits[6], T(65504.f).bits) << "65519 rounds to fp16's largest finite value";
  }
}

TEST(WeightCopiesCuda, Bf16CopiesEqualTheCpusBitForBit) { expect_copies_match_the_cpu<tg::bf16>(); }
TEST(WeightCopiesCuda, Fp16CopiesEqualTheCpusBitForBit) { expect_copies_match_the_cpu<tg::fp16>(); }

TEST(WeightCopiesCuda, ParamAsReadsTheCopyAttachedToTheDeviceMaster) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(13);
  const tg::nn::GPT cpu_model(kTiny, gen);
  const tg::nn::BasicGPT<tg::cuda> gpu_model(cpu_model);
  const auto cpu_params = cpu_model.named_parameters();
  const auto gpu_params = gpu_model.named_parameters();
  const tg::Tensor<float, tg::cuda>& w = gpu_params[0].tensor;
  auto& alloc = tg::allocator<tg::cuda>();
  {
    tg::amp::WeightCopies<tg::bf16, tg::cuda> copies(gpu_params);
    for (const auto& p : gpu_params) {
      const tg::AttachedCopy* slot = p.tensor.storage()->attached_copy();
      ASSERT_NE(slot, nullptr) << p.name << ": the GPU master holds its copy";
      EXPECT_EQ(slot->dtype, tg::dtype_traits<tg::bf16>::dtype);
      EXPECT_EQ(slot->device, tg::DeviceKind::cuda);
    }
    EXPECT_EQ(cpu_params[0].tensor.storage()->attached_copy(), nullptr) << "the CPU masters are other tensors";
    const std::int64_t before = alloc.stats().bytes_in_use;
    const tg::Tensor<tg::bf16, tg::cuda> seen = tg::amp::param_as<tg::bf16>(w);
    EXPECT_EQ(alloc.stats().bytes_in_use, before) << "param_as converted instead of reading the copy";
    EXPECT_EQ(seen.data(), copies.copy_of(w).data()) << "the forward reads the attached copy, no conversion";
    EXPECT_TRUE(seen.requires_grad());
    // One owner per master, on the GPU too.
    try {
      tg::amp::WeightCopies<tg::fp16, tg::cuda> second(gpu_params);
      ADD_FAILURE() << "expected tg::Error: the masters already hold bf16 copies";
    } catch (const tg::Error& e) {
      EXPECT_NE(std::string(e.what()).find("already holds bf16 compute copies on cuda"), std::string::npos) << e.what();
    }
    EXPECT_EQ(tg::amp::param_as<tg::bf16>(w).data(), copies.copy_of(w).data()) << "the first copies stay attached";
  }
  for (const auto& p : gpu_params) EXPECT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name << " detached";
  const std::int64_t before = alloc.stats().bytes_in_use;
  const tg::Tensor<tg::bf16, tg::cuda> converted = tg::amp::param_as<tg::bf16>(w);
  EXPECT_GT(alloc.stats().bytes_in_use, before) << "without copies, param_as converts";
  EXPECT_EQ(bits_of(converted), bits_of(cpu_params[0].tensor.detach().to<tg::bf16>()));
}

/// A bf16 forward + backward of BasicGPT<cuda> through MixedPrecision's copies against the same model's
/// forward<bf16> without copies (a to<bf16>() per use): the same loss and the same fp32 gradients on the
/// masters, bit for bit (the same values enter the same kernels).
TEST(WeightCopiesCuda, Bf16ForwardBackwardThroughCopiesEqualsWithoutCopies) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(14);
  const tg::nn::GPT cpu_model(kTiny, gen);
  const tg::nn::BasicGPT<tg::cuda> model(cpu_model);
  const auto params = model.named_parameters();
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(params, 1e-2f), {.lr = 1e-3f});
  using Amp = tg::amp::MixedPrecision<tg::amp::bf16_mixed, tg::amp::NoScaler, tg::cuda>;
  std::optional<Amp> amp(std::in_place, params, opt);
  static_assert(std::is_same_v<decltype(amp->forward(model, std::declval<tg::Tensor<std::int64_t>>(), gen)),
                               tg::Tensor<tg::bf16, tg::cuda>>);
  const auto [x, y] = batch(15);
  tg::Generator g1(1), g2(1);
  const auto with_copies = amp->loss(amp->forward(model, x, g1), y);
  static_assert(std::is_same_v<std::remove_cvref_t<decltype(with_copies)>, tg::Tensor<float, tg::cuda>>);
  with_copies.backward();
  std::vector<std::vector<float>> grads;
  for (const auto& p : params) {
    ASSERT_TRUE(p.tensor.grad().defined()) << "no fp32 gradient reached the master " << p.name;
    grads.push_back(floats_of(p.tensor.grad()));
  }
  opt.zero_grad();
  amp.reset();  // the copies detach: the forward below converts each use with to<bf16>()
  for (const auto& p : params) ASSERT_EQ(p.tensor.storage()->attached_copy(), nullptr) << p.name;
  const auto without = tg::cross_entropy_as<tg::fp32>(model.forward<tg::bf16>(x, g2, true), y);
  without.backward();
  EXPECT_EQ(with_copies.item(), without.item());
  for (std::size_t i = 0; i < params.size(); ++i)
    EXPECT_EQ(floats_of(params[i].tensor.grad()), grads[i]) << "gradient of " << params[i].name;
}

/// The trainer's step on the GPU with BasicAdamW<cuda>: the step makes the copies stale (a forward then is an
/// error naming the steps), after_step() refreshes them to the updated masters.
TEST(WeightCopiesCuda, AdamWStepMakesTheCopiesStaleUntilAfterStep) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(16);
  const tg::nn::GPT cpu_model(kTiny, gen);
  const tg::nn::BasicGPT<tg::cuda> model(cpu_model);
  const auto params = model.named_parameters();
  tg::optim::BasicAdamW<tg::cuda> opt(tg::optim::default_groups(params, 1e-2f), {.lr = 1e-2f});
  tg::optim::Schedule schedule = tg::optim::Constant{1e-2f};
  tg::optim::GradAccumRuntime accum(2);
  tg::amp::MixedPrecision<tg::amp::bf16_mixed, tg::amp::NoScaler, tg::cuda> amp(params, opt);
  EXPECT_EQ(amp.weights.refreshes(), 1);
  const tg::Tensor<float, tg::cuda>& wte = params[0].tensor;
  const auto copy_before = bits_of(amp.weights.copy_of(wte));
  for (int m = 0; m < 2; ++m) {
    const auto [x, y] = batch(20 + static_cast<std::uint64_t>(m));
    accum.scale(amp.loss(amp.forward(model, x, gen), y), amp.scaler).backward();
    const bool stepped = accum.micro_step(opt, schedule, std::optional<double>(1.0), amp.scaler);
    EXPECT_EQ(stepped, m == 1);
    EXPECT_EQ(amp.weights.stale(), m == 1) << "micro-batch " << m;
  }
  EXPECT_EQ(opt.step_count(), 1);
  const auto [x, y] = batch(30);
  try {
    (void)amp.forward(model, x, gen);
    FAIL() << "expected tg::Error: a forward after an AdamW step without after_step()";
  } catch (const tg::Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("bf16 weight copies are stale on cuda"), std::string::npos) << what;
    EXPECT_NE(what.find("(step 1) after the last refresh() (step 0)"), std::string::npos) << what;
  }
  EXPECT_EQ(bits_of(amp.weights.copy_of(wte)), copy_before) << "nothing refreshed the copies yet";
  EXPECT_TRUE(amp.after_step(accum));
  EXPECT_FALSE(amp.weights.stale());
  EXPECT_EQ(amp.weights.refreshes(), 2);
  const auto refreshed = bits_of(amp.weights.copy_of(wte));
  EXPECT_NE(refreshed, copy_before) << "the step moved the masters (lr 1e-2)";
  EXPECT_EQ(refreshed, bits_of(wte.detach().to<tg::bf16>())) << "the copies hold the updated masters";
  EXPECT_NO_THROW((void)amp.forward(model, x, gen));
}

/// A checkpoint region recorded on the GPU recomputes (in backward) from the copies attached to the
/// masters, not from fresh conversions of them (Note [regions see the copies]).
TEST(WeightCopiesCuda, CheckpointRecomputeReadsTheForwardsCopies) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator g(5);
  const tg::Tensor<float, tg::cuda> w = tg::nn::normal_parameter<tg::cuda>({8, 8}, 1.f, g);
  const std::vector<tg::optim::BasicParam<tg::cuda>> ps{tg::optim::BasicParam<tg::cuda>("w", w)};
  tg::amp::WeightCopies<tg::bf16, tg::cuda> copies(ps);
  std::vector<const void*> seen;
  std::vector<std::int64_t> allocated;  // device tensor bytes param_as allocated: 0 when it reads the copy
  const auto fn = [&](const tg::Tensor<tg::bf16, tg::cuda>& x) {
    const std::int64_t before = tg::allocator<tg::cuda>().stats().bytes_in_use;
    const tg::Tensor<tg::bf16, tg::cuda> wb = tg::amp::param_as<tg::bf16>(w);
    allocated.push_back(tg::allocator<tg::cuda>().stats().bytes_in_use - before);
    seen.push_back(wb.data());
    return tg::matmul(x, wb);
  };
  const tg::Tensor<tg::bf16, tg::cuda> x = tg::Tensor<tg::bf16, tg::cuda>::full({4, 8}, 0.5);
  const tg::Tensor<tg::bf16, tg::cuda> y = tg::checkpoint<tg::RecomputeAll>(fn, x);
  tg::sum(y.to<tg::fp32>()).backward();
  ASSERT_EQ(seen.size(), 2u) << "one forward and one recompute";
  EXPECT_EQ(seen[0], copies.copy_of(w).data());
  EXPECT_EQ(seen[1], copies.copy_of(w).data()) << "the recompute converted the master again";
  EXPECT_EQ(allocated, (std::vector<std::int64_t>{0, 0})) << "a conversion allocated its output";
  ASSERT_TRUE(w.grad().defined()) << "the gradient reaches the fp32 master through the copy";
  // d/dw Σ(x·w) = xᵀ·1: every entry is Σ_rows 0.5 = 2 (exact in bf16 and fp32).
  for (float v : floats_of(w.grad())) EXPECT_EQ(v, 2.f);
  EXPECT_NE(w.storage()->attached_copy(), nullptr) << "the copy stays attached to the master";
}

/// The GPT's checkpointed blocks under MixedPrecision on the GPU: the recompute reads the copies and the
/// masters get the gradients of the run without checkpointing.
TEST(WeightCopiesCuda, CheckpointedGptUnderCopiesMatchesThePlainRun) {
  TG_SKIP_WITHOUT_GPU();
  tg::Generator gen(17);
  const tg::nn::GPT cpu_model(kTiny, gen);
  tg::nn::BasicGPT<tg::cuda> plain(cpu_model), ckpt(cpu_model);
  const auto pa = plain.named_parameters(), pb = ckpt.named_parameters();
  tg::optim::BasicSgd<tg::cuda> oa(pa, {.lr = 0.f}), ob(pb, {.lr = 0.f});
  tg::amp::MixedPrecision<tg::amp::bf16_mixed, tg::amp::NoScaler, tg::cuda> ampa(pa, oa), ampb(pb, ob);
  const auto [x, y] = batch(18);
  tg::Generator g1(1), g2(1);
  const auto recomputes = tg::autodiff::checkpoint_stats().recomputes;
  ampa.loss(ampa.forward(plain, x, g1), y).backward();
  ampb.loss(ckpt.forward<tg::bf16, tg::RecomputeAll>(x, g2, true), y).backward();  // the blocks checkpointed
  EXPECT_EQ(tg::autodiff::checkpoint_stats().recomputes - recomputes, kTiny.n_layer) << "one recompute per block";
  for (std::size_t i = 0; i < pa.size(); ++i) {
    ASSERT_TRUE(pb[i].tensor.grad().defined()) << pb[i].name;
    const auto a = floats_of(pa[i].tensor.grad()), b = floats_of(pb[i].tensor.grad());
    ASSERT_EQ(a.size(), b.size());
    double err = 0, scale = 0;  // max|a − b| / max|a|: the recompute runs the same kernels on the same copies
    for (std::size_t k = 0; k < a.size(); ++k) {
      err = std::max(err, std::abs(static_cast<double>(a[k]) - b[k]));
      scale = std::max(scale, std::abs(static_cast<double>(a[k])));
    }
    EXPECT_LE(err, 1e-5 * scale) << "gradient of " << pa[i].name;
  }
}

}  // namespace

}  // namespace test_cuda_weights_cpp

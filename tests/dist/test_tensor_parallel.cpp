// Tensor parallelism (Note [tensor parallelism]) over the whole world as one group (1, 2 or 3 ranks under
// CTest): the split GPT trained through TrainStep equals the one-process GPT, its communication ops' gradients,
// the vocabulary-parallel cross-entropy, the gathered layout, and the errors for groups that do not fit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/dist/comm.hpp>
#include <typegrad/dist/tensor_parallel.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/train/step.hpp>

namespace test_tensor_parallel_cpp {  // the file's own names (Note [unity test sources])

namespace {

using F = tg::Tensor<float>;
tg::dist::Communicator& W() { return tg::dist::world(); }

tg::nn::GPTConfig config(float dropout) {
  tg::nn::GPTConfig c;
  c.vocab_size = 50;  // not a multiple of 2 or 3: the last rank's vocabulary range is short
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 12;  // splits over 1, 2, 3 and 4 ranks
  c.n_embd = 48;
  c.dropout = dropout;
  return c;
}

struct Batch {
  tg::Tensor<std::int64_t> inputs, targets;
};
Batch batch(std::int64_t k, std::int64_t V) { return {tg::testing::random_tokens(3, 12, V, 300 + 2 * k), tg::testing::random_tokens(3, 12, V, 301 + 2 * k)}; }

tg::optim::AdamWOptions adamw() { return {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f}; }

struct Run {
  std::vector<double> losses;
  std::vector<tg::optim::NamedTensor> weights;  // the one-process layout
};

template <class Policy>
Run one_process(float dropout, int steps) {
  tg::Generator init(5), drop(9);
  tg::nn::GPT model(config(dropout), init);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::train::TrainStep<Policy> step(ps, opt, sched, {.clip = 0.5});
  Run out;
  std::int64_t k = 0;
  for (int i = 0; i < steps; ++i) out.losses.push_back(step.run(model, [&] { return batch(k++, 50); }, drop).loss);
  for (const auto& p : ps) out.weights.push_back({p.name, p.tensor.detach().clone()});
  return out;
}

template <class Policy, class Ckpt = tg::NoCheckpoint>
Run tensor_parallel(float dropout, int steps, tg::dist::TensorParallelOptions options = {}) {
  tg::Generator init(5), drop(9);
  const tg::nn::GPT full(config(dropout), init);
  auto tp = W().split(0, W().rank());
  tg::dist::TensorParallelGPT<> model(full, *tp, options);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), adamw());
  tg::optim::Schedule sched = tg::optim::Constant{3e-3f};
  tg::dist::TensorParallelSync<tg::cpu> sync(model);
  tg::train::TrainStep<Policy, Ckpt> step(ps, opt, sched, {.clip = 0.5, .sync = &sync});
  Run out;
  std::int64_t k = 0;
  for (int i = 0; i < steps; ++i)
    out.losses.push_back(step.run(model, [&] { return batch(k++, 50); }, drop,
                                  [&](const auto& logits, const Batch& b) { return model.loss(logits, b.targets); }).loss);
  out.weights = model.gather_full();
  return out;
}

/// The key third of c_attn.bias holds Adam-amplified rounding noise (its gradient is zero in exact arithmetic;
/// see tests/dist/test_dist.cpp): left out.
std::vector<float> compared(const tg::optim::NamedTensor& t) {
  std::vector<float> v = t.tensor.to_vector();
  if (!t.name.ends_with("c_attn.bias")) return v;
  const std::size_t c = v.size() / 3;
  v.erase(v.begin() + static_cast<std::ptrdiff_t>(c), v.begin() + static_cast<std::ptrdiff_t>(2 * c));
  return v;
}

void expect_close(const Run& got, const Run& ref, double tol, const char* what) {
  double worst_loss = 0, num = 0, den = 0;
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    const double rel = std::abs(got.losses[i] - ref.losses[i]) / ref.losses[i];
    worst_loss = std::max(worst_loss, rel);
    EXPECT_LE(rel, tol) << what << ": step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
  }
  ASSERT_EQ(got.weights.size(), ref.weights.size());
  for (std::size_t t = 0; t < ref.weights.size(); ++t) {
    ASSERT_EQ(got.weights[t].name, ref.weights[t].name);
    ASSERT_EQ(got.weights[t].tensor.shape(), ref.weights[t].tensor.shape()) << got.weights[t].name;
    const auto a = compared(got.weights[t]), b = compared(ref.weights[t]);
    for (std::size_t i = 0; i < a.size(); ++i) {
      num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
      den += static_cast<double>(b[i]) * b[i];
    }
  }
  const double rel = std::sqrt(num / den);
  EXPECT_LE(rel, tol) << what << ": the weights";
  if (W().rank() == 0)
    std::printf("[ tp ] %s, tensor-parallel size %d, vs one process: loss %.2g, weights %.2g; tolerance %.0e\n", what, W().size(), worst_loss,
                rel, tol);
}

TEST(TensorParallel, EqualsOneProcessFp32WithDropout) {
  expect_close(tensor_parallel<tg::amp::fp32_policy>(0.1f, 10), one_process<tg::amp::fp32_policy>(0.1f, 10), 1e-5, "fp32, dropout 0.1");
}

TEST(TensorParallel, EqualsOneProcessBf16) {
  expect_close(tensor_parallel<tg::amp::bf16_mixed>(0.f, 10), one_process<tg::amp::bf16_mixed>(0.f, 10), 1e-2, "bf16 mixed");
}

// Note [sequence parallelism]: the LayerNorm, dropout and residual regions split along the sequence (12
// positions: 12, 6, 4 or 3 per rank) give the one-process run, dropout included.
constexpr tg::dist::TensorParallelOptions kSequence{.sequence_parallel = true};

TEST(TensorParallel, SequenceParallelEqualsOneProcessFp32WithDropout) {
  expect_close(tensor_parallel<tg::amp::fp32_policy>(0.1f, 10, kSequence), one_process<tg::amp::fp32_policy>(0.1f, 10), 1e-5,
               "sequence parallel, fp32, dropout 0.1");
}

TEST(TensorParallel, SequenceParallelBf16WithRecomputedBlocks) {
  expect_close(tensor_parallel<tg::amp::bf16_mixed, tg::RecomputeAll>(0.1f, 10, kSequence), one_process<tg::amp::bf16_mixed>(0.1f, 10),
               1e-2, "sequence parallel, bf16 mixed, dropout 0.1, blocks recomputed");
}

// x (B, T, C) differs on every rank; gather_from_sequence of rank r's rows gives the full tensor, and
// reduce_scatter_to_sequence of every rank's x gives rank r's rows of their sum; backward: the conjugates.
// B = 1 takes the path without packing copies.
void check_sequence_ops(std::int64_t B) {
  const int n = W().size(), r = W().rank();
  const std::int64_t T = 3 * n, C = 5, Tl = T / n;
  auto of_rank = [&](int k) {
    tg::Generator g(40 + static_cast<std::uint64_t>(k));
    return F::normal({B, T, C}, 0.f, 1.f, g);
  };
  F sum = F::zeros({B, T, C});
  for (int k = 0; k < n; ++k) sum = tg::add(sum, of_rank(k)).detach();
  const F mine = of_rank(r);
  // all-gather forward: the full tensor is rank k's rows from rank k, here of one common tensor
  F part = sum.narrow(1, r * Tl, Tl).contiguous();
  part.requires_grad_(true);
  const F gathered = tg::dist::gather_from_sequence(part, W());
  EXPECT_EQ(gathered.to_vector(), sum.to_vector());
  // backward: a reduce-scatter of the upstream gradients (each rank's own)
  tg::sum(tg::mul(gathered, mine)).backward();
  const auto dpart = part.grad().to_vector(), dref = sum.narrow(1, r * Tl, Tl).contiguous().to_vector();
  for (std::size_t i = 0; i < dref.size(); ++i) EXPECT_NEAR(dpart[i], dref[i], 1e-5) << i;
  // reduce-scatter forward: rank r's rows of the sum over the ranks
  F x = mine.clone();
  x.requires_grad_(true);
  const F scattered = tg::dist::reduce_scatter_to_sequence(x, W());
  ASSERT_EQ(scattered.shape(), tg::Shape({B, Tl, C}));
  const auto got = scattered.to_vector(), want = sum.narrow(1, r * Tl, Tl).contiguous().to_vector();
  for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5) << i;
  // backward: an all-gather of every rank's upstream gradient (rank k's: ones times k + 1)
  tg::mul(tg::sum(scattered), F::full({}, static_cast<float>(r + 1))).backward();
  const F dx = x.grad();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t) EXPECT_EQ(dx.narrow(0, b, 1).narrow(1, t, 1).to_vector()[0], static_cast<float>(t / Tl + 1)) << b << "," << t;
}

TEST(TensorParallel, SequenceGatherAndReduceScatter) {
  check_sequence_ops(2);
  check_sequence_ops(1);
}

TEST(TensorParallel, SequenceParallelNeedsAMultipleOfTheGroup) {
  if (W().size() == 1) GTEST_SKIP() << "one rank: every sequence splits";
  tg::Generator init(5), drop(9);
  const tg::nn::GPT full(config(0.f), init);
  auto tp = W().split(0, W().rank());
  tg::dist::TensorParallelGPT<> model(full, *tp, kSequence);
  const auto idx = tg::testing::random_tokens(2, 13, 50, 3);  // 13 positions: prime
  try {
    (void)model.forward<float>(idx, drop, true);
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sequence parallelism: a sequence of 13 positions does not split evenly over"), std::string::npos)
        << e.what();
  }
}

TEST(TensorParallel, SplitsHeadsMlpAndVocabulary) {
  tg::Generator init(5);
  const tg::nn::GPT full(config(0.f), init);
  auto tp = W().split(0, W().rank());
  tg::dist::TensorParallelGPT<> model(full, *tp);
  const int n = W().size();
  for (const auto& p : model.sharded_parameters()) {
    if (p.name == "h.0.attn.c_attn.weight") EXPECT_EQ(p.tensor.shape(), tg::Shape({3 * 48 / n, 48}));
    if (p.name == "h.0.attn.c_proj.weight") EXPECT_EQ(p.tensor.shape(), tg::Shape({48, 48 / n}));
    if (p.name == "h.0.mlp.c_fc.weight") EXPECT_EQ(p.tensor.shape(), tg::Shape({4 * 48 / n, 48}));
    if (p.name == "h.0.mlp.c_proj.bias") EXPECT_EQ(p.split, tg::dist::Split::replicated);
  }
  EXPECT_EQ(model.vocab_begin(), W().rank() * ((50 + n - 1) / n));
  // Gathering gives back the full model's tensors exactly.
  const auto gathered = model.gather_full();
  const auto ref = full.named_parameters();
  ASSERT_EQ(gathered.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_EQ(gathered[i].tensor.to_vector(), ref[i].tensor.to_vector()) << ref[i].name;
}

TEST(TensorParallel, VocabularyParallelCrossEntropyIsTheFullOne) {
  const int n = W().size(), r = W().rank();
  const std::int64_t V = 11, N = 5;
  tg::Generator g(3);
  const F full = F::normal({N, V}, 0.f, 2.f, g);  // the same on every rank
  const auto targets = tg::testing::random_tokens(1, N, V, 4).reshape({N});
  const auto [v0, v1] = tg::dist::detail::range_of(V, r, n);
  F local = full.narrow(1, v0, v1 - v0).contiguous();
  local.requires_grad_(true);
  const F loss = tg::dist::vocab_parallel_cross_entropy(local, targets, W(), v0, V);
  loss.backward();
  F ref_in = full.clone();
  ref_in.requires_grad_(true);
  const F ref = tg::cross_entropy(ref_in, targets);
  ref.backward();
  EXPECT_NEAR(loss.item(), ref.item(), 1e-6);
  const F dref = ref_in.grad().narrow(1, v0, v1 - v0).contiguous();
  const auto a = local.grad().to_vector(), b = dref.to_vector();
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-7) << i;
}

TEST(TensorParallel, GroupsThatDoNotFitAreClearErrors) {
  if (W().size() == 1) GTEST_SKIP() << "one rank: every model fits";
  auto c = config(0.f);
  c.n_head = W().size() + 1;  // not a multiple of the group's size
  c.n_embd = 8 * c.n_head;
  tg::Generator init(5);
  const tg::nn::GPT full(c, init);
  auto tp = W().split(0, W().rank());
  try {
    tg::dist::TensorParallelGPT<> model(full, *tp);
    ADD_FAILURE() << "no error";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("attention heads do not split over"), std::string::npos) << e.what();
  }
}

}  // namespace

}  // namespace test_tensor_parallel_cpp

// nn modules and the GPT model: GPT-2 parameter names and counts, init schemes, forward shapes and
// errors, and a tiny model that learns (overfits a short repeating text with AdamW).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <set>

#include "nn/gpt_test_util.hpp"

#include <typegrad/amp/amp.hpp>
#include <typegrad/io/model_config.hpp>
#include <typegrad/io/safetensors.hpp>
#include <typegrad/io/train_state.hpp>
#include <typegrad/nn/gpt.hpp>
#include <typegrad/ops/cross_entropy.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/typegrad.hpp>

namespace {

double stddev_of(const tg::Tensor<float>& t) {
  const auto v = t.to_vector();
  double m = 0, s = 0;
  for (float x : v) m += x;
  m /= static_cast<double>(v.size());
  for (float x : v) s += (x - m) * (x - m);
  return std::sqrt(s / static_cast<double>(v.size()));
}

const tg::Tensor<float>& find(const std::vector<tg::nn::NamedParameter>& ps, const std::string& name) {
  for (const auto& p : ps)
    if (p.name == name) return p.tensor;
  throw tg::Error("no parameter named ", name);
}

TEST(GPTConfig, PresetsAndErrors) {
  const auto g = tg::nn::GPTConfig::preset("gpt2");
  EXPECT_EQ(g.n_layer, 12);
  EXPECT_EQ(g.n_head, 12);
  EXPECT_EQ(g.n_embd, 768);
  EXPECT_EQ(g.block_size, 1024);
  EXPECT_EQ(g.vocab_size, 50304);
  EXPECT_THROW(tg::nn::GPTConfig::preset("huge"), tg::Error);
  tg::nn::GPTConfig bad = tg::nn::GPTConfig::preset("tiny");
  bad.n_head = 3;
  try {
    bad.validate();
    FAIL() << "validate accepted n_embd 128 with 3 heads";
  } catch (const tg::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not divisible by n_head 3"), std::string::npos) << e.what();
  }
}

TEST(GPT, Gpt2PresetHasGpt2NamesAndCount) {
  tg::Generator gen(0);
  const tg::nn::GPT model(tg::nn::GPTConfig::preset("gpt2"), gen);
  const auto ps = model.named_parameters();
  // 6 + 12·12 + 2 tensors; 124,475,904 values with the LM head tied to wte (GPT-2 small padded to 50304).
  EXPECT_EQ(ps.size(), 2u + 12u * 12u + 2u);
  EXPECT_EQ(tg::nn::count_parameters(ps), 124475904);
  EXPECT_EQ(ps.front().name, "wte.weight");
  EXPECT_EQ(ps.back().name, "ln_f.bias");
  EXPECT_EQ(find(ps, "h.3.attn.c_attn.weight").shape(), (tg::Shape{2304, 768}));
  EXPECT_EQ(find(ps, "h.11.mlp.c_proj.weight").shape(), (tg::Shape{768, 3072}));
  std::set<std::string> names;
  for (const auto& p : ps) names.insert(p.name);
  EXPECT_EQ(names.size(), ps.size()) << "parameter names must be unique";
}

TEST(GPT, InitFollowsGpt2) {
  tg::Generator gen(3);
  const auto cfg = tg::nn::GPTConfig::preset("tiny");
  const tg::nn::GPT model(cfg, gen);
  const auto ps = model.named_parameters();
  EXPECT_NEAR(stddev_of(find(ps, "h.0.attn.c_attn.weight")), 0.02, 0.001);
  EXPECT_NEAR(stddev_of(find(ps, "wte.weight")), 0.02, 0.001);
  const double scaled = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  EXPECT_NEAR(stddev_of(find(ps, "h.1.mlp.c_proj.weight")), scaled, 0.1 * scaled);
  for (float v : find(ps, "h.2.mlp.c_fc.bias").to_vector()) EXPECT_EQ(v, 0.f);
  for (float v : find(ps, "h.0.ln_1.weight").to_vector()) EXPECT_EQ(v, 1.f);
  const auto n = tg::nn::count_parameters(ps);
  EXPECT_GT(n, 700000);
  EXPECT_LT(n, 1300000) << "tiny should be about 1M parameters";
  for (const auto& p : ps) EXPECT_TRUE(p.tensor.requires_grad()) << p.name;
}

TEST(GPT, SmallPresetIsAboutTenMillion) {
  tg::Generator gen(3);
  const tg::nn::GPT model(tg::nn::GPTConfig::preset("small"), gen);
  const auto n = tg::nn::count_parameters(model.named_parameters());
  EXPECT_GT(n, 8000000);
  EXPECT_LT(n, 13000000);
}

TEST(GPT, ForwardShapeAndErrors) {
  tg::Generator gen(1);
  const tg::nn::GPT model(tg::nn::GPTConfig::preset("tiny"), gen);
  auto idx = tg::Tensor<std::int64_t>::zeros({2, 7});
  const auto logits = model.forward<tg::fp32>(idx);
  EXPECT_EQ(logits.shape(), (tg::Shape{2, 7, 256}));
  EXPECT_THROW(model.forward<tg::fp32>(tg::Tensor<std::int64_t>::zeros({1, 129})), tg::Error);
  EXPECT_THROW(model.forward<tg::fp32>(tg::Tensor<std::int64_t>::zeros({7})), tg::Error);
}

TEST(GPT, NoDecayGroupsHoldBiasesNormsAndEmbeddings) {
  tg::Generator gen(1);
  const tg::nn::GPT model(tg::nn::GPTConfig::preset("tiny"), gen);
  const auto groups = tg::optim::default_groups(model.named_parameters(), 0.1f);
  for (const auto& p : groups[0].params) {
    EXPECT_EQ(p.tensor.dim(), 2) << p.name;
    EXPECT_TRUE(p.name.find(".weight") != std::string::npos && p.name.find("ln") == std::string::npos) << p.name;
  }
  bool saw_wte = false;
  for (const auto& p : groups[1].params) saw_wte |= p.name == "wte.weight";
  EXPECT_TRUE(saw_wte);
}

TEST(GPT, TinyModelLearnsARepeatingText) {
  tg::Generator gen(5);
  auto cfg = tg::nn::GPTConfig::preset("tiny");
  cfg.n_layer = 2;
  const tg::nn::GPT model(cfg, gen);
  tg::optim::AdamW opt(model.named_parameters(), {.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.99f, .eps = 1e-8f, .weight_decay = 0.f});
  const std::string text = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. ";
  const std::int64_t T = 32;
  auto idx = tg::Tensor<std::int64_t>::empty({2, T}), tgt = tg::Tensor<std::int64_t>::empty({2, T});
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < T; ++t) {
      idx.data()[b * T + t] = static_cast<unsigned char>(text[static_cast<std::size_t>(b * 5 + t)]);
      tgt.data()[b * T + t] = static_cast<unsigned char>(text[static_cast<std::size_t>(b * 5 + t + 1)]);
    }
  float first = 0, last = 0;
  // 80 steps: the loss falls steeply around step 60 (0.86 at 50, 0.49 at 60, 0.15 at 80 on one machine),
  // so a 60-step bound of 0.5 flipped with the GEMM's summation order; at 80 the bound has a 3x margin.
  for (int step = 0; step < 80; ++step) {
    const auto loss = tg::cross_entropy(model.forward<tg::fp32>(idx), tgt);
    if (step == 0) first = loss.item();
    last = loss.item();
    loss.backward();
    opt.step();
    opt.zero_grad();
  }
  EXPECT_NEAR(first, std::log(256.f), 0.3f) << "an untrained model is close to uniform";
  EXPECT_LT(last, 0.5f) << "80 AdamW steps should memorize 64 tokens (first loss " << first << ")";
}

}  // namespace

// Note [padded vocabulary]: a GPT whose embedding rows are stored padded (V = 50 in 64 rows) is the unpadded
// GPT: the same parameters (real shapes), logits, loss, gradients and training; the stored rows past V stay
// zero; its checkpoints hold the real shapes and load into either model; the device copy keeps the padding.
namespace {
tg::nn::GPTConfig padded_config(std::int64_t multiple) {
  tg::nn::GPTConfig c{50, 16, 2, 2, 32, 0.f};
  c.vocab_multiple = multiple;
  return c;
}
}  // namespace

TEST(PaddedVocabulary, SameParametersLogitsLossAndGradients) {
  tg::Generator g1(5), g2(5);
  const tg::nn::GPT plain(padded_config(1), g1), padded(padded_config(64), g2);
  EXPECT_EQ(padded.config().padded_vocab(), 64);
  const auto pp = plain.named_parameters(), qp = padded.named_parameters();
  ASSERT_EQ(pp.size(), qp.size());
  for (std::size_t i = 0; i < pp.size(); ++i) {
    EXPECT_EQ(pp[i].tensor.shape(), qp[i].tensor.shape()) << pp[i].name;
    EXPECT_EQ(pp[i].tensor.to_vector(), qp[i].tensor.to_vector()) << pp[i].name;
  }
  EXPECT_EQ(tg::nn::stored_rows(qp[0].tensor), 64);
  EXPECT_EQ(tg::nn::stored_rows(pp[0].tensor), 50);
  const auto idx = tg::testing::random_tokens(3, 12, 50, 1), tgt = tg::testing::random_tokens(3, 12, 50, 2);
  const auto a = plain.forward<float>(idx), b = padded.forward<float>(idx);
  ASSERT_EQ(b.shape(), (tg::Shape{3, 12, 50}));
  const auto av = a.contiguous().to_vector(), bv = b.contiguous().to_vector();
  for (std::size_t i = 0; i < av.size(); ++i) EXPECT_NEAR(av[i], bv[i], 1e-6f * (1 + std::abs(av[i]))) << i;
  tg::Generator unused(0);
  const auto la = tg::cross_entropy(plain.forward<float>(idx, unused, true), tgt), lb = tg::cross_entropy(padded.forward<float>(idx, unused, true), tgt);
  EXPECT_NEAR(la.item(), lb.item(), 1e-6);
  la.backward();
  lb.backward();
  for (std::size_t i = 0; i < pp.size(); ++i) {
    ASSERT_EQ(qp[i].tensor.grad().shape(), pp[i].tensor.shape()) << pp[i].name;
    const auto ga = pp[i].tensor.grad().to_vector(), gb = qp[i].tensor.grad().to_vector();
    double num = 0, den = 0;
    for (std::size_t k = 0; k < ga.size(); ++k) {
      num += (static_cast<double>(ga[k]) - gb[k]) * (static_cast<double>(ga[k]) - gb[k]);
      den += static_cast<double>(ga[k]) * ga[k];
    }
    EXPECT_LE(std::sqrt(num / std::max(den, 1e-30)), 1e-6) << pp[i].name;
  }
}

TEST(PaddedVocabulary, TrainsLikeTheUnpaddedModelAndKeepsItsZeroRows) {
  auto train = [](std::int64_t multiple) {
    tg::Generator g(5), drop(6);
    tg::nn::GPT model(padded_config(multiple), g);
    const auto ps = model.named_parameters();
    tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f});
    for (int s = 0; s < 10; ++s) {
      const auto idx = tg::testing::random_tokens(2, 12, 50, 10 + 2 * s), tgt = tg::testing::random_tokens(2, 12, 50, 11 + 2 * s);
      tg::cross_entropy(model.forward<float>(idx, drop, true), tgt).backward();
      opt.step();
      opt.zero_grad();
    }
    return model;
  };
  const tg::nn::GPT plain = train(1), padded = train(64);
  const auto pp = plain.named_parameters(), qp = padded.named_parameters();
  for (std::size_t i = 0; i < pp.size(); ++i) {
    const auto a = pp[i].tensor.to_vector(), b = qp[i].tensor.to_vector();
    for (std::size_t k = 0; k < a.size(); ++k) EXPECT_NEAR(a[k], b[k], 1e-5f) << pp[i].name << " " << k;
  }
  // The stored rows past V: still zero.
  const auto& w = qp[0].tensor;
  const float* tail = w.data() + 50 * 32;
  for (std::int64_t k = 0; k < 14 * 32; ++k) ASSERT_EQ(tail[k], 0.f) << k;
}

// The bf16 copy of a padded embedding is stored padded too (zero rows, never written): the LM head reads it
// in place (no zero-padded copy per forward), and it stays the master rounded, its padding zero, over steps in
// which AdamW writes the copies.
TEST(PaddedVocabulary, Bf16CopiesAreStoredPaddedAndReadInPlace) {
  tg::Generator g(5), drop(6);
  tg::nn::GPT model(padded_config(64), g);
  const auto ps = model.named_parameters();
  tg::optim::AdamW opt(tg::optim::default_groups(ps, 0.1f), {.lr = 3e-3f});
  tg::amp::MixedPrecision<tg::amp::bf16_mixed> mp(ps, opt);
  tg::optim::GradAccum<1> accum;
  tg::optim::Schedule schedule = tg::optim::Constant{3e-3f};
  const auto& wte = ps[0].tensor;
  ASSERT_EQ(ps[0].name, "wte.weight");
  const tg::Tensor<tg::bf16> copy = mp.weights.copy_of(wte);
  ASSERT_EQ(copy.shape(), (tg::Shape{50, 32}));
  EXPECT_EQ(tg::nn::stored_rows(copy), 64);
  {
    const tg::Tensor<tg::bf16> head = tg::padded_rows(tg::amp::param_as<tg::bf16>(wte), 64, /*storage_tail_is_zero=*/true);
    EXPECT_EQ(head.data(), copy.data()) << "the LM head made a padded copy";
  }
  for (int s = 0; s < 3; ++s) {
    const auto idx = tg::testing::random_tokens(2, 12, 50, 10 + 2 * s), tgt = tg::testing::random_tokens(2, 12, 50, 11 + 2 * s);
    accum.scale(mp.loss(mp.forward(model, idx, drop), tgt), mp.scaler).backward();
    ASSERT_TRUE(accum.micro_step(opt, schedule, 1.0, mp.scaler));
    mp.after_step(accum, tg::amp::CopyRefresh::unwritten);
  }
  EXPECT_EQ(mp.weights.last_converted(), 0) << "AdamW wrote every copy";
  const auto rounded = wte.to<tg::bf16>();
  for (std::int64_t i = 0; i < 50 * 32; ++i) ASSERT_EQ(copy.data()[i].bits, rounded.data()[i].bits) << i;
  for (std::int64_t i = 50 * 32; i < 64 * 32; ++i) ASSERT_EQ(copy.data()[i].bits, 0) << "padding element " << i;
}

TEST(PaddedVocabulary, CheckpointsHoldTheRealShapes) {
  tg::Generator g(5), g2(9), g3(11);
  const tg::nn::GPT padded(padded_config(64), g);
  const std::string path = ::testing::TempDir() + "/padded_vocab.safetensors";
  tg::io::save_weights(path, padded.named_parameters());
  const auto file = tg::io::SafetensorsReader::open(path);
  EXPECT_EQ(file.info("wte.weight").shape, (tg::Shape{50, 32}));  // GPT-2's names and shapes: PyTorch reads it as before
  // It loads into an unpadded model and into another padded one.
  const tg::nn::GPT plain(padded_config(1), g2), other(padded_config(64), g3);
  tg::io::load_weights(path, plain.named_parameters());
  tg::io::load_weights(path, other.named_parameters());
  EXPECT_EQ(plain.named_parameters()[0].tensor.to_vector(), padded.named_parameters()[0].tensor.to_vector());
  EXPECT_EQ(other.named_parameters()[0].tensor.to_vector(), padded.named_parameters()[0].tensor.to_vector());
  EXPECT_EQ(tg::nn::stored_rows(other.named_parameters()[0].tensor), 64);
  const auto cfg = tg::io::gpt_config_from_json(tg::io::gpt_config_json(padded.config()), "test");
  EXPECT_EQ(cfg.vocab_multiple, 64);
  EXPECT_EQ(tg::io::gpt_config_json(tg::nn::GPTConfig{}).find("vocab_multiple"), std::string::npos);
  std::remove(path.c_str());
}

TEST(PaddedVocabulary, Gpt2PresetPadsItsTokenizersVocabulary) {
  const auto c = tg::nn::GPTConfig::preset("gpt2", 50257);
  EXPECT_EQ(c.vocab_size, 50257);
  EXPECT_EQ(c.padded_vocab(), 50304);
  EXPECT_EQ(tg::nn::GPTConfig::preset("tiny").padded_vocab(), 256);
}

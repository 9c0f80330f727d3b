// Generation (include/typegrad/nn/generate.hpp): the KV cache gives the full forward's logits, cached and
// full-window decoding produce the same tokens for the same seed across window shifts (Note [the decoding
// window]), and the sampler's options do what Note [sampling the next token] says.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include <typegrad/nn/generate.hpp>

namespace {

tg::nn::GPT make_model(std::uint64_t seed, std::int64_t block = 32) {
  const tg::nn::GPTConfig cfg{64, block, 2, 2, 32, 0.f};
  tg::Generator g(seed);
  return tg::nn::GPT(cfg, g);
}

std::vector<std::int32_t> prompt_of(std::int64_t n) {
  std::vector<std::int32_t> p;
  for (std::int64_t i = 0; i < n; ++i) p.push_back(static_cast<std::int32_t>((7 * i + 3) % 64));
  return p;
}

TEST(Generate, CachedLogitsEqualTheFullForward) {
  const auto model = make_model(11);
  tg::nn::KVCache cache(model.config(), 32);
  std::vector<std::int32_t> ids = prompt_of(5);
  tg::Tensor<float> got = tg::nn::forward_cached(model, ids, cache);
  for (int step = 0; step < 20; ++step) {
    tg::NoGrad no_grad;
    auto idx = tg::Tensor<std::int64_t>::empty({1, static_cast<std::int64_t>(ids.size())});
    for (std::size_t t = 0; t < ids.size(); ++t) idx.data()[t] = ids[t];
    const auto full = model.forward<tg::fp32>(idx).contiguous();
    const float* last = full.data() + (static_cast<std::int64_t>(ids.size()) - 1) * 64;
    ASSERT_EQ(got.numel(), 64);
    for (int v = 0; v < 64; ++v) ASSERT_NEAR(got.data()[v], last[v], 2e-5f) << "step " << step << " token " << v;
    ids.push_back(static_cast<std::int32_t>((step * 13 + 1) % 64));
    got = tg::nn::forward_cached(model, std::span<const std::int32_t>(ids).subspan(ids.size() - 1), cache);
  }
  EXPECT_EQ(cache.length(), 25);
}

TEST(Generate, CachedAndFullWindowDecodingGiveTheSameTokens) {
  const auto model = make_model(3);
  for (const tg::nn::SamplingOptions o : {tg::nn::SamplingOptions{0.8f, 40, 1.0}, tg::nn::SamplingOptions{1.0f, 0, 0.9},
                                          tg::nn::SamplingOptions{0.f, 0, 1.0}}) {
    for (std::uint64_t seed : {1u, 2u, 3u}) {
      for (std::int64_t window : {32, 9, 1}) {  // 100 tokens cross the window many times
        tg::nn::Decoder cached(model, window, true), full(model, window, false);
        cached.set_prompt(prompt_of(12));
        full.set_prompt(prompt_of(12));
        tg::Generator ga(seed), gb(seed);
        for (int i = 0; i < 100; ++i)
          ASSERT_EQ(cached.next(o, ga), full.next(o, gb))
              << "token " << i << ", seed " << seed << ", window " << window << ", temperature " << o.temperature;
        EXPECT_EQ(cached.context(), full.context());
        EXPECT_EQ(ga.offset(), gb.offset());
        // The cache runs about one position per token (plus the re-prefills); the full window many more.
        if (window == 32) EXPECT_LT(cached.positions_computed() * 5, full.positions_computed());
      }
    }
  }
}

TEST(Generate, ContextStaysWithinTheWindow) {
  const auto model = make_model(5);
  tg::nn::Decoder dec(model, 10);
  const auto prompt = prompt_of(25);
  dec.set_prompt(prompt);  // cut to its newest 10
  EXPECT_EQ(dec.context(), std::vector<std::int32_t>(prompt.end() - 10, prompt.end()));
  tg::Generator g(1);
  for (int i = 0; i < 30; ++i) {
    dec.next({}, g);
    EXPECT_LE(static_cast<std::int64_t>(dec.context().size()), 11);  // at most window + the token just drawn
    EXPECT_LE(dec.cache()->length(), 10);
  }
  EXPECT_EQ(dec.generated(), 30);
  // A window beyond the model's positions is clamped to block_size.
  EXPECT_EQ(tg::nn::Decoder(model, 1000).window(), 32);
}

TEST(Generate, BadInputsAreErrors) {
  const auto model = make_model(5);
  EXPECT_THROW(tg::nn::Decoder(model, 0), tg::Error);
  tg::nn::Decoder dec(model, 8);
  tg::Generator g(1);
  EXPECT_THROW(dec.next({}, g), tg::Error);  // no prompt
  EXPECT_THROW(dec.set_prompt({}), tg::Error);
  const std::vector<std::int32_t> bad{1, 64};
  dec.set_prompt(bad);
  EXPECT_THROW(dec.next({}, g), tg::Error);  // 64 is outside the vocabulary
  EXPECT_THROW((tg::nn::SamplingOptions{-1.f, 0, 1.0}.validate()), tg::Error);
  EXPECT_THROW((tg::nn::SamplingOptions{1.f, -2, 1.0}.validate()), tg::Error);
  EXPECT_THROW((tg::nn::SamplingOptions{1.f, 0, 0.0}.validate()), tg::Error);
  EXPECT_THROW((tg::nn::SamplingOptions{1.f, 0, 1.5}.validate()), tg::Error);
}

TEST(Sampling, GreedyTopKAndTopP) {
  const std::vector<float> logits{0.f, 2.f, 1.f, 2.f, -1.f};
  tg::Generator g(4);
  EXPECT_EQ(tg::nn::sample_from_logits(logits, {0.f, 0, 1.0}, g), 1);  // ties: the lower id
  EXPECT_EQ(g.offset(), 0u) << "greedy draws nothing";
  for (int i = 0; i < 50; ++i) EXPECT_EQ(tg::nn::sample_from_logits(logits, {1.f, 1, 1.0}, g), 1);
  EXPECT_EQ(g.offset(), 50u) << "one draw per token";
  // top-k 3 keeps ids 1, 3, 2; a small top-p keeps only the first of them.
  for (int i = 0; i < 200; ++i) {
    const auto t = tg::nn::sample_from_logits(logits, {1.f, 3, 1.0}, g);
    EXPECT_TRUE(t == 1 || t == 2 || t == 3) << t;
    EXPECT_EQ(tg::nn::sample_from_logits(logits, {1.f, 0, 0.1}, g), 1);
  }
}

TEST(Sampling, FrequenciesFollowTheTemperature) {
  // p(1) / p(0) = exp((ln 3 - 0) / T): 3:1 at T = 1, 9:1 at T = 0.5.
  const std::vector<float> logits{0.f, std::log(3.f)};
  for (auto [temperature, expected] : {std::pair{1.f, 0.75}, std::pair{0.5f, 0.9}}) {
    tg::Generator g(17);
    int ones = 0;
    const int n = 40000;
    for (int i = 0; i < n; ++i) ones += tg::nn::sample_from_logits(logits, {temperature, 0, 1.0}, g);
    EXPECT_NEAR(static_cast<double>(ones) / n, expected, 0.01) << "temperature " << temperature;
  }
}

}  // namespace

// Note [trained positions] (examples/gpt/trainer.hpp): the trainer's samples (tg::nn::generate_text over a
// window of the trained positions) never use a position that training did not reach. Two models that differ
// only in the embeddings of positions >= S (NaN in one) must generate the same text over a window of S,
// however long the sample; the full block would not.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "trainer.hpp"

namespace {

const tg::nn::SamplingOptions kSampling{0.8f, 40, 1.0};  // temperature, top-k, top-p

// Sets every row >= `from` of the position embedding to `value`.
void poison_positions(const tg::nn::GPT& model, std::int64_t from, float value) {
  for (const auto& p : model.named_parameters()) {
    if (p.name != "wpe.weight") continue;
    const std::int64_t rows = p.tensor.shape()[0], cols = p.tensor.shape()[1];
    float* d = p.tensor.data();
    for (std::int64_t r = from; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) d[r * cols + c] = value;
    return;
  }
  FAIL() << "no wpe.weight";
}

TEST(TrainerSampling, NeverUsesPositionsBeyondTheTrainedOnes) {
  const std::int64_t S = 16, block = 64;
  const tg::nn::GPTConfig cfg{256, block, 2, 2, 32, 0.f};
  tg::Generator g1(5), g2(5);
  const tg::nn::GPT a(cfg, g1), b(cfg, g2);
  poison_positions(a, S, 0.f);
  poison_positions(b, S, std::nanf(""));
  const tg::data::ByteTokenizer tok;
  tg::Generator sa(9), sb(9);
  const std::string out_a = tg::nn::generate_text(a, tok, "Hello", 3 * block, kSampling, sa, S);
  const std::string out_b = tg::nn::generate_text(b, tok, "Hello", 3 * block, kSampling, sb, S);
  EXPECT_EQ(out_a.size(), std::string("Hello").size() + 3 * block);
  EXPECT_EQ(out_a, out_b) << "a position >= " << S << " reached the logits";
  // The control: with the whole block as the window the untrained rows are used, and the texts differ.
  tg::Generator ca(9), cb(9);
  EXPECT_NE(tg::nn::generate_text(a, tok, "Hello", 3 * block, kSampling, ca, block),
            tg::nn::generate_text(b, tok, "Hello", 3 * block, kSampling, cb, block));
}

TEST(TrainerSampling, WindowMustBePositive) {
  const tg::nn::GPTConfig cfg{256, 8, 1, 1, 16, 0.f};
  tg::Generator g(1);
  const tg::nn::GPT m(cfg, g);
  tg::Generator s(2);
  EXPECT_THROW(tg::nn::generate_text(m, tg::data::ByteTokenizer{}, "x", 4, {1.f, 0, 1.0}, s, 0), tg::Error);
}

}  // namespace

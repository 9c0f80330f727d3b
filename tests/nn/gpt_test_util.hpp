// Helpers shared by the tests that train a small GPT: random token ids, a small configuration.
//   const auto idx = tg::testing::random_tokens(2, 16, cfg.vocab_size, /*seed=*/1);   // (B,T) int64
//   tg::nn::GPT model(tg::testing::small_gpt(0.1f), init);                            // 2 layers, C = 32
#pragma once

#include <cstdint>

#include <typegrad/core/random.hpp>
#include <typegrad/core/tensor.hpp>
#include <typegrad/nn/gpt.hpp>

namespace tg::testing {

/// (B,T) token ids uniform in [0, V) from a generator seeded with `seed`.
inline Tensor<std::int64_t> random_tokens(std::int64_t B, std::int64_t T, std::int64_t V, std::uint64_t seed) {
  Generator g(seed);
  auto t = Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) t.data()[i] = static_cast<std::int64_t>(g.next_u64() % static_cast<std::uint64_t>(V));
  return t;
}

/// The 2-layer GPT of the compiled-step and device-boundary tests: vocabulary 50, block 16, 4 heads, C = 32.
inline nn::GPTConfig small_gpt(float dropout) {
  nn::GPTConfig c;
  c.vocab_size = 50;
  c.block_size = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.dropout = dropout;
  return c;
}

}  // namespace tg::testing

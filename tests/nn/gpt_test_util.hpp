// Helpers shared by the tests that train a small GPT: random token ids.
//   const auto idx = tg::testing::random_tokens(2, 16, cfg.vocab_size, /*seed=*/1);   // (B,T) int64
#pragma once

#include <cstdint>

#include <typegrad/core/random.hpp>
#include <typegrad/core/tensor.hpp>

namespace tg::testing {

/// (B,T) token ids uniform in [0, V) from a generator seeded with `seed`.
inline Tensor<std::int64_t> random_tokens(std::int64_t B, std::int64_t T, std::int64_t V, std::uint64_t seed) {
  Generator g(seed);
  auto t = Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t i = 0; i < B * T; ++i) t.data()[i] = static_cast<std::int64_t>(g.next_u64() % static_cast<std::uint64_t>(V));
  return t;
}

}  // namespace tg::testing

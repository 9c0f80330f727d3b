// A synthetic token stream for the GPU tests and benchmarks: next = (5·tok + 3 + noise) mod V with 10% noise,
// deterministic in (seed, step), so every device sees the same batches.
//   auto [x, y] = tg::testing::synthetic_batch(/*B=*/4, /*T=*/16, /*V=*/64, /*seed=*/99, /*step=*/0);
#pragma once

#include <cstdint>
#include <utility>

#include <typegrad/core/random.hpp>
#include <typegrad/core/tensor.hpp>

namespace tg::testing {

/// Token ids (B,T) and their next tokens from a fixed synthetic stream t_{i+1} = (5 t_i + 3 + noise) mod V,
/// which a GPT learns quickly; batch `step` reads Philox counters of (seed, step), so every device sees
/// the same batches.
inline std::pair<Tensor<std::int64_t>, Tensor<std::int64_t>> synthetic_batch(std::int64_t B, std::int64_t T,
                                                                             std::int64_t V, std::uint64_t seed,
                                                                             std::uint64_t step) {
  Generator gen(seed);
  gen.set_state(seed, step * static_cast<std::uint64_t>(B * (T + 1)));
  Tensor<std::int64_t> x = Tensor<std::int64_t>::empty({B, T}), y = Tensor<std::int64_t>::empty({B, T});
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t tok = static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(V));
    for (std::int64_t t = 0; t < T; ++t) {
      const std::int64_t noise = gen.uniform() < 0.1f ? 1 : 0;
      const std::int64_t next = (5 * tok + 3 + noise) % V;
      x.data()[b * T + t] = tok;
      y.data()[b * T + t] = next;
      tok = next;
    }
  }
  return {x, y};
}

}  // namespace tg::testing

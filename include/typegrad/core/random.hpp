// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): element i of a draw depends only
// on (seed, offset + i), so results do not depend on the thread count and the GPU can reproduce them.
//   tg::Generator gen(42);  auto w = tg::Tensor<tg::fp32>::normal({768, 768}, 0.f, 0.02f, gen);
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "typegrad/detail/macros.hpp"

namespace tg {

namespace detail {
TG_HOST_DEVICE inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> ctr,
                                                                 std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr std::uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = static_cast<std::uint64_t>(kMul0) * ctr[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(kMul1) * ctr[2];
    ctr = {static_cast<std::uint32_t>(p1 >> 32) ^ ctr[1] ^ key[0], static_cast<std::uint32_t>(p1),
           static_cast<std::uint32_t>(p0 >> 32) ^ ctr[3] ^ key[1], static_cast<std::uint32_t>(p0)};
    key[0] += kWeyl0;
    key[1] += kWeyl1;
  }
  return ctr;
}

/// Four random 32-bit words for counter `index` of stream (seed, offset).
TG_HOST_DEVICE inline std::array<std::uint32_t, 4> philox_words(std::uint64_t seed, std::uint64_t index) {
  return philox4x32_10({static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32), 0u, 0u},
                       {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
}
/// Uniform in [0, 1) with 24 random bits.
TG_HOST_DEVICE inline float uniform_from_bits(std::uint32_t w) { return static_cast<float>(w >> 8) * 5.9604644775390625e-8f; }
/// Dropout masks read all four words of each Philox counter (Note [dropout replays its mask]). A mask's place in
/// its generator's stream is a word position: word w is word w % 4 of counter w / 4.
inline constexpr std::uint64_t kDropoutWordsPerCounter = 4;
/// The counters a dropout mask of n elements consumes.
TG_HOST_DEVICE inline std::uint64_t dropout_counters(std::uint64_t n) { return (n + kDropoutWordsPerCounter - 1) / kDropoutWordsPerCounter; }
/// The word position of counter `counter`'s first word.
TG_HOST_DEVICE inline std::uint64_t dropout_position(std::uint64_t counter) { return counter * kDropoutWordsPerCounter; }
/// The uniform of word position w of stream `seed`: element i of a mask at position p reads w = p + i.
TG_HOST_DEVICE inline float dropout_uniform(std::uint64_t seed, std::uint64_t w) {
  return uniform_from_bits(philox_words(seed, w / kDropoutWordsPerCounter)[w % kDropoutWordsPerCounter]);
}
/// Standard normal by Box–Muller from two words (uses 1 - u so log never sees 0).
TG_HOST_DEVICE inline float normal_from_bits(std::uint32_t w0, std::uint32_t w1) {
  const float u1 = 1.0f - uniform_from_bits(w0);
  const float u2 = uniform_from_bits(w1);
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.283185307179586f * u2);
}
}  // namespace detail

class Generator;
namespace detail {
/// True while a checkpoint region is active on this thread; draws are then reported to it so that its
/// recompute can replay them (Note [checkpoint regions] in autodiff/checkpoint.hpp).
bool rng_watch_active();
void rng_watch_draw(Generator& gen);
}  // namespace detail

/// A seeded stream. Each draw of n numbers consumes counters [offset, offset + n) and advances offset,
/// so (seed, offset) is the whole state: save and restore it for exact resume.
class Generator {
 public:
  explicit Generator(std::uint64_t seed = 0x5eed) : seed_(seed) {}
  std::uint64_t seed() const { return seed_; }
  std::uint64_t offset() const { return offset_; }
  void set_state(std::uint64_t seed, std::uint64_t offset) {
    seed_ = seed;
    offset_ = offset;
  }
  /// Reserves n counters and returns the first.
  std::uint64_t advance(std::uint64_t n) {
    if (detail::rng_watch_active()) detail::rng_watch_draw(*this);
    const std::uint64_t first = offset_;
    offset_ += n;
    return first;
  }
  float uniform() { return detail::uniform_from_bits(detail::philox_words(seed_, advance(1))[0]); }
  std::uint64_t next_u64() {
    const auto w = detail::philox_words(seed_, advance(1));
    return (static_cast<std::uint64_t>(w[0]) << 32) | w[1];
  }

 private:
  std::uint64_t seed_;
  std::uint64_t offset_ = 0;
};

/// The process-wide default generator (used when no generator is passed).
Generator& default_generator();

}  // namespace tg

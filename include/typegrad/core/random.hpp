// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): element i of a draw depends only
// on (seed, offset + i), so results do not depend on the thread count and the GPU can reproduce them.
//   tg::Generator gen(42);  auto w = tg::Tensor<tg::fp32>::normal({768, 768}, 0.f, 0.02f, gen);
#pragma once

#include <array>
#include <cmath>
#include <cstdint>

#include "typegrad/core/device.hpp"
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

// Note [the Philox base in memory]
// A dropout kernel finds its mask at a word position of its generator's stream (Note [dropout replays its
// mask]). Passed as a kernel argument, that position grows from one step to the next, so a step captured as a
// graph would replay the first step's masks (Note [graph blockers]). A PhiloxBaseScope moves the growing part
// into memory: while it is open on a thread, a dropout on device kind K drawing from generator g passes its
// kernel the position relative to b = dropout_position(g.offset()) at the scope's opening, and a pointer to a
// cell on K that holds b; the kernel draws at *cell + relative (modulo 2^64, as the host would: the same words,
// bit for bit). A step that draws alike every time passes the same arguments every time; its owner writes the
// new b into the cell before each step (train::TrainStep with a device boundary: the boundary's step inputs,
// Note [the step boundary on the device]). Elsewhere the cell is null and the position absolute. The cell must
// hold b while the step's kernels run, backward and checkpoint recomputes included (they draw at the saved
// relative position through the same cell).
namespace detail {
/// Where a dropout's mask lies: stream `seed`, word position `offset` (+ *base when base is not null).
struct DropoutDraw {
  std::uint64_t seed = 0, offset = 0;
  const std::uint64_t* base = nullptr;
};
struct PhiloxBinding {
  const Generator* gen = nullptr;
  DeviceKind kind = DeviceKind::cpu;
  const std::uint64_t* cell = nullptr;
  std::uint64_t base = 0;
};
inline const PhiloxBinding*& philox_binding() {
  thread_local const PhiloxBinding* b = nullptr;
  return b;
}
/// The draw of a dropout mask of n elements on device D from gen: the generator advanced by its counters.
template <Device D>
DropoutDraw dropout_draw(Generator& gen, std::uint64_t n) {
  const std::uint64_t position = dropout_position(gen.advance(dropout_counters(n)));
  const PhiloxBinding* b = philox_binding();
  if (b && b->gen == &gen && b->kind == device_traits<D>::kind) return {gen.seed(), position - b->base, b->cell};
  return {gen.seed(), position, nullptr};
}
}  // namespace detail

/// Draws of `gen` by dropouts on device kind `kind` are relative to a base kept in `cell` (memory on that
/// device, holding dropout_position(gen.offset()) as of now) while the scope is open on this thread (Note [the
/// Philox base in memory]). Scopes nest; the innermost one applies.
class PhiloxBaseScope {
 public:
  PhiloxBaseScope(const Generator& gen, DeviceKind kind, const std::uint64_t* cell)
      : binding_{&gen, kind, cell, detail::dropout_position(gen.offset())}, previous_(detail::philox_binding()) {
    detail::philox_binding() = &binding_;
  }
  ~PhiloxBaseScope() { detail::philox_binding() = previous_; }
  PhiloxBaseScope(const PhiloxBaseScope&) = delete;
  PhiloxBaseScope& operator=(const PhiloxBaseScope&) = delete;
  /// The base the cell must hold: dropout_position(gen.offset()) at the scope's opening.
  std::uint64_t base() const { return binding_.base; }

 private:
  detail::PhiloxBinding binding_;
  const detail::PhiloxBinding* previous_;
};

}  // namespace tg

// The memory of a captured training step: every allocation the step makes on a device, traced once, planned
// into one arena by liveness, and served from that arena at fixed offsets on every later step.
//   auto mem = tg::capture::StepMemory::create(tg::allocator<tg::cpu>(), tg::DeviceKind::cpu);
//   mem->begin_trace();  run_step();  tg::capture::MemoryPlan plan = mem->end_trace();     // plan.peak_bytes()
//   mem->begin_replay(); run_step();  if (!mem->end_replay().ok) ...                        // no allocator calls
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "typegrad/core/allocator.hpp"
#include "typegrad/core/device.hpp"

namespace tg::capture {

// Note [step memory plan]
// A training step whose shapes repeat makes the same allocations in the same order every time. StepMemory
// installs itself, for the calling thread and one device, as the allocation override that Storage::allocate
// consults (core/allocator.hpp), so it sees every storage the step creates there, and is each storage's
// owner, so it sees every free.
//   * Trace: requests go to the device's allocator; StepMemory records each one's size (rounded up to 64
//     bytes) and the event counter at its allocation and at its free. A block still alive when the step ends
//     escapes the plan (the optimizer's state created by the first step, a tensor the step returns).
//   * Plan: the blocks that died inside the step are intervals in time; each gets an offset in one arena,
//     largest first, at the lowest address free for its whole interval (greedy by size; a first-fit
//     interval packing). The arena's size is the planned peak; the most bytes alive at once (max_live) is its
//     lower bound. For each block the plan also lists the earlier blocks that share some of its addresses.
//   * Replay: the k-th request is served at its planned offset when its size is the plan's (one-time escapes
//     of the traced step, such as the optimizer state, are skipped over) and every earlier block sharing its
//     addresses has been freed; otherwise it goes to the device's allocator and the replay is marked diverged
//     (the caller traces again). So a replay never hands out memory that is still in use, whatever the step
//     does. A replay that ends with arena blocks still alive (a tensor kept past the step) retires that arena:
//     it is freed when its last block is, and the next replay gets a new one.
// In the steady state a replayed step makes no allocator call at all. The peak of a replayed step is the
// resident bytes plus the arena; the eager step's peak is predicted too (the most traced bytes alive at once,
// in the device allocator's rounded sizes). StepMemory owns itself once created: retire() hands it over to the
// storages still pointing at it, and it deletes itself when the last one is freed.

/// What a traced step's memory plan says (Note [step memory plan]); bytes on the traced device.
struct MemoryPlan {
  std::int64_t resident_bytes = 0;       ///< in use when the step began (weights, weight copies, optimizer state, ...)
  std::int64_t weight_bytes = 0;         ///< of which the parameters (when the compiled step was given them)
  std::int64_t created_bytes = 0;        ///< allocated during the step and alive after it (the first step: optimizer state)
  std::int64_t activation_bytes = 0;     ///< planned bytes alive when the first backward began (kept for backward)
  std::int64_t max_live_bytes = 0;       ///< the most planned bytes alive at once
  std::int64_t arena_bytes = 0;          ///< the arena holding every planned block at its offset
  std::int64_t arena_block_bytes = 0;    ///< what the device's allocator took for the arena (its size class)
  std::int64_t eager_peak_bytes = 0;     ///< the eager step's peak in the device allocator's sizes (resident included)
  std::int64_t planned_blocks = 0;       ///< allocations served from the arena per step
  std::int64_t escaping_blocks = 0;      ///< allocations left to the device's allocator (they outlived the traced step)
  /// The replayed step's peak: resident + created + the arena's block.
  std::int64_t peak_bytes() const { return resident_bytes + created_bytes + std::max(arena_bytes, arena_block_bytes); }
  /// Temporaries: the arena beyond the activations kept for backward.
  std::int64_t temporary_bytes() const { return arena_bytes > activation_bytes ? arena_bytes - activation_bytes : 0; }
  /// A few lines for people: the breakdown and the totals.
  std::string describe() const;
};

/// How a replay went.
struct ReplayResult {
  bool ok = true;                 ///< every request served as planned, nothing planned left alive
  std::int64_t served = 0;        ///< requests served from the arena
  std::int64_t fallbacks = 0;     ///< requests handed to the device's allocator (escapes included)
  std::string divergence;         ///< the first request that did not match the plan ("" when ok)
};

class StepMemory final : public Allocator, public AllocationOverride {
 public:
  /// A StepMemory over `base` (the device's allocator) for `device`. Call retire() instead of deleting it.
  static StepMemory* create(Allocator& base, DeviceKind device);
  /// Hands this object to the storages still pointing at it (it deletes itself after the last one's free).
  void retire();

  /// Drops the current arena: the next replay takes a new one from the device's allocator on the then current
  /// stream (whose free list it goes back to). For a step called on another stream than before, once the device
  /// has finished the earlier calls' work (CompiledStep synchronizes first; Note [compiled steps]).
  void renew_arena();
  /// Traces the calling thread's allocations on the device until end_trace().
  void begin_trace();
  MemoryPlan end_trace();
  /// Serves the calling thread's allocations from the plan until end_replay().
  void begin_replay();
  ReplayResult end_replay();
  bool has_plan() const { return planned_; }
  bool tracing_or_replaying() const {
    std::lock_guard lock(mu_);
    return mode_ != Mode::off;
  }
  const MemoryPlan& plan() const { return plan_; }
  /// Marks the start of backward in the current trace (activation_bytes).
  void mark_backward();
  void set_weight_bytes(std::int64_t b) { plan_.weight_bytes = b; }

  // Allocator (the owner side): frees from storages.
  void* allocate(std::size_t bytes) override;
  void deallocate(void* ptr, std::size_t bytes) override;
  AllocatorStats stats() const override { return base_->stats(); }
  void reset_peak() override { base_->reset_peak(); }
  void empty_cache() override { base_->empty_cache(); }
  std::string name() const override { return "step memory over " + base_->name(); }
  // AllocationOverride (the request side).
  void* allocate(std::size_t bytes, Allocator*& owner) override;

  /// The alignment of each block in the arena: 64 bytes on the CPU (a cache line, an AVX-512 vector), 256 on a GPU
  /// (what cudaMalloc gives the eager step's blocks: cuBLASLt chooses its algorithm by the operands' alignment, so a
  /// replay's blocks must be aligned as the eager step's for its GEMMs to run the same algorithms).
  static constexpr std::size_t kAlign = 64, kDeviceAlign = 256;
  std::size_t alignment() const { return device_ == DeviceKind::cpu ? kAlign : kDeviceAlign; }

 private:
  StepMemory(Allocator& base, DeviceKind device) : base_(&base), device_(device) {}
  ~StepMemory() override;
  struct Traced {
    std::size_t bytes;
    std::int64_t born, died = -1;
    std::size_t eager_bytes;
  };
  struct Planned {
    std::size_t bytes;
    std::int64_t offset;  // -1: an escape, served by the device's allocator
  };
  struct Arena {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::int64_t live = 0, block_bytes = 0;
    bool retired = false;
  };
  struct Live {
    std::int64_t index;
    Arena* arena;
  };
  void build_plan();
  void ensure_arena();
  void* from_base(std::size_t bytes, Allocator*& owner);
  void diverge(std::string why);
  void release_arena(Arena* a);

  Allocator* base_;
  DeviceKind device_;
  enum class Mode { off, trace, replay } mode_ = Mode::off;
  mutable std::mutex mu_;
  std::int64_t outstanding_ = 0;  // blocks handed out whose owner is this
  bool retired_ = false;
  // trace
  std::vector<Traced> traced_;
  std::unordered_map<void*, std::int64_t> tracing_;  // live traced blocks -> index
  std::int64_t clock_ = 0, backward_at_ = -1;
  // plan
  bool planned_ = false;
  MemoryPlan plan_;
  std::vector<Planned> planned_blocks_;
  std::vector<std::int64_t> conflict_begin_, conflicts_;  // CSR: earlier blocks sharing addresses
  // replay
  std::vector<Arena*> arenas_;  // the current one last
  std::unordered_map<void*, Live> live_;
  std::vector<char> alive_;
  std::size_t cursor_ = 0;
  ReplayResult replay_;
};

/// Installs `memory` as the calling thread's allocation override for its device for the scope's lifetime
/// (restoring the previous one).
class StepMemoryScope {
 public:
  StepMemoryScope(StepMemory& memory, DeviceKind device);
  ~StepMemoryScope();
  StepMemoryScope(const StepMemoryScope&) = delete;
  StepMemoryScope& operator=(const StepMemoryScope&) = delete;

 private:
  DeviceKind device_;
  AllocationOverride* previous_;
};

}  // namespace tg::capture

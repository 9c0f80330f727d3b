// StepMemory: trace, plan and replay of a step's allocations (Note [step memory plan]).
#include "typegrad/compile/step_memory.hpp"

#include <algorithm>
#include <array>
#include <cstdio>
#include <numeric>

#include "typegrad/core/error.hpp"

namespace tg {
namespace capture {
namespace {
std::size_t aligned(std::size_t bytes, std::size_t align) { return (std::max<std::size_t>(bytes, 1) + align - 1) / align * align; }
std::string mib(std::int64_t b) {
  char s[64];
  std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  return s;
}
}  // namespace

std::string MemoryPlan::describe() const {
  std::string s;
  s += "  weights (parameters)            " + mib(weight_bytes) + "\n";
  s += "  other resident state            " + mib(resident_bytes - weight_bytes) + " (optimizer state, weight copies, data)\n";
  if (created_bytes > 0) s += "  created by the step and kept    " + mib(created_bytes) + " (the first step's optimizer state)\n";
  s += "  activations kept for backward   " + mib(activation_bytes) + "\n";
  s += "  temporaries                     " + mib(temporary_bytes()) + "\n";
  s += "  arena                           " + mib(arena_bytes) + " (" + std::to_string(planned_blocks) + " blocks; at most " +
       mib(max_live_bytes) + " alive at once)\n";
  s += "  peak                            " + mib(peak_bytes()) + " (eager: " + mib(eager_peak_bytes) + ")\n";
  return s;
}

StepMemory* StepMemory::create(Allocator& base, DeviceKind device) { return new StepMemory(base, device); }

StepMemory::~StepMemory() {
  for (Arena* a : arenas_) {
    if (a->data) base_->deallocate(a->data, a->bytes);
    delete a;
  }
}

void StepMemory::retire() {
  bool now = false;
  {
    std::lock_guard lock(mu_);
    TG_CHECK(mode_ == Mode::off, "StepMemory::retire: a trace or replay is still running");
    retired_ = true;
    now = outstanding_ == 0;
  }
  if (now) delete this;
}

void StepMemory::renew_arena() {
  std::lock_guard lock(mu_);
  TG_CHECK(mode_ == Mode::off, "StepMemory::renew_arena: a trace or replay is still running");
  if (arenas_.empty() || arenas_.back()->retired) return;
  Arena* a = arenas_.back();
  a->retired = true;  // blocks still alive in it keep it until the last one is freed
  if (a->live == 0) release_arena(a);
}

void StepMemory::begin_trace() {
  std::lock_guard lock(mu_);
  TG_CHECK(mode_ == Mode::off, "StepMemory: begin_trace during another trace or replay");
  mode_ = Mode::trace;
  traced_.clear();
  tracing_.clear();
  // A capture after a plan (a retrace, or the fused capture of Note [fusion rewrites]) runs on the device's
  // allocator: an arena no block lives in goes now, so it is neither resident in the new plan nor kept when
  // the new plan needs less (end_trace makes the new one).
  if (!arenas_.empty() && arenas_.back()->live == 0 && !arenas_.back()->retired) release_arena(arenas_.back());
  clock_ = 0;
  backward_at_ = -1;
  const std::int64_t weights = plan_.weight_bytes;
  plan_ = {};
  plan_.weight_bytes = weights;
  plan_.resident_bytes = base_->stats().bytes_in_use;
}

void StepMemory::mark_backward() {
  std::lock_guard lock(mu_);
  if (mode_ == Mode::trace && backward_at_ < 0) backward_at_ = clock_;
}

MemoryPlan StepMemory::end_trace() {
  std::lock_guard lock(mu_);
  TG_CHECK(mode_ == Mode::trace, "StepMemory: end_trace without begin_trace");
  mode_ = Mode::off;
  // What the step left allocated on the device: its escapes, and what other threads keep (workspaces).
  plan_.created_bytes = base_->stats().bytes_in_use - plan_.resident_bytes;
  build_plan();
  ensure_arena();  // now, so that the first replay makes no allocator call either
  // The arena's block in the device allocator's size classes (on the CPU its rounding: ensure_arena asks for a
  // block of exactly that size class).
  plan_.arena_block_bytes = device_ == DeviceKind::cpu ? static_cast<std::int64_t>(CachingHostAllocator::round_size(static_cast<std::size_t>(plan_.arena_bytes)))
                                                       : arenas_.back()->block_bytes;
  tracing_.clear();  // the escapes' later frees go straight to the device's allocator
  return plan_;
}

void StepMemory::build_plan() {
  const std::int64_t n = static_cast<std::int64_t>(traced_.size());
  planned_blocks_.assign(static_cast<std::size_t>(n), Planned{0, -1});
  std::vector<std::int64_t> order;
  for (std::int64_t i = 0; i < n; ++i) {
    const Traced& t = traced_[static_cast<std::size_t>(i)];
    planned_blocks_[static_cast<std::size_t>(i)].bytes = t.bytes;
    if (t.died < 0) {
      ++plan_.escaping_blocks;
    } else {
      order.push_back(i);
    }
  }
  // Largest first, earlier first among equals; each at the lowest offset free over its whole interval.
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    const Traced &x = traced_[static_cast<std::size_t>(a)], &y = traced_[static_cast<std::size_t>(b)];
    return x.bytes != y.bytes ? x.bytes > y.bytes : x.born < y.born;
  });
  std::vector<std::int64_t> placed;
  std::vector<std::pair<std::int64_t, std::int64_t>> busy;  // [offset, end) of the placed blocks alive with this one
  std::int64_t arena = 0;
  for (std::int64_t i : order) {
    const Traced& t = traced_[static_cast<std::size_t>(i)];
    busy.clear();
    for (std::int64_t j : placed) {
      const Traced& u = traced_[static_cast<std::size_t>(j)];
      if (u.born < t.died && t.born < u.died) {
        const std::int64_t off = planned_blocks_[static_cast<std::size_t>(j)].offset;
        busy.emplace_back(off, off + static_cast<std::int64_t>(u.bytes));
      }
    }
    std::sort(busy.begin(), busy.end());
    std::int64_t at = 0;
    for (const auto& [b, e] : busy) {
      if (b >= at + static_cast<std::int64_t>(t.bytes)) break;
      at = std::max(at, e);
    }
    planned_blocks_[static_cast<std::size_t>(i)].offset = at;
    arena = std::max(arena, at + static_cast<std::int64_t>(t.bytes));
    placed.push_back(i);
  }
  plan_.arena_bytes = arena;
  plan_.planned_blocks = static_cast<std::int64_t>(order.size());
  // For each block, the earlier planned blocks that share some of its addresses (they must be free first).
  conflict_begin_.assign(static_cast<std::size_t>(n) + 1, 0);
  conflicts_.clear();
  std::vector<std::int64_t> by_offset = order;
  std::sort(by_offset.begin(), by_offset.end(), [&](std::int64_t a, std::int64_t b) {
    return planned_blocks_[static_cast<std::size_t>(a)].offset < planned_blocks_[static_cast<std::size_t>(b)].offset;
  });
  std::vector<std::vector<std::int64_t>> earlier(static_cast<std::size_t>(n));
  for (std::size_t x = 0; x < by_offset.size(); ++x) {
    const std::int64_t a = by_offset[x];
    const Planned& pa = planned_blocks_[static_cast<std::size_t>(a)];
    const std::int64_t end_a = pa.offset + static_cast<std::int64_t>(pa.bytes);
    for (std::size_t y = x + 1; y < by_offset.size(); ++y) {
      const std::int64_t b = by_offset[y];
      if (planned_blocks_[static_cast<std::size_t>(b)].offset >= end_a) break;
      earlier[static_cast<std::size_t>(std::max(a, b))].push_back(std::min(a, b));
    }
  }
  for (std::int64_t i = 0; i < n; ++i) {
    conflict_begin_[static_cast<std::size_t>(i)] = static_cast<std::int64_t>(conflicts_.size());
    conflicts_.insert(conflicts_.end(), earlier[static_cast<std::size_t>(i)].begin(), earlier[static_cast<std::size_t>(i)].end());
  }
  conflict_begin_[static_cast<std::size_t>(n)] = static_cast<std::int64_t>(conflicts_.size());
  // The most bytes alive at once (planned sizes and the device allocator's), and at the start of backward.
  std::vector<std::pair<std::int64_t, std::int64_t>> events;  // (time, +-index-1)
  for (std::int64_t i : order) {
    events.emplace_back(traced_[static_cast<std::size_t>(i)].born, i + 1);
    events.emplace_back(traced_[static_cast<std::size_t>(i)].died, -(i + 1));
  }
  std::sort(events.begin(), events.end());
  std::int64_t live = 0, live_eager = 0, max_eager = 0;
  for (const auto& [time, e] : events) {
    const Traced& t = traced_[static_cast<std::size_t>(std::abs(e) - 1)];
    live += e > 0 ? static_cast<std::int64_t>(t.bytes) : -static_cast<std::int64_t>(t.bytes);
    live_eager += e > 0 ? static_cast<std::int64_t>(t.eager_bytes) : -static_cast<std::int64_t>(t.eager_bytes);
    plan_.max_live_bytes = std::max(plan_.max_live_bytes, live);
    max_eager = std::max(max_eager, live_eager);
  }
  if (backward_at_ >= 0)
    for (std::int64_t i : order) {
      const Traced& t = traced_[static_cast<std::size_t>(i)];
      if (t.born < backward_at_ && t.died > backward_at_) plan_.activation_bytes += static_cast<std::int64_t>(t.bytes);
    }
  // What stays after the step counts whole in the eager peak (a slight overestimate on the first step, whose
  // optimizer state is born after most of the step's temporaries died).
  plan_.eager_peak_bytes = plan_.resident_bytes + max_eager + plan_.created_bytes;
  planned_ = true;
}

void StepMemory::ensure_arena() {
  Arena* cur = arenas_.empty() ? nullptr : arenas_.back();
  if (cur && cur->live > 0) {  // blocks of the last replay still alive: never reuse their addresses
    cur->retired = true;
    cur = nullptr;
  }
  if (!cur || cur->bytes < static_cast<std::size_t>(plan_.arena_bytes)) {
    if (cur && cur->live == 0) release_arena(cur);
    const auto bytes = static_cast<std::size_t>(std::max<std::int64_t>(plan_.arena_bytes, 1));
    // A block of the arena's own size class: the caching allocator serves a request from a free block up to twice
    // its size, and after a capture that shrank the plan (the fused capture of Note [fusion rewrites]) the released
    // arena's block would serve the smaller one, holding bytes no replay uses and that the plan does not show.
    const std::int64_t before = base_->stats().bytes_in_use;
    void* data = base_->allocate_exact(bytes);  // first: an allocation failure leaves nothing behind
    auto* a = new Arena;
    a->bytes = bytes;
    a->data = data;
    a->block_bytes = base_->stats().bytes_in_use - before;
    arenas_.push_back(a);
  }
}

void StepMemory::begin_replay() {
  std::lock_guard lock(mu_);
  TG_CHECK(mode_ == Mode::off, "StepMemory: begin_replay during another trace or replay");
  TG_CHECK(planned_, "StepMemory: begin_replay without a plan (trace a step first)");
  ensure_arena();
  alive_.assign(planned_blocks_.size(), 0);
  cursor_ = 0;
  replay_ = {};
  mode_ = Mode::replay;
}

ReplayResult StepMemory::end_replay() {
  std::lock_guard lock(mu_);
  TG_CHECK(mode_ == Mode::replay, "StepMemory: end_replay without begin_replay");
  mode_ = Mode::off;
  while (cursor_ < planned_blocks_.size() && planned_blocks_[cursor_].offset < 0) ++cursor_;  // escapes not requested
  if (replay_.ok && cursor_ != planned_blocks_.size())
    diverge("the step made " + std::to_string(cursor_) + " of the plan's " + std::to_string(planned_blocks_.size()) + " allocations");
  if (replay_.ok && arenas_.back()->live > 0)
    diverge(std::to_string(arenas_.back()->live) + " planned blocks outlived the step (a tensor kept past it)");
  return replay_;
}

void StepMemory::diverge(std::string why) {
  if (replay_.ok) replay_.divergence = std::move(why);
  replay_.ok = false;
}

void StepMemory::release_arena(Arena* a) {
  base_->deallocate(a->data, a->bytes);
  arenas_.erase(std::find(arenas_.begin(), arenas_.end(), a));
  delete a;
}

void* StepMemory::from_base(std::size_t bytes, Allocator*& owner) {
  void* p = base_->allocate(bytes);
  ++outstanding_;
  owner = this;
  return p;
}

void* StepMemory::allocate(std::size_t) { throw Error("StepMemory: storages are allocated through the allocation override"); }

void* StepMemory::allocate(std::size_t bytes, Allocator*& owner) {
  std::lock_guard lock(mu_);
  const std::size_t need = aligned(bytes, alignment());
  if (mode_ == Mode::trace) {
    void* p = base_->allocate(bytes);
    traced_.push_back({need, clock_++, -1, CachingHostAllocator::round_size(bytes)});
    tracing_[p] = static_cast<std::int64_t>(traced_.size()) - 1;
    ++outstanding_;
    owner = this;
    return p;
  }
  if (mode_ != Mode::replay) return from_base(bytes, owner);
  // Skip the traced step's one-time escapes that this step does not make (their sizes differ).
  while (cursor_ < planned_blocks_.size() && planned_blocks_[cursor_].offset < 0 && planned_blocks_[cursor_].bytes != need) ++cursor_;
  if (cursor_ >= planned_blocks_.size() || planned_blocks_[cursor_].bytes != need) {
    diverge("allocation " + std::to_string(cursor_) + " is " + std::to_string(need) + " bytes, the plan's " +
            (cursor_ < planned_blocks_.size() ? std::to_string(planned_blocks_[cursor_].bytes) + " bytes" : std::string("end")));
    ++replay_.fallbacks;
    return from_base(bytes, owner);
  }
  const std::size_t k = cursor_++;
  if (planned_blocks_[k].offset < 0) {
    ++replay_.fallbacks;
    return from_base(bytes, owner);
  }
  for (std::int64_t c = conflict_begin_[k]; c < conflict_begin_[k + 1]; ++c)
    if (alive_[static_cast<std::size_t>(conflicts_[static_cast<std::size_t>(c)])]) {
      diverge("allocation " + std::to_string(k) + " shares addresses with allocation " + std::to_string(conflicts_[static_cast<std::size_t>(c)]) +
              ", which is still alive");
      ++replay_.fallbacks;
      return from_base(bytes, owner);
    }
  Arena* a = arenas_.back();
  void* p = static_cast<char*>(a->data) + planned_blocks_[k].offset;
  alive_[k] = 1;
  live_[p] = {static_cast<std::int64_t>(k), a};
  ++a->live;
  ++outstanding_;
  ++replay_.served;
  owner = this;
  return p;
}

void StepMemory::deallocate(void* ptr, std::size_t bytes) {
  bool gone = false;
  {
    std::lock_guard lock(mu_);
    if (auto it = live_.find(ptr); it != live_.end()) {
      Arena* a = it->second.arena;
      if (a == arenas_.back() && !a->retired && static_cast<std::size_t>(it->second.index) < alive_.size())
        alive_[static_cast<std::size_t>(it->second.index)] = 0;
      live_.erase(it);
      if (--a->live == 0 && a->retired) release_arena(a);
    } else {
      if (auto t = tracing_.find(ptr); t != tracing_.end()) {
        traced_[static_cast<std::size_t>(t->second)].died = clock_++;
        tracing_.erase(t);
      }
      base_->deallocate(ptr, bytes);
    }
    gone = --outstanding_ == 0 && retired_;
  }
  if (gone) delete this;
}

StepMemoryScope::StepMemoryScope(StepMemory& memory, DeviceKind device)
    : device_(device), previous_(tg::detail::allocation_override(device)) {
  tg::detail::allocation_override(device) = &memory;
}
StepMemoryScope::~StepMemoryScope() { tg::detail::allocation_override(device_) = previous_; }

}  // namespace capture
}  // namespace tg

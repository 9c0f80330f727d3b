// The thread-local checkpoint-region stack and the generator watch (Note [checkpoint regions]).
#include <algorithm>

#include "typegrad/autodiff/region.hpp"
#include "typegrad/core/error.hpp"
#include "typegrad/core/random.hpp"

namespace tg::autodiff {

namespace {
thread_local std::vector<RegionContext*> t_regions;
thread_local CheckpointStats t_stats;
}  // namespace

std::vector<RegionContext*>& region_stack() { return t_regions; }
CheckpointStats& checkpoint_stats() { return t_stats; }

void region_note_requires_grad() {
  // Only regions still in their forward phase decide whether to record; a recomputing one already did.
  for (auto it = t_regions.rbegin(); it != t_regions.rend() && (*it)->phase == RegionPhase::forward; ++it)
    (*it)->saw_grad = true;
}

}  // namespace tg::autodiff

namespace tg::detail {

bool rng_watch_active() { return !autodiff::t_regions.empty(); }

// A draw inside regions in their forward phase registers the generator (with its state before this
// first draw, which is its state at the region's start). A recomputing region has set every generator
// it registered back to that state; a draw from any other generator would make the recompute differ
// from the forward, so it is an error.
void rng_watch_draw(Generator& gen) {
  using autodiff::RegionPhase;
  for (auto it = autodiff::t_regions.rbegin(); it != autodiff::t_regions.rend(); ++it) {
    auto& records = *(*it)->rng;
    const bool known = std::any_of(records.begin(), records.end(), [&](const auto& r) { return r.gen == &gen; });
    if ((*it)->phase == RegionPhase::forward) {
      if (!known) records.push_back({&gen, gen.seed(), gen.offset(), gen.offset()});
      continue;
    }
    TG_CHECK(known, "checkpoint: recomputing region '", (*it)->name,
             "' drew random numbers from a generator its forward did not use (seed ", gen.seed(),
             "): the region's function must draw from the same generators on every call");
    break;
  }
}

}  // namespace tg::detail

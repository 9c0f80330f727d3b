// The thread-local stack of active checkpoint regions, which ops and generators consult while a region
// runs (Note [checkpoint regions] in checkpoint.hpp). Light: included by node.hpp and the GEMM ops.
//   auto out = autodiff::region_kept_output<Tensor<T>>("linear", shape, [&] { return gemm(...); });
//   autodiff::checkpoint_stats().recomputes;   // how many region recomputes ran on this thread
#pragma once

#include <any>
#include <cstdint>
#include <vector>

#include "typegrad/core/error.hpp"
#include "typegrad/core/random.hpp"
#include "typegrad/core/shape.hpp"

namespace tg::autodiff {

/// forward: the region's first run, without recording (it fills `kept` and `rng`).
/// recompute: the backward's rerun with recording on (it reuses `kept` and checks `rng`).
enum class RegionPhase { forward, recompute };

/// A generator drawn from inside a region: its state when the region started and when it ended.
struct RngRecord {
  Generator* gen = nullptr;
  std::uint64_t seed = 0, entry_offset = 0, exit_offset = 0;
};

struct RegionContext {
  const char* name = "checkpoint";
  RegionPhase phase = RegionPhase::forward;
  bool keep_gemm = false;               // the policy keeps matmul/linear outputs
  std::vector<std::any>* kept = nullptr;  // kept outputs, in op order (Tensor<T, D> each)
  std::size_t cursor = 0;               // recompute: the next kept output to reuse
  std::vector<RngRecord>* rng = nullptr;  // generators used inside, in first-use order
  bool saw_grad = false;                // forward: some op inside had an input that requires grad
};

/// Counters of this thread's checkpoint activity (tests and benchmarks read them; reset by assignment).
struct CheckpointStats {
  std::int64_t regions_recorded = 0;  // region nodes put on a tape
  std::int64_t recomputes = 0;        // region forwards rerun by backward
  std::int64_t kept_outputs = 0;      // outputs a policy kept during a region's forward
  std::int64_t reused_outputs = 0;    // kept outputs a recompute reused instead of recomputing
};
CheckpointStats& checkpoint_stats();

/// Active regions on this thread, outermost first.
std::vector<RegionContext*>& region_stack();

/// Pushes `ctx` for the guard's lifetime.
class RegionScope {
 public:
  explicit RegionScope(RegionContext& ctx) { region_stack().push_back(&ctx); }
  ~RegionScope() { region_stack().pop_back(); }
  RegionScope(const RegionScope&) = delete;
  RegionScope& operator=(const RegionScope&) = delete;
};

/// record() calls this when it records nothing although an input requires grad: a region running its
/// forward without recording learns that it must put a node on the tape.
void region_note_requires_grad();

/// Runs a GEMM-like op's computation, or reuses its kept output (Note [checkpoint regions]): the source
/// is the innermost recomputing region (past regions still in their forward), if its policy keeps GEMM
/// outputs; every region in its forward phase above it whose policy keeps them stores the result.
template <class Out, class Compute>
Out region_kept_output(const char* op, const Shape& shape, Compute&& compute) {
  auto& stack = region_stack();
  if (stack.empty()) return compute();
  RegionContext* source = nullptr;
  for (auto it = stack.rbegin(); it != stack.rend(); ++it)
    if ((*it)->phase == RegionPhase::recompute) {
      source = *it;
      break;
    }
  Out out;
  if (source && source->keep_gemm) {
    const std::size_t i = source->cursor;
    TG_CHECK(i < source->kept->size(), "checkpoint: recomputing region '", source->name, "' reached ", op,
             " number ", i + 1, " but its forward kept only ", source->kept->size(),
             " outputs: the region's function must run the same ops on every call");
    const Out* kept = std::any_cast<Out>(&(*source->kept)[i]);
    TG_CHECK(kept != nullptr, "checkpoint: recomputing region '", source->name, "': kept output ", i + 1, " (", op,
             ") has another dtype or device than the recompute's: the region's function must run the same ops on "
             "every call");
    TG_CHECK(kept->shape() == shape, "checkpoint: recomputing region '", source->name, "': kept output ", i + 1, " (",
             op, ") has shape ", kept->shape(), ", the recompute needs ", shape,
             ": the region's function must run the same ops on every call");
    out = *kept;
    ++source->cursor;
    ++checkpoint_stats().reused_outputs;
  } else {
    out = compute();
  }
  for (auto it = stack.rbegin(); it != stack.rend() && (*it)->phase == RegionPhase::forward; ++it)
    if ((*it)->keep_gemm) {
      (*it)->kept->push_back(out.detach());
      ++checkpoint_stats().kept_outputs;
    }
  return out;
}

}  // namespace tg::autodiff

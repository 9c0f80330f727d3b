// What the fusion rewrite tests (test_pair_fusion, test_attention_fusion) share: a model's training run, eager or
// through tg::compile, and what it gives (losses, weights, allocator calls, the fused pairs and recorded ops, the
// plan and the replays' measured peak); the bit-for-bit comparison of two runs.
//   Block<float> m;                                          // input(k), targets(k), step(x, y), ps
//   const FusionRun r = run_model(m, /*compiled=*/true, /*fuse=*/true, 20);
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <typegrad/compile/compile.hpp>
#include <typegrad/typegrad.hpp>

namespace tg::testing {

struct FusionRun {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;
  std::vector<std::int64_t> allocations;  // allocator calls of each call
  std::vector<std::string> pairs;         // the fused pairs, described
  std::vector<std::string> ops;           // the ops the last capture recorded
  std::size_t chains = 0;
  capture::MemoryPlan plan;
  std::int64_t measured_peak = 0;  // the allocator's peak over the calls from the fourth on (replays when fused)
};

/// `steps` calls of m.step on m.input(k), m.targets(k), eagerly or through tg::compile with fusion on or off.
template <class Model>
FusionRun run_model(Model& m, bool compiled, bool fuse, int steps) {
  auto c = tg::compile([&](const Tensor<float>& x, const Tensor<std::int64_t>& y) { return m.step(x, y); },
                       CompileOptions{.verbose = false, .fuse = fuse});
  FusionRun r;
  auto& a = allocator<cpu>();
  for (int k = 0; k < steps; ++k) {
    const Tensor<float> x = m.input(k);
    const Tensor<std::int64_t> y = m.targets(k);
    if (k == 3) a.reset_peak();
    const std::int64_t before = a.stats().allocations;
    r.losses.push_back(compiled ? c(x, y) : m.step(x, y));
    r.allocations.push_back(a.stats().allocations - before);
  }
  r.measured_peak = a.stats().peak_bytes;
  for (const auto& q : m.ps) r.weights.push_back(q.tensor.to_vector());
  for (const auto& pr : c.fused_pairs()) r.pairs.push_back(pr.describe());
  r.chains = c.fused_chains().size();
  for (const auto& o : c.ops()) r.ops.push_back(o.op);
  r.plan = c.memory_plan();
  return r;
}

/// Losses and every weight equal bit for bit.
inline void expect_bitwise(const FusionRun& got, const FusionRun& ref, const std::string& what) {
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_EQ(std::memcmp(&got.losses[i], &ref.losses[i], sizeof(double)), 0)
        << what << ": step " << i << ": " << got.losses[i] << " vs " << ref.losses[i];
  ASSERT_EQ(got.weights.size(), ref.weights.size());
  for (std::size_t t = 0; t < ref.weights.size(); ++t)
    EXPECT_EQ(std::memcmp(got.weights[t].data(), ref.weights[t].data(), ref.weights[t].size() * sizeof(float)), 0) << what << ": tensor " << t;
}

/// The replays' measured peak within 5% of the plan's.
inline void expect_plan_predicts_peak(const FusionRun& r) {
  EXPECT_LE(std::abs(static_cast<double>(r.plan.peak_bytes() - r.measured_peak)), 0.05 * static_cast<double>(r.measured_peak))
      << r.plan.peak_bytes() << " planned, " << r.measured_peak << " measured\n" << r.plan.describe();
}

inline std::size_t count(const std::vector<std::string>& ops, const std::string& op) {
  return static_cast<std::size_t>(std::count(ops.begin(), ops.end(), op));
}

}  // namespace tg::testing

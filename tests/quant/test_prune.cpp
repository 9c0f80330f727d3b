// Pruning (include/typegrad/quant/prune.hpp): magnitude selection (global, per layer, 2:4) against an
// independent sort, Zhu & Gupta's schedule, masks that only shrink, masked AdamW training, checkpoint masks
// round trip and hostile masks, spec parsing, and which GPT parameters are prunable.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <typegrad/nn/gpt.hpp>
#include <typegrad/optim/optim.hpp>
#include <typegrad/quant/prune.hpp>
#include <typegrad/typegrad.hpp>

#include "nn/gpt_test_util.hpp"

namespace tg::quant {
// The header must compile for the GPU model too (the trainer's CUDA build instantiates it); a CPU-only
// build compiles it against the CUDA stubs.
template class Pruner<cuda>;
}  // namespace tg::quant

namespace test_prune_cpp {  // the file's own names (Note [unity test sources])

using namespace tg;
using quant::GradualSchedule;
using quant::PruneScope;
using quant::PruneSpec;
using quant::Pruner;
using quant::SparsityPattern;
using Masks = std::vector<std::pair<std::string, Tensor<std::uint8_t>>>;

nn::GPTConfig tiny_config() { return {64, 16, 2, 2, 32, 0.0f}; }  // V, T, L, H, C

struct TinyModel {
  Generator gen{11};
  nn::GPT model{tiny_config(), gen};
  std::vector<optim::Param> params = model.named_parameters();
  std::vector<optim::Param> prunable() const {
    std::vector<optim::Param> r;
    for (const auto& p : params)
      if (quant::is_prunable(p.name, p.tensor.shape())) r.push_back(p);
    return r;
  }
};

std::vector<std::vector<std::uint8_t>> masks_of(const Pruner<cpu>& pr) {
  std::vector<std::vector<std::uint8_t>> r;
  for (const auto& [name, t] : pr.mask_tensors()) r.push_back(t.to_vector());
  return r;
}
std::int64_t zeros_in(const std::vector<std::vector<std::uint8_t>>& ms) {
  std::int64_t z = 0;
  for (const auto& m : ms) z += std::count(m.begin(), m.end(), std::uint8_t{0});
  return z;
}
std::int64_t rounded(double s, std::int64_t n) { return static_cast<std::int64_t>(std::llround(s * static_cast<double>(n))); }

/// The expected masks, computed independently: sort every (key, flat index) of a group and prune the first k;
/// key = |w|, or −1 for a weight `before` already pruned. Groups: all parameters together (global) or each one.
std::vector<std::vector<std::uint8_t>> expected_unstructured(const std::vector<optim::Param>& ps, double s, bool global,
                                                             const std::vector<std::vector<std::uint8_t>>* before = nullptr) {
  std::vector<std::vector<std::uint8_t>> masks;
  for (std::size_t i = 0; i < ps.size(); ++i)
    masks.push_back(before ? (*before)[i] : std::vector<std::uint8_t>(static_cast<std::size_t>(ps[i].tensor.numel()), 1));
  auto run = [&](std::size_t first, std::size_t last) {
    std::vector<std::pair<double, std::pair<std::size_t, std::size_t>>> order;  // (key, (param, element))
    std::int64_t n = 0;
    for (std::size_t i = first; i < last; ++i) {
      const auto w = ps[i].tensor.to_vector();
      for (std::size_t j = 0; j < w.size(); ++j) order.push_back({masks[i][j] ? std::fabs(double(w[j])) : -1.0, {i, j}});
      n += static_cast<std::int64_t>(w.size());
    }
    std::sort(order.begin(), order.end());
    const std::int64_t k = rounded(s, n);
    for (std::int64_t r = 0; r < k; ++r) masks[order[r].second.first][order[r].second.second] = 0;
  };
  if (global) run(0, ps.size());
  else
    for (std::size_t i = 0; i < ps.size(); ++i) run(i, i + 1);
  return masks;
}

/// Overwrites every prunable weight with fresh N(0, 1) values (so the next selection sees new magnitudes).
void redraw(const std::vector<optim::Param>& ps, std::uint64_t seed) {
  Generator g(seed);
  for (const auto& p : ps) {
    const auto r = Tensor<fp32>::normal(p.tensor.shape(), 0.f, 1.f, g);
    std::copy(r.data(), r.data() + r.numel(), p.tensor.data());
  }
}

// ---- which parameters ---------------------------------------------------------------------------------------

TEST(PruneParams, TheBlocksLinearWeightsOfAGptAreThePrunableOnes) {
  TinyModel m;
  std::set<std::string> got;
  for (const auto& p : m.params)
    if (quant::is_prunable(p.name, p.tensor.shape())) got.insert(p.name);
  std::set<std::string> want;
  for (int i = 0; i < 2; ++i)
    for (const char* s : {"attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"}) want.insert("h." + std::to_string(i) + "." + s + ".weight");
  EXPECT_EQ(got, want);
  for (const char* never : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.ln_1.bias", "h.1.ln_2.weight", "ln_f.weight",
                            "ln_f.bias", "h.0.attn.c_attn.bias", "h.1.mlp.c_proj.bias"})
    EXPECT_FALSE(quant::is_prunable(never, {32, 32})) << never;
  EXPECT_FALSE(quant::is_prunable("h.0.mlp.c_fc.weight", {128})) << "1-D";
  EXPECT_FALSE(quant::is_prunable("h.0.mlp.c_fc.weight", {2, 4, 4})) << "3-D";
  EXPECT_FALSE(quant::is_prunable("h.x.mlp.c_fc.weight", {4, 4})) << "not a block index";
  EXPECT_FALSE(quant::is_prunable("h.0.weight", {4, 4})) << "no layer between the block and the weight";
  EXPECT_FALSE(quant::is_prunable("encoder.h.0.mlp.c_fc.weight", {4, 4}));
  EXPECT_TRUE(quant::is_prunable("h.11.mlp.c_proj.weight", {768, 3072}));
}

// ---- parse_prune_spec -------------------------------------------------------------------------------------------

TEST(PruneSpecParse, GoodSpecs) {
  EXPECT_EQ(quant::parse_prune_spec("unstructured:0.5"), (PruneSpec{SparsityPattern::unstructured, 0.5, PruneScope::global}));
  EXPECT_EQ(quant::parse_prune_spec("unstructured:0.9:per-layer"), (PruneSpec{SparsityPattern::unstructured, 0.9, PruneScope::per_layer}));
  EXPECT_EQ(quant::parse_prune_spec("unstructured:0.25:global"), (PruneSpec{SparsityPattern::unstructured, 0.25, PruneScope::global}));
  EXPECT_EQ(quant::parse_prune_spec("unstructured:0"), (PruneSpec{SparsityPattern::unstructured, 0.0, PruneScope::global}));
  EXPECT_EQ(quant::parse_prune_spec("unstructured:.75"), (PruneSpec{SparsityPattern::unstructured, 0.75, PruneScope::global}));
  EXPECT_EQ(quant::parse_prune_spec("2:4"), (PruneSpec{SparsityPattern::two_four, 0.5, PruneScope::global}));
  for (const char* s : {"unstructured:0.5", "unstructured:0.9:per-layer", "2:4"})
    EXPECT_EQ(quant::to_string(quant::parse_prune_spec(s)), s);
}

TEST(PruneSpecParse, BadSpecsAreClearErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "empty"},
      {"unstructured", "sparsity S is missing"},
      {"unstructured:", "sparsity S is missing"},
      {"unstructured:1", "outside [0, 1)"},
      {"unstructured:1.5", "outside [0, 1)"},
      {"unstructured:-0.1", "outside [0, 1)"},
      {"unstructured:abc", "is not a number"},
      {"unstructured:0.5x", "is not a number"},
      {"unstructured: 0.5", "is not a number"},
      {"unstructured:nan", "is not a number"},
      {"unstructured:inf", "is not a number"},
      {"unstructured:0.5:per_layer", "unknown scope 'per_layer'"},
      {"unstructured:0.5:per-layer:x", "too many fields"},
      {"structured:0.5", "unknown pattern 'structured'"},
      {"Unstructured:0.5", "unknown pattern"},
      {"1:4", "unknown pattern '1'"},
      {"2:4:0.5", "2:4 takes no sparsity"},
      {"2:4:per-layer", "2:4 takes no sparsity"},
      {"0.5", "unknown pattern '0.5'"},
  };
  for (const auto& [text, why] : cases) {
    try {
      quant::parse_prune_spec(text);
      ADD_FAILURE() << "'" << text << "' was accepted";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("--prune: '" + text + "'"), std::string::npos) << msg;
      EXPECT_NE(msg.find(why), std::string::npos) << msg;
      EXPECT_NE(msg.find("expected unstructured:S with 0 <= S < 1, or 2:4"), std::string::npos) << msg;
    }
  }
}

// ---- magnitude selection ----------------------------------------------------------------------------------------

TEST(PruneMagnitude, GlobalPrunesExactlyTheKSmallestOverAllLayers) {
  TinyModel m;
  const auto ps = m.prunable();
  for (double s : {0.0, 0.1, 0.3, 0.5, 0.77, 0.95}) {
    Pruner<cpu> pr(m.params, {SparsityPattern::unstructured, s, PruneScope::global});
    pr.prune_to(s);
    const auto got = masks_of(pr);
    const auto want = expected_unstructured(ps, s, /*global=*/true);
    EXPECT_EQ(got, want) << "s = " << s;
    std::int64_t n = 0;
    for (const auto& p : ps) n += p.tensor.numel();
    EXPECT_EQ(zeros_in(got), rounded(s, n)) << "s = " << s;
    EXPECT_DOUBLE_EQ(pr.sparsity(), static_cast<double>(rounded(s, n)) / static_cast<double>(n));
    // Layers differ in scale (c_proj is initialized 1/sqrt(2L) smaller), so a global cut is uneven.
    const auto rep = pr.report();
    ASSERT_EQ(rep.size(), ps.size());
    std::int64_t pruned = 0;
    for (std::size_t i = 0; i < rep.size(); ++i) {
      EXPECT_EQ(rep[i].name, ps[i].name);
      EXPECT_EQ(rep[i].total, ps[i].tensor.numel());
      EXPECT_EQ(rep[i].pruned, std::count(got[i].begin(), got[i].end(), std::uint8_t{0}));
      pruned += rep[i].pruned;
    }
    EXPECT_EQ(pruned, rounded(s, n));
  }
}

TEST(PruneMagnitude, PerLayerPrunesExactlyTheKSmallestOfEachLayer) {
  TinyModel m;
  const auto ps = m.prunable();
  for (double s : {0.2, 0.5, 0.63}) {
    Pruner<cpu> pr(m.params, {SparsityPattern::unstructured, s, PruneScope::per_layer});
    pr.prune_to(s);
    EXPECT_EQ(masks_of(pr), expected_unstructured(ps, s, /*global=*/false)) << "s = " << s;
    for (const auto& r : pr.report()) EXPECT_EQ(r.pruned, rounded(s, r.total)) << r.name;
  }
}

// Hand-made weights with equal magnitudes: ties go to the lower flat index (the parameters concatenated).
std::vector<optim::Param> tied_params() {
  return {optim::Param("h.0.mlp.c_fc.weight", Tensor<fp32>::from_values({2, 4}, {1, -1, 2, 1, 1, 3, -2, 1})),
          optim::Param("h.1.mlp.c_fc.weight", Tensor<fp32>::from_values({1, 4}, {-1, 0.5, 1, 1}))};
}

TEST(PruneMagnitude, TiesAreBrokenByFlatIndex) {
  const auto ps = tied_params();
  Pruner<cpu> global(ps, {SparsityPattern::unstructured, 0.5, PruneScope::global});
  global.prune_to(0.5);  // k = 6 of 12: 0.5 (B[1]), then the |w| = 1 at A[0], A[1], A[3], A[4], A[7]
  EXPECT_EQ(masks_of(global), (std::vector<std::vector<std::uint8_t>>{{0, 0, 1, 0, 0, 1, 1, 0}, {1, 0, 1, 1}}));
  Pruner<cpu> layer(ps, {SparsityPattern::unstructured, 0.5, PruneScope::per_layer});
  layer.prune_to(0.5);  // A: 4 of the five 1s, lowest indices; B: 0.5, then the first 1 (index 0)
  EXPECT_EQ(masks_of(layer), (std::vector<std::vector<std::uint8_t>>{{0, 0, 1, 0, 0, 1, 1, 1}, {0, 0, 1, 1}}));
  Pruner<cpu> rounding(ps, {SparsityPattern::unstructured, 0.125, PruneScope::global});
  rounding.prune_to(0.125);  // 0.125·12 = 1.5 rounds to 2: 0.5, then A[0]
  EXPECT_EQ(masks_of(rounding), (std::vector<std::vector<std::uint8_t>>{{0, 1, 1, 1, 1, 1, 1, 1}, {1, 0, 1, 1}}));
  Pruner<cpu> two_four(ps, {SparsityPattern::two_four, 0.5, PruneScope::global});
  two_four.prune_to(0.5);  // [1,-1,2,1] -> 0, 1;  [1,3,-2,1] -> 0, 3;  [-1,0.5,1,1] -> 1 (0.5), 0 (first 1)
  EXPECT_EQ(masks_of(two_four), (std::vector<std::vector<std::uint8_t>>{{0, 0, 1, 1, 0, 1, 1, 0}, {0, 0, 1, 1}}));
}

TEST(PruneMagnitude, NanWeightsAreKeptAndTheCountIsStillExact) {
  std::vector<optim::Param> ps = {
      optim::Param("h.0.mlp.c_fc.weight", Tensor<fp32>::from_values({1, 8}, {0.1, NAN, 0.3, -0.2, INFINITY, 0.05, 0.7, 0.4}))};
  Pruner<cpu> pr(ps, {SparsityPattern::unstructured, 0.75, PruneScope::global});
  pr.prune_to(0.75);  // 6 of 8: every finite weight; the NaN (ordered as +inf) and the inf stay
  EXPECT_EQ(masks_of(pr), (std::vector<std::vector<std::uint8_t>>{{0, 1, 0, 0, 1, 0, 0, 0}}));
  pr.apply_to_weights();
  EXPECT_TRUE(pr.weights_respect_masks());
}

TEST(PruneTwoFour, EveryGroupOfFourHasExactlyItsTwoSmallestPruned) {
  TinyModel m;
  const auto ps = m.prunable();
  Pruner<cpu> pr(m.params, quant::parse_prune_spec("2:4"));
  pr.prune_to(0.0);
  EXPECT_EQ(pr.sparsity(), 0.0) << "0: masks all ones";
  pr.prune_to(0.5);
  const auto got = masks_of(pr);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto w = ps[i].tensor.to_vector();
    const std::int64_t in = ps[i].tensor.size(1);
    ASSERT_EQ(in % 4, 0);
    for (std::size_t g = 0; g < w.size(); g += 4) {
      std::vector<std::pair<float, std::size_t>> group;
      for (std::size_t j = g; j < g + 4; ++j) group.push_back({std::fabs(w[j]), j});
      std::sort(group.begin(), group.end());
      for (std::size_t r = 0; r < 4; ++r)
        ASSERT_EQ(got[i][group[r].second], r < 2 ? 0 : 1) << ps[i].name << " group at " << g << " (row " << g / in << ")";
    }
    EXPECT_EQ(pr.report()[i].pruned, ps[i].tensor.numel() / 2);
  }
  EXPECT_DOUBLE_EQ(pr.sparsity(), 0.5);
  const auto before = got;
  redraw(ps, 99);
  pr.prune_to(0.5);
  EXPECT_EQ(masks_of(pr), before) << "2:4 masks are fixed once chosen (masks only shrink)";
  EXPECT_THROW(pr.prune_to(0.3), Error);
}

TEST(PruneTwoFour, AnInputDimensionNotDivisibleByFourIsAnErrorNamingTheParameter) {
  std::vector<optim::Param> ps = {optim::Param("h.0.attn.c_attn.weight", Tensor<fp32>::ones({6, 8})),
                                  optim::Param("h.0.attn.c_proj.weight", Tensor<fp32>::ones({8, 6}))};
  try {
    Pruner<cpu> pr(ps, quant::parse_prune_spec("2:4"));
    ADD_FAILURE() << "accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'h.0.attn.c_proj.weight'"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("divisible by 4"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(Pruner<cpu>(ps, quant::parse_prune_spec("unstructured:0.5")));
}

TEST(PruneErrors, ConstructionAndTargets) {
  std::vector<optim::Param> none = {optim::Param("wte.weight", Tensor<fp32>::ones({8, 4})),
                                    optim::Param("h.0.ln_1.weight", Tensor<fp32>::ones({4}))};
  EXPECT_THROW(Pruner<cpu>(none, {}), Error);
  const auto ps = tied_params();
  EXPECT_THROW(Pruner<cpu>(ps, {SparsityPattern::unstructured, 1.0, PruneScope::global}), Error);
  EXPECT_THROW(Pruner<cpu>(ps, {SparsityPattern::unstructured, -0.1, PruneScope::global}), Error);
  EXPECT_THROW(Pruner<cpu>(ps, {SparsityPattern::two_four, 0.3, PruneScope::global}), Error);
  Pruner<cpu> pr(ps, {});
  EXPECT_THROW(pr.prune_to(1.0), Error);
  EXPECT_THROW(pr.prune_to(NAN), Error);
  EXPECT_EQ(pr.sparsity(), 0.0) << "all masks start at ones";
  EXPECT_NO_THROW(pr.apply_to_grads()) << "no gradients yet";
}

// ---- the gradual schedule ---------------------------------------------------------------------------------------

TEST(PruneSchedule, ZhuGuptaCubicInFp64) {
  const GradualSchedule s{.start = 100, .end = 200, .every = 10, .initial = 0.1, .final_sparsity = 0.7};
  EXPECT_NO_THROW(s.validate());
  auto formula = [](double t) {  // eq. 1, written out independently
    const double x = 1.0 - (t - 100.0) / 100.0;
    return 0.7 + (0.1 - 0.7) * std::pow(x, 3.0);
  };
  EXPECT_EQ(s.sparsity_at(0), 0.1);
  EXPECT_EQ(s.sparsity_at(99), 0.1);
  EXPECT_EQ(s.sparsity_at(100), 0.1) << "s_i at t0";
  EXPECT_DOUBLE_EQ(s.sparsity_at(150), 0.7 - 0.6 * 0.125);
  EXPECT_DOUBLE_EQ(s.sparsity_at(125), 0.7 - 0.6 * 0.421875);
  EXPECT_DOUBLE_EQ(s.sparsity_at(175), 0.7 - 0.6 * 0.015625);
  for (std::int64_t t = 100; t <= 200; ++t) EXPECT_NEAR(s.sparsity_at(t), formula(static_cast<double>(t)), 1e-15) << t;
  for (std::int64_t t = 100; t < 200; ++t) EXPECT_LT(s.sparsity_at(t), s.sparsity_at(t + 1)) << "rises strictly at " << t;
  for (std::int64_t t = 101; t < 199; ++t)
    EXPECT_GT(s.sparsity_at(t) - s.sparsity_at(t - 1), s.sparsity_at(t + 1) - s.sparsity_at(t)) << "concave at " << t;
  EXPECT_EQ(s.sparsity_at(200), 0.7) << "s_f at t1";
  EXPECT_EQ(s.sparsity_at(201), 0.7);
  EXPECT_EQ(s.sparsity_at(1000000), 0.7);

  for (std::int64_t t : {100, 110, 150, 190, 200}) EXPECT_TRUE(s.updates_at(t)) << t;
  for (std::int64_t t : {0, 99, 101, 105, 199, 201, 210}) EXPECT_FALSE(s.updates_at(t)) << t;
  const GradualSchedule ragged{.start = 0, .end = 25, .every = 10, .initial = 0.0, .final_sparsity = 0.5};
  std::vector<std::int64_t> at;
  for (std::int64_t t = -5; t < 40; ++t)
    if (ragged.updates_at(t)) at.push_back(t);
  EXPECT_EQ(at, (std::vector<std::int64_t>{0, 10, 20, 25})) << "and at t1 off the grid";
  const GradualSchedule once{.start = 50, .end = 50, .every = 1, .initial = 0.2, .final_sparsity = 0.6};
  EXPECT_EQ(once.sparsity_at(49), 0.2);
  EXPECT_EQ(once.sparsity_at(50), 0.6);
  EXPECT_TRUE(once.updates_at(50));
  EXPECT_FALSE(once.updates_at(51));

  EXPECT_THROW((GradualSchedule{.start = 0, .end = 10, .every = 0}.validate()), Error);
  EXPECT_THROW((GradualSchedule{.start = 0, .end = 10, .every = 0}.updates_at(5)), Error);
  EXPECT_THROW((GradualSchedule{.start = 10, .end = 0}.validate()), Error);
  EXPECT_THROW((GradualSchedule{.start = 0, .end = 10, .every = 1, .initial = 0.0, .final_sparsity = 1.0}.validate()), Error);
  EXPECT_THROW((GradualSchedule{.start = 0, .end = 10, .every = 1, .initial = -0.5, .final_sparsity = 0.5}.validate()), Error);
}

// ---- masks only shrink ------------------------------------------------------------------------------------------

TEST(PruneShrink, SuccessivePruningKeepsEveryZeroAndAddsTheSmallestLiveWeights) {
  for (const PruneScope scope : {PruneScope::global, PruneScope::per_layer}) {
    TinyModel m;
    const auto ps = m.prunable();
    const bool global = scope == PruneScope::global;
    Pruner<cpu> pr(m.params, {SparsityPattern::unstructured, 0.6, scope});
    pr.prune_to(0.2);
    const auto m1 = masks_of(pr);
    EXPECT_EQ(m1, expected_unstructured(ps, 0.2, global));
    redraw(ps, 5);  // new magnitudes: the pruned ones are now large too, yet must stay pruned
    pr.prune_to(0.6);
    const auto m2 = masks_of(pr);
    EXPECT_EQ(m2, expected_unstructured(ps, 0.6, global, &m1));
    for (std::size_t i = 0; i < m1.size(); ++i)
      for (std::size_t j = 0; j < m1[i].size(); ++j) ASSERT_TRUE(m1[i][j] == 1 || m2[i][j] == 0) << ps[i].name << " " << j;
    std::int64_t n = 0;
    for (const auto& p : ps) n += p.tensor.numel();
    if (global) EXPECT_EQ(zeros_in(m2), rounded(0.6, n));
    redraw(ps, 6);
    pr.prune_to(0.3);  // lower: nothing changes
    EXPECT_EQ(masks_of(pr), m2);
    pr.prune_to(0.6);  // same: nothing changes either (the count is reached)
    EXPECT_EQ(masks_of(pr), m2);
    pr.prune_to(0.0);
    EXPECT_EQ(masks_of(pr), m2);
  }
}

// ---- training with masks ----------------------------------------------------------------------------------------

TEST(PruneTraining, AdamWStepsKeepPrunedWeightsExactlyZeroAndTrainTheRest) {
  TinyModel m;
  const auto ps = m.prunable();
  optim::AdamW opt(optim::default_groups(m.params, 0.1f), {.lr = 1e-2f, .weight_decay = 0.1f});
  const auto idx = tg::testing::random_tokens(2, 16, 64, 1), tgt = tg::testing::random_tokens(2, 16, 64, 2);
  auto backward = [&] { cross_entropy(m.model.forward<fp32>(idx), tgt).backward(); };
  for (int i = 0; i < 2; ++i) {  // dense steps first: Adam's moments of the soon pruned weights are not zero
    backward();
    opt.step();
    opt.zero_grad();
  }
  Pruner<cpu> pr(m.params, quant::parse_prune_spec("unstructured:0.5"));
  pr.prune_to(0.5);
  EXPECT_FALSE(pr.weights_respect_masks()) << "prune_to changes only the masks";
  pr.apply_to_weights();
  EXPECT_TRUE(pr.weights_respect_masks());
  const auto masks = masks_of(pr);
  std::vector<std::vector<float>> start;
  for (const auto& p : ps) start.push_back(p.tensor.to_vector());
  const auto wte0 = m.params[0].tensor.to_vector();

  // Without apply_to_weights the momentum moves pruned weights off zero, even with masked gradients.
  backward();
  pr.apply_to_grads();
  opt.step();
  opt.zero_grad();
  EXPECT_FALSE(pr.weights_respect_masks());
  pr.apply_to_weights();
  EXPECT_TRUE(pr.weights_respect_masks());

  for (int step = 0; step < 50; ++step) {  // 50 masked AdamW steps (the test)
    backward();
    pr.apply_to_grads();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto g = ps[i].tensor.grad().to_vector();
      std::int64_t live_nonzero = 0;
      for (std::size_t j = 0; j < g.size(); ++j) {
        if (masks[i][j] == 0) ASSERT_EQ(std::bit_cast<std::uint32_t>(g[j]), 0u) << ps[i].name << " grad " << j;
        else live_nonzero += g[j] != 0.f;
      }
      EXPECT_GT(live_nonzero, 0) << ps[i].name;
    }
    opt.step();
    pr.apply_to_weights();
    opt.zero_grad();
  }
  EXPECT_TRUE(pr.weights_respect_masks());
  for (std::size_t i = 0; i < ps.size(); ++i) {
    const auto w = ps[i].tensor.to_vector();
    std::int64_t live = 0, changed = 0;
    for (std::size_t j = 0; j < w.size(); ++j) {
      if (masks[i][j] == 0) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(w[j]), 0u) << ps[i].name << " " << j << " is " << w[j];
      } else {
        ++live;
        changed += w[j] != start[i][j];
      }
    }
    EXPECT_EQ(changed, live) << ps[i].name << ": every live weight trains";
  }
  EXPECT_NE(m.params[0].tensor.to_vector(), wte0) << "wte (never pruned) trains";
  EXPECT_EQ(masks_of(pr), masks) << "training does not move the masks";
}

// ---- checkpoint masks ---------------------------------------------------------------------------------------------

TEST(PruneCheckpoint, MaskTensorsRoundTripBitForBitIntoAFreshPruner) {
  for (const char* spec : {"unstructured:0.45", "unstructured:0.3:per-layer", "2:4"}) {
    TinyModel m;
    Pruner<cpu> a(m.params, quant::parse_prune_spec(spec));
    Pruner<cpu> fresh(m.params, quant::parse_prune_spec(spec));
    fresh.load_masks(a.mask_tensors());  // all ones (saved before the first prune_to) loads too
    EXPECT_EQ(fresh.sparsity(), 0.0);
    a.prune_to(a.spec().sparsity);
    const Masks saved = a.mask_tensors();
    ASSERT_EQ(saved.size(), 8u);
    EXPECT_EQ(saved[0].first, "prune.mask.h.0.attn.c_attn.weight");
    for (const auto& [name, t] : saved) EXPECT_TRUE(name.starts_with(Pruner<cpu>::kMaskPrefix)) << name;

    TinyModel other;  // another model of the same shape (a resume), different weights
    redraw(other.prunable(), 77);
    Pruner<cpu> b(other.params, quant::parse_prune_spec(spec));
    b.load_masks(saved);
    const Masks loaded = b.mask_tensors();
    ASSERT_EQ(loaded.size(), saved.size());
    for (std::size_t i = 0; i < saved.size(); ++i) {
      EXPECT_EQ(loaded[i].first, saved[i].first);
      EXPECT_EQ(loaded[i].second.shape(), saved[i].second.shape());
      EXPECT_EQ(loaded[i].second.to_vector(), saved[i].second.to_vector()) << saved[i].first;
    }
    EXPECT_EQ(b.sparsity(), a.sparsity());
    for (std::size_t i = 0; i < saved.size(); ++i) EXPECT_EQ(b.report()[i].pruned, a.report()[i].pruned);
    b.apply_to_weights();
    EXPECT_TRUE(b.weights_respect_masks());
    const auto ps = other.prunable();
    for (std::size_t i = 0; i < ps.size(); ++i) {
      const auto w = ps[i].tensor.to_vector();
      const auto mask = saved[i].second.to_vector();
      for (std::size_t j = 0; j < w.size(); ++j) ASSERT_EQ(w[j] == 0.f, mask[j] == 0) << spec << " " << ps[i].name << " " << j;
    }
    // A loaded mask is one more set that only shrinks: pruning further keeps it.
    if (std::string(spec) != "2:4") {
      b.prune_to(0.6);
      const auto after = masks_of(b);
      for (std::size_t i = 0; i < saved.size(); ++i) {
        const auto mask = saved[i].second.to_vector();
        for (std::size_t j = 0; j < mask.size(); ++j) ASSERT_TRUE(mask[j] == 1 || after[i][j] == 0);
      }
    }
  }
}

Masks copy_masks(const Masks& ms) {
  Masks r;
  for (const auto& [name, t] : ms) r.emplace_back(name, t.clone());
  return r;
}

void expect_rejected(Pruner<cpu>& pr, const Masks& hostile, const std::string& why, const char* what) {
  const auto before = masks_of(pr);
  const double sparsity = pr.sparsity();
  try {
    pr.load_masks(hostile);
    ADD_FAILURE() << what << ": accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(why), std::string::npos) << what << ": " << e.what();
  }
  EXPECT_EQ(masks_of(pr), before) << what << ": the masks changed";
  EXPECT_EQ(pr.sparsity(), sparsity) << what;
}

TEST(PruneCheckpoint, HostileMasksAreErrorsAndChangeNothing) {
  TinyModel m;
  Pruner<cpu> src(m.params, quant::parse_prune_spec("unstructured:0.5"));
  src.prune_to(0.5);
  const Masks good = src.mask_tensors();
  TinyModel other;
  Pruner<cpu> pr(other.params, quant::parse_prune_spec("unstructured:0.5"));
  pr.prune_to(0.3);  // masks that differ from `good`, so a partial load would show
  ASSERT_NE(masks_of(pr), masks_of(src));
  pr.apply_to_weights();

  Masks missing = copy_masks(good);
  missing.erase(missing.begin() + 3);
  expect_rejected(pr, missing, "no mask for the prunable parameter 'h.0.mlp.c_proj.weight'", "missing");
  Masks extra = copy_masks(good);
  extra.emplace_back("prune.mask.wte.weight", Tensor<std::uint8_t>::ones({64, 32}));
  expect_rejected(pr, extra, "'prune.mask.wte.weight' names no prunable parameter", "extra");
  Masks repeated = copy_masks(good);
  repeated.push_back({repeated[0].first, repeated[0].second.clone()});
  expect_rejected(pr, repeated, "given more than once", "repeated");
  Masks prefix = copy_masks(good);
  prefix[1].first = "mask.h.0.attn.c_proj.weight";
  expect_rejected(pr, prefix, "is not a pruning mask", "prefix");
  Masks shape = copy_masks(good);
  shape[0].second = Tensor<std::uint8_t>::ones({32, 96});  // c_attn is [96, 32]
  expect_rejected(pr, shape, "has shape [32,96], the parameter has shape [96,32]", "wrong shape");
  Masks two = copy_masks(good);
  two[5].second.data()[17] = 2;
  expect_rejected(pr, two, "holds 2 at flat index 17", "value 2");
  Masks undefined = copy_masks(good);
  undefined[2].second = Tensor<std::uint8_t>();
  expect_rejected(pr, undefined, "undefined", "undefined");
  expect_rejected(pr, {}, "no mask for the prunable parameter 'h.0.attn.c_attn.weight'", "empty");

  pr.load_masks(good);  // and the good ones load
  EXPECT_EQ(masks_of(pr), masks_of(src));
  EXPECT_FALSE(pr.weights_respect_masks()) << "a load changes masks, not weights";
  pr.apply_to_weights();
  EXPECT_TRUE(pr.weights_respect_masks());
}

TEST(PruneCheckpoint, BrokenTwoFourMasksAreErrors) {
  TinyModel m;
  Pruner<cpu> src(m.params, quant::parse_prune_spec("2:4"));
  src.prune_to(0.5);
  const Masks good = src.mask_tensors();
  Pruner<cpu> pr(m.params, quant::parse_prune_spec("2:4"));
  pr.prune_to(0.5);
  redraw(m.prunable(), 3);

  // One group with 3 zeros: c_fc of block 1 ([128, 32]), row 2, columns 8..11.
  Masks three = copy_masks(good);
  std::uint8_t* p = three[6].second.data() + 2 * 32 + 8;
  p[0] = p[1] = p[2] = 0, p[3] = 1;
  expect_rejected(pr, three, "'prune.mask.h.1.mlp.c_fc.weight' breaks the 2:4 pattern: the group of 4 at row 2, columns 8..11", "3 zeros");
  Masks one = copy_masks(good);
  p = one[0].second.data() + 4;
  p[0] = p[1] = p[2] = 1, p[3] = 0;
  expect_rejected(pr, one, "row 0, columns 4..7", "1 zero");
  Masks dense = copy_masks(good);  // one mask all ones while the others are pruned
  dense[4].second = Tensor<std::uint8_t>::ones(dense[4].second.shape());
  expect_rejected(pr, dense, "'prune.mask.h.1.attn.c_attn.weight' breaks the 2:4 pattern", "one dense mask");
  // The same masks are fine for an unstructured pruner.
  Pruner<cpu> unstructured(m.params, quant::parse_prune_spec("unstructured:0.5"));
  EXPECT_NO_THROW(unstructured.load_masks(three));
}

}  // namespace test_prune_cpp

// The host side of pruning (include/typegrad/quant/prune.hpp): spec parsing, the gradual schedule, which
// parameters are prunable, and magnitude selection over host keys.
#include "typegrad/quant/prune.hpp"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <sstream>

namespace tg::quant {

namespace {
constexpr const char* kExpected =
    "expected unstructured:S with 0 <= S < 1, or 2:4 (unstructured:S:per-layer prunes each layer to S)";

[[noreturn]] void bad_spec(std::string_view text, const std::string& why) {
  throw Error("--prune: '", std::string(text), "': ", why, "; ", kExpected);
}

std::vector<std::string_view> split_colons(std::string_view s) {
  std::vector<std::string_view> parts;
  std::size_t start = 0;
  for (std::size_t i = 0; i <= s.size(); ++i)
    if (i == s.size() || s[i] == ':') {
      parts.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  return parts;
}
}  // namespace

PruneSpec parse_prune_spec(std::string_view text) {
  if (text == "2:4") return {SparsityPattern::two_four, 0.5, PruneScope::global};
  const std::vector<std::string_view> parts = split_colons(text);
  if (parts[0] != "unstructured") {
    if (parts[0] == "2" && parts.size() >= 2 && parts[1] == "4") bad_spec(text, "2:4 takes no sparsity or scope (it is 0.5, per group of 4)");
    bad_spec(text, text.empty() ? std::string("empty") : "unknown pattern '" + std::string(parts[0]) + "'");
  }
  if (parts.size() < 2 || parts[1].empty()) bad_spec(text, "the sparsity S is missing");
  if (parts.size() > 3) bad_spec(text, "too many fields");
  PruneSpec spec{SparsityPattern::unstructured, 0.0, PruneScope::global};
  const std::string_view s = parts[1];
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), spec.sparsity);
  if (ec != std::errc() || end != s.data() + s.size() || !std::isfinite(spec.sparsity))
    bad_spec(text, "sparsity '" + std::string(s) + "' is not a number");
  if (!(spec.sparsity >= 0.0 && spec.sparsity < 1.0)) bad_spec(text, "sparsity " + std::string(s) + " is outside [0, 1)");
  if (parts.size() == 3) {
    if (parts[2] == "per-layer") spec.scope = PruneScope::per_layer;
    else if (parts[2] == "global") spec.scope = PruneScope::global;
    else bad_spec(text, "unknown scope '" + std::string(parts[2]) + "' (per-layer or global)");
  }
  return spec;
}

std::string to_string(const PruneSpec& spec) {
  if (spec.pattern == SparsityPattern::two_four) return "2:4";
  std::ostringstream os;
  os << "unstructured:" << spec.sparsity;
  if (spec.scope == PruneScope::per_layer) os << ":per-layer";
  return os.str();
}

void validate(const PruneSpec& spec) {
  if (spec.pattern == SparsityPattern::two_four)
    TG_CHECK(spec.sparsity == 0.5, "PruneSpec: 2:4 sparsity is 0.5, got ", spec.sparsity);
  else
    TG_CHECK(spec.sparsity >= 0.0 && spec.sparsity < 1.0, "PruneSpec: unstructured sparsity must be in [0, 1), got ", spec.sparsity);
}

double GradualSchedule::sparsity_at(std::int64_t step) const {
  // The ends exactly (the formula's fp64 rounding would give s_f + (s_i − s_f) ≠ s_i at t0); t1 first, so a
  // schedule with t1 == t0 is s_f from t0 on.
  if (step >= end) return final_sparsity;
  if (step <= start) return initial;
  // t0 < t < t1 here.
  const double r = 1.0 - static_cast<double>(step - start) / static_cast<double>(end - start);
  return final_sparsity + (initial - final_sparsity) * r * r * r;
}

bool GradualSchedule::updates_at(std::int64_t step) const {
  TG_CHECK(every >= 1, "GradualSchedule: every must be >= 1, got ", every);
  if (step < start || step > end) return false;
  return (step - start) % every == 0 || step == end;
}

void GradualSchedule::validate() const {
  TG_CHECK(start <= end, "GradualSchedule: start ", start, " is after end ", end);
  TG_CHECK(every >= 1, "GradualSchedule: every must be >= 1, got ", every);
  TG_CHECK(initial >= 0.0 && initial < 1.0, "GradualSchedule: the initial sparsity must be in [0, 1), got ", initial);
  TG_CHECK(final_sparsity >= 0.0 && final_sparsity < 1.0, "GradualSchedule: the final sparsity must be in [0, 1), got ",
           final_sparsity);
}

bool is_prunable(const std::string& name, const Shape& shape) {
  if (shape.size() != 2) return false;
  const std::vector<std::string_view> parts = optim::detail::split_dots(name);
  // h . <i> . <module...> . weight: at least one module component between the block index and "weight".
  if (parts.size() < 4 || parts[0] != "h" || parts.back() != "weight") return false;
  if (parts[1].empty() || !std::all_of(parts[1].begin(), parts[1].end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  for (std::string_view c : parts)
    if (c.starts_with("ln") || c == "wte" || c == "wpe" || c.empty()) return false;
  return true;
}

namespace detail {

void prune_smallest(std::span<const float> keys, std::int64_t k, std::span<std::uint8_t> keep) {
  const auto n = static_cast<std::int64_t>(keys.size());
  TG_CHECK(keep.size() == keys.size(), "prune_smallest: ", keys.size(), " keys for ", keep.size(), " mask entries");
  TG_CHECK(k >= 0 && k <= n, "prune_smallest: cannot prune ", k, " of ", n);
  if (k == 0) return;
  std::vector<float> scratch(keys.begin(), keys.end());
  std::nth_element(scratch.begin(), scratch.begin() + (k - 1), scratch.end());
  const float tau = scratch[static_cast<std::size_t>(k - 1)];  // the k-th smallest key
  std::int64_t below = 0;
  for (float x : keys) below += x < tau;
  // The order (key, index) puts every key < τ first, then the keys == τ by index: take k − below of those.
  std::int64_t ties = k - below;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] < tau) keep[i] = 0;
    else if (keys[i] == tau && ties > 0) {
      keep[i] = 0;
      --ties;
    }
  }
}

void prune_two_four(std::span<const float> keys, std::span<std::uint8_t> keep) {
  TG_CHECK(keep.size() == keys.size() && keys.size() % 4 == 0, "prune_two_four: ", keys.size(), " keys for ", keep.size(),
           " mask entries (a multiple of 4 each)");
  for (std::size_t g = 0; g < keys.size(); g += 4) {
    if ((keep[g] == 0) + (keep[g + 1] == 0) + (keep[g + 2] == 0) + (keep[g + 3] == 0) >= 2) continue;
    std::array<int, 4> order{0, 1, 2, 3};
    // Stable by index on equal keys (a pruned weight's key −1 sorts first, so it stays pruned).
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return keys[g + a] < keys[g + b]; });
    keep[g + order[0]] = 0;
    keep[g + order[1]] = 0;
  }
}

std::int64_t first_bad_two_four_group(std::span<const std::uint8_t> keep, bool allow_dense) {
  for (std::size_t g = 0; g + 4 <= keep.size(); g += 4) {
    const int zeros = (keep[g] == 0) + (keep[g + 1] == 0) + (keep[g + 2] == 0) + (keep[g + 3] == 0);
    if (zeros != 2 && !(allow_dense && zeros == 0)) return static_cast<std::int64_t>(g);
  }
  return -1;
}

}  // namespace detail
}  // namespace tg::quant

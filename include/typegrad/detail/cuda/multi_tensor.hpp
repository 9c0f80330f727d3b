// How a multi-tensor launch cuts its tensors into chunks, and how per-chunk partial sums become per-tensor
// sums, in plain C++ (no CUDA headers) so the CPU tests check it. Private to the backend (backends/cuda/
// optim.cu); tests/cuda/test_cuda_optim.cpp.
//   const auto chunks = chunk_table(count, sizes);              // block b of the launch handles chunks[b]
//   const auto sums = sum_by_tensor<2>(chunks, partials, count);  // partials[b * 2 + j] -> sums[t][j]
//   const auto starts = prefix_starts(count, rows);             // rows of every tensor, numbered in one range
//   const int t = owner_of(starts.data(), count, global_row);   // which tensor global_row belongs to
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

#include "typegrad/detail/macros.hpp"

namespace tg::backend::cuda::detail {

/// Elements per chunk: one block's share of a multi-tensor launch.
constexpr std::int64_t kChunk = std::int64_t{1} << 16;

/// Chunk b of a launch: elements [start, min(start + kChunk, n)) of tensor `tensor`.
struct Chunk {
  std::int32_t tensor;
  std::int64_t start;
};

/// Every tensor's chunks in tensor order, then start order (an empty tensor has none).
inline std::vector<Chunk> chunk_table(int count, const std::int64_t* sizes) {
  std::vector<Chunk> out;
  for (int t = 0; t < count; ++t)
    for (std::int64_t s = 0; s < sizes[t]; s += kChunk) out.push_back({t, s});
  return out;
}

/// K fp64 partial sums per chunk (partials[b * K + j]) added per tensor in chunk order: a fixed order, so
/// the sums are deterministic. A tensor without chunks sums to 0.
template <int K>
std::vector<std::array<double, K>> sum_by_tensor(const std::vector<Chunk>& chunks, const double* partials, int count) {
  std::vector<std::array<double, K>> out(static_cast<std::size_t>(count < 0 ? 0 : count), std::array<double, K>{});
  for (std::size_t b = 0; b < chunks.size(); ++b)
    for (int j = 0; j < K; ++j) out[static_cast<std::size_t>(chunks[b].tensor)][j] += partials[b * K + j];
  return out;
}

/// Where each tensor's chunks begin: tensor t owns chunks [first[t], first[t + 1]) (count + 1 entries; a
/// tensor without chunks owns an empty range). chunk_table lists each tensor's chunks together, in order.
inline std::vector<std::int64_t> chunk_firsts(const std::vector<Chunk>& chunks, int count) {
  const auto n = static_cast<std::int64_t>(chunks.size());
  std::vector<std::int64_t> first(static_cast<std::size_t>(count < 0 ? 0 : count) + 1, n);
  for (std::int64_t b = n - 1; b >= 0; --b) first[static_cast<std::size_t>(chunks[static_cast<std::size_t>(b)].tensor)] = b;
  for (int t = count - 1; t >= 0; --t)
    first[static_cast<std::size_t>(t)] = std::min(first[static_cast<std::size_t>(t)], first[static_cast<std::size_t>(t) + 1]);
  return first;
}

/// Numbers the items of `count` tensors (sizes[t] each: rows, columns ...) in one range: tensor t owns
/// [starts[t], starts[t + 1]); starts has count + 1 entries, starts[count] is the total.
inline std::vector<std::int64_t> prefix_starts(int count, const std::int64_t* sizes) {
  std::vector<std::int64_t> starts(static_cast<std::size_t>(count < 0 ? 0 : count) + 1, 0);
  for (int t = 0; t < count; ++t) starts[static_cast<std::size_t>(t) + 1] = starts[static_cast<std::size_t>(t)] + sizes[t];
  return starts;
}

/// The tensor that owns item i of a prefix_starts range (0 <= i < starts[count]): the last t with
/// starts[t] <= i, skipping tensors without items. Binary search; runs on the host and the device.
TG_HOST_DEVICE inline int owner_of(const std::int64_t* starts, int count, std::int64_t i) {
  int lo = 0, hi = count - 1;  // invariant: the owner is in [lo, hi]
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace tg::backend::cuda::detail

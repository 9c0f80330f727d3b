// Validation of a language model: mean cross-entropy per token over a split's first batches, and the same
// loss in bits per byte of text, which compares runs with different tokenizers.
//   const std::vector<std::int32_t> bytes = tok.token_byte_lengths();
//   const tg::train::Evaluation e = tg::train::evaluate(model, ds, 16, 64, 8, bytes);   // e.loss, e.bits_per_byte
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "typegrad/data/dataset.hpp"
#include "typegrad/data/sampler.hpp"
#include "typegrad/ops/cross_entropy.hpp"

namespace tg::train {

/// A validation result: the mean cross-entropy per token (nats) and the same loss per byte of text, in bits.
struct Evaluation {
  double loss = 0;
  double bits_per_byte = 0;
};

/// Mean cross-entropy over the first `batches` sequential (batch x seq) windows of `ds`'s validation split,
/// with the fp32 forward and no tape, and bits per byte: the batches' summed loss over ln 2 times the bytes
/// their target tokens decode to (`token_bytes[id]`, from the tokenizer's token_byte_lengths()); a
/// byte-level run's bits per byte is its loss / ln 2.
template <class Model>
Evaluation evaluate(const Model& model, const data::TextDataset& ds, std::int64_t batch, std::int64_t seq, std::int64_t batches,
                    const std::vector<std::int32_t>& token_bytes) {
  NoGrad no_grad;
  auto sampler = data::BatchSampler::sequential(ds.validation(), batch, seq);
  const std::int64_t n = std::max<std::int64_t>(1, std::min(batches, sampler.num_batches()));
  double total = 0, nats = 0, bytes = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    const auto b = sampler.next();
    const double mean = static_cast<double>(cross_entropy(model.template forward<fp32>(b.inputs), b.targets).item());
    total += mean;
    nats += mean * static_cast<double>(b.targets.numel());
    for (std::int64_t k = 0; k < b.targets.numel(); ++k) {
      const std::int64_t id = b.targets.data()[k];
      TG_CHECK(id >= 0 && id < static_cast<std::int64_t>(token_bytes.size()), "evaluate: token id ", id,
               " has no byte length (token_bytes holds ", token_bytes.size(), ")");
      bytes += token_bytes[static_cast<std::size_t>(id)];
    }
  }
  return {total / static_cast<double>(n), bytes > 0 ? nats / (std::log(2.0) * bytes) : 0.0};
}

}  // namespace tg::train

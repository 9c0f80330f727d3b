// Op database entries for the communication ops of tensor parallelism (dist/tensor_parallel.hpp, Note
// [tensor parallelism]), over a single-process group: copy_to_group and reduce_from_group are then identities
// forward and backward, and so are gather_from_sequence and reduce_scatter_to_sequence (Note [sequence
// parallelism]); vocab_parallel_cross_entropy is the mean cross-entropy of the full logits. Their behaviour
// over several ranks is tested under MPI (tests/dist/test_tensor_parallel.cpp). sequence_parallel_dropout
// needs no group: its samples take slices of longer sequences, against the dropout rule written out.
//
// Tolerances: the defaults (the identities are exact; the cross-entropy is fp64 math on the host with one
// rounding of the loss and of each gradient element).
#include <gtest/gtest.h>

#include <cmath>

#include <typegrad/dist/tensor_parallel.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

/// A group of one process whose buffers live on `device` (kept alive for the backward's all-reduce).
dist::Communicator& alone(DeviceKind device) {
  static dist::SingleProcess host(DeviceKind::cpu), gpu(DeviceKind::cuda);
  return device == DeviceKind::cpu ? static_cast<dist::Communicator&>(host) : static_cast<dist::Communicator&>(gpu);
}

OpEntry copy_to_group_entry() {
  OpEntry e = make_entry("copy_to_group", [](const auto& x, const I&, const Sample&) { return dist::copy_to_group(x[0], alone(x[0].device())); });
  e.sample("matrix", {{{4, 6}}}).sample("rank3", {{{2, 3, 5}}}).sample("transposed", {{{5, 4}, L::transposed}}).sample("vector", {{{7}}});
  e.reference([](const X& x, const I&, const Sample&) { return x[0].clone(); });
  return e;
}
TG_REGISTER_OP(copy_to_group_entry());

OpEntry reduce_from_group_entry() {
  OpEntry e = make_entry("reduce_from_group", [](const auto& x, const I&, const Sample&) { return dist::reduce_from_group(x[0], alone(x[0].device())); });
  e.sample("matrix", {{{4, 6}}}).sample("rank3", {{{2, 3, 5}}}).sample("strided", {{{3, 4}, L::strided}}).sample("vector", {{{7}}});
  e.reference([](const X& x, const I&, const Sample&) { return x[0].clone(); });
  return e;
}
TG_REGISTER_OP(reduce_from_group_entry());

OpEntry gather_from_sequence_entry() {
  OpEntry e = make_entry("gather_from_sequence", [](const auto& x, const I&, const Sample&) { return dist::gather_from_sequence(x[0], alone(x[0].device())); });
  e.sample("matrix", {{{4, 6}}}).sample("rank3", {{{2, 3, 5}}}).sample("transposed", {{{3, 5, 4}, L::transposed}}).sample("strided", {{{2, 4, 3}, L::strided}});
  e.reference([](const X& x, const I&, const Sample&) { return x[0].clone(); });
  e.error("rank", [] { dist::gather_from_sequence(Tensor<float>::zeros({5}), alone(DeviceKind::cpu)); },
          "gather_from_sequence: a (B, T, ...) tensor is split along its sequence (dim 1), got");
  return e;
}
TG_REGISTER_OP(gather_from_sequence_entry());

OpEntry reduce_scatter_to_sequence_entry() {
  OpEntry e = make_entry("reduce_scatter_to_sequence",
                         [](const auto& x, const I&, const Sample&) { return dist::reduce_scatter_to_sequence(x[0], alone(x[0].device())); });
  e.sample("matrix", {{{4, 6}}}).sample("rank3", {{{2, 3, 5}}}).sample("transposed", {{{3, 5, 4}, L::transposed}}).sample("strided", {{{2, 4, 3}, L::strided}});
  e.reference([](const X& x, const I&, const Sample&) { return x[0].clone(); });
  e.error("rank", [] { dist::reduce_scatter_to_sequence(Tensor<float>::zeros({5}), alone(DeviceKind::cpu)); },
          "reduce_scatter_to_sequence: a (B, T, ...) tensor is split along its sequence (dim 1), got");
  return e;
}
TG_REGISTER_OP(reduce_scatter_to_sequence_entry());

// ---- sequence_parallel_dropout: args = {p, seed, offset, training, full_length, t0} ----------------
OpEntry sequence_parallel_dropout_entry() {
  OpEntry e = make_entry("sequence_parallel_dropout", [](const auto& x, const I&, const Sample& s) {
    Generator gen;
    gen.set_state(static_cast<std::uint64_t>(s.args[1]), static_cast<std::uint64_t>(s.args[2]));
    return dist::sequence_parallel_dropout(x[0], s.args[0], gen, s.args[3] != 0, static_cast<std::int64_t>(s.args[4]),
                                           static_cast<std::int64_t>(s.args[5]));
  });
  e.sample("whole_sequence", {{{3, 4, 5}}}, {}, {0.5, 42, 0, 1, 4, 0})
      .sample("middle_slice", {{{2, 3, 6}}}, {}, {0.3, 7, 100, 1, 9, 3})
      .sample("last_slice_transposed", {{{2, 4, 5}, L::transposed}}, {}, {0.2, 11, 5, 1, 8, 4})
      .sample("first_slice_strided", {{{3, 2, 4}, L::strided}}, {}, {0.6, 5, 1ull << 33, 1, 6, 0})
      .sample("matrix_slice", {{{4, 3}}}, {}, {0.5, 3, 0, 1, 7, 2})
      .sample("eval_identity", {{{2, 3, 4}}}, {}, {0.5, 1, 0, 0, 6, 3});
  e.reference([](const X& x, const I&, const Sample& s) {
    const double p = s.args[0];
    const auto seed = static_cast<std::uint64_t>(s.args[1]), offset = static_cast<std::uint64_t>(s.args[2]);
    const auto full = static_cast<std::int64_t>(s.args[4]), t0 = static_cast<std::int64_t>(s.args[5]);
    const bool active = s.args[3] != 0 && p != 0.0;
    const std::vector<double> v = values(x[0]);
    const std::int64_t B = x[0].shape()[0], Tl = x[0].shape()[1], inner = x[0].numel() / (B * Tl);
    Tensor<double> out = Tensor<double>::empty(x[0].shape());
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = 0; t < Tl; ++t)
        for (std::int64_t j = 0; j < inner; ++j) {
          const std::size_t i = static_cast<std::size_t>((b * Tl + t) * inner + j);
          // element (b, t0 + t, j) of the full (B, full, inner) tensor: the dropout rule of db_elementwise.cpp (the
          // mask at word 4·offset, word (4·offset + e) % 4 of counter (4·offset + e) / 4 for element e)
          const std::uint64_t at = 4 * offset + static_cast<std::uint64_t>((b * full + t0 + t) * inner + j);
          const double u = static_cast<double>(tg::detail::philox_words(seed, at / 4)[at % 4] >> 8) / 16777216.0;
          const bool keep = u >= static_cast<double>(static_cast<float>(p));
          out.data()[i] = !active ? v[i] : keep ? v[i] / (1.0 - p) : 0.0;
        }
    return out;
  });
  e.error("outside", [] { Generator g; dist::sequence_parallel_dropout(Tensor<float>::zeros({2, 3, 4}), 0.5, g, true, 4, 2); },
          "sequence_parallel_dropout: positions [2, 5) are outside a sequence of 4");
  return e;
}
TG_REGISTER_OP(sequence_parallel_dropout_entry());

OpEntry vocab_parallel_cross_entropy_entry() {
  OpEntry e = make_entry("vocab_parallel_cross_entropy", [](const auto& x, const I& idx, const Sample&) {
    return dist::vocab_parallel_cross_entropy(x[0], idx[0], alone(x[0].device()), 0, x[0].size(-1));
  });
  e.sample("rows", {{{5, 7}}}, {{{5}, 0, 7}})
      .sample("rank3", {{{2, 3, 9}, -3.0, 3.0}}, {{{2, 3}, 0, 9}})
      .sample("transposed", {{{6, 5}, L::transposed}}, {{{6}, 0, 5}})
      .sample("one_class", {{{4, 1}}}, {{{4}, 0, 1}});
  e.reference([](const X& x, const I& idx, const Sample&) {
    const std::int64_t V = x[0].shape()[x[0].dim() - 1], rows = x[0].numel() / V;
    double total = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const double* row = x[0].data() + r * V;
      double m = -INFINITY, s = 0;
      for (std::int64_t j = 0; j < V; ++j) m = std::max(m, row[j]);
      for (std::int64_t j = 0; j < V; ++j) s += std::exp(row[j] - m);
      total += m + std::log(s) - row[idx[0].data()[r]];
    }
    return Tensor<double>::full(Shape(), total / static_cast<double>(rows));
  });
  e.error("target", [] { dist::vocab_parallel_cross_entropy(Tensor<float>::zeros({2, 3}), Tensor<std::int64_t>::full({2}, 3), alone(DeviceKind::cpu), 0, 3); },
          "vocab_parallel_cross_entropy: target 3 is outside the vocabulary of 3");
  e.error("rows", [] { dist::vocab_parallel_cross_entropy(Tensor<float>::zeros({2, 3}), Tensor<std::int64_t>::zeros({3}), alone(DeviceKind::cpu), 0, 3); },
          "vocab_parallel_cross_entropy: 2 rows of logits, 3 targets");
  return e;
}
TG_REGISTER_OP(vocab_parallel_cross_entropy_entry());

}  // namespace
}  // namespace tg::testing

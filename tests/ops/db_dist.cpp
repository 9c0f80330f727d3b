// Op database entries for the communication ops of tensor parallelism (dist/tensor_parallel.hpp, Note
// [tensor parallelism]), over a single-process group: copy_to_group and reduce_from_group are then identities
// forward and backward, and vocab_parallel_cross_entropy is the mean cross-entropy of the full logits. Their
// behaviour over several ranks is tested under MPI (tests/dist/test_tensor_parallel.cpp).
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

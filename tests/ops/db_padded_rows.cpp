// Op database entry for padded_rows (ops/padded_rows.hpp, Note [padded vocabulary]): a matrix widened with zero
// rows; its gradient is the first rows of the upstream one. The samples take the copying path (a fresh input's
// storage holds its own rows only); the view over a padded parameter's storage is tested in tests/nn/test_gpt.cpp.
//
// Tolerances: the defaults (a copy and a narrow: exact).
#include <gtest/gtest.h>

#include <typegrad/ops/padded_rows.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

// args = {rows}
OpEntry padded_rows_entry() {
  OpEntry e = make_entry("padded_rows", [](const auto& x, const I&, const Sample& s) {
    return tg::padded_rows(x[0], static_cast<std::int64_t>(s.args[0]), /*storage_tail_is_zero=*/true);
  });
  e.sample("vocabulary", {{{5, 4}}}, {}, {8})
      .sample("no_padding", {{{3, 6}}}, {}, {3})
      .sample("transposed", {{{4, 5}, L::transposed}}, {}, {7})
      .sample("strided", {{{6, 3}, L::strided}}, {}, {128})
      .sample("one_row", {{{1, 9}}}, {}, {2});
  e.reference([](const X& x, const I&, const Sample& s) {
    const std::int64_t R = x[0].shape()[0], C = x[0].shape()[1], rows = static_cast<std::int64_t>(s.args[0]);
    const std::vector<double> v = values(x[0]);
    Tensor<double> out = Tensor<double>::zeros({rows, C});
    for (std::int64_t i = 0; i < R * C; ++i) out.data()[i] = v[static_cast<std::size_t>(i)];
    return out;
  });
  e.error("fewer_rows", [] { tg::padded_rows(Tensor<float>::zeros({4, 2}), 3); }, "padded_rows: 3 rows cannot hold the matrix's 4");
  e.error("vector", [] { tg::padded_rows(Tensor<float>::zeros({4}), 8); }, "padded_rows: w must be a matrix, got");
  return e;
}
TG_REGISTER_OP(padded_rows_entry());

}  // namespace
}  // namespace tg::testing

// Op database entry for dropout_add (ops/dropout_add.hpp, Note [fused dropout and residual add]):
// out = x + dropout(branch, p) with dropout's mask. args = {p, seed, offset, training}. The behaviour tests
// check that it is `add(x, dropout(branch))` bit for bit (values, both gradients, the generator's state).
//
// Tolerances: the defaults (a scaled value rounded to T, then added and rounded again).
#include <gtest/gtest.h>

#include <cstring>

#include <typegrad/ops/dropout_add.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

OpEntry dropout_add_entry() {
  OpEntry e = make_entry("dropout_add", [](const auto& x, const I&, const Sample& s) {
    Generator gen(static_cast<std::uint64_t>(s.args[1]));
    gen.set_state(static_cast<std::uint64_t>(s.args[1]), static_cast<std::uint64_t>(s.args[2]));
    return tg::dropout_add(x[0], x[1], s.args[0], gen, s.args[3] != 0);
  });
  e.sample("half", {{{5, 7}}, {{5, 7}}}, {}, {0.5, 42, 0, 1})
      .sample("low_p_transposed", {{{6, 5}}, {{6, 5}, L::transposed}}, {}, {0.1, 7, 1000, 1})
      .sample("high_p_strided", {{{3, 4, 5}, L::strided}, {{3, 4, 5}}}, {}, {0.9, 99, 5, 1})
      .sample("offset_above_2_32", {{{1, 9, 1}}, {{1, 9, 1}}}, {}, {0.3, 3, 1ull << 33, 1})
      .sample("parallel", {{{67, 503}}, {{67, 503}}}, {}, {0.25, 2024, 17, 1})  // > 2^15 elements: OpenMP pieces
      .sample("eval_is_add", {{{4, 6}}, {{4, 6}}}, {}, {0.5, 1, 0, 0})
      .sample("p_zero_is_add", {{{4, 6}}, {{4, 6}, L::transposed}}, {}, {0.0, 1, 0, 1});
  e.reference([](const X& x, const I&, const Sample& s) {
    const double p = s.args[0];
    const auto seed = static_cast<std::uint64_t>(s.args[1]), offset = static_cast<std::uint64_t>(s.args[2]);
    const bool active = s.args[3] != 0 && p != 0.0;
    const std::vector<double> a = values(x[0]), b = values(x[1]);
    Tensor<double> out = Tensor<double>::empty(x[0].shape());
    for (std::size_t i = 0; i < a.size(); ++i) {
      // dropout's documented rule: the mask starts at word 4·offset (the generator's counter); element i reads word
      // (4·offset + i) % 4 of counter (4·offset + i) / 4, 24 random bits of it as u in [0,1); keep iff u >= p (p in fp32)
      const std::uint64_t word = 4 * offset + i;
      const std::uint32_t w = tg::detail::philox_words(seed, word / 4)[word % 4];
      const double u = static_cast<double>(w >> 8) / 16777216.0;
      const bool keep = u >= static_cast<double>(static_cast<float>(p));
      out.data()[i] = a[i] + (!active ? b[i] : keep ? b[i] / (1.0 - p) : 0.0);
    }
    return out;
  });
  e.error("shapes", [] { Generator g(1); tg::dropout_add(Tensor<float>::zeros({4, 6}), Tensor<float>::zeros({1, 6}), 0.1, g); },
          "dropout_add: x [4,6] and branch [1,6] must have the same shape");
  e.error("p", [] { Generator g(1); tg::dropout_add(Tensor<float>::zeros({4}), Tensor<float>::zeros({4}), 1.0, g); },
          "dropout_add: p must be in [0, 1), got 1");
  return e;
}
TG_REGISTER_OP(dropout_add_entry());

template <class T>
void check_against_unfused(std::int64_t rows, std::int64_t n, double p) {
  Generator init(3);
  const Tensor<float> x0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, init), r0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, init);
  const Tensor<float> u0 = Tensor<float>::normal({rows, n}, 0.f, 1.f, init);
  Tensor<T> xf = leaf_as<T>(x0), rf = leaf_as<T>(r0), xu = leaf_as<T>(x0), ru = leaf_as<T>(r0);
  Generator gf(11), gu(11);
  gf.advance(5);
  gu.advance(5);
  const Tensor<T> f = tg::dropout_add(xf, rf, p, gf), g = tg::add(xu, tg::dropout(ru, p, gu));
  EXPECT_TRUE(same_bits(f, g)) << "output";
  EXPECT_EQ(gf.offset(), gu.offset()) << "the generator advances as dropout's";
  const Tensor<T> u = u0.to<T>();
  (f * u).backward(u);
  (g * u).backward(u);
  EXPECT_TRUE(same_bits(xf.grad(), xu.grad())) << "dx";
  EXPECT_TRUE(same_bits(rf.grad(), ru.grad())) << "dbranch";
}

TEST(OpDb_dropout_add_behaviour, EqualsAddOfDropoutBitForBit) {
  check_against_unfused<fp32>(7, 33, 0.1);
  check_against_unfused<fp32>(64, 768, 0.2);  // the OpenMP path
  check_against_unfused<bf16>(7, 33, 0.1);
  check_against_unfused<bf16>(64, 768, 0.5);
  check_against_unfused<fp64>(3, 10, 0.3);
}

// One node when active; an "add" node and no draw when inactive.
TEST(OpDb_dropout_add_behaviour, OneNodeAndNoDrawWhenInactive) {
  Tensor<float> x = Tensor<float>::ones({2, 4}), r = Tensor<float>::ones({2, 4});
  x.requires_grad_();
  Generator g(5);
  const std::uint64_t off0 = g.offset();
  const std::size_t nodes0 = autodiff::current_tape().live_nodes().size();
  const Tensor<float> a = tg::dropout_add(x, r, 0.3, g);
  EXPECT_EQ(autodiff::current_tape().live_nodes().size(), nodes0 + 1);
  EXPECT_EQ(g.offset(), off0 + 2);  // 8 elements: 2 counters of 4 words
  const Tensor<float> b = tg::dropout_add(x, r, 0.3, g, /*training=*/false);
  EXPECT_EQ(g.offset(), off0 + 2);  // 8 elements: 2 counters of 4 words
  for (float v : b.to_vector()) EXPECT_EQ(v, 2.f);
}

}  // namespace
}  // namespace tg::testing

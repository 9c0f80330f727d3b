// Op database entry for causal_attention_qkv (ops/attention.hpp): causal attention of the heads packed in a
// fused QKV projection's (B,T,3C) output, written as (B,T,C). args = {n_head}. The reference splits the heads
// and runs the fp64 loops; the behaviour test checks the op equals splitting into contiguous heads,
// causal_attention and merging back, bit for bit on the CPU (forward and dqkv), in fp32 and bf16.
//
// Tolerances: the defaults (the fused attention's: fp32 math, one rounding per output and gradient).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include <typegrad/ops/attention.hpp>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

OpEntry attention_qkv_entry() {
  OpEntry e = make_entry("causal_attention_qkv", [](const auto& x, const I&, const Sample& s) {
    return tg::causal_attention_qkv(x[0], static_cast<std::int64_t>(s.args[0]));
  });
  e.sample("two_heads", {{{1, 5, 12}}}, {}, {2})              // C = 4, hs = 2
      .sample("one_token", {{{2, 1, 12}}}, {}, {1})
      .sample("strided", {{{2, 7, 24}, L::strided}}, {}, {4})  // hs = 2
      .sample("two_blocks", {{{1, 70, 48}}}, {}, {2});         // T > the CPU kernel's 64-row block, hs = 8
  e.reference([](const X& x, const I&, const Sample& s) {
    const std::int64_t B = x[0].shape()[0], Tn = x[0].shape()[1], C = x[0].shape()[2] / 3;
    const auto H = static_cast<std::int64_t>(s.args[0]);
    const std::int64_t hs = C / H;
    const std::vector<double> v = values(x[0]);
    const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
    Tensor<double> out = Tensor<double>::zeros({B, Tn, C});
    auto at = [&](std::int64_t b, std::int64_t t, std::int64_t part, std::int64_t h, std::int64_t c) {
      return v[static_cast<std::size_t>(((b * Tn + t) * 3 + part) * C + h * hs + c)];
    };
    std::vector<double> p(static_cast<std::size_t>(Tn));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t i = 0; i < Tn; ++i) {
          double m = -INFINITY, l = 0;
          for (std::int64_t j = 0; j <= i; ++j) {
            double d = 0;
            for (std::int64_t c = 0; c < hs; ++c) d += at(b, i, 0, h, c) * at(b, j, 1, h, c);
            p[static_cast<std::size_t>(j)] = d * scale;
            m = std::max(m, d * scale);
          }
          for (std::int64_t j = 0; j <= i; ++j) l += (p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - m));
          for (std::int64_t j = 0; j <= i; ++j)
            for (std::int64_t c = 0; c < hs; ++c)
              out.data()[(b * Tn + i) * C + h * hs + c] += p[static_cast<std::size_t>(j)] / l * at(b, j, 2, h, c);
        }
    return out;
  });
  e.error("rank", [] { tg::causal_attention_qkv(Tensor<float>::zeros({5, 12}), 2); },
          "causal_attention_qkv: qkv must be (B,T,3C), got [5,12]");
  e.error("heads", [] { tg::causal_attention_qkv(Tensor<float>::zeros({1, 5, 12}), 3); },
          "causal_attention_qkv: the last dim of qkv [1,5,12] must be 3·n_head·head_size with n_head = 3");
  e.error("n_head", [] { tg::causal_attention_qkv(Tensor<float>::zeros({1, 5, 12}), 0); },
          "causal_attention_qkv: n_head must be >= 1, got 0");
  return e;
}
TG_REGISTER_OP(attention_qkv_entry());

template <class T>
void check_against_split_heads(std::int64_t B, std::int64_t Tn, std::int64_t H, std::int64_t hs) {
  const std::int64_t C = H * hs;
  Generator gen(3);
  const Tensor<float> x0 = Tensor<float>::normal({B, Tn, 3 * C}, 0.f, 1.f, gen), u0 = Tensor<float>::normal({B, Tn, C}, 0.f, 1.f, gen);
  Tensor<T> xf = leaf_as<T>(x0), xs = leaf_as<T>(x0);
  const Tensor<T> yf = tg::causal_attention_qkv(xf, H);
  auto heads = [&](std::int64_t part) { return xs.narrow(2, part * C, C).reshape({B, Tn, H, hs}).transpose(1, 2).contiguous(); };
  const Tensor<T> ys = tg::causal_attention(heads(0), heads(1), heads(2)).transpose(1, 2).reshape({B, Tn, C});
  EXPECT_TRUE(same_bits(yf, ys)) << "output";
  const Tensor<T> u = u0.to<T>();
  yf.backward(u);
  ys.backward(u);
  EXPECT_TRUE(same_bits(xf.grad(), xs.grad())) << "dqkv";
}

TEST(OpDb_causal_attention_qkv_behaviour, EqualsSplitHeadsBitForBit) {
  check_against_split_heads<fp32>(2, 17, 3, 8);
  check_against_split_heads<fp32>(2, 64, 12, 64);  // GPT-2's heads, the OpenMP paths
  check_against_split_heads<bf16>(2, 17, 3, 8);
  check_against_split_heads<bf16>(1, 70, 4, 16);
}

}  // namespace
}  // namespace tg::testing

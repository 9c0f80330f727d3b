// Op database entries for the nn ops: matmul, linear, linear_gelu_tanh, softmax, log_softmax, layernorm, rmsnorm, embedding,
// cross_entropy, causal_attention (fused) and attention_composite; plus a test that the fused attention
// matches its composite. References are plain fp64 loops over the contiguous inputs.
//
// Tolerances: inputs are rounded to the precision under test before the reference sees them, so the
// remaining error is accumulation (fp32 everywhere) and the rounding of outputs and intermediates. A 16-bit
// GEMM or softmax output is rounded once: bf16 keeps 8 significant bits (relative step 2^-8 ≈ 3.9e-3),
// fp16 11 (4.9e-4). Ops that chain several rounded intermediates (attention_composite rounds the scores,
// the probabilities and the output) get the looser tolerances noted at their entries.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "ops/op_db.hpp"

namespace tg::testing {
namespace {
using L = InputSpec::Layout;
using X = std::vector<Tensor<double>>;
using I = std::vector<Tensor<std::int64_t>>;

// ---- matmul ------------------------------------------------------------------------------------------
/// torch.matmul over contiguous fp64 inputs, written as loops.
Tensor<double> ref_matmul(const Tensor<double>& a, const Tensor<double>& b) {
  Shape sa = a.shape(), sb = b.shape();
  if (a.dim() == 1) sa = {1, sa[0]};
  if (b.dim() == 1) sb = {sb[0], 1};
  const std::int64_t M = sa[sa.size() - 2], K = sa[sa.size() - 1], N = sb[sb.size() - 1];
  Shape ba, bb;
  for (int i = 0; i + 2 < sa.size(); ++i) ba.push_back(sa[i]);
  for (int i = 0; i + 2 < sb.size(); ++i) bb.push_back(sb[i]);
  const Shape batch = broadcast_shapes(ba, bb, "ref");
  Shape full = batch;
  full.push_back(M);
  full.push_back(N);
  const Tensor<double> a3 = a.as_strided_raw([&] { Shape s = ba; s.push_back(M); s.push_back(K); return s; }(),
                                             contiguous_strides([&] { Shape s = ba; s.push_back(M); s.push_back(K); return s; }()), 0);
  const Tensor<double> b3 = b.as_strided_raw([&] { Shape s = bb; s.push_back(K); s.push_back(N); return s; }(),
                                             contiguous_strides([&] { Shape s = bb; s.push_back(K); s.push_back(N); return s; }()), 0);
  Tensor<double> out = tabulate(full, [&](const auto& i) {
    double acc = 0;
    auto ia = i, ib = i;
    for (std::int64_t k = 0; k < K; ++k) {
      ia[ia.size() - 1] = k;
      ib[ib.size() - 2] = k;
      acc += at_broadcast(a3, ia) * at_broadcast(b3, ib);
    }
    return acc;
  });
  Shape os = batch;
  if (a.dim() > 1) os.push_back(M);
  if (b.dim() > 1) os.push_back(N);
  return out.as_strided_raw(os, contiguous_strides(os), 0);
}

OpEntry matmul_entry() {
  OpEntry e = make_entry("matmul", [](const auto& x, const I&, const Sample&) { return tg::matmul(x[0], x[1]); });
  e.sample("odd_2d", {{{5, 7}}, {{7, 3}}})
      .sample("broadcast_batch", {{{2, 1, 5, 7}}, {{3, 7, 4}}})
      .sample("shared_b", {{{3, 5, 7}}, {{7, 3}}})    // batch folds into M; dB reduces over the batch
      .sample("shared_a", {{{5, 7}}, {{2, 7, 3}}})    // dA reduces over the batch
      .sample("transposed", {{{4, 5, 7}, L::transposed}, {{7, 3}, L::transposed}})  // Trans::T, no copies
      .sample("strided", {{{5, 7}, L::strided}, {{2, 7, 3}, L::strided}})           // no unit stride: copied
      .sample("vector_matrix", {{{7}}, {{2, 7, 3}}})
      .sample("matrix_vector", {{{2, 5, 7}}, {{7}}})
      .sample("dot", {{{7}}, {{7}}})
      .sample("size_one_dims", {{{1, 1, 7}}, {{1, 7, 1}}})
      .sample("inner_one", {{{3, 4, 1}}, {{1, 1, 5}}});
  e.reference([](const X& x, const I&, const Sample&) { return ref_matmul(x[0], x[1]); });
  e.error("inner", [] { tg::matmul(Tensor<float>::zeros({4, 64, 768}), Tensor<float>::zeros({512, 768})); },
          "matmul: inner dimensions differ: a is [4,64,768], b is [512,768]");
  e.error("batch", [] { tg::matmul(Tensor<float>::zeros({2, 3, 4}), Tensor<float>::zeros({3, 4, 5})); },
          "matmul: batch dimensions cannot be broadcast: a is [2,3,4], b is [3,4,5]");
  e.error("scalar", [] { tg::matmul(Tensor<float>::zeros({}), Tensor<float>::zeros({3})); },
          "matmul: both operands need at least one dim: a is [], b is [3]");
  return e;
}

// ---- linear: args = {has_bias} -------------------------------------------------------------------------
OpEntry linear_entry() {
  OpEntry e = make_entry("linear", [](const auto& x, const I&, const Sample& s) {
    return s.args[0] != 0 ? tg::linear(x[0], x[1], x[2]) : tg::linear(x[0], x[1]);
  });
  e.sample("bias", {{{5, 7}}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("batched_bias", {{{2, 3, 7}}, {{4, 7}}, {{4}}}, {}, {1})
      .sample("no_bias", {{{2, 3, 7}}, {{4, 7}}}, {}, {0})
      .sample("x_transposed", {{{5, 7}, L::transposed}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("w_transposed", {{{5, 7}}, {{3, 7}, L::transposed}, {{3}}}, {}, {1})  // Wᵀ runs as Trans::N
      .sample("x_strided", {{{2, 3, 7}, L::strided}, {{4, 7}, L::strided}}, {}, {0})
      .sample("vector", {{{7}}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("one_row", {{{1, 1, 7}}, {{1, 7}}, {{1}}}, {}, {1});
  e.reference([](const X& x, const I&, const Sample& s) {
    const std::int64_t K = x[0].shape()[x[0].dim() - 1], N = x[1].shape()[0], rows = x[0].numel() / K;
    Shape os = x[0].shape();
    os[os.size() - 1] = N;
    Tensor<double> out = Tensor<double>::empty(os);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t n = 0; n < N; ++n) {
        double acc = s.args[0] != 0 ? x[2].data()[n] : 0.0;
        for (std::int64_t k = 0; k < K; ++k) acc += x[0].data()[r * K + k] * x[1].data()[n * K + k];
        out.data()[r * N + n] = acc;
      }
    return out;
  });
  e.error("inner", [] { tg::linear(Tensor<float>::zeros({4, 64, 768}), Tensor<float>::zeros({512, 700})); },
          "linear: inner dimensions differ: x is [4,64,768], weight is [512,700]");
  e.error("weight_rank", [] { tg::linear(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8})); },
          "linear: weight must be [out_features, in_features], got [8]");
  e.error("bias", [] { tg::linear(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({3, 8}), Tensor<float>::zeros({4})); },
          "linear: bias must be [3], got [4]");
  return e;
}

// ---- linear_gelu_tanh: args = {has_bias} ----------------------------------------------------------------
/// gelu_tanh(x·Wᵀ + b) in fp64 loops (the tanh formula written out, not math::gelu_tanh).
Tensor<double> ref_linear_gelu_tanh(const X& x, bool has_bias) {
  const std::int64_t K = x[0].shape()[x[0].dim() - 1], N = x[1].shape()[0], rows = x[0].numel() / K;
  Shape os = x[0].shape();
  os[os.size() - 1] = N;
  Tensor<double> out = Tensor<double>::empty(os);
  const double k = std::sqrt(2.0 / std::acos(-1.0));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t n = 0; n < N; ++n) {
      double v = has_bias ? x[2].data()[n] : 0.0;
      for (std::int64_t i = 0; i < K; ++i) v += x[0].data()[r * K + i] * x[1].data()[n * K + i];
      out.data()[r * N + n] = 0.5 * v * (1.0 + std::tanh(k * (v + 0.044715 * v * v * v)));
    }
  return out;
}

OpEntry linear_gelu_tanh_entry() {
  OpEntry e = make_entry("linear_gelu_tanh", [](const auto& x, const I&, const Sample& s) {
    return s.args[0] != 0 ? tg::linear_gelu_tanh(x[0], x[1], x[2]) : tg::linear_gelu_tanh(x[0], x[1]);
  });
  e.sample("bias", {{{5, 7}}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("batched_bias", {{{2, 3, 7}}, {{4, 7}}, {{4}}}, {}, {1})
      .sample("no_bias", {{{2, 3, 7}}, {{4, 7}}}, {}, {0})
      .sample("x_transposed", {{{5, 7}, L::transposed}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("w_transposed", {{{5, 7}}, {{3, 7}, L::transposed}, {{3}}}, {}, {1})
      .sample("x_strided", {{{2, 3, 7}, L::strided}, {{4, 7}, L::strided}}, {}, {0})
      .sample("vector", {{{7}}, {{3, 7}}, {{3}}}, {}, {1})
      .sample("one_row", {{{1, 1, 7}}, {{1, 7}}, {{1}}}, {}, {1})
      // N a multiple of 8: the shapes cuBLASLt's GELU epilogue takes on the GPU (the others fall back)
      .sample("epilogue_bias", {{{2, 5, 12}}, {{16, 12}}, {{16}}}, {}, {1})
      .sample("epilogue_no_bias", {{{6, 12}}, {{8, 12}}}, {}, {0});
  e.reference([](const X& x, const I&, const Sample& s) { return ref_linear_gelu_tanh(x, s.args[0] != 0); });
  // The default tolerances hold although 16-bit rounds twice in a chain (the pre-activation, then the GELU
  // output; gelu_tanh' <= 1.13 carries the first). On the GPU the epilogue's GELU reads the fp32 sum
  // instead: one rounding less than the CPU, well inside the CPU-vs-CUDA bound (twice these).
  e.error("inner", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({4, 64, 768}), Tensor<float>::zeros({3072, 700}), Tensor<float>::zeros({3072})); },
          "linear_gelu_tanh: inner dimensions differ: x is [4,64,768], weight is [3072,700]");
  e.error("inner_no_bias", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({16, 9})); },
          "linear_gelu_tanh: inner dimensions differ: x is [4,8], weight is [16,9]");
  e.error("weight_rank", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8})); },
          "linear_gelu_tanh: weight must be [out_features, in_features], got [8]");
  e.error("bias", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({3, 8}), Tensor<float>::zeros({4})); },
          "linear_gelu_tanh: bias must be [3], got [4]");
  e.error("bias_rank", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({3, 8}), Tensor<float>::zeros({1, 3})); },
          "linear_gelu_tanh: bias must be [3], got [1,3]");
  e.error("x_scalar", [] { tg::linear_gelu_tanh(Tensor<float>::zeros({}), Tensor<float>::zeros({3, 8})); },
          "linear_gelu_tanh: x needs at least one dim, got []");
  return e;
}

// ---- mlp_gelu_tanh: args = {has_bias}; inputs x, W_fc, (b_fc), W_proj, (b_proj) ---------------------------
OpEntry mlp_gelu_tanh_entry() {
  OpEntry e = make_entry("mlp_gelu_tanh", [](const auto& x, const I&, const Sample& s) {
    return s.args[0] != 0 ? tg::mlp_gelu_tanh(x[0], x[1], x[2], x[3], x[4]) : tg::mlp_gelu_tanh(x[0], x[1], x[2]);
  });
  e.sample("bias", {{{5, 7}}, {{6, 7}}, {{6}}, {{3, 6}}, {{3}}}, {}, {1})
      .sample("batched_bias", {{{2, 3, 7}}, {{4, 7}}, {{4}}, {{5, 4}}, {{5}}}, {}, {1})
      .sample("no_bias", {{{2, 3, 7}}, {{4, 7}}, {{5, 4}}}, {}, {0})
      .sample("x_transposed", {{{5, 7}, L::transposed}, {{6, 7}}, {{6}}, {{3, 6}}, {{3}}}, {}, {1})
      .sample("w_transposed", {{{5, 7}}, {{6, 7}, L::transposed}, {{6}}, {{3, 6}, L::transposed}, {{3}}}, {}, {1})
      .sample("one_row", {{{1, 1, 7}}, {{2, 7}}, {{2}}, {{1, 2}}, {{1}}}, {}, {1})
      // hidden width a multiple of 8: the shapes cuBLASLt's GELU, DGELU_BGRAD and BGRADB epilogues take on the GPU
      .sample("epilogue_bias", {{{2, 5, 12}}, {{16, 12}}, {{16}}, {{8, 16}}, {{8}}}, {}, {1})
      .sample("epilogue_no_bias", {{{6, 12}}, {{8, 12}}, {{4, 8}}}, {}, {0});
  // 16-bit rounds three times in the chain (pre, h, the output) and sums 16 rounded h per output: twice the
  // default tolerances in bf16 and fp16.
  Tolerances t;
  for (int p : {2, 3}) {
    t.fwd[p] = {2 * t.fwd[p].atol, 2 * t.fwd[p].rtol};
    t.grad[p] = {2 * t.grad[p].atol, 2 * t.grad[p].rtol};
  }
  e.tolerances(t);
  e.reference([](const X& x, const I&, const Sample& s) {
    const bool bias = s.args[0] != 0;
    const Tensor<double> h = ref_linear_gelu_tanh(x, bias);  // reads x[0], x[1] (and x[2])
    const Tensor<double>& wp = x[bias ? 3 : 2];
    const std::int64_t H = wp.shape()[1], O = wp.shape()[0], rows = h.numel() / H;
    Shape os = h.shape();
    os[os.size() - 1] = O;
    Tensor<double> out = Tensor<double>::empty(os);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t o = 0; o < O; ++o) {
        double acc = bias ? x[4].data()[o] : 0.0;
        for (std::int64_t k = 0; k < H; ++k) acc += h.data()[r * H + k] * wp.data()[o * H + k];
        out.data()[r * O + o] = acc;
      }
    return out;
  });
  e.error("inner", [] { tg::mlp_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({16, 9}), Tensor<float>::zeros({4, 16})); },
          "mlp_gelu_tanh: inner dimensions differ: x is [4,8], weight is [16,9]");
  e.error("proj", [] { tg::mlp_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({16, 8}), Tensor<float>::zeros({4, 15})); },
          "mlp_gelu_tanh: W_proj must be [out_features, 16] (its inputs are W_fc's outputs), got [4,15]");
  e.error("b_fc", [] {
    tg::mlp_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({16, 8}), Tensor<float>::zeros({15}),
                      Tensor<float>::zeros({4, 16}), Tensor<float>::zeros({4}));
  }, "mlp_gelu_tanh: bias must be [16], got [15]");
  e.error("b_proj", [] {
    tg::mlp_gelu_tanh(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({16, 8}), Tensor<float>::zeros({16}),
                      Tensor<float>::zeros({4, 16}), Tensor<float>::zeros({5}));
  }, "mlp_gelu_tanh: b_proj must be [4], got [5]");
  return e;
}

// ---- softmax / log_softmax ------------------------------------------------------------------------------
Tensor<double> ref_softmax(const Tensor<double>& x, bool log) {
  const std::int64_t n = x.dim() ? x.shape()[x.dim() - 1] : 1, rows = x.numel() / n;
  Tensor<double> out = Tensor<double>::empty(x.shape());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* p = x.data() + r * n;
    double m = -INFINITY, s = 0;
    for (std::int64_t j = 0; j < n; ++j) m = std::max(m, p[j]);
    for (std::int64_t j = 0; j < n; ++j) s += std::exp(p[j] - m);
    for (std::int64_t j = 0; j < n; ++j) out.data()[r * n + j] = log ? p[j] - m - std::log(s) : std::exp(p[j] - m) / s;
  }
  return out;
}

OpEntry softmax_entry(bool log) {
  OpEntry e = log ? make_entry("log_softmax", [](const auto& x, const I&, const Sample&) { return tg::log_softmax(x[0]); })
                  : make_entry("softmax", [](const auto& x, const I&, const Sample&) { return tg::softmax(x[0]); });
  e.sample("rows", {{{4, 7}}})
      .sample("rank3_strided", {{{2, 3, 5}, L::strided}})
      .sample("transposed", {{{5, 6}, L::transposed}})
      .sample("size_one", {{{3, 1}}})
      .sample("large_logits", {{{3, 9}, -30.0, 30.0}});  // exp would overflow without the max shift
  e.reference([log](const X& x, const I&, const Sample&) { return ref_softmax(x[0], log); });
  // large_logits in 16-bit: the inputs are ~30 in magnitude; log_softmax's output (x − lse) is rounded at
  // that magnitude (fp16 ulp 2^-6 near 30; bf16 2^-3), so its atol follows the output's scale.
  if (log) {
    e.tol.fwd[2] = {6e-2, 2e-2};
    e.tol.fwd[3] = {1e-2, 4e-3};
  }
  const std::string name = log ? "log_softmax" : "softmax";
  e.error("dim", [log] { log ? (void)tg::log_softmax(Tensor<float>::zeros({2, 3}), 0) : (void)tg::softmax(Tensor<float>::zeros({2, 3}), 0); },
          name + ": only the last dim is supported, got dim 0 for a tensor of shape [2,3]");
  e.error("dim_range", [log] { log ? (void)tg::log_softmax(Tensor<float>::zeros({2, 3}), 2) : (void)tg::softmax(Tensor<float>::zeros({2, 3}), 2); },
          name + ": dim 2 is out of range for a tensor of rank 2");
  return e;
}

// ---- layernorm / rmsnorm: args = {eps} -----------------------------------------------------------------
Tensor<double> ref_norm(const X& x, bool rms, double eps) {
  const std::int64_t n = x[0].shape()[x[0].dim() - 1], rows = x[0].numel() / n;
  Tensor<double> out = Tensor<double>::empty(x[0].shape());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* p = x[0].data() + r * n;
    double mu = 0, v = 0;
    if (!rms) {
      for (std::int64_t j = 0; j < n; ++j) mu += p[j];
      mu /= static_cast<double>(n);
    }
    for (std::int64_t j = 0; j < n; ++j) v += (p[j] - mu) * (p[j] - mu);
    const double rs = 1.0 / std::sqrt(v / static_cast<double>(n) + eps);
    for (std::int64_t j = 0; j < n; ++j)
      out.data()[r * n + j] = (p[j] - mu) * rs * x[1].data()[j] + (rms ? 0.0 : x[2].data()[j]);
  }
  return out;
}

OpEntry layernorm_entry() {
  OpEntry e = make_entry("layernorm", [](const auto& x, const I&, const Sample& s) {
    return tg::layernorm(x[0], x[1], x[2], s.args[0]);
  });
  e.sample("rows", {{{4, 7}}, {{7}, 0.5, 1.5}, {{7}}}, {}, {1e-5})
      .sample("rank3_strided", {{{2, 3, 5}, L::strided}, {{5}, 0.5, 1.5, L::strided}, {{5}}}, {}, {1e-5})
      .sample("transposed", {{{6, 5}, L::transposed}, {{5}, 0.5, 1.5}, {{5}}}, {}, {1e-3})
      .sample("one_row_offset", {{{1, 9}, 3.0, 5.0}, {{9}, 0.5, 1.5}, {{9}}}, {}, {1e-5})  // mean far from 0
      // rows of whole 16-byte packs: the GPU's one-pass backward (Note [one-pass norm backward]), rows over
      // several warps and blocks
      .sample("aligned_rows", {{{2, 19, 64}}, {{64}, 0.5, 1.5}, {{64}}}, {}, {1e-5})
      // rows of at least one 16-byte pack per lane: the GPU's warp-per-row forward (Note [norm forward in packs])
      .sample("packed_rows", {{{3, 256}}, {{256}, 0.5, 1.5}, {{256}}}, {}, {1e-5});
  e.reference([](const X& x, const I&, const Sample& s) { return ref_norm(x, false, s.args[0]); });
  e.error("weight", [] { tg::layernorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({7}), Tensor<float>::zeros({8})); },
          "layernorm: weight must be [8] (the last dim of x [4,8]), got [7]");
  e.error("bias", [] { tg::layernorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8}), Tensor<float>::zeros({2, 4})); },
          "layernorm: bias must be [8] (the last dim of x [4,8]), got [2,4]");
  return e;
}

OpEntry rmsnorm_entry() {
  OpEntry e = make_entry("rmsnorm", [](const auto& x, const I&, const Sample& s) { return tg::rmsnorm(x[0], x[1], s.args[0]); });
  e.sample("rows", {{{4, 7}}, {{7}, 0.5, 1.5}}, {}, {1e-6})
      .sample("rank3_strided", {{{2, 3, 5}, L::strided}, {{5}, 0.5, 1.5}}, {}, {1e-6})
      .sample("size_one", {{{3, 1}, 0.5, 2.0}, {{1}, 0.5, 1.5}}, {}, {1e-3})
      .sample("aligned_rows", {{{21, 32}}, {{32}, 0.5, 1.5}}, {}, {1e-6})  // the GPU's one-pass backward
      .sample("packed_rows", {{{3, 256}}, {{256}, 0.5, 1.5}}, {}, {1e-6});  // its warp-per-row forward
  e.reference([](const X& x, const I&, const Sample& s) { return ref_norm(x, true, s.args[0]); });
  e.error("weight", [] { tg::rmsnorm(Tensor<float>::zeros({4, 8}), Tensor<float>::zeros({8, 1})); },
          "rmsnorm: weight must be [8] (the last dim of x [4,8]), got [8,1]");
  return e;
}

// ---- embedding ---------------------------------------------------------------------------------------
OpEntry embedding_entry() {
  OpEntry e = make_entry("embedding", [](const auto& x, const I& idx, const Sample&) { return tg::embedding(x[0], idx[0]); });
  e.sample("batch", {{{10, 4}}}, {IndexSpec{{2, 3}, 0, 10}})
      .sample("repeats", {{{3, 5}}}, {IndexSpec{{11}, 0, 3}})  // every row hit several times: scatter-add
      .sample("transposed_weight", {{{6, 5}, L::transposed}}, {IndexSpec{{4}, 0, 6}})
      .sample("unused_rows", {{{50, 3}}}, {IndexSpec{{1, 2}, 0, 50}});  // most rows get zero gradient
  e.reference([](const X& x, const I& idx, const Sample&) {
    const std::int64_t C = x[0].shape()[1];
    Shape os = idx[0].shape();
    os.push_back(C);
    Tensor<double> out = Tensor<double>::empty(os);
    for (std::int64_t i = 0; i < idx[0].numel(); ++i)
      for (std::int64_t c = 0; c < C; ++c) out.data()[i * C + c] = x[0].data()[idx[0].data()[i] * C + c];
    return out;
  });
  e.error("too_large", [] { tg::embedding(Tensor<float>::zeros({10, 4}), Tensor<std::int64_t>::from_values({3}, {1, 10, 2})); },
          "embedding: index 10 at position 1 is out of range for a weight of V = 10");
  e.error("negative", [] { tg::embedding(Tensor<float>::zeros({10, 4}), Tensor<std::int64_t>::from_values({2}, {-1, 2})); },
          "embedding: index -1 at position 0 is out of range for a weight of V = 10");
  e.error("weight_rank", [] { tg::embedding(Tensor<float>::zeros({10}), Tensor<std::int64_t>::zeros({2})); },
          "embedding: weight must be [num_embeddings, dim], got [10]");
  return e;
}

// ---- cross_entropy: args = {ignore_index} ---------------------------------------------------------------
OpEntry cross_entropy_entry() {
  OpEntry e = make_entry("cross_entropy", [](const auto& x, const I& idx, const Sample& s) {
    return tg::cross_entropy(x[0], idx[0], static_cast<std::int64_t>(s.args[0]));
  });
  e.sample("rows", {{{5, 7}}}, {IndexSpec{{5}, 0, 7}}, {-100})
      .sample("batch_time", {{{2, 3, 7}}}, {IndexSpec{{2, 3}, 0, 7}}, {-100})
      .sample("ignored", {{{9, 4}}}, {IndexSpec{{9}, -1, 4}}, {-1})  // about a fifth of the rows ignored
      .sample("transposed", {{{6, 5}, L::transposed}}, {IndexSpec{{6}, 0, 5}}, {-100})
      .sample("large_logits", {{{4, 6}, -30.0, 30.0}}, {IndexSpec{{4}, 0, 6}}, {-100})
      .sample("one_class", {{{3, 1}}}, {IndexSpec{{3}, 0, 1}}, {-100})
      // rows of whole 16-byte packs (Note [cross-entropy in one pass over 16-byte packs]), some ignored; and rows
      // longer than the GPU block, of whole packs in every type or in fp32 / fp64 only
      .sample("packed_rows", {{{6, 40}}}, {IndexSpec{{6}, -1, 40}}, {-1})
      .sample("wide_rows", {{{2, 2, 1032}}}, {IndexSpec{{2, 2}, 0, 1032}}, {-100})
      .sample("wide_rows_tail", {{{3, 1100}, -8.0, 8.0}}, {IndexSpec{{3}, 0, 1100}}, {-100});
  e.reference([](const X& x, const I& idx, const Sample& s) {
    const std::int64_t V = x[0].shape()[x[0].dim() - 1], rows = x[0].numel() / V, ignore = static_cast<std::int64_t>(s.args[0]);
    double total = 0;
    std::int64_t count = 0;
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t t = idx[0].data()[r];
      if (t == ignore) continue;
      const double* p = x[0].data() + r * V;
      double m = -INFINITY, se = 0;
      for (std::int64_t j = 0; j < V; ++j) m = std::max(m, p[j]);
      for (std::int64_t j = 0; j < V; ++j) se += std::exp(p[j] - m);
      total += m + std::log(se) - p[t];
      ++count;
    }
    return Tensor<double>::full(Shape(), total / static_cast<double>(count));
  });
  e.error("shape", [] { tg::cross_entropy(Tensor<float>::zeros({2, 3, 7}), Tensor<std::int64_t>::zeros({2, 4})); },
          "cross_entropy: targets must be [2,3] for logits [2,3,7], got [2,4]");
  e.error("rank", [] { tg::cross_entropy(Tensor<float>::zeros({7}), Tensor<std::int64_t>::zeros({1})); },
          "cross_entropy: logits must be [N, V] or [B, T, V], got [7]");
  e.error("target", [] { tg::cross_entropy(Tensor<float>::zeros({3, 7}), Tensor<std::int64_t>::from_values({3}, {0, 6, 7})); },
          "cross_entropy: target 7 at position 2 is out of range for the number of classes V = 7");
  e.error("negative_target", [] { tg::cross_entropy(Tensor<float>::zeros({2, 7}), Tensor<std::int64_t>::from_values({2}, {-5, 1})); },
          "cross_entropy: target -5 at position 0 is out of range");
  return e;
}

// ---- attention ----------------------------------------------------------------------------------------
Tensor<double> ref_attention(const X& x) {
  const Shape s = x[0].shape();
  const std::int64_t BH = s[0] * s[1], Tn = s[2], hs = s[3];
  const double scale = 1.0 / std::sqrt(static_cast<double>(hs));
  Tensor<double> out = Tensor<double>::zeros(s);
  std::vector<double> p(static_cast<std::size_t>(Tn));
  for (std::int64_t h = 0; h < BH; ++h) {
    const double *q = x[0].data() + h * Tn * hs, *k = x[1].data() + h * Tn * hs, *v = x[2].data() + h * Tn * hs;
    double* o = out.data() + h * Tn * hs;
    for (std::int64_t i = 0; i < Tn; ++i) {
      double m = -INFINITY, l = 0;
      for (std::int64_t j = 0; j <= i; ++j) {
        double d = 0;
        for (std::int64_t c = 0; c < hs; ++c) d += q[i * hs + c] * k[j * hs + c];
        p[static_cast<std::size_t>(j)] = d * scale;
        m = std::max(m, d * scale);
      }
      for (std::int64_t j = 0; j <= i; ++j) l += (p[static_cast<std::size_t>(j)] = std::exp(p[static_cast<std::size_t>(j)] - m));
      for (std::int64_t j = 0; j <= i; ++j)
        for (std::int64_t c = 0; c < hs; ++c) o[i * hs + c] += p[static_cast<std::size_t>(j)] / l * v[j * hs + c];
    }
  }
  return out;
}

template <class F>
OpEntry attention_entry(const char* name, F op) {
  OpEntry e = make_entry(name, op);
  e.sample("small", {{{1, 2, 5, 3}}, {{1, 2, 5, 3}}, {{1, 2, 5, 3}}})
      .sample("one_token", {{{2, 1, 1, 4}}, {{2, 1, 1, 4}}, {{2, 1, 1, 4}}})
      .sample("transposed_q", {{{2, 1, 7, 4}, L::transposed}, {{2, 1, 7, 4}}, {{2, 1, 7, 4}, L::strided}})
      .sample("two_blocks", {{{1, 1, 70, 8}}, {{1, 1, 70, 8}}, {{1, 1, 70, 8}}});  // T > the 64-row kernel block
  e.reference([](const X& x, const I&, const Sample&) { return ref_attention(x); });
  return e;
}

OpEntry causal_attention_entry() {
  OpEntry e = attention_entry("causal_attention", [](const auto& x, const I&, const Sample&) {
    return tg::causal_attention(x[0], x[1], x[2]);
  });
  // Fused: fp32 math throughout, one rounding of the output (and of each gradient).
  e.error("rank", [] { tg::causal_attention(Tensor<float>::zeros({2, 5, 4}), Tensor<float>::zeros({2, 5, 4}), Tensor<float>::zeros({2, 5, 4})); },
          "causal_attention: q must be (B,H,T,hs), got [2,5,4]");
  e.error("k_shape", [] { tg::causal_attention(Tensor<float>::zeros({1, 2, 5, 4}), Tensor<float>::zeros({1, 2, 6, 4}), Tensor<float>::zeros({1, 2, 5, 4})); },
          "causal_attention: k must have q's shape [1,2,5,4], got [1,2,6,4]");
  e.error("v_shape", [] { tg::causal_attention(Tensor<float>::zeros({1, 2, 5, 4}), Tensor<float>::zeros({1, 2, 5, 4}), Tensor<float>::zeros({1, 2, 5, 3})); },
          "causal_attention: v must have q's shape [1,2,5,4], got [1,2,5,3]");
  return e;
}

OpEntry attention_composite_entry() {
  OpEntry e = attention_entry("attention_composite", [](const auto& x, const I&, const Sample&) {
    return tg::attention_composite(x[0], x[1], x[2]);
  });
  // The composite rounds its (B,H,T,T) scores and probabilities to the storage precision before the next
  // GEMM: three roundings in a chain, so 16-bit tolerances are about twice the single-rounding ones.
  e.tol.fwd[2] = {4e-2, 4e-2};
  e.tol.fwd[3] = {8e-3, 8e-3};
  e.tol.grad[2] = {8e-2, 8e-2};
  e.tol.grad[3] = {1.6e-2, 1.6e-2};
  e.error("rank", [] { tg::attention_composite(Tensor<float>::zeros({5, 4}), Tensor<float>::zeros({5, 4}), Tensor<float>::zeros({5, 4})); },
          "attention_composite: q must be (B,H,T,hs), got [5,4]");
  return e;
}

TG_REGISTER_OP(matmul_entry());
TG_REGISTER_OP(linear_entry());
TG_REGISTER_OP(linear_gelu_tanh_entry());
TG_REGISTER_OP(mlp_gelu_tanh_entry());
TG_REGISTER_OP(softmax_entry(false));
TG_REGISTER_OP(softmax_entry(true));
TG_REGISTER_OP(layernorm_entry());
TG_REGISTER_OP(rmsnorm_entry());
TG_REGISTER_OP(embedding_entry());
TG_REGISTER_OP(cross_entropy_entry());
TG_REGISTER_OP(causal_attention_entry());
TG_REGISTER_OP(attention_composite_entry());

// Note [cross-entropy on strided rows]: the padded LM head's narrowed logits ((B, T, V) of (B, T, P), and
// (N, V) of (N, P)) are read in place; the loss and the gradient equal those of the contiguous copy bit for
// bit, ignored targets included, and the forward allocates no copy of the logits.
template <class T>
void check_cross_entropy_on_narrowed_rows(const Shape& padded, std::int64_t V) {
  Generator gen(11);
  const std::int64_t P = padded[padded.size() - 1];
  const Tensor<float> values = Tensor<float>::uniform(padded, -3.f, 3.f, gen);
  Shape tshape = padded;
  tshape.erase(tshape.size() - 1);
  Tensor<std::int64_t> targets = Tensor<std::int64_t>::empty(tshape);
  for (std::int64_t i = 0; i < targets.numel(); ++i)
    targets.data()[i] = i % 5 == 3 ? -100 : static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(V));
  Tensor<T> base = leaf_as<T>(values);
  const Tensor<T> narrowed = base.narrow(static_cast<int>(padded.size()) - 1, 0, V);
  ASSERT_EQ(narrowed.is_contiguous(), P == V);
  Tensor<T> copy = leaf_as<T>(values.narrow(static_cast<int>(padded.size()) - 1, 0, V).contiguous());
  allocator<cpu>().reset_peak();
  const std::int64_t in_use = allocator<cpu>().stats().bytes_in_use;
  const Tensor<T> a = cross_entropy(narrowed, targets);
  EXPECT_LT(allocator<cpu>().stats().peak_bytes - in_use, static_cast<std::int64_t>(narrowed.numel() * sizeof(T)) / 2)
      << "the forward copied the narrowed logits";
  const Tensor<T> b = cross_entropy(copy, targets);
  ASSERT_TRUE(same_bits(a.detach(), b.detach())) << scalar_cast<double>(a.item()) << " vs " << scalar_cast<double>(b.item());
  a.backward();
  b.backward();
  const Tensor<T> ga = base.grad();
  ASSERT_EQ(ga.shape(), padded);
  EXPECT_TRUE(same_bits(ga.narrow(static_cast<int>(padded.size()) - 1, 0, V), copy.grad()));
  const Tensor<T> tail = ga.narrow(static_cast<int>(padded.size()) - 1, V, P - V).contiguous();
  for (std::int64_t i = 0; i < tail.numel(); ++i) ASSERT_EQ(static_cast<double>(scalar_cast<float>(tail.data()[i])), 0.0);
}
TEST(OpDb_cross_entropy, NarrowedRowsAreReadInPlaceAndEqualTheCopy) {
  check_cross_entropy_on_narrowed_rows<float>({2, 3, 1024}, 1000);
  check_cross_entropy_on_narrowed_rows<float>({7, 512}, 500);
  check_cross_entropy_on_narrowed_rows<bf16>({2, 5, 640}, 600);
  check_cross_entropy_on_narrowed_rows<double>({1, 4, 300}, 290);
  check_cross_entropy_on_narrowed_rows<float>({3, 1, 257}, 257);  // the whole rows, contiguous: the same path
}
// Note [cross-entropy on padded logits]: on narrow_classes' view the loss is recorded against the padded base,
// whose gradient (rows of P, zero past V) equals the plain narrow's widened one bit for bit, without the (rows, V)
// gradient and its widening copy; a second reader of the view still sends its gradient through the narrow.
template <class T>
void check_cross_entropy_on_narrow_classes(const Shape& padded, std::int64_t V, bool second_reader, bool through_op) {
  Generator gen(20261205);
  const Tensor<float> values = Tensor<float>::normal(padded, 0.f, 2.f, gen);
  Shape tshape = padded;
  tshape.erase(tshape.size() - 1);
  Tensor<std::int64_t> targets = Tensor<std::int64_t>::empty(tshape);
  for (std::int64_t i = 0; i < targets.numel(); ++i)
    targets.data()[i] = i % 7 == 2 ? -100 : static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(V));
  const int last = static_cast<int>(padded.size()) - 1;
  const std::int64_t P = padded[last];
  auto run = [&](bool classes, std::int64_t* backward_peak) {
    Tensor<T> leaf = leaf_as<T>(values);
    const Tensor<T> base = through_op ? mul(leaf, 1.0) : leaf;  // a recorded op's output, as the LM head's logits
    const Tensor<T> logits = classes ? narrow_classes(base, V) : base.narrow(last, 0, V);
    Tensor<T> loss = cross_entropy(logits, targets);
    if (second_reader) loss = add(loss, mul(sum(logits), 1e-3));
    allocator<cpu>().reset_peak();
    const std::int64_t in_use = allocator<cpu>().stats().bytes_in_use;
    loss.backward();
    *backward_peak = allocator<cpu>().stats().peak_bytes - in_use;
    return std::pair{loss.detach(), leaf.grad()};
  };
  std::int64_t peak_classes = 0, peak_narrow = 0;
  const auto [la, ga] = run(true, &peak_classes);
  const auto [lb, gb] = run(false, &peak_narrow);
  ASSERT_TRUE(same_bits(la, lb));
  ASSERT_EQ(ga.shape(), padded);
  EXPECT_TRUE(same_bits(ga, gb)) << "narrow_classes' gradient differs from the widened narrow's";
  const Tensor<T> tail = ga.narrow(last, V, P - V).contiguous();
  for (std::int64_t i = 0; i < tail.numel(); ++i) ASSERT_EQ(static_cast<double>(scalar_cast<float>(tail.data()[i])), 0.0);
  const auto bytes = static_cast<std::int64_t>(ga.numel() * sizeof(T));
  if (!second_reader && !through_op && P > V) {
    // the narrow's path holds a (rows, V) gradient and its (rows, P) widening at once; this path only the latter
    EXPECT_LE(peak_classes + bytes / P * V / 2, peak_narrow) << "the loss's gradient was still widened";
  }
}
TEST(OpDb_cross_entropy, NarrowClassesWritesThePaddedGradientDirectly) {
  for (const bool through_op : {false, true}) {
    check_cross_entropy_on_narrow_classes<float>({2, 3, 1024}, 1000, false, through_op);
    check_cross_entropy_on_narrow_classes<bf16>({2, 5, 640}, 600, false, through_op);
    check_cross_entropy_on_narrow_classes<double>({7, 300}, 290, false, through_op);
    check_cross_entropy_on_narrow_classes<float>({3, 1, 257}, 257, false, through_op);  // nothing padded
    check_cross_entropy_on_narrow_classes<float>({2, 3, 1024}, 1000, true, through_op);
    check_cross_entropy_on_narrow_classes<fp16>({4, 136}, 130, true, through_op);
  }
}
TEST(OpDb_cross_entropy, NarrowClassesChecksItsArguments) {
  const Tensor<float> x = Tensor<float>::zeros({2, 8});
  EXPECT_THROW(narrow_classes(x, 9), Error);
  EXPECT_THROW(narrow_classes(x, 0), Error);
  EXPECT_EQ(narrow_classes(x, 5).shape(), (Shape{2, 5}));
}

// A layout whose rows are not a fixed stride apart (a transposed batch and time) is copied first: same values.
TEST(OpDb_cross_entropy, RowsNotAFixedStrideApartAreCopiedFirst) {
  Generator gen(5);
  const Tensor<float> x = Tensor<float>::uniform({3, 4, 6}, -2.f, 2.f, gen);
  Tensor<std::int64_t> targets = Tensor<std::int64_t>::empty({4, 3});
  for (std::int64_t i = 0; i < 12; ++i) targets.data()[i] = i % 6;
  EXPECT_EQ(detail::uniform_row_stride(x.transpose(0, 1)), 0);
  EXPECT_EQ(detail::uniform_row_stride(x.narrow(2, 0, 5)), 6);
  EXPECT_EQ(detail::uniform_row_stride(x.narrow(1, 0, 2)), 0);  // rows 6 apart within a batch, 24 across
  EXPECT_EQ(detail::uniform_row_stride(x.narrow(0, 1, 1)), 6);
  const Tensor<float> a = cross_entropy(x.transpose(0, 1), targets), b = cross_entropy(x.transpose(0, 1).contiguous(), targets);
  EXPECT_TRUE(same_bits(a, b));
}

// The fused kernel must match its composite, forward and all three gradients, in fp32 (several heads,
// T spanning three kernel blocks, non-power-of-two sizes).
TEST(OpDb_causal_attention_fused, MatchesCompositeFp32) {
  Generator gen(20240611);
  const Shape s{2, 3, 150, 16};
  const Tensor<float> q0 = Tensor<float>::normal(s, 0.f, 1.f, gen), k0 = Tensor<float>::normal(s, 0.f, 1.f, gen),
                      v0 = Tensor<float>::normal(s, 0.f, 1.f, gen), u = Tensor<float>::normal(s, 0.f, 1.f, gen);
  auto run = [&](bool fused) {
    Tensor<float> q = q0.clone().detach(), k = k0.clone().detach(), v = v0.clone().detach();
    q.requires_grad_();
    k.requires_grad_();
    v.requires_grad_();
    Tensor<float> out = fused ? tg::causal_attention(q, k, v) : tg::attention_composite(q, k, v);
    out.backward(u);
    return std::vector<std::vector<float>>{out.to_vector(), q.grad().to_vector(), k.grad().to_vector(), v.grad().to_vector()};
  };
  const auto f = run(true), c = run(false);
  const char* what[] = {"out", "dq", "dk", "dv"};
  for (std::size_t t = 0; t < f.size(); ++t) {
    ASSERT_EQ(f[t].size(), c[t].size());
    double worst = 0;
    for (std::size_t i = 0; i < f[t].size(); ++i)
      worst = std::max(worst, std::abs(double(f[t][i]) - c[t][i]) / (1e-5 + 1e-4 * std::abs(double(c[t][i]))));
    EXPECT_LE(worst, 1.0) << what[t] << ": fused and composite differ beyond atol 1e-5, rtol 1e-4";
  }
}

/// Every tensor of `f` equals the one of `ref` bit for bit; `what` names them, `ref_name` the reference.
void expect_bitwise_equal(const std::vector<std::vector<float>>& f, const std::vector<std::vector<float>>& ref,
                          const char* const* what, const char* ref_name) {
  ASSERT_EQ(f.size(), ref.size());
  for (std::size_t t = 0; t < f.size(); ++t) {
    ASSERT_EQ(f[t].size(), ref[t].size()) << what[t];
    std::size_t differ = 0;
    for (std::size_t i = 0; i < f[t].size(); ++i) differ += std::memcmp(&f[t][i], &ref[t][i], sizeof(float)) != 0;
    EXPECT_EQ(differ, 0u) << what[t] << ": " << differ << " of " << f[t].size() << " values differ from " << ref_name;
  }
}

// linear_gelu_tanh on the CPU is the composite's kernels in the composite's order (Note [fused linear +
// GELU]): output and every gradient equal gelu_tanh(linear(...))'s bit for bit, with and without a bias.
template <class T>
void check_linear_gelu_equals_composite(bool with_bias) {
  Generator gen(20261203);
  const Tensor<float> x0 = Tensor<float>::normal({3, 5, 24}, 0.f, 1.f, gen), w0 = Tensor<float>::normal({40, 24}, 0.f, 0.3f, gen),
                      b0 = Tensor<float>::normal({40}, 0.f, 0.5f, gen), u0 = Tensor<float>::normal({3, 5, 40}, 0.f, 1.f, gen);
  auto run = [&](bool fused) {
    Tensor<T> x = x0.to<T>(), w = w0.to<T>(), b = b0.to<T>();
    x.requires_grad_();
    w.requires_grad_();
    b.requires_grad_();
    Tensor<T> y;
    if (with_bias) y = fused ? tg::linear_gelu_tanh(x, w, b) : tg::gelu_tanh(tg::linear(x, w, b));
    else y = fused ? tg::linear_gelu_tanh(x, w) : tg::gelu_tanh(tg::linear(x, w));
    y.backward(u0.to<T>());
    std::vector<std::vector<float>> r{y.template to<float>().to_vector(), x.grad().template to<float>().to_vector(),
                                      w.grad().template to<float>().to_vector()};
    if (with_bias) r.push_back(b.grad().template to<float>().to_vector());
    return r;
  };
  const char* what[] = {"out", "dx", "dw", "db"};
  expect_bitwise_equal(run(true), run(false), what, "the composite's");
}
TEST(OpDb_linear_gelu_tanh_fused, EqualsCompositeBitwiseFp32) {
  check_linear_gelu_equals_composite<float>(true);
  check_linear_gelu_equals_composite<float>(false);
}
TEST(OpDb_linear_gelu_tanh_fused, EqualsCompositeBitwiseBf16) {
  check_linear_gelu_equals_composite<bf16>(true);
  check_linear_gelu_equals_composite<bf16>(false);
}

// Under SelectiveRecompute the op's GEMM output (the pre-activation) is kept and reused, and the recompute
// runs only the GELU on it: gradients equal the plain run's bit for bit; RecomputeAll reruns the op.
template <class Policy>
void check_linear_gelu_checkpointed(std::int64_t kept) {
  Generator gen(77);
  const Tensor<float> x0 = Tensor<float>::normal({4, 6, 16}, 0.f, 1.f, gen), w0 = Tensor<float>::normal({24, 16}, 0.f, 0.4f, gen),
                      b0 = Tensor<float>::normal({24}, 0.f, 0.3f, gen), u = Tensor<float>::normal({4, 6, 24}, 0.f, 1.f, gen);
  auto run = [&](bool ck) {
    Tensor<float> x = x0.clone().detach(), w = w0.clone().detach(), b = b0.clone().detach();
    x.requires_grad_();
    w.requires_grad_();
    b.requires_grad_();
    auto fn = [&](const Tensor<float>& t) { return tg::linear_gelu_tanh(t, w, b); };
    const Tensor<float> y = ck ? tg::checkpoint<Policy>(fn, x) : fn(x);
    y.backward(u);
    return std::vector<std::vector<float>>{y.to_vector(), x.grad().to_vector(), w.grad().to_vector(), b.grad().to_vector()};
  };
  const auto plain = run(false);
  autodiff::checkpoint_stats() = {};
  const auto ck = run(true);
  EXPECT_EQ(autodiff::checkpoint_stats().kept_outputs, kept);
  EXPECT_EQ(autodiff::checkpoint_stats().reused_outputs, kept);
  EXPECT_EQ(autodiff::checkpoint_stats().recomputes, 1);
  for (std::size_t t = 0; t < plain.size(); ++t) EXPECT_EQ(ck[t], plain[t]) << "tensor " << t;
}
TEST(OpDb_linear_gelu_tanh_fused, SelectiveCheckpointKeepsThePreActivation) {
  check_linear_gelu_checkpointed<SelectiveRecompute>(1);
}
TEST(OpDb_linear_gelu_tanh_fused, RecomputeAllRerunsTheOp) { check_linear_gelu_checkpointed<RecomputeAll>(0); }

// One tape node, named for the op, saving x, W and the pre-activation (what linear and gelu_tanh saved).
std::int64_t live_ops(const std::string& op) {
  std::int64_t n = 0;
  for (const auto& node : autodiff::current_tape().live_nodes()) n += op == node->op();
  return n;
}
TEST(OpDb_linear_gelu_tanh_fused, RecordsOneNode) {
  Tensor<float> x = Tensor<float>::ones({2, 4}), w = Tensor<float>::ones({8, 4}), b = Tensor<float>::zeros({8});
  w.requires_grad_();
  const std::int64_t fused0 = live_ops("linear_gelu_tanh"), linear0 = live_ops("linear"), gelu0 = live_ops("gelu_tanh");
  const Tensor<float> y = tg::linear_gelu_tanh(x, w, b);
  EXPECT_EQ(live_ops("linear_gelu_tanh"), fused0 + 1);
  EXPECT_EQ(live_ops("linear"), linear0);
  EXPECT_EQ(live_ops("gelu_tanh"), gelu0);
  ASSERT_TRUE(y.requires_grad());
  EXPECT_EQ(y.shape(), (Shape{2, 8}));
  // gelu_tanh(4) for every element (x·wᵀ = 4)
  const double k = std::sqrt(2.0 / std::acos(-1.0)), g4 = 0.5 * 4.0 * (1.0 + std::tanh(k * (4.0 + 0.044715 * 64.0)));
  for (float v : y.to_vector()) EXPECT_NEAR(v, g4, 1e-5);
}

// mlp_gelu_tanh on the CPU is the unfused pair's kernels in their order (Note [the fused GELU MLP]): output and
// every gradient equal linear(linear_gelu_tanh(...))'s bit for bit, with and without biases, in fp32 and bf16;
// it records one node, and a SelectiveRecompute region keeps its two GEMM outputs (pre and the output) as the
// pair's would and gives the plain run's gradients.
template <class T>
std::vector<std::vector<float>> run_mlp(int mode, bool with_bias) {  // mode 0: fused, 1: unfused, 2: fused checkpointed
  Generator gen(20261206);
  const Tensor<float> x0 = Tensor<float>::normal({3, 5, 24}, 0.f, 1.f, gen), w0 = Tensor<float>::normal({40, 24}, 0.f, 0.3f, gen),
                      b0 = Tensor<float>::normal({40}, 0.f, 0.5f, gen), p0 = Tensor<float>::normal({16, 40}, 0.f, 0.3f, gen),
                      c0 = Tensor<float>::normal({16}, 0.f, 0.5f, gen), u0 = Tensor<float>::normal({3, 5, 16}, 0.f, 1.f, gen);
  Tensor<T> x = x0.to<T>(), w = w0.to<T>(), b = b0.to<T>(), p = p0.to<T>(), c = c0.to<T>();
  for (Tensor<T>* t : {&x, &w, &b, &p, &c}) t->requires_grad_();
  auto fused = [&](const Tensor<T>& t) { return with_bias ? tg::mlp_gelu_tanh(t, w, b, p, c) : tg::mlp_gelu_tanh(t, w, p); };
  Tensor<T> y;
  if (mode == 0) y = fused(x);
  else if (mode == 1) y = with_bias ? tg::linear(tg::linear_gelu_tanh(x, w, b), p, c) : tg::linear(tg::linear_gelu_tanh(x, w), p);
  else y = tg::checkpoint<SelectiveRecompute>(fused, x);
  y.backward(u0.to<T>());
  std::vector<std::vector<float>> r{y.template to<float>().to_vector(), x.grad().template to<float>().to_vector(),
                                    w.grad().template to<float>().to_vector(), p.grad().template to<float>().to_vector()};
  if (with_bias) {
    r.push_back(b.grad().template to<float>().to_vector());
    r.push_back(c.grad().template to<float>().to_vector());
  }
  return r;
}
template <class T>
void check_mlp_equals_unfused(bool with_bias) {
  const char* what[] = {"out", "dx", "dW_fc", "dW_proj", "db_fc", "db_proj"};
  expect_bitwise_equal(run_mlp<T>(0, with_bias), run_mlp<T>(1, with_bias), what, "the unfused ops'");
}
TEST(OpDb_mlp_gelu_tanh_fused, EqualsUnfusedBitwiseFp32) {
  check_mlp_equals_unfused<float>(true);
  check_mlp_equals_unfused<float>(false);
}
TEST(OpDb_mlp_gelu_tanh_fused, EqualsUnfusedBitwiseBf16) {
  check_mlp_equals_unfused<bf16>(true);
  check_mlp_equals_unfused<bf16>(false);
}
TEST(OpDb_mlp_gelu_tanh_fused, SelectiveCheckpointKeepsBothGemmOutputs) {
  const auto plain = run_mlp<float>(0, true);
  autodiff::checkpoint_stats() = {};
  const auto ck = run_mlp<float>(2, true);
  EXPECT_EQ(autodiff::checkpoint_stats().kept_outputs, 2);
  EXPECT_EQ(autodiff::checkpoint_stats().reused_outputs, 2);
  EXPECT_EQ(autodiff::checkpoint_stats().recomputes, 1);
  for (std::size_t t = 0; t < plain.size(); ++t) EXPECT_EQ(ck[t], plain[t]) << "tensor " << t;
}
// The backward drops the saved GELU output once dW_proj is computed, except when the graph is retained: a
// second backward through a retained graph gives the same gradients again.
TEST(OpDb_mlp_gelu_tanh_fused, RetainedGraphBackwardsTwice) {
  Generator gen(3);
  Tensor<float> x = Tensor<float>::normal({4, 6}, 0.f, 1.f, gen), w = Tensor<float>::normal({8, 6}, 0.f, 0.5f, gen),
                b = Tensor<float>::normal({8}, 0.f, 0.5f, gen), p = Tensor<float>::normal({3, 8}, 0.f, 0.5f, gen),
                c = Tensor<float>::normal({3}, 0.f, 0.5f, gen);
  p.requires_grad_();
  w.requires_grad_();
  const Tensor<float> y = tg::mlp_gelu_tanh(x, w, b, p, c);
  y.backward(Tensor<float>::ones({4, 3}), /*retain_graph=*/true);
  const auto dp1 = p.grad().to_vector(), dw1 = w.grad().to_vector();
  y.backward(Tensor<float>::ones({4, 3}));
  const auto dp2 = p.grad().to_vector(), dw2 = w.grad().to_vector();
  for (std::size_t i = 0; i < dp1.size(); ++i) EXPECT_EQ(dp2[i], 2 * dp1[i]) << "dW_proj " << i;
  for (std::size_t i = 0; i < dw1.size(); ++i) EXPECT_EQ(dw2[i], 2 * dw1[i]) << "dW_fc " << i;
}

TEST(OpDb_mlp_gelu_tanh_fused, RecordsOneNode) {
  Tensor<float> x = Tensor<float>::ones({2, 4}), w = Tensor<float>::ones({8, 4}), b = Tensor<float>::zeros({8}),
                p = Tensor<float>::ones({3, 8}), c = Tensor<float>::zeros({3});
  p.requires_grad_();
  const std::int64_t mlp0 = live_ops("mlp_gelu_tanh"), fused0 = live_ops("linear_gelu_tanh"), linear0 = live_ops("linear");
  const Tensor<float> y = tg::mlp_gelu_tanh(x, w, b, p, c);
  EXPECT_EQ(live_ops("mlp_gelu_tanh"), mlp0 + 1);
  EXPECT_EQ(live_ops("linear_gelu_tanh"), fused0);
  EXPECT_EQ(live_ops("linear"), linear0);
  EXPECT_EQ(y.shape(), (Shape{2, 3}));
  const double k = std::sqrt(2.0 / std::acos(-1.0)), g4 = 0.5 * 4.0 * (1.0 + std::tanh(k * (4.0 + 0.044715 * 64.0)));
  for (float v : y.to_vector()) EXPECT_NEAR(v, 8 * g4, 1e-4);  // eight GELU outputs summed
}

}  // namespace
}  // namespace tg::testing

// PyTorch parity: every op's fp32 output and gradients against goldens written by PyTorch (fp32, CPU)
// with make_goldens.py, and a small GPT-style stack (embeddings, pre-LN blocks, tied head, loss). An op
// runs either through a PARITY_OP runner below or, for ops added since, through its op database entry
// (.golden(), Note [goldens from the op database] in tests/ops/op_db.hpp): Parity.<op> either way.
// Error measure per tensor: rel = ||a - b||_2 / ||b||_2 (||a - b||_2 when ||b|| = 0), bound kMaxRelErr.
// The goldens directory is $TG_GOLDENS_DIR, else the committed tests/reference/goldens.
// A summary line with the largest relative error per op is printed at the end.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <set>

#include "golden.hpp"
#include "ops/op_db.hpp"
#include "typegrad/ops/attention.hpp"
#include "typegrad/ops/concat.hpp"
#include "typegrad/ops/cross_entropy.hpp"
#include "typegrad/ops/dropout.hpp"
#include "typegrad/ops/embedding.hpp"
#include "typegrad/ops/layernorm.hpp"
#include "typegrad/ops/masked_fill.hpp"
#include "typegrad/ops/matmul.hpp"
#include "typegrad/ops/softmax.hpp"
#include "typegrad/ops/unary.hpp"

namespace tg::testing {
namespace {

constexpr double kMaxRelErr = 1e-5;

using X = std::vector<Tensor<float>>;
using I = std::vector<Tensor<std::int64_t>>;
using A = std::vector<double>;
using Runner = std::function<Tensor<float>(const X&, const I&, const A&)>;

std::string goldens_dir() {
  if (const char* env = std::getenv("TG_GOLDENS_DIR"); env && *env) return env;
  return TG_GOLDENS_DEFAULT_DIR;
}
std::string golden_path(const std::string& name) { return goldens_dir() + "/" + name + ".tgg"; }

// ---- the summary: largest relative error per op ---------------------------------------------------
std::map<std::string, double>& worst_errors() {
  static std::map<std::string, double> m;
  return m;
}
std::set<std::string>& op_names() {
  static std::set<std::string> s;
  return s;
}
class SummaryEnvironment : public ::testing::Environment {
 public:
  void TearDown() override {
    std::printf("[parity] goldens: %s\n", goldens_dir().c_str());
    std::printf("[parity] max relative error per op (fp32, ||a-b||/||b||, bound %.0e):", kMaxRelErr);
    for (const auto& [op, err] : worst_errors()) std::printf(" %s=%.2e", op.c_str(), err);
    if (worst_errors().empty()) std::printf(" (no op ran)");
    std::printf("\n");
  }
};
[[maybe_unused]] ::testing::Environment* const summary_env = ::testing::AddGlobalTestEnvironment(new SummaryEnvironment);

/// ||got - want|| / ||want|| over the finite elements; equal infinities count as equal, anything else
/// non-finite (NaN, an infinity on one side only) makes the error infinite.
double rel_error(const std::vector<float>& got, const std::vector<float>& want) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(want[i]) || !std::isfinite(got[i])) {
      if (!(got[i] == want[i])) return INFINITY;
      continue;
    }
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    num += d * d;
    den += static_cast<double>(want[i]) * want[i];
  }
  if (std::isnan(num)) return INFINITY;
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

/// Compares one tensor; records its error under `op`; returns the error.
double expect_match(const std::string& op, const std::string& what, const Tensor<float>& got, const Tensor<float>& want) {
  EXPECT_EQ(to_string(got.shape()), to_string(want.shape())) << what << ": shape";
  if (!(got.shape() == want.shape())) return INFINITY;
  const double err = rel_error(got.to_vector(), want.to_vector());
  double& worst = worst_errors()[op];
  worst = std::max(worst, err);
  EXPECT_LE(err, kMaxRelErr) << what << ": relative error " << err << " exceeds " << kMaxRelErr;
  return err;
}

/// Input layouts (the `layout` record): 0 contiguous, 1 stored with its last two dims swapped and viewed
/// back through a transpose, 2 every other element of a twice-as-long last dim. Same values either way.
Tensor<float> lay_out(const Tensor<float>& c, std::int64_t layout) {
  if (layout == 1 && c.dim() >= 2) {
    const Tensor<float> stored = c.transpose(-1, -2).contiguous_raw();
    Shape sz = stored.shape(), st = stored.strides();
    std::swap(sz[sz.size() - 1], sz[sz.size() - 2]);
    std::swap(st[st.size() - 1], st[st.size() - 2]);
    return stored.as_strided_raw(sz, st, 0);
  }
  if (layout == 2 && c.dim() >= 1) {
    Shape wide = c.shape();
    wide[wide.size() - 1] *= 2;
    const Tensor<float> storage = Tensor<float>::full(wide, 1e30);  // loud if a kernel reads the gaps
    Shape st = contiguous_strides(wide);
    st[st.size() - 1] = 2;
    const Tensor<float> view = storage.as_strided_raw(c.shape(), st, 0);
    detail::copy_tensor(c, view);
    return view;
  }
  return c;
}

/// Runs every case of <op>.tgg: forward vs `out`, then backward of sum(out * u) vs `dx<k>`.
void check_op(const std::string& op, const Runner& run) {
  const GoldenFile g = GoldenFile::load(golden_path(op));
  std::vector<std::string> cases;
  for (const auto& r : g.records())
    if (r.name.size() > 4 && r.name.ends_with("/out")) cases.push_back(r.name.substr(0, r.name.size() - 4));
  ASSERT_FALSE(cases.empty()) << g.path() << " holds no cases";
  double worst = 0;
  for (const auto& c : cases) {
    SCOPED_TRACE(op + "/" + c);
    const A args = g.f64(c + "/args");
    const Tensor<std::int64_t> layout = g.i64(c + "/layout");
    X xs;
    std::vector<bool> wants_grad;
    for (int k = 0; g.has(c + "/x" + std::to_string(k)); ++k) {
      Tensor<float> x = lay_out(g.f32(c + "/x" + std::to_string(k)), k < layout.numel() ? layout.data()[k] : 0);
      wants_grad.push_back(g.has(c + "/dx" + std::to_string(k)));
      if (wants_grad.back()) x.requires_grad_();
      xs.push_back(x);
    }
    I idx;
    for (int k = 0; g.has(c + "/idx" + std::to_string(k)); ++k) idx.push_back(g.i64(c + "/idx" + std::to_string(k)));
    const Tensor<float> out = run(xs, idx, args);
    worst = std::max(worst, expect_match(op, c + " output", out, g.f32(c + "/out")));
    if (std::none_of(wants_grad.begin(), wants_grad.end(), [](bool b) { return b; })) continue;
    ASSERT_TRUE(out.requires_grad()) << c << ": the output does not require grad";
    out.backward(g.f32(c + "/u"));
    for (std::size_t k = 0; k < xs.size(); ++k) {
      if (!wants_grad[k]) continue;
      const Tensor<float> want = g.f32(c + "/dx" + std::to_string(k));
      const Tensor<float> got = xs[k].grad().defined() ? xs[k].grad() : Tensor<float>::zeros(xs[k].shape());
      worst = std::max(worst, expect_match(op, c + " gradient of input " + std::to_string(k), got, want));
    }
  }
  std::printf("[parity] %-20s %zu cases, max rel error %.3e\n", op.c_str(), cases.size(), worst);
}

struct OpRegistrar {
  explicit OpRegistrar(const char* name) { op_names().insert(name); }
};

// PARITY_OP(name) { body }: a runner (x, idx, a) -> output and a test Parity.name over goldens/<name>.tgg.
#define PARITY_OP(name)                                                         \
  Tensor<float> parity_run_##name(const X& x, const I& idx, const A& a);        \
  const OpRegistrar parity_reg_##name{#name};                                   \
  TEST(Parity, name) { check_op(#name, parity_run_##name); }                    \
  Tensor<float> parity_run_##name([[maybe_unused]] const X& x, [[maybe_unused]] const I& idx, [[maybe_unused]] const A& a)

std::int64_t ia(const A& a, std::size_t k) { return static_cast<std::int64_t>(a.at(k)); }

/// sum / mean: a = [keepdim, dims...]; no dims = all.
template <class F>
Tensor<float> reduce_call(F f, const Tensor<float>& x, const A& a) {
  const bool keep = a.at(0) != 0;
  switch (a.size()) {
    case 1: return f(x, {}, false);
    case 2: return f(x, {ia(a, 1)}, keep);
    case 3: return f(x, {ia(a, 1), ia(a, 2)}, keep);
    default: return f(x, {ia(a, 1), ia(a, 2), ia(a, 3)}, keep);
  }
}
Shape shape_of(const A& a, std::size_t from = 0) {
  Shape s;
  for (std::size_t k = from; k < a.size(); ++k) s.push_back(ia(a, k));
  return s;
}

// ---- binary arithmetic, reductions ----------------------------------------------------------------
PARITY_OP(add) { return tg::add(x[0], x[1]); }
PARITY_OP(sub) { return tg::sub(x[0], x[1]); }
PARITY_OP(mul) { return tg::mul(x[0], x[1]); }
PARITY_OP(div) { return tg::div(x[0], x[1]); }
PARITY_OP(neg) { return tg::neg(x[0]); }
PARITY_OP(scalar_arith) { return (2.0 - x[0] * 3.0) / 4.0 + 1.0; }
PARITY_OP(sum) {
  return reduce_call([](const Tensor<float>& t, std::initializer_list<std::int64_t> d, bool k) { return tg::sum(t, d, k); }, x[0], a);
}
PARITY_OP(mean) {
  return reduce_call([](const Tensor<float>& t, std::initializer_list<std::int64_t> d, bool k) { return tg::mean(t, d, k); }, x[0], a);
}
PARITY_OP(max) { return tg::max(x[0], ia(a, 0), a.at(1) != 0); }

// ---- views and copies -----------------------------------------------------------------------------
PARITY_OP(reshape) { return x[0].reshape(shape_of(a)); }
PARITY_OP(transpose) { return x[0].transpose(ia(a, 0), ia(a, 1)); }
PARITY_OP(permute) {
  if (a.size() == 3) return x[0].permute({ia(a, 0), ia(a, 1), ia(a, 2)});
  return x[0].permute({ia(a, 0), ia(a, 1), ia(a, 2), ia(a, 3)});
}
PARITY_OP(slice) { return x[0].slice(ia(a, 0), ia(a, 1), ia(a, 2), ia(a, 3)); }
PARITY_OP(narrow) { return x[0].narrow(ia(a, 0), ia(a, 1), ia(a, 2)); }
PARITY_OP(expand) { return x[0].expand(shape_of(a)); }
PARITY_OP(squeeze_unsqueeze) { return x[0].squeeze(ia(a, 0)).unsqueeze(ia(a, 1)); }
PARITY_OP(contiguous) { return x[0].contiguous(); }
PARITY_OP(to) {
  switch (ia(a, 0)) {
    case 0: return x[0].to<fp64>().to<fp32>();
    case 1: return x[0].to<bf16>().to<fp32>();
    default: return x[0].to<fp16>().to<fp32>();
  }
}

// ---- unary elementwise, masked_fill, dropout (eval) --------------------------------------------------
PARITY_OP(exp) { return tg::exp(x[0]); }
PARITY_OP(log) { return tg::log(x[0]); }
PARITY_OP(sqrt) { return tg::sqrt(x[0]); }
PARITY_OP(rsqrt) { return tg::rsqrt(x[0]); }
PARITY_OP(tanh) { return tg::tanh(x[0]); }
PARITY_OP(sigmoid) { return tg::sigmoid(x[0]); }
PARITY_OP(relu) { return tg::relu(x[0]); }
PARITY_OP(silu) { return tg::silu(x[0]); }
PARITY_OP(gelu) { return tg::gelu(x[0]); }
PARITY_OP(gelu_tanh) { return tg::gelu(x[0], GeluApprox::tanh); }
PARITY_OP(masked_fill) { return tg::masked_fill(x[0], idx[0].to<std::uint8_t>(), a.at(0)); }
PARITY_OP(dropout_eval) {
  Generator gen(1);
  return tg::dropout(x[0], a.at(0), gen, /*training=*/false);
}

// ---- concat, split ----------------------------------------------------------------------------------
PARITY_OP(concat) { return tg::concat(x, ia(a, 0)); }
PARITY_OP(split) {
  const std::int64_t dim = ia(a, 0);
  std::vector<Tensor<float>> pieces;
  if (ia(a, 1) == 0) {
    std::vector<std::int64_t> sizes;
    for (std::size_t k = 2; k < a.size(); ++k) sizes.push_back(ia(a, k));
    pieces = tg::split(x[0], sizes, dim);
  } else {
    pieces = tg::split(x[0], ia(a, 2), dim);
  }
  for (std::size_t k = 0; k < pieces.size(); ++k) pieces[k] = pieces[k] * static_cast<double>(k + 1);
  return tg::concat(pieces, dim);
}

// ---- softmax, norms, embedding, loss, matmul, linear, attention --------------------------------------
/// typegrad's softmax runs over the last dim; another dim goes through a transpose (a view) each way.
template <class F>
Tensor<float> along_dim(F f, const Tensor<float>& x, std::int64_t dim) {
  const int d = wrap_dim(dim, x.dim(), "along_dim");
  if (d == x.dim() - 1) return f(x);
  return f(x.transpose(d, -1)).transpose(d, -1);
}
PARITY_OP(softmax) {
  return along_dim([](const Tensor<float>& t) { return tg::softmax(t); }, x[0], ia(a, 0));
}
PARITY_OP(log_softmax) {
  return along_dim([](const Tensor<float>& t) { return tg::log_softmax(t); }, x[0], ia(a, 0));
}
PARITY_OP(layernorm) { return tg::layernorm(x[0], x[1], x[2], a.at(0)); }
PARITY_OP(rmsnorm) { return tg::rmsnorm(x[0], x[1], a.at(0)); }
PARITY_OP(embedding) { return tg::embedding(x[0], idx[0]); }
PARITY_OP(cross_entropy) { return tg::cross_entropy(x[0], idx[0], ia(a, 0)); }
PARITY_OP(matmul) { return tg::matmul(x[0], x[1]); }
PARITY_OP(linear) { return a.at(0) != 0 ? tg::linear(x[0], x[1], x[2]) : tg::linear(x[0], x[1]); }
PARITY_OP(linear_gelu_tanh) {
  return a.at(0) != 0 ? tg::linear_gelu_tanh(x[0], x[1], x[2]) : tg::linear_gelu_tanh(x[0], x[1]);
}
PARITY_OP(causal_attention) { return tg::causal_attention(x[0], x[1], x[2]); }
PARITY_OP(attention_composite) { return tg::attention_composite(x[0], x[1], x[2]); }

// ---- the GPT stack ---------------------------------------------------------------------------------
// Written with the library's ops (not nn::GPT, so every step is visible here), parameters from the
// golden file with GPT-2's names and nn.Linear's [out, in] layout.
TEST(Parity, gpt) {
  const GoldenFile g = GoldenFile::load(golden_path("gpt"));
  const Tensor<std::int64_t> cfg = g.i64("config");  // V, C, H, T, B, L
  const std::int64_t V = cfg.data()[0], C = cfg.data()[1], H = cfg.data()[2], T = cfg.data()[3], B = cfg.data()[4],
                     L = cfg.data()[5], hs = C / H;
  const float eps = static_cast<float>(g.f64("eps").at(0));
  const std::int64_t ignore_index = g.i64("ignore_index").data()[0];
  std::map<std::string, Tensor<float>> P;
  for (const auto& r : g.records())
    if (r.name.starts_with("param/")) P[r.name.substr(6)] = g.f32(r.name).requires_grad_();
  auto p = [&](const std::string& name) -> const Tensor<float>& {
    auto it = P.find(name);
    if (it == P.end()) throw Error("gpt golden: no parameter '", name, "'");
    return it->second;
  };
  const Tensor<std::int64_t> idx = g.i64("idx"), targets = g.i64("targets");  // (B,T)

  Tensor<float> x = add(embedding(p("wte.weight"), idx), embedding(p("wpe.weight"), Tensor<std::int64_t>::arange(T)));  // (B,T,C)
  for (std::int64_t l = 0; l < L; ++l) {
    const std::string h = "h." + std::to_string(l) + ".";
    const Tensor<float> a_in = layernorm(x, p(h + "ln_1.weight"), p(h + "ln_1.bias"), eps);
    const Tensor<float> qkv = linear(a_in, p(h + "attn.c_attn.weight"), p(h + "attn.c_attn.bias"));  // (B,T,3C)
    auto heads = [&](std::int64_t part) {  // (B,H,T,hs)
      return qkv.narrow(2, part * C, C).reshape({B, T, H, hs}).transpose(1, 2).contiguous();
    };
    const Tensor<float> y = causal_attention(heads(0), heads(1), heads(2));  // (B,H,T,hs)
    x = add(x, linear(y.transpose(1, 2).reshape({B, T, C}), p(h + "attn.c_proj.weight"), p(h + "attn.c_proj.bias")));
    const Tensor<float> m_in = layernorm(x, p(h + "ln_2.weight"), p(h + "ln_2.bias"), eps);
    const Tensor<float> fc = gelu(linear(m_in, p(h + "mlp.c_fc.weight"), p(h + "mlp.c_fc.bias")), GeluApprox::tanh);  // (B,T,4C)
    x = add(x, linear(fc, p(h + "mlp.c_proj.weight"), p(h + "mlp.c_proj.bias")));
  }
  x = layernorm(x, p("ln_f.weight"), p("ln_f.bias"), eps);
  const Tensor<float> logits = linear(x, p("wte.weight"));  // tied LM head, (B,T,V)
  const Tensor<float> loss = cross_entropy(logits.reshape({B * T, V}), targets.reshape({B * T}), ignore_index);

  expect_match("gpt", "logits", logits, g.f32("logits"));
  expect_match("gpt", "loss", loss, g.f32("loss"));
  loss.backward();
  double worst = 0;
  for (const auto& [name, t] : P) {
    ASSERT_TRUE(t.grad().defined()) << name << " got no gradient";
    worst = std::max(worst, expect_match("gpt", "gradient of " + name, t.grad(), g.f32("grad/" + name)));
  }
  std::printf("[parity] %-20s %zu parameters, loss %.6f (torch %.6f), max gradient rel error %.3e\n", "gpt", P.size(),
              static_cast<double>(loss.item()), static_cast<double>(g.f32("loss").item()), worst);
}

// ---- op database entries with a golden (Note [goldens from the op database]) -------------------------
/// Registers Parity.<golden file> for every op database entry marked .golden(): the entry's fp32 function
/// on the golden's inputs, with the golden's args as the sample's args.
void register_op_db_goldens() {
  for (const OpEntry& e : op_db()) {
    if (e.golden_file.empty()) continue;
    const std::string file = e.golden_file;
    const bool duplicate = op_names().count(file) != 0;
    op_names().insert(file);
    Runner run = [&e](const X& x, const I& idx, const A& a) { return e.f32(x, idx, Sample{e.name, {}, {}, a}); };
    auto body = [file, run, duplicate] {
      ASSERT_FALSE(duplicate) << file << ".tgg has a PARITY_OP runner and an op database entry marked .golden(): keep one";
      check_op(file, run);
    };
    ::testing::RegisterTest("Parity", file.c_str(), nullptr, nullptr, __FILE__, __LINE__, [body]() -> ::testing::Test* {
      struct Body : ::testing::Test {
        decltype(body) f;
        explicit Body(decltype(body) fn) : f(std::move(fn)) {}
        void TestBody() override { f(); }
      };
      return new Body(body);
    });
  }
}

// ---- the goldens directory and the tests agree -----------------------------------------------------
const std::set<std::string> kNonOpGoldens = {"gpt"};

TEST(Parity, every_golden_file_has_a_test) {
  namespace fs = std::filesystem;
  ASSERT_TRUE(fs::is_directory(goldens_dir())) << goldens_dir() << " is not a directory";
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(goldens_dir()))
    if (e.path().extension() == ".tgg") files.insert(e.path().stem().string());
  for (const auto& f : files)
    EXPECT_TRUE(op_names().count(f) || kNonOpGoldens.count(f)) << f << ".tgg has no parity test";
  for (const auto& op : op_names()) EXPECT_TRUE(files.count(op)) << "no golden file " << op << ".tgg in " << goldens_dir();
}

// ---- the reader rejects bad files -----------------------------------------------------------------
std::vector<unsigned char> good_file_bytes() {
  std::vector<unsigned char> b(kGoldenMagic, kGoldenMagic + 8);
  auto put = [&](const void* p, std::size_t n) {
    const auto* c = static_cast<const unsigned char*>(p);
    b.insert(b.end(), c, c + n);
  };
  const std::uint32_t count = 1, name_len = 1, rank = 2;
  const std::uint8_t code = 1;
  const std::int64_t dims[2] = {2, 3};
  const float data[6] = {1, 2, 3, 4, 5, 6};
  put(&count, 4);
  put(&name_len, 4);
  put("w", 1);
  put(&code, 1);
  put(&rank, 4);
  put(dims, 16);
  put(data, 24);
  return b;
}
void expect_rejected(const std::vector<unsigned char>& bytes, const std::string& problem) {
  try {
    GoldenFile::parse("bad.tgg", bytes);
    ADD_FAILURE() << "accepted a file that should fail with '" << problem << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("bad.tgg"), std::string::npos) << msg;
    EXPECT_NE(msg.find(problem), std::string::npos) << msg;
  }
}

TEST(GoldenReader, reads_a_good_file) {
  const GoldenFile g = GoldenFile::parse("good.tgg", good_file_bytes());
  const Tensor<float> w = g.f32("w");
  EXPECT_EQ(to_string(w.shape()), "[2,3]");
  EXPECT_EQ(w.at({1, 2}), 6.f);
}
TEST(GoldenReader, rejects_wrong_magic) {
  auto b = good_file_bytes();
  b[7] = '2';
  expect_rejected(b, "wrong magic");
  expect_rejected({'T', 'G'}, "wrong magic");
}
TEST(GoldenReader, rejects_truncated_records) {
  const auto b = good_file_bytes();
  for (std::size_t cut : {10ul, 14ul, 17ul, 20ul, 30ul, b.size() - 1})
    expect_rejected(std::vector<unsigned char>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(cut)), "truncated record");
}
TEST(GoldenReader, rejects_dims_overflow) {
  auto b = good_file_bytes();
  const std::int64_t huge = std::int64_t(1) << 40;
  std::memcpy(b.data() + 8 + 4 + 4 + 1 + 1 + 4, &huge, 8);
  std::memcpy(b.data() + 8 + 4 + 4 + 1 + 1 + 4 + 8, &huge, 8);
  expect_rejected(b, "dims overflow");
}
TEST(GoldenReader, rejects_bad_headers) {
  auto b = good_file_bytes();
  b[8 + 4 + 4 + 1] = 9;  // dtype code
  expect_rejected(b, "unknown dtype code 9");
  b = good_file_bytes();
  b[8 + 4 + 4 + 1 + 1] = 12;  // rank
  expect_rejected(b, "rank 12 exceeds");
  b = good_file_bytes();
  b.push_back(0);
  expect_rejected(b, "trailing bytes");
  EXPECT_THROW(GoldenFile::load("/nonexistent/x.tgg"), Error);
}
TEST(GoldenReader, load_names_the_file_of_a_truncated_golden) {
  // A committed golden cut short on disk: the message names the path and the problem.
  const GoldenFile whole = GoldenFile::load(golden_path("add"));
  std::ifstream in(golden_path("add"), std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_GT(bytes.size(), 100u);
  const std::string path = (std::filesystem::temp_directory_path() / "tg_parity_truncated.tgg").string();
  {
    std::ofstream out(path, std::ios::binary);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size() - 7));
  }
  try {
    GoldenFile::load(path);
    ADD_FAILURE() << "accepted a truncated file";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ": truncated record"), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
  EXPECT_FALSE(whole.records().empty());
}

}  // namespace
}  // namespace tg::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // The op database's own behaviour tests (OpDb_*) come with its entries; they run in test_ops, not here.
  if (std::string(GTEST_FLAG_GET(filter)) == "*") GTEST_FLAG_SET(filter, "-OpDb_*");
  tg::testing::register_op_db_goldens();
  return RUN_ALL_TESTS();
}

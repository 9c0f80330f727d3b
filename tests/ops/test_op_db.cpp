// Generic typed tests over the op database (op_db.hpp): forward vs the fp64 reference in every precision,
// central finite-difference gradcheck in fp64, fp32/bf16/fp16 gradients vs fp64 gradients, CUDA vs CPU
// (forward and gradients, fp32/bf16/fp16; skipped without a GPU), error messages, and a coverage check
// that every op recorded by the library has an entry.
// Tests are registered one per (op, sample, check, precision), so CTest names say what failed.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "ops/op_db.hpp"

namespace tg::testing {

namespace {

template <class T>
constexpr int precision_index() {
  if constexpr (std::is_same_v<T, fp64>) return 0;
  else if constexpr (std::is_same_v<T, fp32>) return 1;
  else if constexpr (std::is_same_v<T, bf16>) return 2;
  else return 3;
}

template <class T>
const OpFn<T>& fn_for(const OpEntry& e) {
  if constexpr (std::is_same_v<T, fp64>) return e.f64;
  else if constexpr (std::is_same_v<T, fp32>) return e.f32;
  else if constexpr (std::is_same_v<T, bf16>) return e.bf;
  else return e.h;
}

std::uint64_t seed_of(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

/// Base values (contiguous, spec.shape) for input k of a sample.
Tensor<double> base_values(const OpEntry& e, const Sample& s, std::size_t k) {
  Generator gen(seed_of(e.name + "/" + s.name + "/" + std::to_string(k)));
  const InputSpec& spec = s.inputs[k];
  return Tensor<double>::uniform(spec.shape, static_cast<float>(spec.lo), static_cast<float>(spec.hi), gen);
}

/// Lays `base` (contiguous) out as spec.layout asks, in precision T on device D, as a fresh leaf (on CUDA
/// the views are rebuilt there, so device kernels see the same strides as the CPU's).
template <class T, class D = cpu>
Tensor<T, D> lay_out(const Tensor<double>& base, const InputSpec& spec) {
  const Tensor<T, D> c = on_device_of(Tensor<T, D>(), base.to<T>().detach()).detach();
  if (spec.layout == InputSpec::Layout::transposed && c.dim() >= 2) {
    const Tensor<T, D> stored = c.transpose(-1, -2).contiguous_raw();  // storage with the last two dims swapped
    Shape sz = stored.shape(), st = stored.strides();
    std::swap(sz[sz.size() - 1], sz[sz.size() - 2]);
    std::swap(st[st.size() - 1], st[st.size() - 2]);
    return stored.as_strided_raw(sz, st, 0);
  }
  if (spec.layout == InputSpec::Layout::strided && c.dim() >= 1) {
    Shape wide = c.shape();
    wide[wide.size() - 1] *= 2;
    Tensor<T, D> storage = Tensor<T, D>::full(wide, 1e9);  // garbage in the gaps: a kernel reading them fails loudly
    Shape st = contiguous_strides(wide);
    st[st.size() - 1] = 2;
    Tensor<T, D> view = storage.as_strided_raw(c.shape(), st, 0);
    detail::copy_tensor(c, view);
    return view;
  }
  return c.contiguous_raw().clone().detach();
}

std::vector<Tensor<std::int64_t>> make_indices(const OpEntry& e, const Sample& s) {
  std::vector<Tensor<std::int64_t>> out;
  for (std::size_t k = 0; k < s.indices.size(); ++k) {
    const IndexSpec& spec = s.indices[k];
    Generator gen(seed_of(e.name + "/" + s.name + "/idx" + std::to_string(k)));
    Tensor<std::int64_t> t = Tensor<std::int64_t>::empty(spec.shape);
    for (std::int64_t i = 0; i < t.numel(); ++i)
      t.data()[i] = spec.lo + static_cast<std::int64_t>(gen.next_u64() % static_cast<std::uint64_t>(spec.hi - spec.lo));
    out.push_back(t);
  }
  return out;
}

struct Mismatch {
  double worst = 0;  // max of |a-b| / (atol + rtol |b|)
  std::int64_t where = -1;
  double got = 0, want = 0;
};
Mismatch compare(const std::vector<double>& got, const std::vector<double>& want, Tol tol) {
  Mismatch m;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    double r;
    if (std::isnan(w) || std::isnan(g)) r = (std::isnan(w) && std::isnan(g)) ? 0 : INFINITY;
    else if (std::isinf(w) || std::isinf(g)) r = g == w ? 0 : INFINITY;
    else r = std::abs(g - w) / (tol.atol + tol.rtol * std::abs(w));
    if (r > m.worst) m = {r, static_cast<std::int64_t>(i), g, w};
  }
  return m;
}
void expect_close(const std::vector<double>& got, const std::vector<double>& want, Tol tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what << ": sizes differ";
  const Mismatch m = compare(got, want, tol);
  EXPECT_LE(m.worst, 1.0) << what << ": element " << m.where << " is " << m.got << ", expected " << m.want
                          << " (atol " << tol.atol << ", rtol " << tol.rtol << ")";
}

template <class T, class D = cpu>
std::vector<Tensor<T, D>> inputs_in(const OpEntry& e, const Sample& s) {
  std::vector<Tensor<T, D>> xs;
  for (std::size_t k = 0; k < s.inputs.size(); ++k) xs.push_back(lay_out<T, D>(base_values(e, s, k), s.inputs[k]));
  return xs;
}
/// The T-rounded inputs, back in fp64 (so the reference sees exactly what the op saw).
template <class T>
std::vector<Tensor<double>> rounded_inputs(const OpEntry& e, const Sample& s) {
  std::vector<Tensor<double>> xs;
  for (std::size_t k = 0; k < s.inputs.size(); ++k)
    xs.push_back(lay_out<double>(base_values(e, s, k).to<T>().detach().template to<double>().detach(), s.inputs[k]));
  return xs;
}

template <class T>
void check_forward(const OpEntry& e, const Sample& s) {
  const auto idx = make_indices(e, s);
  const Tensor<T> out = fn_for<T>(e)(inputs_in<T>(e, s), idx, s);
  std::vector<Tensor<double>> contiguous_ref_inputs;
  for (auto& x : rounded_inputs<T>(e, s)) contiguous_ref_inputs.push_back(x.contiguous_raw());
  const Tensor<double> want = e.ref(contiguous_ref_inputs, idx, s);
  ASSERT_EQ(out.shape(), want.shape()) << "output shape";
  expect_close(out.template to<double>().to_vector(), want.to_vector(), e.tol.fwd[precision_index<T>()],
               e.name + "/" + s.name + " forward in " + std::string(dtype_traits<T>::name));
}

/// Gradients of sum(op(x) · u) w.r.t. the differentiable inputs, computed by backward in precision T.
template <class T>
std::vector<std::vector<double>> analytic_grads(const OpEntry& e, const Sample& s, std::vector<Tensor<T>> xs,
                                                const Tensor<double>& u64) {
  const auto idx = make_indices(e, s);
  for (std::size_t k = 0; k < xs.size(); ++k)
    if (s.inputs[k].differentiable) xs[k].requires_grad_();
  Tensor<T> out = fn_for<T>(e)(xs, idx, s);
  out.backward(u64.to<T>().detach());
  std::vector<std::vector<double>> grads;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    if (!s.inputs[k].differentiable) continue;
    const Tensor<T> g = xs[k].grad();
    grads.push_back(g.defined() ? g.template to<double>().to_vector() : std::vector<double>(static_cast<std::size_t>(xs[k].numel()), 0.0));
  }
  return grads;
}

Tensor<double> upstream_for(const OpEntry& e, const Sample& s, const Shape& out_shape) {
  Generator gen(seed_of(e.name + "/" + s.name + "/upstream"));
  return Tensor<double>::uniform(out_shape, -1.f, 1.f, gen);
}

Shape output_shape(const OpEntry& e, const Sample& s) {
  NoGrad ng;
  return e.f64(inputs_in<double>(e, s), make_indices(e, s), s).shape();
}

void check_gradcheck(const OpEntry& e, const Sample& s) {
  const Tensor<double> u = upstream_for(e, s, output_shape(e, s));
  const std::vector<Tensor<double>> xs = inputs_in<double>(e, s);
  const auto analytic = analytic_grads<double>(e, s, xs, u);
  const auto idx = make_indices(e, s);
  auto objective = [&](const std::vector<Tensor<double>>& in) {
    NoGrad ng;
    const auto o = e.f64(in, idx, s).to_vector();
    const auto uv = u.to_vector();
    double acc = 0;
    for (std::size_t i = 0; i < o.size(); ++i) acc += o[i] * uv[i];
    return acc;
  };
  std::size_t g = 0;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    if (!s.inputs[k].differentiable) continue;
    // Perturb up to 48 positions per input (all of them for small inputs), spread over the tensor.
    const std::int64_t n = xs[k].numel();
    const std::int64_t step = std::max<std::int64_t>(1, n / 48);
    std::vector<double> numeric, picked;
    for (std::int64_t i = 0; i < n; i += step) {
      const auto mi = unravel(i, xs[k].shape());
      std::int64_t off = 0;
      for (int d = 0; d < xs[k].dim(); ++d) off += mi[d] * xs[k].strides()[d];
      double* p = xs[k].data() + off;
      const double saved = *p, h = e.gradcheck_eps * std::max(1.0, std::abs(saved));
      std::vector<Tensor<double>> plus = xs, minus = xs;
      *p = saved + h;
      const double fp = objective(xs);
      *p = saved - h;
      const double fm = objective(xs);
      *p = saved;
      numeric.push_back((fp - fm) / (2 * h));
      picked.push_back(analytic[g][static_cast<std::size_t>(i)]);
    }
    expect_close(picked, numeric, Tol{1e-6, 1e-4}, e.name + "/" + s.name + " gradcheck of input " + std::to_string(k));
    ++g;
  }
}

template <class T>
void check_grad_precision(const OpEntry& e, const Sample& s) {
  const Tensor<double> u = upstream_for(e, s, output_shape(e, s)).to<T>().detach().template to<double>().detach();
  const auto want = analytic_grads<double>(e, s, rounded_inputs<T>(e, s), u);
  const auto got = analytic_grads<T>(e, s, inputs_in<T>(e, s), u);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t k = 0; k < got.size(); ++k)
    expect_close(got[k], want[k], e.tol.grad[precision_index<T>()],
                 e.name + "/" + s.name + " gradient " + std::to_string(k) + " in " + std::string(dtype_traits<T>::name));
}

// ---- CUDA vs CPU -------------------------------------------------------------------------------------
// Note [CPU-vs-CUDA tolerances]
// Both backends compute in accum_t<T> (fp32 for 16-bit storage) and round once on store, so they differ
// only by summation order and libm-vs-CUDA-math ulps. Each is within the entry's tolerance of the fp64
// reference, so their distance is within twice that: the CUDA tests use 2x the entry's per-precision
// tolerances (exact entries, such as masked_fill, stay exact; dropout masks must agree bit for bit).
template <class T>
const OpFn<T, cuda>& cuda_fn_for(const OpEntry& e) {
  if constexpr (std::is_same_v<T, fp32>) return e.cuda32;
  else if constexpr (std::is_same_v<T, bf16>) return e.cuda_bf;
  else return e.cuda_h;
}
Tol doubled(Tol t) { return {2 * t.atol, 2 * t.rtol}; }

#define TG_SKIP_WITHOUT_GPU()                                                                          \
  if (backend::cuda::device_count() == 0)                                                               \
  GTEST_SKIP() << "no CUDA device (" << backend::cuda::device_description()                             \
               << "): the CPU-vs-CUDA comparison runs only on a GPU machine (scripts/gpu-check.sh)"

template <class T>
void check_cuda_forward(const OpEntry& e, const Sample& s) {
  TG_SKIP_WITHOUT_GPU();
  const auto idx = make_indices(e, s);
  const Tensor<T> want = fn_for<T>(e)(inputs_in<T>(e, s), idx, s);
  const Tensor<T, cuda> got = cuda_fn_for<T>(e)(inputs_in<T, cuda>(e, s), idx, s);
  ASSERT_EQ(got.shape(), want.shape()) << "output shape";
  expect_close(got.template to<cpu>().template to<double>().to_vector(), want.template to<double>().to_vector(),
               doubled(e.tol.fwd[precision_index<T>()]),
               e.name + "/" + s.name + " CUDA vs CPU forward in " + std::string(dtype_traits<T>::name));
}

template <class T, class D>
std::vector<std::vector<double>> grads_on(const OpEntry& e, const Sample& s, const OpFn<T, D>& f, const Tensor<double>& u) {
  const auto idx = make_indices(e, s);
  std::vector<Tensor<T, D>> xs = inputs_in<T, D>(e, s);
  for (std::size_t k = 0; k < xs.size(); ++k)
    if (s.inputs[k].differentiable) xs[k].requires_grad_();
  const Tensor<T, D> out = f(xs, idx, s);
  out.backward(on_device_of(out, u.to<T>().detach()));
  std::vector<std::vector<double>> grads;
  for (std::size_t k = 0; k < xs.size(); ++k) {
    if (!s.inputs[k].differentiable) continue;
    const Tensor<T, D> g = xs[k].grad();
    grads.push_back(g.defined() ? g.template to<cpu>().template to<double>().to_vector()
                                : std::vector<double>(static_cast<std::size_t>(xs[k].numel()), 0.0));
  }
  return grads;
}

template <class T>
void check_cuda_grad(const OpEntry& e, const Sample& s) {
  TG_SKIP_WITHOUT_GPU();
  const Tensor<double> u = upstream_for(e, s, output_shape(e, s));
  const auto want = grads_on<T, cpu>(e, s, fn_for<T>(e), u);
  const auto got = grads_on<T, cuda>(e, s, cuda_fn_for<T>(e), u);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t k = 0; k < got.size(); ++k)
    expect_close(got[k], want[k], doubled(e.tol.grad[precision_index<T>()]),
                 e.name + "/" + s.name + " CUDA vs CPU gradient " + std::to_string(k) + " in " +
                     std::string(dtype_traits<T>::name));
}

void check_errors(const OpEntry& e) {
  for (const auto& c : e.errors) {
    bool threw = false;
    try {
      c.run();
    } catch (const Error& err) {
      threw = true;
      EXPECT_NE(std::string(err.what()).find(c.expected), std::string::npos)
          << e.name << " error case '" << c.name << "': message \"" << err.what() << "\" lacks \"" << c.expected << "\"";
    }
    EXPECT_TRUE(threw) << e.name << " error case '" << c.name << "' did not throw tg::Error";
  }
}

/// Every name the library records on the tape (scanned from the op headers) has a database entry.
void check_coverage() {
  std::set<std::string> recorded;
  const std::regex pattern(R"re(record\(\s*"([a-z_0-9]+)")re");
  for (const auto& f : std::filesystem::recursive_directory_iterator(TG_SOURCE_DIR "/include/typegrad")) {
    if (f.path().extension() != ".hpp") continue;
    std::ifstream in(f.path());
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    for (auto it = std::sregex_iterator(text.begin(), text.end(), pattern); it != std::sregex_iterator(); ++it)
      recorded.insert((*it)[1]);
  }
  ASSERT_FALSE(recorded.empty()) << "found no recorded ops under " TG_SOURCE_DIR "/include/typegrad";
  std::set<std::string> entries;
  for (const auto& e : op_db()) entries.insert(e.name);
  for (const auto& name : recorded) EXPECT_TRUE(entries.count(name)) << "op '" << name << "' has no op database entry";
  for (const auto& e : op_db()) {
    EXPECT_FALSE(e.samples.empty()) << e.name << " has no samples";
    EXPECT_TRUE(static_cast<bool>(e.ref)) << e.name << " has no reference";
    EXPECT_TRUE(e.cuda32 && e.cuda_bf && e.cuda_h) << e.name << " has no CUDA form (build entries with make_entry)";
  }
}

template <class F>
void add_test(const std::string& suite, const std::string& name, F body) {
  ::testing::RegisterTest(suite.c_str(), name.c_str(), nullptr, nullptr, __FILE__, __LINE__,
                          [body]() -> ::testing::Test* {
                            struct Body : ::testing::Test {
                              F f;
                              explicit Body(F fn) : f(fn) {}
                              void TestBody() override { f(); }
                            };
                            return new Body(body);
                          });
}

void register_all() {
  add_test("OpDb", "Coverage", check_coverage);
  for (const OpEntry& e : op_db()) {
    const std::string suite = "OpDb_" + e.name;
    for (const Sample& s : e.samples) {
      add_test(suite, s.name + "_forward_fp64", [&e, &s] { check_forward<fp64>(e, s); });
      add_test(suite, s.name + "_forward_fp32", [&e, &s] { check_forward<fp32>(e, s); });
      add_test(suite, s.name + "_forward_bf16", [&e, &s] { check_forward<bf16>(e, s); });
      add_test(suite, s.name + "_forward_fp16", [&e, &s] { check_forward<fp16>(e, s); });
      const bool any_diff = std::any_of(s.inputs.begin(), s.inputs.end(), [](const InputSpec& i) { return i.differentiable; });
      if (e.differentiable && any_diff) {
        add_test(suite, s.name + "_gradcheck_fp64", [&e, &s] { check_gradcheck(e, s); });
        add_test(suite, s.name + "_grad_fp32", [&e, &s] { check_grad_precision<fp32>(e, s); });
        add_test(suite, s.name + "_grad_bf16", [&e, &s] { check_grad_precision<bf16>(e, s); });
        add_test(suite, s.name + "_grad_fp16", [&e, &s] { check_grad_precision<fp16>(e, s); });
      }
      add_test(suite, s.name + "_cuda_forward_fp32", [&e, &s] { check_cuda_forward<fp32>(e, s); });
      add_test(suite, s.name + "_cuda_forward_bf16", [&e, &s] { check_cuda_forward<bf16>(e, s); });
      add_test(suite, s.name + "_cuda_forward_fp16", [&e, &s] { check_cuda_forward<fp16>(e, s); });
      if (e.differentiable && any_diff) {
        add_test(suite, s.name + "_cuda_grad_fp32", [&e, &s] { check_cuda_grad<fp32>(e, s); });
        add_test(suite, s.name + "_cuda_grad_bf16", [&e, &s] { check_cuda_grad<bf16>(e, s); });
        add_test(suite, s.name + "_cuda_grad_fp16", [&e, &s] { check_cuda_grad<fp16>(e, s); });
      }
    }
    if (!e.errors.empty()) add_test(suite, "errors", [&e] { check_errors(e); });
  }
}

}  // namespace
}  // namespace tg::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  tg::testing::register_all();
  return RUN_ALL_TESTS();
}

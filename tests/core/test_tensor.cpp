// Tests of Tensor<T, cpu>: factories, strides, views (and that they share storage), conversions, element
// access, printing, and tape autodiff basics (views, binary ops, broadcasting, accumulation, release).
//   ./build/cpu/tests/test_tensor --gtest_filter='TensorViews*:Autodiff*'
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "typegrad/typegrad.hpp"

namespace test_tensor_cpp {  // the file's own names (Note [unity test sources])

namespace {

using F = tg::Tensor<tg::fp32>;
using tg::Shape;

std::vector<double> values_of(const auto& t) {
  std::vector<double> out;
  for (const auto& v : t.to_vector()) out.push_back(tg::scalar_cast<double>(v));
  return out;
}
std::vector<double> iota(int n, double start = 0) {
  std::vector<double> v(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = start + i;
  return v;
}
bool shares_storage(const auto& a, const auto& b) { return a.storage() == b.storage(); }

// ---- factories ------------------------------------------------------------------------------------------

TEST(TensorFactories, ZerosOnesFull) {
  const F z = F::zeros({2, 3});
  EXPECT_EQ(z.shape(), (Shape{2, 3}));
  EXPECT_EQ(z.numel(), 6);
  EXPECT_EQ(z.dim(), 2);
  EXPECT_EQ(values_of(z), std::vector<double>(6, 0.0));
  EXPECT_EQ(values_of(F::ones({4})), std::vector<double>(4, 1.0));
  EXPECT_EQ(values_of(F::full({3, 1, 2}, -2.5)), std::vector<double>(6, -2.5));
  EXPECT_EQ(values_of(tg::Tensor<tg::bf16>::full({2}, 1.00390625)), (std::vector<double>{1.0, 1.0}));  // rounded tie
  EXPECT_EQ(values_of(tg::Tensor<std::int64_t>::full({3}, 7.0)), (std::vector<double>{7, 7, 7}));
  // Large enough to take the parallel path.
  const F big = F::full({1 << 17}, 3.0);
  for (float v : big.to_vector()) ASSERT_EQ(v, 3.f);
  // Empty and rank-0 tensors.
  EXPECT_EQ(F::zeros({0, 5}).numel(), 0);
  const F scalar = F::full({}, 4.0);
  EXPECT_EQ(scalar.dim(), 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.item(), 4.f);
}

TEST(TensorFactories, Arange) {
  EXPECT_EQ(values_of(F::arange(5)), iota(5));
  EXPECT_EQ(values_of(F::arange(2.0, 4.0, 0.5)), (std::vector<double>{2.0, 2.5, 3.0, 3.5}));
  EXPECT_EQ(values_of(F::arange(5.0, 0.0, -2.0)), (std::vector<double>{5, 3, 1}));
  EXPECT_EQ(values_of(F::arange(0.0, 1.0, 0.3)), (std::vector<double>{0.0, 0.30000001192092896, 0.60000002384185791,
                                                                       0.89999997615814209}));
  EXPECT_EQ(F::arange(3.0, 1.0).numel(), 0);  // empty range
  EXPECT_EQ(values_of(tg::Tensor<std::int64_t>::arange(4)), iota(4));
  EXPECT_EQ(F::arange(7).shape(), (Shape{7}));
}

TEST(TensorFactories, FromValuesAndFromVector) {
  const F a = F::from_values({2, 2}, {1.5, -2, 3, 4});
  EXPECT_EQ(a.shape(), (Shape{2, 2}));
  EXPECT_EQ(a.at({0, 0}), 1.5f);
  EXPECT_EQ(a.at({0, 1}), -2.f);
  EXPECT_EQ(a.at({1, 0}), 3.f);
  const auto b = tg::Tensor<std::int32_t>::from_vector({3}, std::vector<std::int32_t>{5, 6, 7});
  EXPECT_EQ(b.to_vector(), (std::vector<std::int32_t>{5, 6, 7}));
  const auto h = tg::Tensor<tg::fp16>::from_values({2}, {0.1, 65520.0});
  EXPECT_EQ(h.at({0}).bits, 0x2e66);
  EXPECT_EQ(h.at({1}).bits, 0x7c00);  // rounds to inf
}

TEST(TensorFactories, ContiguousStridesAndAlignment) {
  const F t = F::zeros({2, 3, 4});
  EXPECT_EQ(t.strides(), (Shape{12, 4, 1}));
  EXPECT_TRUE(t.is_contiguous());
  EXPECT_EQ(t.storage_offset(), 0);
  EXPECT_EQ(t.nbytes(), 24u * sizeof(float));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(t.data()) % 64, 0u);
  EXPECT_EQ(tg::contiguous_strides({5}), (Shape{1}));
  EXPECT_EQ(tg::contiguous_strides({3, 0, 2}), (Shape{2, 2, 1}));  // a zero-size dim still gets a stride
  EXPECT_EQ(t.size(-1), 4);
  EXPECT_EQ(t.stride(0), 12);
  EXPECT_TRUE(t.defined());
  EXPECT_FALSE(F().defined());
  EXPECT_EQ(F::dtype(), tg::DType::f32);
  EXPECT_EQ(F::device(), tg::DeviceKind::cpu);
}

// ---- views ----------------------------------------------------------------------------------------------

TEST(TensorViews, ViewAndReshapeInferMinusOne) {
  const F t = F::from_values({2, 3, 4}, iota(24));
  const F v = t.view({4, -1});
  EXPECT_EQ(v.shape(), (Shape{4, 6}));
  EXPECT_EQ(v.strides(), (Shape{6, 1}));
  EXPECT_TRUE(shares_storage(v, t));
  EXPECT_EQ(values_of(v), iota(24));
  EXPECT_EQ(t.reshape({-1}).shape(), (Shape{24}));
  EXPECT_EQ(t.reshape({2, -1, 3}).shape(), (Shape{2, 4, 3}));
  EXPECT_EQ(t.flatten().shape(), (Shape{24}));
  EXPECT_TRUE(shares_storage(t.reshape({6, 4}), t));  // contiguous: no copy
}

TEST(TensorViews, ReshapeOfNonContiguousCopies) {
  const F t = F::from_values({2, 3}, iota(6));
  const F tt = t.transpose(0, 1);  // (3,2): 0 3 1 4 2 5
  ASSERT_FALSE(tt.is_contiguous());
  const F r = tt.reshape({6});
  EXPECT_FALSE(shares_storage(r, t));
  EXPECT_EQ(values_of(r), (std::vector<double>{0, 3, 1, 4, 2, 5}));
  r.set({0}, 100.f);
  EXPECT_EQ(t.at({0, 0}), 0.f);  // the copy is independent
}

TEST(TensorViews, TransposeAndPermute) {
  const F t = F::from_values({2, 3, 4}, iota(24));
  const F tr = t.transpose(0, 2);  // (4,3,2)
  EXPECT_EQ(tr.shape(), (Shape{4, 3, 2}));
  EXPECT_EQ(tr.strides(), (Shape{1, 4, 12}));
  EXPECT_FALSE(tr.is_contiguous());
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 2; ++k) ASSERT_EQ(tr.at({i, j, k}), t.at({k, j, i}));
  EXPECT_EQ(t.transpose(-1, -2).shape(), (Shape{2, 4, 3}));

  const F p = t.permute({1, 2, 0});  // (3,4,2), p[i,j,k] = t[k,i,j]
  EXPECT_EQ(p.shape(), (Shape{3, 4, 2}));
  EXPECT_EQ(p.strides(), (Shape{4, 1, 12}));
  std::vector<double> expected;
  for (int i = 0; i < 3; ++i)
    for (int j = 0; j < 4; ++j)
      for (int k = 0; k < 2; ++k) expected.push_back(k * 12 + i * 4 + j);
  EXPECT_EQ(values_of(p.contiguous()), expected);
  EXPECT_TRUE(p.contiguous().is_contiguous());
  EXPECT_EQ(t.permute({-1, 0, 1}).shape(), (Shape{4, 2, 3}));
}

TEST(TensorViews, SliceStepsNegativeIndicesAndClamping) {
  const F t = F::from_values({10}, iota(10));
  EXPECT_EQ(values_of(t.slice(0, 2, 8, 3)), (std::vector<double>{2, 5}));
  EXPECT_EQ(t.slice(0, 2, 8, 3).strides(), (Shape{3}));
  EXPECT_EQ(t.slice(0, 2, 8, 3).storage_offset(), 2);
  EXPECT_EQ(values_of(t.slice(0, 1, 10, 2)), (std::vector<double>{1, 3, 5, 7, 9}));
  EXPECT_EQ(values_of(t.slice(0, -3, -1)), (std::vector<double>{7, 8}));
  EXPECT_EQ(values_of(t.slice(0, -100, 3)), (std::vector<double>{0, 1, 2}));  // clamped start
  EXPECT_EQ(values_of(t.slice(0, 8, 100)), (std::vector<double>{8, 9}));     // clamped end
  EXPECT_EQ(t.slice(0, 6, 4).numel(), 0);                                    // empty, not negative
  EXPECT_EQ(t.slice(0, 20, 30).numel(), 0);

  const F m = F::from_values({3, 4}, iota(12));
  const F cols = m.slice(1, 1, 4, 2);  // columns 1 and 3
  EXPECT_EQ(cols.shape(), (Shape{3, 2}));
  EXPECT_EQ(values_of(cols), (std::vector<double>{1, 3, 5, 7, 9, 11}));
  EXPECT_EQ(values_of(m.slice(-2, 1, 3)), (std::vector<double>{4, 5, 6, 7, 8, 9, 10, 11}));
}

TEST(TensorViews, Narrow) {
  const F m = F::from_values({3, 4}, iota(12));
  const F n = m.narrow(1, 1, 2);
  EXPECT_EQ(n.shape(), (Shape{3, 2}));
  EXPECT_EQ(n.storage_offset(), 1);
  EXPECT_EQ(values_of(n), (std::vector<double>{1, 2, 5, 6, 9, 10}));
  EXPECT_EQ(values_of(m.narrow(0, 2, 1)), (std::vector<double>{8, 9, 10, 11}));
  EXPECT_EQ(m.narrow(-1, 4, 0).numel(), 0);
}

TEST(TensorViews, ExpandBroadcastsWithStrideZero) {
  const F row = F::from_values({3}, {1, 2, 3});
  const F e = row.expand({2, 3});
  EXPECT_EQ(e.shape(), (Shape{2, 3}));
  EXPECT_EQ(e.strides(), (Shape{0, 1}));
  EXPECT_TRUE(shares_storage(e, row));
  EXPECT_EQ(values_of(e), (std::vector<double>{1, 2, 3, 1, 2, 3}));
  const F col = F::from_values({2, 1}, {5, 6});
  const F ec = col.expand({2, -1, 4});  // -1 keeps the size
  EXPECT_EQ(ec.shape(), (Shape{2, 2, 4}));
  EXPECT_EQ(ec.strides(), (Shape{0, 1, 0}));
  EXPECT_EQ(values_of(ec), (std::vector<double>{5, 5, 5, 5, 6, 6, 6, 6, 5, 5, 5, 5, 6, 6, 6, 6}));
  row.set({1}, 20.f);
  EXPECT_EQ(e.at({1, 1}), 20.f);  // every broadcast copy sees the write
}

TEST(TensorViews, UnsqueezeSqueeze) {
  const F t = F::from_values({2, 3}, iota(6));
  EXPECT_EQ(t.unsqueeze(0).shape(), (Shape{1, 2, 3}));
  EXPECT_EQ(t.unsqueeze(1).shape(), (Shape{2, 1, 3}));
  EXPECT_EQ(t.unsqueeze(-1).shape(), (Shape{2, 3, 1}));
  EXPECT_EQ(t.unsqueeze(2).shape(), (Shape{2, 3, 1}));
  EXPECT_TRUE(shares_storage(t.unsqueeze(1), t));
  EXPECT_EQ(t.unsqueeze(1).squeeze(1).shape(), (Shape{2, 3}));
  EXPECT_EQ(values_of(t.unsqueeze(0).squeeze(0)), iota(6));
  // Squeezing a non-contiguous view keeps its element order.
  const F tt = t.transpose(0, 1).unsqueeze(0);
  EXPECT_EQ(tt.shape(), (Shape{1, 3, 2}));
  EXPECT_EQ(values_of(tt.squeeze(0)), (std::vector<double>{0, 3, 1, 4, 2, 5}));
}

TEST(TensorViews, ContiguousOfViewsHasRowMajorOrder) {
  const F t = F::from_values({3, 4}, iota(12));
  const F c = t.transpose(0, 1).slice(0, 1, 4, 2).contiguous();  // rows 1 and 3 of t^T
  EXPECT_TRUE(c.is_contiguous());
  EXPECT_EQ(c.shape(), (Shape{2, 3}));
  EXPECT_EQ(values_of(c), (std::vector<double>{1, 5, 9, 3, 7, 11}));
  EXPECT_EQ(c.strides(), (Shape{3, 1}));
  EXPECT_TRUE(shares_storage(t.contiguous(), t));  // already contiguous: self
  // Size-1 dims do not break contiguity.
  EXPECT_TRUE(t.narrow(0, 1, 1).is_contiguous());
}

TEST(TensorViews, ViewsShareStorageCloneDoesNot) {
  const F base = F::zeros({3, 4});
  base.transpose(0, 1).set({2, 1}, 7.f);  // base[1,2]
  EXPECT_EQ(base.at({1, 2}), 7.f);
  base.narrow(1, 1, 2).slice(0, 0, 3, 2).set({1, 0}, 8.f);  // base[2,1]
  EXPECT_EQ(base.at({2, 1}), 8.f);
  base.view({12}).set({0}, 9.f);
  EXPECT_EQ(base.at({0, 0}), 9.f);
  base.unsqueeze(0).set({0, 2, 3}, 10.f);
  EXPECT_EQ(base.at({2, 3}), 10.f);
  base.permute({1, 0}).set({3, 0}, 11.f);
  EXPECT_EQ(base.at({0, 3}), 11.f);

  const F cl = base.clone();
  EXPECT_FALSE(shares_storage(cl, base));
  EXPECT_EQ(values_of(cl), values_of(base));
  cl.set({0, 0}, -1.f);
  EXPECT_EQ(base.at({0, 0}), 9.f);
  // clone of a view is contiguous and in logical order.
  const F ct = base.transpose(0, 1).clone();
  EXPECT_TRUE(ct.is_contiguous());
  EXPECT_EQ(ct.at({3, 0}), 11.f);
}

// ---- conversions ----------------------------------------------------------------------------------------

TEST(TensorConversions, Fp32ToBf16ToFp32Rounds) {
  const F x = F::from_values({6}, {1.0, 1.00390625, 1.01171875, 3.14159265, -0.1, 1e30});
  const auto b = x.to<tg::bf16>();
  static_assert(std::is_same_v<decltype(b), const tg::Tensor<tg::bf16>>);
  EXPECT_EQ(b.shape(), x.shape());
  const F back = b.to<tg::fp32>();
  EXPECT_EQ(values_of(back), (std::vector<double>{1.0, 1.0, 1.015625, 3.140625, -0.10009765625,
                                                  static_cast<double>(static_cast<float>(tg::bf16(1e30f)))}));
  // Every converted value is within half a bf16 ulp (2^-8 relative).
  for (int i = 0; i < 6; ++i) EXPECT_LE(std::fabs(back.at({i}) - x.at({i})), std::fabs(x.at({i})) * 0.00390625);
}

TEST(TensorConversions, Fp64AndInt64) {
  const F x = F::from_values({2, 2}, {0.1, -2.7, 2.7, 1e6});
  const auto d = x.to<tg::fp64>();
  EXPECT_EQ(d.at({0, 0}), static_cast<double>(0.1f));  // exact widening
  EXPECT_EQ(values_of(d.to<tg::fp32>()), values_of(x));
  const auto i = x.to<std::int64_t>();
  EXPECT_EQ(i.to_vector(), (std::vector<std::int64_t>{0, -2, 2, 1000000}));  // truncation toward zero
  EXPECT_EQ(values_of(i.to<tg::fp32>()), (std::vector<double>{0, -2, 2, 1e6}));
  // A strided source converts in logical order.
  EXPECT_EQ(values_of(x.transpose(0, 1).to<tg::fp64>()), (std::vector<double>{values_of(x)[0], values_of(x)[2],
                                                                               values_of(x)[1], values_of(x)[3]}));
  // to<same type> and to<cpu> are the tensor itself.
  EXPECT_TRUE(shares_storage(x.to<tg::fp32>(), x));
  EXPECT_TRUE(shares_storage(x.to<tg::cpu>(), x));
}

// A long contiguous tensor is one row to the copy, binary and unary kernels; they cut it into pieces shared
// by the threads (detail/cpu/row_pieces.hpp). Every element, at the pieces' edges too, must come out as one
// thread computes it; with one, two and three threads (the pieces then fall on different boundaries), and
// dropout's mask must not depend on the split.
TEST(TensorConversions, LongContiguousRowsCutBetweenThreadsGiveEveryElement) {
  const std::int64_t n = 3 * (1 << 14) + 77;  // not a multiple of the piece size
  std::vector<double> a(static_cast<std::size_t>(n)), b(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    a[static_cast<std::size_t>(i)] = static_cast<double>(i % 1000) * 0.25 - 100.0;
    b[static_cast<std::size_t>(i)] = static_cast<double>((i * 7) % 997) + 0.5;
  }
  const auto xb = tg::Tensor<tg::bf16>::from_values({n}, a);
  std::vector<double> small(a.size());
  for (std::size_t k = 0; k < a.size(); ++k) small[k] = a[k] * 0.01;
  const F x = F::from_values({n}, a), y = F::from_values({n}, b), xs = F::from_values({n}, small);
  const int threads_before = tg::backend::cpu::num_threads();
  std::vector<float> exp_one_thread, dropped_one_thread;
  for (const int threads : {1, 2, 3}) {
    tg::backend::cpu::set_num_threads(threads);
    const F widened = xb.to<tg::fp32>();  // contiguous bf16 -> fp32: one row of n elements
    const F sum = tg::add(x, y);
    const auto narrowed = x.to<tg::bf16>();
    const F scaled = tg::exp(xs);
    tg::Generator gen(99), gen_rows(99);
    const F dropped = tg::dropout(y, 0.5, gen);
    // The same draw over [n, 1]: n rows of one element, never cut, index i is row i.
    const F dropped_rows = tg::dropout(y.reshape({n, 1}), 0.5, gen_rows).reshape({n});
    EXPECT_EQ(dropped.to_vector(), dropped_rows.to_vector()) << "threads " << threads;
    for (std::int64_t i = 0; i < n; ++i) {
      const auto k = static_cast<std::size_t>(i);
      ASSERT_EQ(widened.at({i}), static_cast<float>(tg::bf16(static_cast<float>(a[k])))) << "threads " << threads << ", i " << i;
      ASSERT_EQ(sum.at({i}), static_cast<float>(a[k]) + static_cast<float>(b[k])) << "threads " << threads << ", i " << i;
      ASSERT_EQ(narrowed.at({i}).bits, tg::bf16(static_cast<float>(a[k])).bits) << "threads " << threads << ", i " << i;
      const double e = std::exp(static_cast<double>(xs.at({i})));
      ASSERT_NEAR(scaled.at({i}), e, 3e-7 * e) << "threads " << threads << ", i " << i;
      const float d = dropped.at({i});
      ASSERT_TRUE(d == 0.f || d == 2.f * static_cast<float>(b[k])) << "threads " << threads << ", i " << i;
    }
    if (threads == 1) {
      exp_one_thread = scaled.to_vector();
      dropped_one_thread = dropped.to_vector();
    } else {
      EXPECT_EQ(scaled.to_vector(), exp_one_thread) << "threads " << threads;
      EXPECT_EQ(dropped.to_vector(), dropped_one_thread) << "threads " << threads;
    }
  }
  tg::backend::cpu::set_num_threads(threads_before);
}

// ---- element access ---------------------------------------------------------------------------------------

TEST(TensorElementAccess, AtSetItem) {
  const F t = F::zeros({2, 3});
  t.set({1, 2}, 5.f);
  EXPECT_EQ(t.at({1, 2}), 5.f);
  EXPECT_EQ(t.data()[5], 5.f);
  EXPECT_EQ(F::full({1, 1}, 3.0).item(), 3.f);
  EXPECT_EQ(t.narrow(1, 2, 1).narrow(0, 1, 1).item(), 5.f);
  EXPECT_THROW(t.at({2, 0}), tg::Error);    // out of range
  EXPECT_THROW(t.at({0, -1}), tg::Error);   // negative
  EXPECT_THROW(t.at({0}), tg::Error);       // rank mismatch
  EXPECT_THROW(t.set({0, 0, 0}, 1.f), tg::Error);
  EXPECT_THROW(t.item(), tg::Error);
  EXPECT_THROW(F::zeros({0}).item(), tg::Error);
}

// ---- printing ---------------------------------------------------------------------------------------------

TEST(TensorPrinting, ShowsDtypeDeviceShapeValues) {
  std::ostringstream os;
  os << F::from_values({2, 3}, {0, 1.5, 2, 3, 4, -5});
  const std::string s = os.str();
  EXPECT_NE(s.find("fp32"), std::string::npos) << s;
  EXPECT_NE(s.find("cpu"), std::string::npos) << s;
  EXPECT_NE(s.find("[2,3]"), std::string::npos) << s;
  EXPECT_NE(s.find("[[0, 1.5, 2], [3, 4, -5]]"), std::string::npos) << s;

  std::ostringstream ob;
  ob << F::from_values({2, 2}, {1, 2, 3, 4}).transpose(0, 1).to<tg::bf16>();
  EXPECT_NE(ob.str().find("Tensor<bf16, cpu> [2,2]"), std::string::npos) << ob.str();
  EXPECT_NE(ob.str().find("[[1, 3], [2, 4]]"), std::string::npos) << ob.str();  // logical order

  std::ostringstream ol;
  ol << F::arange(10);
  EXPECT_NE(ol.str().find("[0, 1, 2, ..., 7, 8, 9]"), std::string::npos) << ol.str();

  std::ostringstream ou;
  ou << F();
  EXPECT_NE(ou.str().find("undefined"), std::string::npos) << ou.str();
  std::ostringstream oi;
  oi << tg::Tensor<std::int64_t>::arange(3);
  EXPECT_NE(oi.str().find("int64"), std::string::npos) << oi.str();
}

// ---- autodiff -------------------------------------------------------------------------------------------

TEST(Autodiff, SumOfSquaresPlusBias) {
  F w = F::from_values({2, 3}, {1, -2, 3, 0.5, 0, -1});
  F b = F::from_values({2, 3}, {9, 9, 9, 9, 9, 9});
  w.requires_grad_();
  b.requires_grad_();
  const F loss = tg::sum(w * w + b);
  EXPECT_TRUE(loss.requires_grad());
  EXPECT_EQ(loss.numel(), 1);
  EXPECT_FLOAT_EQ(loss.item(), 1 + 4 + 9 + 0.25f + 0 + 1 + 54);
  loss.backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{2, -4, 6, 1, 0, -2}));  // d/dw = 2w
  EXPECT_EQ(values_of(b.grad()), std::vector<double>(6, 1.0));
  EXPECT_EQ(w.grad().shape(), w.shape());
}

TEST(Autodiff, BroadcastingGradientsSumToShape) {
  F x = F::from_values({4, 3}, iota(12));
  F row = F::from_values({3}, {1, 2, 3});
  F col = F::from_values({4, 1}, {1, 1, 2, 2});
  x.requires_grad_();
  row.requires_grad_();
  col.requires_grad_();
  // loss = sum((x + row) * col)
  const F loss = tg::sum((x + row) * col);
  loss.backward();
  EXPECT_EQ(row.grad().shape(), (Shape{3}));
  EXPECT_EQ(values_of(row.grad()), (std::vector<double>{6, 6, 6}));  // sum over rows of col
  EXPECT_EQ(col.grad().shape(), (Shape{4, 1}));
  // d/dcol[i] = sum_j (x[i,j] + row[j]) = (3i + 3i+1 + 3i+2) + 6
  EXPECT_EQ(values_of(col.grad()), (std::vector<double>{9, 18, 27, 36}));
  EXPECT_EQ(values_of(x.grad()), (std::vector<double>{1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2}));
  // sum_to_shape itself.
  const F g = F::ones({2, 4, 3});
  EXPECT_EQ(values_of(tg::sum_to_shape(g, {4, 1})), std::vector<double>(4, 6.0));
  EXPECT_EQ(values_of(tg::sum_to_shape(g, {3})), std::vector<double>(3, 8.0));
  EXPECT_EQ(tg::sum_to_shape(g, {1, 4, 1}).shape(), (Shape{1, 4, 1}));
}

TEST(Autodiff, GradientsThroughViews) {
  F w = F::from_values({2, 3}, iota(6, 1));  // 1..6
  w.requires_grad_();
  const F c = F::from_values({3, 2}, {10, 20, 30, 40, 50, 60});
  // transpose -> (3,2); multiply; sum: dw[i,j] = c[j,i]
  tg::sum(w.transpose(0, 1) * c).backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{10, 30, 50, 20, 40, 60}));
  w.zero_grad();

  // slice with a step and narrow: only the selected elements get gradient.
  tg::sum(w.slice(1, 0, 3, 2).narrow(0, 1, 1) * 3.0).backward();  // w[1,0] and w[1,2]
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{0, 0, 0, 3, 0, 3}));
  w.zero_grad();

  // view, permute, unsqueeze/squeeze, expand (broadcast: the gradient sums over the 4 copies).
  tg::sum(w.view({3, 2}).permute({1, 0}).unsqueeze(0).expand({4, 2, 3}).unsqueeze(-1).squeeze(3) * 0.5).backward();
  EXPECT_EQ(values_of(w.grad()), std::vector<double>(6, 2.0));
  w.zero_grad();

  // reshape of a non-contiguous view (a copy) and clone still reach the leaf; so does to<fp64>().
  tg::sum(w.transpose(0, 1).reshape({6}).clone().to<tg::fp64>() * tg::Tensor<tg::fp64>::arange(6)).backward();
  // element k of the reshaped transpose is w[k % 2, k / 2]: dw[i,j] = 2j + i
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{0, 2, 4, 1, 3, 5}));
  static_assert(std::is_same_v<decltype(w.grad()), F>);
}

TEST(Autodiff, SubDivAndScalarOperands) {
  F a = F::from_values({2}, {3, 4});
  F b = F::from_values({2}, {2, 8});
  a.requires_grad_();
  b.requires_grad_();
  // loss = sum(a/b - 2a + 1 - (-b)) ; d/da = 1/b - 2 ; d/db = -a/b^2 + 1
  tg::sum(a / b - 2.0 * a + 1.0 - (-b)).backward();
  EXPECT_FLOAT_EQ(a.grad().at({0}), 0.5f - 2);
  EXPECT_FLOAT_EQ(a.grad().at({1}), 0.125f - 2);
  EXPECT_FLOAT_EQ(b.grad().at({0}), -0.75f + 1);
  EXPECT_FLOAT_EQ(b.grad().at({1}), -0.0625f + 1);
}

TEST(Autodiff, GradientsAccumulateOverTwoBackwardCalls) {
  F w = F::from_values({3}, {1, 2, 3});
  w.requires_grad_();
  tg::sum(w * w).backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{2, 4, 6}));
  tg::sum(w * w).backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{4, 8, 12}));
  tg::sum(w * 10.0).backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{14, 18, 22}));
}

TEST(Autodiff, ZeroGradClearsTheGradient) {
  F w = F::ones({2});
  w.requires_grad_();
  tg::sum(w * 3.0).backward();
  ASSERT_TRUE(w.grad().defined());
  w.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  tg::sum(w * 5.0).backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{5, 5}));  // starts from zero again
}

TEST(Autodiff, NoGradRecordsNothing) {
  F w = F::ones({2, 2});
  w.requires_grad_();
  auto& tape = tg::autodiff::current_tape();
  const std::size_t before = tape.size();
  F y;
  {
    tg::NoGrad guard;
    EXPECT_FALSE(tg::autodiff::grad_enabled());
    y = tg::sum(w * w + w.transpose(0, 1));
  }
  EXPECT_TRUE(tg::autodiff::grad_enabled());
  EXPECT_EQ(tape.size(), before);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_FLOAT_EQ(y.item(), 8.f);
  EXPECT_THROW(y.backward(), tg::Error);
  // Nested guards restore the outer state.
  {
    tg::NoGrad outer;
    { tg::NoGrad inner; }
    EXPECT_FALSE(tg::autodiff::grad_enabled());
  }
  // With grad on, the same expression records its nodes.
  const F z = tg::sum(w * w);
  EXPECT_TRUE(z.requires_grad());
  EXPECT_GT(tape.size(), before);
  const auto live = tape.live_nodes();
  ASSERT_FALSE(live.empty());
  EXPECT_STREQ(live.back()->op(), "sum");
}

TEST(Autodiff, NodesRecordOpInputsAndOutputs) {
  F a = F::ones({2, 3});
  a.requires_grad_();
  const F b = F::ones({3});
  const F y = a * b;
  const auto live = tg::autodiff::current_tape().live_nodes();
  ASSERT_FALSE(live.empty());
  const auto& node = *live.back();
  EXPECT_STREQ(node.op(), "mul");
  ASSERT_EQ(node.inputs().size(), 2u);
  EXPECT_EQ(node.inputs()[0].id, a.id());
  EXPECT_EQ(node.inputs()[0].shape, (Shape{2, 3}));
  EXPECT_EQ(node.inputs()[1].shape, (Shape{3}));
  EXPECT_EQ(node.output().id, y.id());
  EXPECT_EQ(node.output().dtype, tg::DType::f32);
  EXPECT_NE(a.id(), y.id());
}

TEST(Autodiff, NonScalarBackwardWithoutUpstreamThrows) {
  F w = F::ones({2, 3});
  w.requires_grad_();
  const F y = w * 2.0;
  try {
    y.backward();
    FAIL() << "expected tg::Error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("backward"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2,3]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("one-element"), std::string::npos) << msg;
  }
}

TEST(Autodiff, SecondBackwardThroughReleasedGraphThrows) {
  F w = F::from_values({2}, {1, 2});
  w.requires_grad_();
  const F loss = tg::sum(w * w);
  loss.backward();
  try {
    loss.backward();
    FAIL() << "expected tg::Error";
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("already released"), std::string::npos) << msg;
    EXPECT_NE(msg.find("retain_graph"), std::string::npos) << msg;
  }
  // The failed call did not change the gradient of the first one.
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{2, 4}));

  // A second loss sharing a released intermediate also refuses (the node is needed and released).
  F v = F::from_values({2}, {1, 2});
  v.requires_grad_();
  const F h = v * v;
  tg::sum(h).backward();
  EXPECT_THROW(tg::sum(h * 2.0).backward(), tg::Error);
}

TEST(Autodiff, RetainGraphAllowsASecondBackward) {
  F w = F::from_values({2}, {1, -3});
  w.requires_grad_();
  const F loss = tg::sum(w * w * 2.0);
  loss.backward(/*retain_graph=*/true);
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{4, -12}));
  loss.backward(/*retain_graph=*/true);
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{8, -24}));  // doubled
  loss.backward();
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{12, -36}));
  EXPECT_THROW(loss.backward(), tg::Error);  // released by the last one
}

TEST(Autodiff, ExplicitUpstreamGradient) {
  F w = F::from_values({2, 2}, {1, 2, 3, 4});
  w.requires_grad_();
  const F y = w * w;
  y.backward(F::from_values({2, 2}, {1, 0, -1, 0.5}));
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{2, 0, -6, 4}));  // upstream * 2w
  EXPECT_THROW(y.backward(F::ones({4})), tg::Error);                    // wrong upstream shape
  // backward on a leaf accumulates the upstream directly.
  F leaf = F::zeros({2});
  leaf.requires_grad_();
  leaf.backward(F::from_values({2}, {3, 4}));
  EXPECT_EQ(values_of(leaf.grad()), (std::vector<double>{3, 4}));
}

TEST(Autodiff, RetainGradKeepsIntermediateGradient) {
  F w = F::from_values({2}, {1, 2});
  w.requires_grad_();
  F h = w * 3.0;
  h.retain_grad();
  F other = w * 4.0;  // a non-retained intermediate
  tg::sum(h * h + other).backward();
  EXPECT_EQ(values_of(h.grad()), (std::vector<double>{6, 12}));  // 2h
  EXPECT_FALSE(other.grad().defined());
  EXPECT_EQ(values_of(w.grad()), (std::vector<double>{18 + 4, 36 + 4}));
}

TEST(Autodiff, GradReadyHookFiresForLeaves) {
  F w = F::ones({3});
  w.requires_grad_();
  int calls = 0;
  double seen = 0;
  w.autograd_meta()->grad_ready_hooks.push_back([&](const F& g) {
    ++calls;
    seen = g.at({0});
  });
  tg::sum(w * 7.0).backward();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen, 7.0);
}

TEST(Autodiff, SavedTensorsAreFreedAfterBackward) {
  auto& alloc = tg::allocator<tg::cpu>();
  const auto rounded = [](std::int64_t numel) {
    return static_cast<std::int64_t>(tg::CachingHostAllocator::round_size(static_cast<std::size_t>(numel) * sizeof(float)));
  };
  const std::int64_t n = 4096;  // 16 KiB per tensor
  F w = F::ones({n});
  w.requires_grad_();
  const std::int64_t base = alloc.stats().bytes_in_use;
  F loss;
  {
    const F h = w * 3.0;  // h dies at the end of the scope; the mul node below saves it
    loss = tg::sum(h * h);
  }
  // Alive now: the loss, the scalar 3.0 and h (saved by h*h's node), and the saved scalar.
  EXPECT_GE(alloc.stats().bytes_in_use, base + rounded(n) + rounded(1));
  loss.backward();
  // After backward: saved tensors released; left are the loss and w's gradient.
  EXPECT_EQ(alloc.stats().bytes_in_use, base + rounded(1) + rounded(n));
  loss = F();
  EXPECT_EQ(alloc.stats().bytes_in_use, base + rounded(n));
  w.zero_grad();
  EXPECT_EQ(alloc.stats().bytes_in_use, base);

  // Without backward, dropping the outputs frees the whole graph.
  {
    const F l2 = tg::sum((w * 2.0) * (w + 1.0));
    EXPECT_GT(alloc.stats().bytes_in_use, base + rounded(n));
  }
  EXPECT_EQ(alloc.stats().bytes_in_use, base);
  // With retain_graph the saved tensors stay until the outputs die.
  {
    F l3;
    {
      const F h = w * 3.0;
      l3 = tg::sum(h * h);
    }
    l3.backward(true);
    EXPECT_GE(alloc.stats().bytes_in_use, base + rounded(n) /*grad*/ + rounded(n) /*saved h*/);
  }
  w.zero_grad();
  EXPECT_EQ(alloc.stats().bytes_in_use, base);
}

TEST(Autodiff, RequiresGradOnlyOnLeaves) {
  F w = F::ones({2});
  w.requires_grad_();
  F y = w * 2.0;
  EXPECT_THROW(y.requires_grad_(false), tg::Error);
  EXPECT_TRUE(w.requires_grad());
  w.requires_grad_(false);
  EXPECT_FALSE(w.requires_grad());
  EXPECT_FALSE((w * 2.0).requires_grad());
  const F c = F::ones({2});
  EXPECT_FALSE(c.requires_grad());
  EXPECT_FALSE(c.grad().defined());
}

}  // namespace

}  // namespace test_tensor_cpp

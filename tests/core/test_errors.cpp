// Tests of tg::Error messages: each names the op, the argument, and expected vs actual (DESIGN.md, Errors).
//   expect_error([] { tg::Tensor<tg::fp32>::zeros({2, 3}).item(); }, {"Tensor::item", "6 elements"});
//   ./build/cpu/tests/test_tensor --gtest_filter='ErrorMessages*'
#include <gtest/gtest.h>

#include <functional>
#include <initializer_list>
#include <string>

#include "typegrad/typegrad.hpp"

namespace test_errors_cpp {  // the file's own names (Note [unity test sources])

namespace {

using F = tg::Tensor<tg::fp32>;

/// Runs fn, which must throw tg::Error whose message contains every one of `parts`.
::testing::AssertionResult throws_error_with(const std::function<void()>& fn, std::initializer_list<const char*> parts) {
  try {
    fn();
  } catch (const tg::Error& e) {
    const std::string msg = e.what();
    for (const char* p : parts)
      if (msg.find(p) == std::string::npos)
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << p << "\"";
    return ::testing::AssertionSuccess() << msg;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-tg::Error: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw";
}

TEST(ErrorMessages, TgErrorIsARuntimeErrorAndConcatenates) {
  const tg::Error e("op: ", 3, " is not ", 4.5, ", shape ", tg::Shape{2, 3});
  EXPECT_STREQ(e.what(), "op: 3 is not 4.5, shape [2,3]");
  const std::runtime_error& base = e;
  EXPECT_STREQ(base.what(), "op: 3 is not 4.5, shape [2,3]");
  EXPECT_STREQ(tg::Error(std::string("plain")).what(), "plain");
  EXPECT_TRUE(throws_error_with([] { TG_CHECK(1 + 1 == 3, "check: ", 1, " + ", 1, " is not 3"); }, {"check: 1 + 1 is not 3"}));
  EXPECT_FALSE(throws_error_with([] { TG_CHECK(true, "never"); }, {}));  // the helper itself can fail
}

TEST(ErrorMessages, BroadcastAddNamesBothShapes) {
  const F a = F::zeros({4, 3}), b = F::zeros({5});
  EXPECT_TRUE(throws_error_with([&] { (void)tg::add(a, b); }, {"add: shapes cannot be broadcast: a is [4,3], b is [5]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)(a * b); }, {"mul: shapes cannot be broadcast: a is [4,3], b is [5]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)(b - a); }, {"sub: shapes cannot be broadcast: a is [5], b is [4,3]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)(F::zeros({2, 3, 4}) / F::zeros({3, 3})); },
                                {"div:", "[2,3,4]", "[3,3]"}));
}

TEST(ErrorMessages, ViewOfNonContiguous) {
  const F t = F::zeros({2, 3}).transpose(0, 1);
  EXPECT_TRUE(throws_error_with([&] { (void)t.view({6}); }, {"view:", "[3,2]", "not contiguous", "reshape()"}));
}

TEST(ErrorMessages, ReshapeWithWrongNumel) {
  const F t = F::zeros({2, 3});
  EXPECT_TRUE(throws_error_with([&] { (void)t.reshape({4}); }, {"reshape:", "[2,3] (6 elements)", "[4] (4 elements)"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.view({5, -1}); }, {"view:", "[2,3]", "[5,-1]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.reshape({-1, -1}); }, {"reshape:", "only one dimension can be -1"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.transpose(0, 1).reshape({7}); }, {"reshape:", "[3,2]", "[7]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.view({-2, 3}); }, {"view:", "invalid dimension -2"}));
}

TEST(ErrorMessages, NarrowOutOfRange) {
  const F t = F::zeros({2, 3});
  EXPECT_TRUE(throws_error_with([&] { (void)t.narrow(1, 2, 2); }, {"narrow:", "[2, 4)", "dim 1 of size 3", "[2,3]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.narrow(0, -1, 1); }, {"narrow:", "out of bounds"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.slice(0, 0, 2, 0); }, {"slice: step must be positive, got 0"}));
}

TEST(ErrorMessages, WrapDimOutOfRange) {
  const F t = F::zeros({2, 3});
  EXPECT_TRUE(throws_error_with([&] { (void)t.transpose(0, 2); }, {"transpose: dim 2 is out of range for a tensor of rank 2"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.transpose(-3, 0); }, {"transpose: dim -3", "rank 2"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.size(5); }, {"Tensor::size: dim 5", "rank 2"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.unsqueeze(4); }, {"unsqueeze: dim 4", "rank 3"}));
  EXPECT_TRUE(throws_error_with([&] { (void)tg::sum(t, {2}); }, {"sum: dim 2", "rank 2"}));
  EXPECT_TRUE(throws_error_with([] { (void)tg::wrap_dim(-4, 3, "myop"); }, {"myop: dim -4 is out of range for a tensor of rank 3"}));
  EXPECT_EQ(tg::wrap_dim(-1, 3, "myop"), 2);
  EXPECT_EQ(tg::wrap_dim(0, 0, "myop"), 0);  // a rank-0 tensor accepts dim 0 and -1
  EXPECT_EQ(tg::wrap_dim(-1, 0, "myop"), 0);
}

TEST(ErrorMessages, PermuteDuplicateAndWrongCount) {
  const F t = F::zeros({2, 3, 4});
  EXPECT_TRUE(throws_error_with([&] { (void)t.permute({0, 2, 0}); }, {"permute: dim 0 appears twice"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.permute({1, -1, 2}); }, {"permute: dim 2 appears twice"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.permute({1, 0}); }, {"permute: got 2 dims", "[2,3,4]"}));
}

TEST(ErrorMessages, ExpandMismatch) {
  const F t = F::zeros({3});
  EXPECT_TRUE(throws_error_with([&] { (void)t.expand({2, 4}); },
                                {"expand:", "size 3 of dim 0 must match 4 or be 1", "[3] to [2,4]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)F::zeros({2, 3}).expand({3}); }, {"expand:", "fewer dims", "[2,3]", "[3]"}));
}

TEST(ErrorMessages, SqueezeOfNonUnitDim) {
  EXPECT_TRUE(throws_error_with([] { (void)F::zeros({2, 3}).squeeze(1); }, {"squeeze: dim 1 has size 3, not 1", "[2,3]"}));
}

TEST(ErrorMessages, ItemOnManyElements) {
  EXPECT_TRUE(throws_error_with([] { (void)F::zeros({2, 3}).item(); }, {"Tensor::item:", "6 elements", "[2,3]", "expected 1"}));
}

TEST(ErrorMessages, AtRankMismatchAndOutOfRange) {
  const F t = F::zeros({2, 3});
  EXPECT_TRUE(throws_error_with([&] { (void)t.at({1}); }, {"Tensor::at:", "1 coordinates", "[2,3]"}));
  EXPECT_TRUE(throws_error_with([&] { (void)t.at({1, 3}); }, {"Tensor::at: index 3 out of range for dim 1 of shape [2,3]"}));
  EXPECT_TRUE(throws_error_with([&] { t.set({0, 0, 0}, 1.f); }, {"Tensor::at:", "3 coordinates"}));
}

TEST(ErrorMessages, RequiresGradOnInt64) {
  auto t = tg::Tensor<std::int64_t>::zeros({3});
  EXPECT_TRUE(throws_error_with([&] { t.requires_grad_(); }, {"requires_grad_:", "floating-point", "int64"}));
  EXPECT_FALSE(t.requires_grad());
  t.requires_grad_(false);  // turning it off is fine
  EXPECT_FALSE(t.requires_grad());
  F w = F::zeros({2});
  w.requires_grad_();
  F y = w * 2.0;
  EXPECT_TRUE(throws_error_with([&] { y.requires_grad_(); }, {"requires_grad_:", "only leaf tensors", "mul"}));
}

TEST(ErrorMessages, ShapeWithMoreThanEightDims) {
  EXPECT_TRUE(throws_error_with([] { tg::Shape s{1, 2, 3, 4, 5, 6, 7, 8, 9}; }, {"Shape: at most 8 dimensions", "got 9"}));
  tg::Shape eight{1, 1, 1, 1, 1, 1, 1, 1};
  EXPECT_EQ(eight.size(), 8);
  EXPECT_TRUE(throws_error_with([&] { eight.push_back(1); }, {"Shape: at most 8 dimensions"}));
  EXPECT_TRUE(throws_error_with([&] { eight.insert(0, 1); }, {"Shape: at most 8 dimensions"}));
  EXPECT_TRUE(throws_error_with([] { (void)F::zeros({1, 1, 1, 1, 1, 1, 1, 1}).unsqueeze(0); }, {"at most 8 dimensions"}));
}

TEST(ErrorMessages, FactoriesAndBackward) {
  EXPECT_TRUE(throws_error_with([] { (void)F::empty({2, -1}); }, {"Tensor::empty: negative dimension", "[2,-1]"}));
  EXPECT_TRUE(throws_error_with([] { (void)F::arange(0.0, 1.0, 0.0); }, {"Tensor::arange: step must not be 0"}));
  EXPECT_TRUE(throws_error_with([] { (void)F::from_values({2, 2}, {1, 2, 3}); },
                                {"Tensor::from_values:", "[2,2]", "needs 4 values, got 3"}));
  EXPECT_TRUE(throws_error_with([] { (void)F::from_vector({3}, std::vector<float>{1}); },
                                {"Tensor::from_vector:", "needs 3 values, got 1"}));
  EXPECT_TRUE(throws_error_with([] { F::ones({1}).backward(); }, {"backward:", "does not require grad"}));
  F w = F::ones({2, 2});
  w.requires_grad_();
  const F y = w * 3.0;
  EXPECT_TRUE(throws_error_with([&] { y.backward(); }, {"backward: the loss has shape [2,2]", "one-element"}));
  EXPECT_TRUE(throws_error_with([&] { y.backward(F::ones({2})); },
                                {"backward: the upstream gradient has shape [2]", "the tensor has shape [2,2]"}));
  EXPECT_TRUE(throws_error_with([] { (void)tg::sum_to_shape(F::ones({3}), {2, 3}); }, {"sum_to_shape:", "[3]", "[2,3]"}));
  EXPECT_TRUE(throws_error_with([] { (void)tg::max(F::zeros({2, 0}), 1); }, {"max: cannot reduce the empty dim 1", "[2,0]"}));
  EXPECT_TRUE(throws_error_with([] { (void)tg::sum(F::zeros({2, 3}), {1, -1}); }, {"sum: a dim appears twice"}));
}

TEST(ErrorMessages, ReleasedGraph) {
  F w = F::ones({2});
  w.requires_grad_();
  const F loss = tg::sum(w * w);
  loss.backward();
  EXPECT_TRUE(throws_error_with([&] { loss.backward(); }, {"backward:", "(last op: sum)", "already released", "retain_graph=true"}));
}

TEST(ErrorMessages, CudaWithoutBackend) {
#if !TG_HAVE_CUDA
  EXPECT_TRUE(throws_error_with([] { (void)tg::allocator<tg::cuda>(); }, {"cuda allocator:", "without the CUDA backend"}));
#else
  GTEST_SKIP() << "built with the CUDA backend";
#endif
}

}  // namespace

}  // namespace test_errors_cpp

// The consumer test's program: exercises headers and the compiled CPU backend (allocator, kernels,
// RNG, tape) through typegrad::typegrad, and checks the numbers. Exit 0 and "typegrad consumer: OK" on success.
#include <cmath>
#include <cstdio>

#include <typegrad/typegrad.hpp>

int main() {
  // loss = sum(w * w + 3 w) over a (3,4) tensor: dloss/dw = 2 w + 3.
  tg::Generator gen(7);
  auto w = tg::Tensor<tg::fp32>::normal({3, 4}, 0.f, 1.f, gen).requires_grad_();
  auto loss = tg::sum(w * w + w * 3.0);
  loss.backward();
  const auto wv = w.to_vector();
  const auto gv = w.grad().to_vector();
  double expect_loss = 0.0;
  for (std::size_t i = 0; i < wv.size(); ++i) {
    expect_loss += double(wv[i]) * wv[i] + 3.0 * wv[i];
    if (std::fabs(gv[i] - (2.f * wv[i] + 3.f)) > 1e-5f) {
      std::printf("typegrad consumer: FAIL: grad[%zu] = %g, expected %g\n", i, gv[i], 2.f * wv[i] + 3.f);
      return 1;
    }
  }
  if (std::fabs(loss.item() - expect_loss) > 1e-4 * (1.0 + std::fabs(expect_loss))) {
    std::printf("typegrad consumer: FAIL: loss = %g, expected %g\n", loss.item(), expect_loss);
    return 1;
  }
  // Broadcasting, a reduction over one dim, a bf16 round trip.
  auto x = tg::Tensor<tg::fp32>::arange(6).reshape({2, 3});
  auto row = tg::sum(x + tg::Tensor<tg::fp32>::ones({3}), {1});  // [0+1+2+3, 3+4+5+3]
  if (row.at({0}) != 6.f || row.at({1}) != 15.f) {
    std::printf("typegrad consumer: FAIL: row sums %g %g, expected 6 15\n", row.at({0}), row.at({1}));
    return 1;
  }
  if (static_cast<float>(x.to<tg::bf16>().at({1, 2})) != 5.f) {
    std::printf("typegrad consumer: FAIL: bf16 round trip\n");
    return 1;
  }
  std::printf("typegrad consumer: OK (typegrad %s, loss %.4f, cpu bytes in use %lld)\n", TG_VERSION_STRING,
              loss.item(), static_cast<long long>(tg::allocator<tg::cpu>().stats().bytes_in_use));
  return 0;
}

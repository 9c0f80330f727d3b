// linear_demo: fits a linear model y = X·w + b to synthetic data by plain gradient descent, using only
// tensors, broadcasting, reductions and tape autodiff (no matmul op, no optimizer class: the update is
// written out under tg::NoGrad). Exits 0 only if the learned weights match the true ones.
//   ./linear_demo            # prints the loss every 10 steps, then learned vs true weights
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include <typegrad/typegrad.hpp>

namespace {

constexpr std::int64_t kSamples = 2048;  // N
constexpr std::int64_t kFeatures = 8;    // D
constexpr float kNoise = 0.1f;           // stddev of the label noise
constexpr double kLr = 0.05;
constexpr int kSteps = 150;

using T = tg::fp32;
using Tensor = tg::Tensor<T>;

/// pred = X·w + b, as broadcasting mul and a sum over the feature dim: (N,D)·(D) -> (N,D) -> (N).
Tensor predict(const Tensor& X, const Tensor& w, const Tensor& b) { return tg::sum(X * w, {1}) + b; }

/// Mean squared error, (N),(N) -> ().
Tensor mse(const Tensor& pred, const Tensor& y) {
  const Tensor r = pred - y;
  return tg::mean(r * r);
}

/// One step of gradient descent on a leaf: p <- p - lr·dp, kept a trainable leaf.
void sgd_update(Tensor& p) {
  tg::NoGrad guard;  // the update itself is not part of the model
  Tensor next = (p - p.grad() * kLr).detach();
  p = next;
  p.requires_grad_();
}

}  // namespace

int main() {
  const auto t0 = std::chrono::steady_clock::now();
  tg::Generator gen(2024);

  // Synthetic data: X ~ N(0, 1), w_true ~ U(-2, 2), b_true = 0.5, y = X·w_true + b_true + N(0, kNoise²).
  const Tensor X = Tensor::normal({kSamples, kFeatures}, 0.f, 1.f, gen);           // (N,D)
  const Tensor w_true = Tensor::uniform({kFeatures}, -2.f, 2.f, gen);             // (D)
  const Tensor b_true = Tensor::full({1}, 0.5);                                   // (1)
  const Tensor noise = Tensor::normal({kSamples}, 0.f, kNoise, gen);              // (N)
  Tensor y;
  {
    tg::NoGrad guard;
    y = predict(X, w_true, b_true) + noise;  // (N)
  }

  // Parameters start at zero.
  Tensor w = Tensor::zeros({kFeatures}).requires_grad_();  // (D)
  Tensor b = Tensor::zeros({1}).requires_grad_();          // (1)

  auto& alloc = tg::allocator<tg::cpu>();
  std::int64_t sys_allocs_after_first = 0;
  float loss_value = 0.f;
  for (int step = 0; step <= kSteps; ++step) {
    const Tensor loss = mse(predict(X, w, b), y);
    loss_value = loss.item();
    if (step % 10 == 0) std::printf("step %3d  loss %.6f\n", step, loss_value);
    if (step == kSteps) break;
    loss.backward();
    sgd_update(w);
    sgd_update(b);
    if (step == 0) sys_allocs_after_first = alloc.stats().system_allocations;
  }

  std::printf("\n  feature   learned      true\n");
  const auto wl = w.to_vector(), wt = w_true.to_vector();
  double max_err = 0.0;
  for (std::int64_t i = 0; i < kFeatures; ++i) {
    std::printf("  w[%lld]   %9.5f %9.5f\n", static_cast<long long>(i), wl[i], wt[i]);
    max_err = std::max(max_err, std::fabs(double(wl[i]) - wt[i]));
  }
  std::printf("  b        %9.5f %9.5f\n", b.item(), b_true.item());
  max_err = std::max(max_err, std::fabs(double(b.item()) - b_true.item()));

  const auto stats = alloc.stats();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("\nmax |learned - true| = %.5f, final loss %.6f (noise variance %.6f)\n", max_err, loss_value,
              double(kNoise) * kNoise);
  std::printf("allocator: peak %.1f KiB, system allocations after step 1: %lld, total time %.2f s\n",
              stats.peak_bytes / 1024.0, static_cast<long long>(stats.system_allocations - sys_allocs_after_first),
              secs);

  // Least squares with N = 2048 samples recovers w to about kNoise/sqrt(N) ≈ 0.002; the loss floor is kNoise².
  const bool converged = max_err < 0.02 && loss_value < 1.5 * kNoise * kNoise;
  std::printf("%s\n", converged ? "converged" : "DID NOT CONVERGE");
  return converged ? 0 : 1;
}

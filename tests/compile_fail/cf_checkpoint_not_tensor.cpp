// Must not compile: a checkpoint region whose function does not return one tensor.
#include <typegrad/typegrad.hpp>
int main() {
  auto x = tg::Tensor<tg::fp32>::ones({2, 3});
  // expected: "tg::checkpoint: the region's function must return one tg::Tensor"
  auto y = tg::checkpoint<tg::RecomputeAll>([](const tg::Tensor<tg::fp32>& t) { return t.numel(); }, x);
  (void)y;
}

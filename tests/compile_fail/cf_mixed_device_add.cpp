// Must not compile: a CUDA and a CPU tensor in one op without an explicit move.
#include <typegrad/typegrad.hpp>
int main() {
  tg::Tensor<tg::fp32, tg::cuda> a;
  tg::Tensor<tg::fp32, tg::cpu> b = tg::Tensor<tg::fp32, tg::cpu>::ones({2, 3});
  tg::add(a, b);  // expected: "tg::add: the operands live on different devices"
}

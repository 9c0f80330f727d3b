// Must not compile: a CPU and a CUDA tensor in one op without an explicit move.
#include <typegrad/typegrad.hpp>
int main() {
  tg::Tensor<tg::fp32, tg::cpu> a = tg::Tensor<tg::fp32, tg::cpu>::ones({2, 3});
  tg::Tensor<tg::fp32, tg::cuda> b;
  tg::mul(a, b);  // expected: "tg::mul: the operands live on different devices"
}

// Must not compile: mixing fp16 and fp32 operands without an explicit conversion.
#include <typegrad/typegrad.hpp>
int main() {
  auto a = tg::Tensor<tg::fp16>::ones({2, 3});
  auto b = tg::Tensor<tg::fp32>::ones({2, 3});
  tg::mul(a, b);  // expected: "tg::mul: the operands have different precisions"
}

// Must not compile: mixing bf16 and fp32 operands without an explicit conversion.
#include <typegrad/typegrad.hpp>
int main() {
  auto a = tg::Tensor<tg::bf16>::ones({2, 3});
  auto b = tg::Tensor<tg::fp32>::ones({2, 3});
  tg::add(a, b);  // expected: "tg::add: the operands have different precisions"
}

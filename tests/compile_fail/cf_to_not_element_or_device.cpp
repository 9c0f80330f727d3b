// Must not compile: to<X>() where X is neither an element type nor a device tag (char is not an element:
// int would be, since it is std::int32_t).
#include <typegrad/typegrad.hpp>
int main() {
  auto a = tg::Tensor<tg::fp32>::ones({2, 3});
  a.to<char>();  // expected: "Tensor::to<X>(): X must be an element type ... or a device tag"
}

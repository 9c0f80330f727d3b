// Must not compile: host element access on a device tensor.
#include <typegrad/typegrad.hpp>
int main() {
  tg::Tensor<tg::fp32, tg::cuda> a;
  (void)a.at({0, 0});  // expected: "Tensor::at: element access needs a CPU tensor"
}

// Scalar math shared by CPU and CUDA kernels (__host__ __device__), so the GPU's elementwise formulas
// are the ones tested on the CPU. All in the accumulation type (fp32 for 16-bit storage).
//   float y = tg::math::gelu_tanh(x);  float dy = tg::math::gelu_tanh_grad(x);
#pragma once

#include <cmath>

#include "typegrad/detail/macros.hpp"

namespace tg::math {

enum class Binary : unsigned char { add, sub, mul, div };

template <class A>
TG_HOST_DEVICE TG_INLINE A apply(Binary op, A a, A b) {
  switch (op) {
    case Binary::add: return a + b;
    case Binary::sub: return a - b;
    case Binary::mul: return a * b;
    case Binary::div: return a / b;
  }
  return a;
}

}  // namespace tg::math

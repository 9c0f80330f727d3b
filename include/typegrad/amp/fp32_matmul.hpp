// A precision policy's Fp32Matmul (precision.hpp) applied to the GPU's fp32 GEMMs for a scope.
//   { tg::amp::Fp32MatmulScope<tg::amp::tf32_policy> mode;  /* fp32 cuBLASLt GEMMs use TF32 here */ }
#pragma once

#include "typegrad/amp/precision.hpp"
#include "typegrad/detail/cuda/kernels.hpp"

namespace tg::amp {

// Note [TF32 by policy]
// TF32 rounds the inputs of fp32 GPU matrix products to 10 mantissa bits (sums stay fp32): several times
// faster on tensor cores, with about bf16-level relative error per product. It is therefore off unless the
// run's policy asks for it (tf32_policy), never a global default. The switch is process-wide
// (backend::cuda::set_allow_tf32); the scope sets the policy's choice and restores the previous one.
// Without the CUDA backend, the IEEE choice is a no-op and asking for TF32 is an error.
template <PrecisionPolicy P>
class Fp32MatmulScope {
 public:
  Fp32MatmulScope() : previous_(backend::cuda::allow_tf32()) {
    backend::cuda::set_allow_tf32(P::fp32_matmul == Fp32Matmul::tf32);
  }
  ~Fp32MatmulScope() {
    try {
      backend::cuda::set_allow_tf32(previous_);
    } catch (...) {  // restoring a value that was set before cannot fail; never throw from a destructor
    }
  }
  Fp32MatmulScope(const Fp32MatmulScope&) = delete;
  Fp32MatmulScope& operator=(const Fp32MatmulScope&) = delete;

 private:
  bool previous_;
};

}  // namespace tg::amp

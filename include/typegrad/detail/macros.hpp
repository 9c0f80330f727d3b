// Portability macros shared by host and CUDA code.
//   TG_HOST_DEVICE float f(float x) { return x; }   // callable from CPU kernels and CUDA kernels alike
#pragma once

#if defined(__CUDACC__)
#define TG_HOST_DEVICE __host__ __device__
#define TG_INLINE __forceinline__
#else
#define TG_HOST_DEVICE
#define TG_INLINE inline __attribute__((always_inline))
#endif

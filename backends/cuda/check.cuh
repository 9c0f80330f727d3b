// Checked CUDA runtime calls: a failure throws tg::Error with the call, file:line and CUDA's message.
//   TG_CUDA_CHECK(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
#pragma once

#include <cuda_runtime.h>

#include "typegrad/core/error.hpp"

#define TG_CUDA_CHECK(call)                                                                          \
  do {                                                                                               \
    const cudaError_t tg_status_ = (call);                                                           \
    if (tg_status_ != cudaSuccess)                                                                   \
      throw ::tg::Error("CUDA error at ", __FILE__, ":", __LINE__, ": ", #call, " failed: ",         \
                        cudaGetErrorName(tg_status_), " (", cudaGetErrorString(tg_status_), ")");    \
  } while (0)

// The CUDA backend's host-side interface: device queries, the caching device allocator, copies, fill.
// Declared always; defined by backends/cuda when TG_HAVE_CUDA, otherwise each call throws a tg::Error
// that says the build has no CUDA backend (device_count() then returns 0, so GPU tests can skip).
//   if (tg::backend::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device";
//   tg::backend::cuda::copy_host_to_device(dst, src, bytes);
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "typegrad/core/allocator.hpp"
#include "typegrad/core/dtype.hpp"

namespace tg::backend::cuda {

/// Number of usable CUDA devices; 0 when there is no driver, no device, or no CUDA backend.
int device_count();
/// "NVIDIA H200, sm_90, 139 GiB" or the reason there is none.
std::string device_description();

void copy_host_to_device(void* dst, const void* src, std::size_t bytes);
void copy_device_to_host(void* dst, const void* src, std::size_t bytes);
void copy_device_to_device(void* dst, const void* src, std::size_t bytes);
void synchronize();

template <class T>
void fill(T* dst, std::int64_t n, T value);
/// dst[i] += src[i] (fp32 arithmetic for 16-bit types).
template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n);

}  // namespace tg::backend::cuda

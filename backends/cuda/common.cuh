// Helpers shared by the CUDA kernels: grid sizing, deterministic warp/block reductions, and a scoped
// workspace from the caching device allocator (the index geometry is detail/cuda/geometry.hpp).
//   const float s = block_sum(v, shm);          // every thread of the block gets the same sum
//   Workspace ws(bytes);  float* p = ws.as<float>();
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "check.cuh"
#include "typegrad/core/allocator.hpp"
#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"
#include "typegrad/core/shape.hpp"
#include "typegrad/detail/cuda/geometry.hpp"  // Geo, make_geo (host-tested)
#include "typegrad/detail/cuda/runtime.hpp"   // current_stream

namespace tg::backend::cuda::detail {

/// The accumulation type of storage type T on the device (double for fp64, else float).
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

/// The calling thread's current stream: every launch, memset and library call goes there (Note [CUDA streams]).
inline cudaStream_t stream() { return static_cast<cudaStream_t>(::tg::backend::cuda::current_stream()); }

constexpr int kThreads = 256;
/// Blocks for a grid-stride loop over n elements (capped; the loop covers the rest).
inline unsigned grid_for(std::int64_t n, int threads = kThreads) {
  return static_cast<unsigned>(std::clamp<std::int64_t>((n + threads - 1) / threads, 1, 65535LL * 16));
}
#define TG_GRID_STRIDE(i, n)                                                                        \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
#define TG_CUDA_LAUNCHED() TG_CUDA_CHECK(cudaGetLastError())

template <class A>
__device__ __forceinline__ A warp_sum(A v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
template <class A>
__device__ __forceinline__ A warp_max(A v) {
  for (int o = 16; o > 0; o >>= 1) {
    const A w = __shfl_xor_sync(0xffffffffu, v, o);
    v = (w > v || w != w) ? w : v;  // NaN wins
  }
  return v;
}
/// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result. The
/// order is fixed by the block shape, so results are deterministic. `shm` holds 32 values.
template <class A>
__device__ A block_sum(A v, A* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // shm may still be read by a previous call
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : A(0);
  return warp_sum(v);
}
template <class A>
__device__ A block_max(A v, A* shm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) shm[warp] = v;
  __syncthreads();
  v = lane < nw ? shm[lane] : -INFINITY;
  return warp_max(v);
}

/// Threads for a one-block-per-row kernel over rows of n elements.
inline int row_threads(std::int64_t n) {
  if (n <= 64) return 32;
  if (n <= 256) return 64;
  if (n <= 1024) return 128;
  if (n <= 4096) return 256;
  return 512;
}

/// Device scratch memory from the caching allocator, returned when the scope ends. Kernels using it are
/// ordered on the current stream, and the block returns to that stream's free list, so when it is handed out
/// again it is only touched after the earlier kernels (Note [CUDA streams]). Inside a compiled step it is
/// planned and served like a tensor's storage (the allocation override, Note [step memory plan]): a replay
/// makes no allocator call for its scratch either.
class Workspace {
 public:
  explicit Workspace(std::size_t bytes) : bytes_(std::max<std::size_t>(bytes, 1)) {
    if (AllocationOverride* o = ::tg::detail::allocation_override(DeviceKind::cuda)) {
      ptr_ = o->allocate(bytes_, owner_);
    } else {
      owner_ = &allocator<::tg::cuda>();
      ptr_ = owner_->allocate(bytes_);
    }
  }
  ~Workspace() { owner_->deallocate(ptr_, bytes_); }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  template <class X>
  X* as() const {
    return static_cast<X*>(ptr_);
  }

 private:
  std::size_t bytes_;
  void* ptr_;
  Allocator* owner_ = nullptr;  // what frees it: the device's allocator, or the step memory that served it
};

/// Host data uploaded to a device workspace (complete on return: the host buffer may die afterwards).
template <class X>
X* upload(Workspace& ws, const X* host, std::int64_t n) {
  if (n > 0) copy_host_to_device(ws.as<X>(), host, static_cast<std::size_t>(n) * sizeof(X));
  return ws.as<X>();
}
/// Device data read back to the host (waits for the current stream's work up to the copy).
template <class X>
void download(X* host, const X* device, std::int64_t n) {
  if (n > 0) copy_device_to_host(host, device, static_cast<std::size_t>(n) * sizeof(X));
}

}  // namespace tg::backend::cuda::detail

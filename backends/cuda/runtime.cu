// Device queries, streams and events, host<->device copies and fill.
#include <string>

#include <cuda_profiler_api.h>

#include "check.cuh"
#include "typegrad/detail/cuda/runtime.hpp"

namespace tg::backend::cuda {

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

void set_device(int index) {
  const int n = device_count();
  if (index < 0 || index >= n) throw Error("set_device: device ", index, " does not exist (", n, " CUDA devices)");
  TG_CUDA_CHECK(cudaSetDevice(index));
}

std::string device_description() {
  int n = 0;
  const cudaError_t st = cudaGetDeviceCount(&n);
  if (st != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("no CUDA device: ") + cudaGetErrorString(st);
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp p{};
  TG_CUDA_CHECK(cudaGetDeviceProperties(&p, 0));
  return std::string(p.name) + ", sm_" + std::to_string(p.major) + std::to_string(p.minor) + ", " +
         std::to_string(p.totalGlobalMem >> 30) + " GiB";
}

// ---- streams and events (Note [CUDA streams]) ------------------------------------------------------------
namespace {
thread_local cudaStream_t t_current_stream = nullptr;
}  // namespace

Stream::Stream() {
  cudaStream_t s = nullptr;
  TG_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  handle_ = s;
}
Stream::~Stream() {
  auto* s = static_cast<cudaStream_t>(handle_);
  (void)cudaStreamSynchronize(s);  // errors of the stream's work were reported by the calls that issued it
  (void)cudaStreamDestroy(s);
}
void Stream::synchronize() const { TG_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(handle_))); }

void* current_stream() { return t_current_stream; }
void synchronize_stream() { TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream)); }

StreamGuard::StreamGuard(const Stream& s) : previous_(t_current_stream) {
  t_current_stream = static_cast<cudaStream_t>(s.handle());
}
StreamGuard::~StreamGuard() { t_current_stream = static_cast<cudaStream_t>(previous_); }

Event::Event() {
  cudaEvent_t e = nullptr;
  TG_CUDA_CHECK(cudaEventCreate(&e));
  handle_ = e;
}
Event::~Event() { (void)cudaEventDestroy(static_cast<cudaEvent_t>(handle_)); }
void Event::record() { TG_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(handle_), t_current_stream)); }
void Event::wait() const {
  TG_CUDA_CHECK(cudaStreamWaitEvent(t_current_stream, static_cast<cudaEvent_t>(handle_), 0));
}
void Event::synchronize() const { TG_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(handle_))); }
float Event::elapsed_ms_since(const Event& earlier) const {
  float ms = 0.f;
  TG_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(earlier.handle_), static_cast<cudaEvent_t>(handle_)));
  return ms;
}

// ---- copies: on the current stream; each returns when its data is where the caller expects it ------------
void copy_host_to_device(void* dst, const void* src, std::size_t bytes) {
  // The host buffer may be freed as soon as this returns, so the copy is complete before it does.
  TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, t_current_stream));
  TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream));
}
void copy_device_to_host(void* dst, const void* src, std::size_t bytes) {
  TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, t_current_stream));
  TG_CUDA_CHECK(cudaStreamSynchronize(t_current_stream));
}
void copy_device_to_device(void* dst, const void* src, std::size_t bytes) {  // stream-ordered
  TG_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, t_current_stream));
}
void synchronize() { TG_CUDA_CHECK(cudaDeviceSynchronize()); }
void profiler_start() { TG_CUDA_CHECK(cudaProfilerStart()); }
void profiler_stop() { TG_CUDA_CHECK(cudaProfilerStop()); }

namespace {
template <class T>
__global__ void fill_kernel(T* dst, std::int64_t n, T value) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = value;
}
}  // namespace

template <class T>
void fill(T* dst, std::int64_t n, T value) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  fill_kernel<T><<<blocks, threads, 0, t_current_stream>>>(dst, n, value);
  TG_CUDA_CHECK(cudaGetLastError());
}

namespace {
template <class T>
__global__ void add_inplace_kernel(T* dst, const T* src, std::int64_t n) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    dst[i] = scalar_cast<T>(scalar_cast<float>(dst[i]) + scalar_cast<float>(src[i]));
}
}  // namespace

template <class T>
void add_inplace(T* dst, const T* src, std::int64_t n) {
  if (n == 0) return;
  const int threads = 256;
  const int blocks = static_cast<int>(std::min<std::int64_t>((n + threads - 1) / threads, 65535));
  add_inplace_kernel<T><<<blocks, threads, 0, t_current_stream>>>(dst, src, n);
  TG_CUDA_CHECK(cudaGetLastError());
}
TG_INSTANTIATE_KERNELS(TG_KERNELS_FILL, TG_ALL_TYPES)
TG_INSTANTIATE_KERNELS(TG_KERNELS_ADD_INPLACE, TG_FLOATING_TYPES)

}  // namespace tg::backend::cuda

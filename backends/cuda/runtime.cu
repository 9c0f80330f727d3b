// Device queries, host<->device copies and fill.
#include <string>

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

void copy_host_to_device(void* dst, const void* src, std::size_t bytes) {
  TG_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}
void copy_device_to_host(void* dst, const void* src, std::size_t bytes) {
  TG_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}
void copy_device_to_device(void* dst, const void* src, std::size_t bytes) {
  TG_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice));
}
void synchronize() { TG_CUDA_CHECK(cudaDeviceSynchronize()); }

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
  fill_kernel<T><<<blocks, threads>>>(dst, n, value);
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
  add_inplace_kernel<T><<<blocks, threads>>>(dst, src, n);
  TG_CUDA_CHECK(cudaGetLastError());
}
template void add_inplace<double>(double*, const double*, std::int64_t);
template void add_inplace<float>(float*, const float*, std::int64_t);
template void add_inplace<fp16>(fp16*, const fp16*, std::int64_t);
template void add_inplace<bf16>(bf16*, const bf16*, std::int64_t);

#define TG_X(type, e, name, st) template void fill<type>(type*, std::int64_t, type);
TG_FOR_EACH_DTYPE(TG_X)
#undef TG_X

}  // namespace tg::backend::cuda

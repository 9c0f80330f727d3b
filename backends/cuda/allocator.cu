// The caching device allocator: the same size classes and statistics as the CPU one (Note [caching
// allocator]); freed blocks are kept for reuse, so a training loop stops calling cudaMalloc after step one.
#include <map>
#include <mutex>

#include "check.cuh"
#include "typegrad/core/allocator.hpp"
#include "typegrad/detail/cuda/runtime.hpp"

namespace tg {
namespace {

class CachingDeviceAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes) override {
    const std::size_t size = CachingHostAllocator::round_size(bytes);
    std::lock_guard lock(mu_);
    ++stats_.allocations;
    std::size_t got = size;
    void* p = nullptr;
    auto it = free_.lower_bound(size);
    if (it != free_.end() && it->first <= 2 * size) {
      got = it->first;
      p = it->second;
      free_.erase(it);
    } else {
      cudaError_t st = cudaMalloc(&p, size);
      if (st == cudaErrorMemoryAllocation) {  // return the cache to the driver and retry once
        (void)cudaGetLastError();
        release_cache_locked();
        st = cudaMalloc(&p, size);
      }
      if (st != cudaSuccess)
        throw Error("cuda allocator: cudaMalloc of ", size, " bytes failed: ", cudaGetErrorString(st), " (",
                    stats_.bytes_in_use, " bytes in use, ", stats_.bytes_reserved, " reserved)");
      ++stats_.system_allocations;
      stats_.bytes_reserved += static_cast<std::int64_t>(size);
    }
    sizes_[p] = got;
    stats_.bytes_in_use += static_cast<std::int64_t>(got);
    if (stats_.bytes_in_use > stats_.peak_bytes) stats_.peak_bytes = stats_.bytes_in_use;
    return p;
  }
  void deallocate(void* ptr, std::size_t) override {
    if (!ptr) return;
    std::lock_guard lock(mu_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return;
    stats_.bytes_in_use -= static_cast<std::int64_t>(it->second);
    free_.emplace(it->second, ptr);
    sizes_.erase(it);
  }
  AllocatorStats stats() const override {
    std::lock_guard lock(mu_);
    return stats_;
  }
  void reset_peak() override {
    std::lock_guard lock(mu_);
    stats_.peak_bytes = stats_.bytes_in_use;
  }
  void empty_cache() override {
    std::lock_guard lock(mu_);
    release_cache_locked();
  }
  std::string name() const override { return "cuda caching allocator"; }

 private:
  void release_cache_locked() {
    for (auto& [size, p] : free_) {
      cudaFree(p);
      stats_.bytes_reserved -= static_cast<std::int64_t>(size);
      ++stats_.system_frees;
    }
    free_.clear();
  }
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> free_;
  std::map<void*, std::size_t> sizes_;
  AllocatorStats stats_;
};

}  // namespace

template <>
Allocator& allocator<cuda>() {
  static CachingDeviceAllocator* instance = new CachingDeviceAllocator();
  return *instance;
}

}  // namespace tg

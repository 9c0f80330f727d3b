// The caching device allocator: the same size classes and statistics as the CPU one (Note [caching
// allocator]); freed blocks are kept for reuse, so a training loop stops calling cudaMalloc after step one.
// One free list per device and stream (Note [CUDA streams]): a block goes back to the list of the device and
// stream that were current when it was allocated, and an allocation takes blocks only from its current
// device's and stream's list (the legacy default stream is one handle on every device).
#include <algorithm>
#include <map>
#include <utility>
#include <mutex>

#include "check.cuh"
#include "typegrad/core/allocator.hpp"
#include "typegrad/detail/cuda/runtime.hpp"

namespace tg {
namespace {

class CachingDeviceAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes) override { return allocate_from(bytes, false); }
  /// A block of the request's own size class only (Allocator::allocate_exact: a step's arena, Note [step memory
  /// plan]), never a larger cached one.
  void* allocate_exact(std::size_t bytes) override { return allocate_from(bytes, true); }
  void* allocate_from(std::size_t bytes, bool exact) {
    const std::size_t size = CachingHostAllocator::round_size(bytes);
    const Key key{current_device(), backend::cuda::current_stream()};
    std::lock_guard lock(mu_);
    ++stats_.allocations;
    std::size_t got = size;
    void* p = nullptr;
    auto& free = free_[key];
    auto it = free.lower_bound(size);
    if (it != free.end() && (exact ? it->first == size : it->first <= 2 * size)) {
      got = it->first;
      p = it->second;
      free.erase(it);
    } else {
      cudaError_t st = cudaMalloc(&p, size);
      const char* note = "";
      if (st == cudaErrorMemoryAllocation) {  // return the cache to the driver and retry once
        (void)cudaGetLastError();
        if (!capturing_now()) {
          release_cache_locked();
          st = cudaMalloc(&p, size);
        } else {  // returning the cache synchronizes the device, which would invalidate the capture
          note = "; inside a CUDA graph's capture, where the cache cannot be returned to the driver";
        }
      }
      if (st != cudaSuccess)
        throw Error("cuda allocator: cudaMalloc of ", size, " bytes failed: ", cudaGetErrorString(st), " (",
                    stats_.bytes_in_use, " bytes in use, ", stats_.bytes_reserved, " reserved", note, ")");
      ++stats_.system_allocations;
      stats_.bytes_reserved += static_cast<std::int64_t>(size);
    }
    blocks_[p] = {got, key};
    stats_.bytes_in_use += static_cast<std::int64_t>(got);
    if (stats_.bytes_in_use > stats_.peak_bytes) stats_.peak_bytes = stats_.bytes_in_use;
    return p;
  }
  void deallocate(void* ptr, std::size_t) override {
    if (!ptr) return;
    std::lock_guard lock(mu_);
    auto it = blocks_.find(ptr);
    if (it == blocks_.end()) return;
    stats_.bytes_in_use -= static_cast<std::int64_t>(it->second.size);
    free_[it->second.key].emplace(it->second.size, ptr);
    blocks_.erase(it);
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
    if (std::all_of(free_.begin(), free_.end(), [](const auto& f) { return f.second.empty(); })) return;  // nothing cached
    TG_CHECK(!capturing_now(), "cuda allocator: empty_cache() inside a CUDA graph's capture (it synchronizes the device, "
             "which would invalidate the capture): call it outside the compiled step");
    release_cache_locked();
  }
  std::string name() const override { return "cuda caching allocator"; }
  /// Stream's destructor, after the stream's work finished. No allocation can be made on a destroyed stream, so its
  /// free blocks would stay cached until an out-of-memory retry: they go back to the driver, after their devices
  /// finish their work (a block's last use may be queued on another stream: a compiled step's outputs, made on its
  /// own stream, are read on the caller's). Inside a capture, where that would invalidate it, and for the stream's
  /// blocks still in use, they move to a list no allocation takes (retired()), released with the rest of the cache.
  /// A stream created later with the same handle starts with no blocks.
  void forget_stream(void* stream) noexcept {
    std::lock_guard lock(mu_);
    for (auto& [p, block] : blocks_)
      if (block.key.second == stream) block.key.second = retired();
    const bool capturing = capturing_now();
    int device = -1;
    (void)cudaGetDevice(&device);
    for (auto it = free_.begin(); it != free_.end();) {
      if (it->first.second != stream) {
        ++it;
        continue;
      }
      auto blocks = std::exchange(it->second, {});
      const int d = it->first.first;
      it = free_.erase(it);
      if (capturing || cudaSetDevice(d) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) {
        free_[{d, retired()}].merge(blocks);  // std::map: inserting keeps `it` valid
        continue;
      }
      for (const auto& [size, p] : blocks) {
        stats_.bytes_reserved -= static_cast<std::int64_t>(size);
        ++stats_.system_frees;
        (void)cudaFree(p);
      }
    }
    if (device >= 0) (void)cudaSetDevice(device);
    (void)cudaGetLastError();
  }

 private:
  using Key = std::pair<int, void*>;  // (device, stream)
  /// The stream of blocks whose stream was destroyed (forget_stream): no allocation's current stream.
  static void* retired() {
    static char tag;
    return &tag;
  }
  static int current_device() {
    int d = 0;
    TG_CUDA_CHECK(cudaGetDevice(&d));
    return d;
  }
  /// Whether the calling thread's stream is being captured into a CUDA graph (Note [CUDA graphs of a step]): then
  /// nothing that would synchronize the device runs.
  static bool capturing_now() { return backend::cuda::current_stream_capturing(); }
  void release_cache_locked() {
    // A free block may still be read or written by work queued before it was freed (its stream's later
    // allocations are ordered after that work; cudaFree is not documented to wait for it): each device
    // with cached blocks finishes its work first.
    struct RestoreDevice {  // the caller's device on every way out, a failed synchronization's included
      int device;
      ~RestoreDevice() { (void)cudaSetDevice(device); }
    } const restore{current_device()};
    int synced = -1;
    for (auto& [key, free] : free_) {
      if (free.empty()) continue;
      if (key.first != synced) {
        TG_CUDA_CHECK(cudaSetDevice(key.first));
        TG_CUDA_CHECK(cudaDeviceSynchronize());
        synced = key.first;
      }
      const auto blocks = std::exchange(free, {});  // out of the list before any free can throw
      for (const auto& [size, p] : blocks) {
        stats_.bytes_reserved -= static_cast<std::int64_t>(size);
        ++stats_.system_frees;
        TG_CUDA_CHECK(cudaFree(p));
      }
    }
    free_.clear();
  }
  struct Block {
    std::size_t size;
    Key key;  // current when the block was allocated; its free list
  };
  mutable std::mutex mu_;
  std::map<Key, std::multimap<std::size_t, void*>> free_;  // per (device, stream): size -> block
  std::map<void*, Block> blocks_;                           // blocks in use
  AllocatorStats stats_;
};

}  // namespace

namespace {
CachingDeviceAllocator& device_allocator() {
  static CachingDeviceAllocator* instance = new CachingDeviceAllocator();
  return *instance;
}
}  // namespace

template <>
Allocator& allocator<cuda>() {
  return device_allocator();
}

namespace backend::cuda::detail {
void forget_stream(void* stream) noexcept { device_allocator().forget_stream(stream); }
}  // namespace backend::cuda::detail

}  // namespace tg

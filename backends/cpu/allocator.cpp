// The CPU caching allocator (see Note [caching allocator] in core/allocator.hpp).
#include <cstdlib>
#include <new>

#include "typegrad/config.hpp"
#include "typegrad/core/allocator.hpp"
#include "typegrad/core/error.hpp"

namespace tg {

namespace {
constexpr std::size_t kAlignment = 64;  // one cache line, a full zmm register
constexpr std::size_t kSmallGranule = 512;
constexpr std::size_t kSmallLimit = std::size_t(1) << 20;
}  // namespace

std::size_t CachingHostAllocator::round_size(std::size_t bytes) {
  if (bytes == 0) bytes = 1;
  if (bytes <= kSmallLimit) return (bytes + kSmallGranule - 1) / kSmallGranule * kSmallGranule;
  std::size_t pow2 = kSmallLimit;
  while (pow2 < bytes) pow2 <<= 1;
  const std::size_t step = pow2 / 8;
  return (bytes + step - 1) / step * step;
}

CachingHostAllocator::~CachingHostAllocator() { empty_cache(); }

void* CachingHostAllocator::allocate(std::size_t bytes) { return allocate_from(bytes, false); }
void* CachingHostAllocator::allocate_exact(std::size_t bytes) { return allocate_from(bytes, true); }

void* CachingHostAllocator::allocate_from(std::size_t bytes, bool exact) {
  const std::size_t size = round_size(bytes);
  std::lock_guard lock(mu_);
  ++stats_.allocations;
  void* p = nullptr;
  std::size_t got = size;
  auto it = free_.lower_bound(size);
  if (it != free_.end() && (exact ? it->first == size : it->first <= 2 * size)) {
    got = it->first;
    p = it->second;
    free_.erase(it);
  } else {
    p = std::aligned_alloc(kAlignment, size);
    if (!p) {
      // Give the cache back and retry once before reporting out-of-memory.
      for (auto& [sz, blk] : free_) {
        std::free(blk);
        stats_.bytes_reserved -= static_cast<std::int64_t>(sz);
        ++stats_.system_frees;
      }
      free_.clear();
      p = std::aligned_alloc(kAlignment, size);
      if (!p) throw Error("cpu allocator: out of memory allocating ", size, " bytes (", stats_.bytes_in_use, " in use)");
    }
    ++stats_.system_allocations;
    stats_.bytes_reserved += static_cast<std::int64_t>(size);
  }
  // The caller passes `bytes` back on deallocate and we re-round it; a block taken from the cache may be
  // larger than its size class, so its true size is kept in a side table.
  if (got != size) oversized_[p] = got;
  stats_.bytes_in_use += static_cast<std::int64_t>(got);
  if (stats_.bytes_in_use > stats_.peak_bytes) stats_.peak_bytes = stats_.bytes_in_use;
  return p;
}

void CachingHostAllocator::deallocate(void* ptr, std::size_t bytes) {
  if (!ptr) return;
  std::lock_guard lock(mu_);
  std::size_t size = round_size(bytes);
  if (auto it = oversized_.find(ptr); it != oversized_.end()) {
    size = it->second;
    oversized_.erase(it);
  }
  stats_.bytes_in_use -= static_cast<std::int64_t>(size);
  free_.emplace(size, ptr);
}

AllocatorStats CachingHostAllocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void CachingHostAllocator::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.peak_bytes = stats_.bytes_in_use;
}

void CachingHostAllocator::empty_cache() {
  std::lock_guard lock(mu_);
  for (auto& [sz, blk] : free_) {
    std::free(blk);
    stats_.bytes_reserved -= static_cast<std::int64_t>(sz);
    ++stats_.system_frees;
  }
  free_.clear();
}

template <>
Allocator& allocator<cpu>() {
  static CachingHostAllocator* instance = new CachingHostAllocator();  // never destroyed: outlives tensors
  return *instance;
}

namespace detail {
namespace {
thread_local AllocationOverride* t_override[2] = {nullptr, nullptr};  // cpu, cuda
}  // namespace
AllocationOverride*& allocation_override(DeviceKind device) { return t_override[device == DeviceKind::cpu ? 0 : 1]; }
}  // namespace detail

#if !TG_HAVE_CUDA
template <>
Allocator& allocator<cuda>() {
  throw Error("cuda allocator: typegrad was built without the CUDA backend (configure with TG_CUDA=ON)");
}
#endif

}  // namespace tg

// One allocator interface with statistics on every device; the CPU one caches freed blocks.
//   auto& a = tg::allocator<tg::cpu>();  void* p = a.allocate(1 << 20);  a.deallocate(p, 1 << 20);
//   a.stats().peak_bytes;  a.reset_peak();   // every memory claim in the project is measured here
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

#include "typegrad/core/device.hpp"

namespace tg {

struct AllocatorStats {
  std::int64_t bytes_in_use = 0;        // handed out to tensors now (rounded block sizes)
  std::int64_t peak_bytes = 0;          // max of bytes_in_use since the last reset_peak()
  std::int64_t bytes_reserved = 0;      // obtained from the system and not yet returned (in use + cached)
  std::int64_t system_allocations = 0;  // calls to the system allocator since the start (never reset)
  std::int64_t system_frees = 0;
  std::int64_t allocations = 0;         // calls to allocate()
};

class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  /// A block of exactly the size class of `bytes`, never a larger cached one (tg::compile's arenas, whose bytes
  /// the plan reports). Allocators without size classes serve it as allocate().
  virtual void* allocate_exact(std::size_t bytes) { return allocate(bytes); }
  virtual void deallocate(void* ptr, std::size_t bytes) = 0;
  virtual AllocatorStats stats() const = 0;
  virtual void reset_peak() = 0;
  /// Returns every cached (free) block to the system.
  virtual void empty_cache() = 0;
  virtual std::string name() const = 0;
};

// Note [caching allocator]
// Page faults cost far more than arithmetic on the project's VMs (PEERS.md: PyTorch's AdamW step took
// 480 ms with fresh allocations, 122 ms with memory kept). So freed blocks are never returned to the
// system in the steady state: a request is rounded up to a size class (512 B granules up to 1 MiB, then
// 1/8 of the next power of two) and served from the smallest cached block of at least that size and at
// most twice it. A training loop whose shapes repeat therefore makes no system allocation after its
// first step; tests check this with AllocatorStats::system_allocations.
class CachingHostAllocator final : public Allocator {
 public:
  CachingHostAllocator() = default;
  ~CachingHostAllocator() override;
  CachingHostAllocator(const CachingHostAllocator&) = delete;
  CachingHostAllocator& operator=(const CachingHostAllocator&) = delete;

  void* allocate(std::size_t bytes) override;
  void* allocate_exact(std::size_t bytes) override;
  void deallocate(void* ptr, std::size_t bytes) override;
  AllocatorStats stats() const override;
  void reset_peak() override;
  void empty_cache() override;
  std::string name() const override { return "cpu caching allocator"; }

  static std::size_t round_size(std::size_t bytes);

 private:
  void* allocate_from(std::size_t bytes, bool exact);
  mutable std::mutex mu_;
  std::multimap<std::size_t, void*> free_;  // block size -> block
  std::map<void*, std::size_t> oversized_;  // blocks handed out larger than their request's size class
  AllocatorStats stats_;
};

/// Serves the calling thread's new storages on one device in place of that device's allocator while it is
/// installed (tg::compile's step memory, Note [step memory plan]).
class AllocationOverride {
 public:
  virtual ~AllocationOverride() = default;
  /// Memory for a storage of `bytes`; sets `owner` to the allocator its deallocation is handed to.
  virtual void* allocate(std::size_t bytes, Allocator*& owner) = 0;
};
namespace detail {
/// The calling thread's override for `device` (null: none; set by capture::StepMemory's scope).
AllocationOverride*& allocation_override(DeviceKind device);
}  // namespace detail

template <class D>
Allocator& allocator();
template <>
Allocator& allocator<cpu>();
template <>
Allocator& allocator<cuda>();  // defined by the CUDA backend; throws without one

}  // namespace tg

// Storage: a reference-counted block of device memory from that device's allocator, with one slot for the
// compute copy of the tensor it holds (a parameter's bf16/fp16 copy; Note [master weights and per-step copies]).
//   auto s = tg::Storage::allocate<tg::cpu>(1024);   // 1024 bytes; returned to the cache when the last owner dies
//   const tg::AttachedCopy* c = s->attached_copy();  // null unless a compute copy is attached
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "typegrad/core/allocator.hpp"
#include "typegrad/core/device.hpp"
#include "typegrad/core/dtype.hpp"

namespace tg {

/// A low-precision compute copy of the tensor a storage holds, attached to that storage (every handle and
/// view of a parameter shares it). Core knows only the copy's element type, its device and its owner; the
/// object belongs to the owner (amp::WeightCopies), which attaches it while it lives and detaches it before
/// it dies, so a storage never points at a dead copy. Note [master weights and per-step copies].
struct AttachedCopy {
  DType dtype;
  DeviceKind device;
  const void* owner;  // identifies the owner (its shared state), for copy_of and the two-owner error
  // For an optimizer that writes the copy in its own update (Note [the optimizer writes the weight copies]):
  // `numel` contiguous elements at `data`, element i the master's element i from `master_data` on.
  // `written` is set by such an update and cleared by the owner's refresh.
  void* data = nullptr;
  const void* master_data = nullptr;
  std::int64_t numel = 0;
  mutable bool written = false;

 protected:
  AttachedCopy(DType d, DeviceKind k, const void* o) : dtype(d), device(k), owner(o) {}
  ~AttachedCopy() = default;
};

class Storage {
 public:
  Storage(void* ptr, std::size_t bytes, Allocator* alloc) : ptr_(ptr), bytes_(bytes), alloc_(alloc) {}
  ~Storage() {
    if (alloc_) alloc_->deallocate(ptr_, bytes_);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  template <class D>
  static std::shared_ptr<Storage> allocate(std::size_t bytes) {
    if (AllocationOverride* o = detail::allocation_override(device_traits<D>::kind)) {  // Note [step memory plan]
      Allocator* owner = nullptr;
      void* p = o->allocate(bytes, owner);
      return std::make_shared<Storage>(p, bytes, owner);
    }
    Allocator& a = allocator<D>();
    return std::make_shared<Storage>(a.allocate(bytes), bytes, &a);
  }

  /// A storage with no memory standing for a value that is never computed: the intermediate of a fused
  /// pointwise chain (Note [fusion rewrites]). Reading it throws tg::Error with `why`.
  static std::shared_ptr<Storage> pending(std::size_t bytes, std::shared_ptr<const std::string> why) {
    auto s = std::make_shared<Storage>(nullptr, bytes, nullptr);
    s->pending_ = std::move(why);
    return s;
  }

  /// Marks an allocated storage as not yet written: reading it throws tg::Error with `why` until
  /// clear_pending(). The output of an op whose value a later op writes (Note [pair rewrites]).
  void set_pending(std::shared_ptr<const std::string> why) noexcept { pending_ = std::move(why); }
  const std::shared_ptr<const std::string>& pending_message() const noexcept { return pending_; }
  void clear_pending() noexcept {
    if (ptr_ || !bytes_) pending_.reset();  // a storage with no memory stays pending
  }

  void* data() const {
    if (pending_) [[unlikely]] throw_pending();
    return ptr_;
  }
  std::size_t bytes() const { return bytes_; }
  bool is_pending() const noexcept { return pending_ != nullptr; }

  // ---- the compute-copy slot (one copy at a time; atomic, so two racing owners get a clean answer) --------
  /// The copy attached now (null: none).
  const AttachedCopy* attached_copy() const noexcept { return copy_.load(std::memory_order_acquire); }
  /// Attaches `c` when no copy is attached. Returns the copy attached afterwards: `c` on success, else the
  /// one that was already there (left in place).
  const AttachedCopy* attach_copy(const AttachedCopy* c) noexcept {
    const AttachedCopy* expected = nullptr;
    if (copy_.compare_exchange_strong(expected, c, std::memory_order_acq_rel, std::memory_order_acquire)) return c;
    return expected;
  }
  /// Detaches `c` if it is the copy attached (else leaves the slot alone).
  void detach_copy(const AttachedCopy* c) noexcept {
    const AttachedCopy* expected = c;
    copy_.compare_exchange_strong(expected, nullptr, std::memory_order_acq_rel, std::memory_order_acquire);
  }

 private:
  void* ptr_;
  std::size_t bytes_;
  Allocator* alloc_;
  std::atomic<const AttachedCopy*> copy_{nullptr};
  std::shared_ptr<const std::string> pending_;
  [[noreturn]] void throw_pending() const;
};

}  // namespace tg

// Storage: a reference-counted block of device memory from that device's allocator.
//   auto s = tg::Storage::allocate<tg::cpu>(1024);   // 1024 bytes; returned to the cache when the last owner dies
#pragma once

#include <cstddef>
#include <memory>

#include "typegrad/core/allocator.hpp"

namespace tg {

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
    Allocator& a = allocator<D>();
    return std::make_shared<Storage>(a.allocate(bytes), bytes, &a);
  }

  void* data() const { return ptr_; }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_;
  std::size_t bytes_;
  Allocator* alloc_;
};

}  // namespace tg

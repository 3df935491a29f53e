// Buffer<T>: an owned array of T in some Memory (host for the CPU backends, device for
// CUDA), the engine's replacement for std::vector wherever a backend reads or writes.
//
// Like a std::vector that never copies: Resize keeps the allocation when it is big
// enough and otherwise replaces it WITHOUT keeping the contents (scratch buffers are
// rewritten every use). Contents are uninitialised after growth.
#ifndef KVLENS_KERNELS_BUFFER_H_
#define KVLENS_KERNELS_BUFFER_H_

#include <algorithm>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "kernels/memory.h"

namespace kvlens::kernels {

template <typename T>
class Buffer {
 public:
  Buffer() : Buffer(HostMemory()) {}
  explicit Buffer(Memory& memory) : memory_(&memory) {}
  ~Buffer() { memory_->Free(data_); }
  Buffer(Buffer&& o) noexcept
      : memory_(o.memory_),
        data_(std::exchange(o.data_, nullptr)),
        size_(std::exchange(o.size_, 0)),
        capacity_(std::exchange(o.capacity_, 0)) {}
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      memory_->Free(data_);
      memory_ = o.memory_;
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
      capacity_ = std::exchange(o.capacity_, 0);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  // A buffer of n elements in `memory`.
  static absl::StatusOr<Buffer> Allocate(Memory& memory, int64_t n) {
    Buffer b(memory);
    if (absl::Status s = b.Resize(n); !s.ok()) return s;
    return b;
  }

  // size() ← n. Growing past capacity() allocates max(n, 1.5 · capacity()) elements, or n
  // where that does not fit, and drops the old contents (on failure the buffer is empty);
  // shrinking never frees.
  absl::Status Resize(int64_t n) {
    if (n < 0) return absl::InvalidArgumentError(absl::StrCat("buffer size ", n, " is negative"));
    if (n > capacity_) {
      int64_t grown = std::max(n, capacity_ + capacity_ / 2);
      memory_->Free(data_);
      data_ = nullptr;
      size_ = capacity_ = 0;
      auto p = memory_->Allocate(static_cast<size_t>(grown) * sizeof(T));
      if (!p.ok() && grown > n) {
        grown = n;
        p = memory_->Allocate(static_cast<size_t>(grown) * sizeof(T));
      }
      if (!p.ok()) return p.status();
      data_ = static_cast<T*>(*p);
      capacity_ = grown;
    }
    size_ = n;
    return absl::OkStatus();
  }

  // Copies in and out: n elements starting at element `offset` of this buffer.
  absl::Status CopyFromHost(const T* src, int64_t n, int64_t offset = 0) {
    return memory_->CopyFromHost(data_ + offset, src, static_cast<size_t>(n) * sizeof(T));
  }
  absl::Status CopyToHost(T* dst, int64_t n, int64_t offset = 0) const {
    return memory_->CopyToHost(dst, data_ + offset, static_cast<size_t>(n) * sizeof(T));
  }

  T* data() { return data_; }
  const T* data() const { return data_; }
  int64_t size() const { return size_; }
  int64_t capacity() const { return capacity_; }
  bool empty() const { return size_ == 0; }
  Memory& memory() const { return *memory_; }

 private:
  Memory* memory_;
  T* data_ = nullptr;
  int64_t size_ = 0;
  int64_t capacity_ = 0;
};

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_BUFFER_H_

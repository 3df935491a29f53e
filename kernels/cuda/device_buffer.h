// An owned cudaMalloc allocation (never managed memory), and a pinned host allocation.
#ifndef KVLENS_KERNELS_CUDA_DEVICE_BUFFER_H_
#define KVLENS_KERNELS_CUDA_DEVICE_BUFFER_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"

namespace kvlens::kernels::cuda {

// cudaMalloc(ptr, bytes) as a Status (RESOURCE_EXHAUSTED when it does not fit). A failed
// allocation leaves the device usable, but also leaves cudaErrorMemoryAllocation as this
// thread's last error, which the next launch's check (cudaGetLastError) would report as
// the launch's own failure: it is read back here, so the error is reported once.
inline absl::Status DeviceMalloc(void** ptr, size_t bytes) {
  *ptr = nullptr;
  const cudaError_t e = cudaMalloc(ptr, bytes);
  if (e == cudaSuccess) return absl::OkStatus();
  (void)cudaGetLastError();
  const std::string what = absl::StrCat("cudaMalloc of ", bytes, " bytes");
  return CudaStatus(e, what.c_str(), __FILE__, __LINE__);
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  ~DeviceBuffer() { Free(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Free();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Makes the buffer hold at least `bytes` (contents are not kept): half as much again
  // for the next growth, or just `bytes` where that does not fit. Growing frees the old
  // allocation; cudaFree waits for the device, so work still reading it finishes first.
  // On failure the buffer is empty.
  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    Free();
    size_t grown = bytes + bytes / 2;
    if (!DeviceMalloc(&ptr_, grown).ok()) {
      grown = bytes;
      if (absl::Status s = DeviceMalloc(&ptr_, grown); !s.ok()) return s;
    }
    bytes_ = grown;
    return absl::OkStatus();
  }
  // Takes ownership of a cudaMalloc allocation.
  static DeviceBuffer Adopt(void* ptr, size_t bytes) {
    DeviceBuffer b;
    b.ptr_ = ptr;
    b.bytes_ = bytes;
    return b;
  }

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Free() {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }

  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  ~PinnedBuffer() {
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    if (this != &o) {
      if (ptr_ != nullptr) cudaFreeHost(ptr_);
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  absl::Status Reserve(size_t bytes) {
    if (bytes <= bytes_) return absl::OkStatus();
    if (ptr_ != nullptr) cudaFreeHost(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
    KVLENS_CUDA_RETURN_IF_ERROR(cudaMallocHost(&ptr_, bytes));
    bytes_ = bytes;
    return absl::OkStatus();
  }
  unsigned char* get() const { return static_cast<unsigned char*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_DEVICE_BUFFER_H_

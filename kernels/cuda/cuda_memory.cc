#include "kernels/cuda/cuda_memory.h"

#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/device_buffer.h"

namespace kvlens::kernels::cuda {

CudaMemory::CudaMemory(int device, cudaStream_t stream)
    : device_(device), stream_(stream), name_(absl::StrCat("cuda:", device)) {}

absl::StatusOr<void*> CudaMemory::Allocate(size_t bytes) {
  if (bytes == 0) return nullptr;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  void* p = nullptr;
  if (absl::Status s = DeviceMalloc(&p, bytes); !s.ok()) return s;
  return p;
}

void CudaMemory::Free(void* p) {
  if (p == nullptr) return;
  cudaSetDevice(device_);
  cudaFree(p);  // waits for the device: work still reading p finishes first
}

absl::Status CudaMemory::CopyFromHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(stream_mu_);
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  // From pageable memory the call returns once src has been staged, so src may be reused.
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaMemory::CopyToHost(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(stream_mu_);
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  KVLENS_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream_));
  return absl::OkStatus();
}

absl::Status CudaMemory::Copy(void* dst, const void* src, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(stream_mu_);
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
  return absl::OkStatus();
}

absl::Status CudaMemory::Memset(void* dst, int byte, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(stream_mu_);
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dst, byte, bytes, stream_));
  return absl::OkStatus();
}

absl::StatusOr<Memory::Usage> CudaMemory::usage() const {
  KVLENS_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  Usage u;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&u.free, &u.total));
  return u;
}

}  // namespace kvlens::kernels::cuda

// CudaMemory: one GPU's global memory as a kernels::Memory (plain cudaMalloc, never
// managed memory). Copies are cudaMemcpyAsync / cudaMemsetAsync on the owning backend's
// stream, so they are ordered with its ops; CopyToHost then waits for that stream.
// Every call makes the device current first, so CopyToHost works from any thread (the
// engine's interpretability readers copy a session's KV blocks out while the step thread
// keeps running). Those stream calls hold stream_mutex(), which the backend holds while
// it captures a CUDA graph on the stream: a copy from another thread then waits instead of
// being captured into the graph.
#ifndef KVLENS_KERNELS_CUDA_CUDA_MEMORY_H_
#define KVLENS_KERNELS_CUDA_CUDA_MEMORY_H_

#include <cuda_runtime_api.h>

#include <mutex>
#include <string>

#include "kernels/memory.h"

namespace kvlens::kernels::cuda {

class CudaMemory final : public Memory {
 public:
  CudaMemory(int device, cudaStream_t stream);

  std::string_view name() const override { return name_; }
  bool host_accessible() const override { return false; }
  absl::StatusOr<void*> Allocate(size_t bytes) override;
  void Free(void* p) override;
  absl::Status CopyFromHost(void* dst, const void* src, size_t bytes) override;
  absl::Status CopyToHost(void* dst, const void* src, size_t bytes) override;
  absl::Status Copy(void* dst, const void* src, size_t bytes) override;
  absl::Status Memset(void* dst, int byte, size_t bytes) override;
  // cudaMemGetInfo of the device.
  absl::StatusOr<Usage> usage() const override;
  // Held by every copy and memset (and by the backend during a graph capture).
  std::mutex& stream_mutex() { return stream_mu_; }

 private:
  int device_;
  cudaStream_t stream_;
  std::string name_;
  std::mutex stream_mu_;
};

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_CUDA_MEMORY_H_

// Copies between host vectors and the CUDA emulator's device memory for its own tests,
// each cudaMemcpy checked with EXPECT (emulator_checks.cc, schedule_checks.cc).
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_COPIES_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_COPIES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels::cuda {

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, sizeof(T) * host.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  // Waited for: from pageable memory cudaMemcpy returns once the bytes are staged, and a
  // non-blocking stream does not wait for the legacy stream's write.
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> HostCopy(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_EMU_COPIES_H_

// The CudaBackend* suites' fixture: a CudaBackend on device 0, or the test skipped with
// the reason when no device is usable (cuda_backend_test.cc, draw_tokens_test.cc).
#ifndef KVLENS_TESTS_KERNELS_CUDA_CUDA_BACKEND_FIXTURE_H_
#define KVLENS_TESTS_KERNELS_CUDA_CUDA_BACKEND_FIXTURE_H_

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <utility>

#include "gtest/gtest.h"
#include "kernels/cuda/cuda_backend.h"

namespace kvlens::kernels::cuda {

// "" when a device is usable, else why not.
inline std::string NoDeviceReason() {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorName(e);
  }
  if (count == 0) return "no CUDA device present";
  return "";
}

class CudaBackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string reason = NoDeviceReason(); !reason.empty()) GTEST_SKIP() << reason;
    absl::StatusOr<std::unique_ptr<CudaBackend>> b = CudaBackend::Create(0);
    ASSERT_TRUE(b.ok()) << b.status();
    backend_ = std::move(*b);
  }
  std::unique_ptr<CudaBackend> backend_;
};

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_TESTS_KERNELS_CUDA_CUDA_BACKEND_FIXTURE_H_

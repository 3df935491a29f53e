// Device memory running out, on the CUDA emulator, whose allocations a test can make fail
// (kvlens_emu::FailDeviceAllocationsAfter; a GPU's cannot be made to, so these run in
// cuda_emu_tests only). An allocation that does not fit fails what needed it with
// RESOURCE_EXHAUSTED, naming the bytes, and nothing else: not the next kernel launch (a
// failed cudaMalloc leaves its error as the thread's last one).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <future>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/staged_backend.h"
#include "tests/engine/serve_together.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using kernels::cuda::CudaBackend;

// Until destroyed, every device allocation fails.
class NoMoreDeviceMemory {
 public:
  NoMoreDeviceMemory() { kvlens_emu::FailDeviceAllocationsAfter(0); }
  ~NoMoreDeviceMemory() { kvlens_emu::FailDeviceAllocationsAfter(-1); }
  NoMoreDeviceMemory(const NoMoreDeviceMemory&) = delete;
  NoMoreDeviceMemory& operator=(const NoMoreDeviceMemory&) = delete;
};

std::unique_ptr<CudaBackend> Backend() {
  auto b = CudaBackend::Create(0);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

// Device floats holding `values`.
float* DeviceFloats(kernels::Memory& memory, std::vector<float> values) {
  auto p = memory.Allocate(sizeof(float) * values.size());
  EXPECT_TRUE(p.ok()) << p.status();
  if (!p.ok()) return nullptr;
  EXPECT_TRUE(memory.CopyFromHost(*p, values.data(), sizeof(float) * values.size()).ok());
  return static_cast<float*>(*p);
}

std::vector<float> HostFloats(kernels::Memory& memory, const float* device, size_t n) {
  std::vector<float> out(n);
  EXPECT_TRUE(memory.CopyToHost(out.data(), device, sizeof(float) * n).ok());
  return out;
}

TEST(CudaOutOfMemory, AFailedAllocationIsNotTheNextLaunchsFailure) {
  std::unique_ptr<CudaBackend> b = Backend();
  ASSERT_NE(b, nullptr);
  kernels::Memory& memory = b->memory();
  float* x = DeviceFloats(memory, {1, 2, 3, 4});
  float* y = DeviceFloats(memory, {10, 20, 30, 40});
  ASSERT_TRUE(x != nullptr && y != nullptr);
  {
    NoMoreDeviceMemory full;
    absl::StatusOr<void*> big = memory.Allocate(1 << 20);
    ASSERT_FALSE(big.ok());
    EXPECT_EQ(big.status().code(), absl::StatusCode::kResourceExhausted) << big.status();
    EXPECT_NE(big.status().message().find("cudaMalloc of 1048576 bytes"), std::string::npos)
        << big.status();
  }
  b->Add(y, x, 4);
  ASSERT_TRUE(b->Synchronize().ok()) << b->Synchronize();
  EXPECT_EQ(HostFloats(memory, y, 4), (std::vector<float>{11, 22, 33, 44}));
  memory.Free(x);
  memory.Free(y);
}

}  // namespace
}  // namespace kvlens

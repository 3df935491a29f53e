// A block's static shared memory on the emulator starts as NaN (0xFF bytes) in every
// block, as its dynamic shared memory does, rather than holding what the block before
// wrote: a GPU's starts undefined, so a kernel reading a __shared__ variable before any
// thread of its block wrote it reads NaN here (it read the previous block's values until
// 2026-12-07, which could pass for right). A variable is filled once a block, when first
// declared: a device function's, declared again at its next call, keeps its value.
#include <cuda_runtime_api.h>

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/cuda/emu/emu_copies.h"

namespace kvlens::kernels::cuda {

// static_shared_fixture.cu.
cudaError_t LaunchWrittenInBlockZero(int blocks, float* out);  // out: [blocks][2]
cudaError_t LaunchBumpTwice(int blocks, int threads, float* out);

namespace {

TEST(CudaEmulatorStaticShared, EveryBlockStartsWithNaNNotTheLastBlocksValues) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 6 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(LaunchWrittenInBlockZero(3, d), cudaSuccess);
  const std::vector<float> got = HostCopy(d, 6);
  EXPECT_EQ(got[0], 5.0f);
  EXPECT_EQ(got[1], 7.0f);
  for (size_t i = 2; i < 6; ++i) EXPECT_TRUE(std::isnan(got[i])) << i << ": " << got[i];
  // A second launch: block 0 writes again, the others still read NaN.
  ASSERT_EQ(LaunchWrittenInBlockZero(2, d), cudaSuccess);
  const std::vector<float> again = HostCopy(d, 4);
  EXPECT_EQ(again[0], 5.0f);
  EXPECT_EQ(again[1], 7.0f);
  EXPECT_TRUE(std::isnan(again[2]));
  EXPECT_TRUE(std::isnan(again[3]));
  cudaFree(d);
}

TEST(CudaEmulatorStaticShared, AVariableDeclaredAgainInItsBlockKeepsItsValue) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 3 * 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(LaunchBumpTwice(3, 64, d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 3 * 64), std::vector<float>(3 * 64, 2.0f));  // 1, then 1 + 1
  cudaFree(d);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

// A launch's limits on the emulator that depend on the kernel, not just the launch:
// its __launch_bounds__ (a block of up to its maximum threads runs, a larger one fails as
// a GPU refuses it, cudaErrorLaunchOutOfResources, having written nothing), and its static
// shared memory, which counts with the dynamic towards 48 KiB unless the kernel opts in;
// a header's (reduce.cuh's) among them; and translate_cu.sh moves every bound of
// kernels/cuda's kernels into the body, and follows every __shared__ variable with its
// count, in its .cu files and headers alike, without moving a line.
#include <cuda_runtime_api.h>

#include <cmath>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/kernels/cuda/emu/emu_copies.h"

namespace kvlens::kernels::cuda {

// launch_limits_fixture.cu: NumberThreadsKernel<warps>, bounded to warps · 32 threads;
// CountThreadsKernel, bounded to 64 over several lines.
cudaError_t LaunchNumberThreads(int warps, dim3 block, int* out);
cudaError_t LaunchCountThreads(dim3 block, int* out);
// StaticAndDynamicKernel<instance> (0 or 1): 40 KiB of static shared memory and `floats`
// of dynamic, opted in to exactly those bytes first where opt_in.
cudaError_t LaunchStaticAndDynamic(int instance, int floats, bool opt_in, float* out);
// StaticDynamicAndReduceKernel: 40 KiB of static shared memory, BlockReduce's 128 bytes
// in reduce.cuh and `floats` of dynamic, 64 threads; writes 64 · (1 + 3).
cudaError_t LaunchStaticDynamicAndReduce(int floats, float* out);

namespace {

constexpr int kUnwritten = -1;  // device memory's 0xFF fill

std::vector<int> Numbered(int n) {
  std::vector<int> v(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i + 1;
  return v;
}

TEST(CudaEmulatorLaunchLimits, ABlockUpToTheBoundRuns) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(int)), cudaSuccess);
  ASSERT_EQ(LaunchNumberThreads(1, dim3(32), d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 32), Numbered(32));
  ASSERT_EQ(LaunchNumberThreads(2, dim3(64), d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 64), Numbered(64));
  ASSERT_EQ(LaunchNumberThreads(2, dim3(4, 4, 2), d), cudaSuccess);  // 32 of 64
  EXPECT_EQ(HostCopy(d, 32), Numbered(32));
  ASSERT_EQ(LaunchCountThreads(dim3(8, 8), d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 1)[0], 64);
  cudaFree(d);
}

TEST(CudaEmulatorLaunchLimits, ALargerBlockFailsAndWritesNothing) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 128 * sizeof(int)), cudaSuccess);
  EXPECT_EQ(LaunchNumberThreads(1, dim3(33), d), cudaErrorLaunchOutOfResources);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read once, then cleared
  EXPECT_EQ(LaunchNumberThreads(2, dim3(65), d), cudaErrorLaunchOutOfResources);
  EXPECT_EQ(LaunchNumberThreads(2, dim3(8, 3, 3), d), cudaErrorLaunchOutOfResources);  // 72
  EXPECT_EQ(LaunchCountThreads(dim3(8, 9), d), cudaErrorLaunchOutOfResources);
  EXPECT_EQ(HostCopy(d, 128), std::vector<int>(128, kUnwritten));
  EXPECT_STREQ(cudaGetErrorString(cudaErrorLaunchOutOfResources),
               "too many resources requested for launch");
  cudaFree(d);
}

TEST(CudaEmulatorLaunchLimits, StaticSharedMemoryCountsTowardsTheDefaultLimit) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, sizeof(float)), cudaSuccess);
  // 40960 + 8192 = 49152 bytes: the default limit exactly.
  ASSERT_EQ(LaunchStaticAndDynamic(0, 2048, /*opt_in=*/false, d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 1)[0], 1.0f + 2.0f + 3.0f + 4.0f);
  // 4 bytes past it, without opting in: refused before anything runs (the kernel's static
  // bytes are known from the launch above), though the dynamic 8196 alone would fit.
  ASSERT_EQ(cudaMemset(d, 0xff, sizeof(float)), cudaSuccess);
  EXPECT_EQ(LaunchStaticAndDynamic(0, 2049, /*opt_in=*/false, d), cudaErrorInvalidConfiguration);
  EXPECT_TRUE(std::isnan(HostCopy(d, 1)[0]));
  // Opted in to the dynamic bytes: the static ones no longer count against them.
  ASSERT_EQ(LaunchStaticAndDynamic(0, 2049, /*opt_in=*/true, d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 1)[0], 10.0f);
  // Opting in to more than 227 KiB with the static: refused by cudaFuncSetAttribute.
  EXPECT_EQ(LaunchStaticAndDynamic(0, 48 * 1024, /*opt_in=*/true, d), cudaErrorInvalidValue);
  cudaFree(d);
}

TEST(CudaEmulatorLaunchLimits, AFirstLaunchOverTheLimitFailsOnceItsStaticBytesAreSeen) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, sizeof(float)), cudaSuccess);
  // The emulator learns a kernel's static bytes as its first block runs, so this launch
  // fails after that block (a GPU, before it), and the next one before running.
  EXPECT_EQ(LaunchStaticAndDynamic(1, 2049, /*opt_in=*/false, d), cudaErrorInvalidConfiguration);
  ASSERT_EQ(cudaMemset(d, 0xff, sizeof(float)), cudaSuccess);
  EXPECT_EQ(LaunchStaticAndDynamic(1, 2049, /*opt_in=*/false, d), cudaErrorInvalidConfiguration);
  EXPECT_TRUE(std::isnan(HostCopy(d, 1)[0]));
  cudaFree(d);
}

TEST(CudaEmulatorLaunchLimits, AHeadersSharedVariablesCountTowardsTheLimit) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, sizeof(float)), cudaSuccess);
  // 40960 + 128 (reduce.cuh's partial sums) + 8064 = 49152 bytes: the limit exactly.
  ASSERT_EQ(LaunchStaticDynamicAndReduce(2016, d), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 1)[0], 64 * 4.0f);
  // 4 bytes past it, with the header's 128: refused, nothing run.
  ASSERT_EQ(cudaMemset(d, 0xff, sizeof(float)), cudaSuccess);
  EXPECT_EQ(LaunchStaticDynamicAndReduce(2017, d), cudaErrorInvalidConfiguration);
  EXPECT_TRUE(std::isnan(HostCopy(d, 1)[0]));
  cudaFree(d);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// Lines that declare a (static) __shared__ variable: their first word.
size_t SharedDeclarations(const std::string& text) {
  size_t n = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::string word;
    std::istringstream(line) >> word;
    n += word == "__shared__" ? 1 : 0;
  }
  return n;
}

// What the emulator compiles (the build's translations) against kernels/cuda's sources,
// its .cu files and its .cuh headers: every bound moved, every __shared__ variable
// counted, no line moved.
TEST(CudaEmulatorLaunchLimits, EveryKernelsBoundAndSharedVariableIsSeenOnItsOwnLine) {
  size_t bounds = 0, shared = 0, header_shared = 0;
  auto check = [&](const std::string& source_path, const std::string& translated_path) {
    SCOPED_TRACE(source_path);
    const std::string source = ReadFile(std::string(KVLENS_SOURCE_DIR) + source_path);
    const std::string translated = ReadFile(std::string(KVLENS_BINARY_DIR) + translated_path);
    const size_t source_bounds = Count(source, "__launch_bounds__(");
    const size_t declared = SharedDeclarations(source);
    EXPECT_EQ(Count(translated, "\n"), Count(source, "\n") + 1);  // + the #line
    EXPECT_EQ(Count(translated, "ExceedsLaunchBounds("), source_bounds);
    EXPECT_EQ(Count(translated, "__launch_bounds__("), 0u);
    EXPECT_EQ(Count(translated, "StaticShared("), declared);
    bounds += source_bounds;
    shared += declared;
    return declared;
  };
  const std::string emu = "/tests/kernels/cuda/emu/";
  std::istringstream names(KVLENS_EMU_KERNEL_FILES);  // the build's lists, by name
  for (std::string name; names >> name;)
    check("/kernels/cuda/" + name + ".cu", emu + name + ".cu.cc");
  std::istringstream headers(KVLENS_EMU_HEADER_FILES);
  for (std::string name; headers >> name;) {
    header_shared +=
        check("/kernels/cuda/" + name + ".cuh", emu + "translated/kernels/cuda/" + name + ".cuh");
  }
  EXPECT_GE(bounds, 11u);        // the kernels' bounds on 2026-12-07
  EXPECT_GE(shared, 15u);        // and their __shared__ variables,
  EXPECT_GE(header_shared, 4u);  // 4 of them in headers (reduce.cuh, split_kv_common.cuh)
  const std::string fixture = ReadFile(std::string(KVLENS_BINARY_DIR) +
                                       "/tests/kernels/cuda/emu/launch_limits_fixture.cu.cc");
  EXPECT_EQ(Count(fixture, "ExceedsLaunchBounds("), 2u);
  EXPECT_EQ(Count(fixture, "__launch_bounds__(1)"), 1u);  // the comment's, left alone
  EXPECT_EQ(Count(fixture, "StaticShared("), 2u);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

// The CUDA emulator's own contract, each check against values worked out by hand: a block
// barrier orders shared-memory writes before reads; warp shuffles and the block reduction
// of kernels/cuda/reduce.cuh give the exact sums; an mma.sync tile (mma_sync.cuh) loaded
// by the PTX ISA's fragment formulas multiplies like a naive loop; a divergent
// __syncthreads, an oversized block, dynamic shared memory over the limit, a host pointer
// passed as a kernel argument and a wrong-direction copy all fail as on a GPU; reading past
// an allocation faults; captured work runs only when its graph is launched.
// clang-format off
#include "tests/kernels/cuda/emu/emu_device.h"  // first: the device keywords reduce.cuh uses
// clang-format on
#include <cuda_runtime_api.h>

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/mma_sync.cuh"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {
namespace {

// Sums 1..n with every thread writing its own value to shared memory, then thread 0
// reading them all after the barrier (without it, thread 0 would read NaN/garbage).
void SharedSumKernel(int n, float* out) {
  __shared__ float values[1024];
  values[threadIdx.x] = static_cast<float>(threadIdx.x + 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int i = 0; i < n; ++i) s += values[i];
    out[blockIdx.x] = s;
  }
}

void ReduceKernel(float* sum, float* max_out) {
  const float v = static_cast<float>(threadIdx.x) - 100.0f;
  const float s = BlockReduce(v, SumOp());
  const float m = BlockReduce(v, MaxOp());
  if (threadIdx.x == 0) {
    *sum = s;
    *max_out = m;
  }
}

void ShuffleKernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x);
  out[lane] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  out[32 + lane] = __shfl_down_sync(0xffffffffu, lane, 3);
}

void DivergentBarrierKernel(float* out) {
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = 1.0f;
}

void EmptyKernel(float*) {}

void ReadPastEndKernel(const float* in, int n, float* out) { out[0] = in[n]; }

// D = A·B + 2C for one m16n8k16 tile through kernels/cuda/mma_sync.cuh, every lane
// loading and storing its fragments by the PTX ISA's formulas for element i (row-major A
// [16][16], B [16][8], C and D [16][8]):
//   A: row = g for i in {0, 1, 4, 5}, else g + 8;   col = 2t + (i & 1) + (i >= 4 ? 8 : 0)
//   B: row = 2t + (i & 1) + (i >= 2 ? 8 : 0);         col = g
//   C: row = g + (i >= 2 ? 8 : 0);                    col = 2t + (i & 1)
void MmaSyncKernel(const __half* a, const __half* b, const float* c, float* d) {
  const int g = threadIdx.x / 4, t = threadIdx.x % 4;
  uint32_t fa[4], fb[2];
  float acc[4];
  for (int i = 0; i < 8; i += 2) {
    const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
    const int col = 2 * t + (i >= 4 ? 8 : 0);
    fa[i / 2] = PackHalf2(__half2float(a[row * 16 + col]), __half2float(a[row * 16 + col + 1]));
  }
  for (int i = 0; i < 4; i += 2) {
    const int row = 2 * t + (i >= 2 ? 8 : 0);
    fb[i / 2] = PackHalf2(__half2float(b[row * 8 + g]), __half2float(b[(row + 1) * 8 + g]));
  }
  for (int i = 0; i < 4; ++i) acc[i] = 2.0f * c[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)];
  MmaF16(acc, fa, fb);
  for (int i = 0; i < 4; ++i) d[(g + (i >= 2 ? 8 : 0)) * 8 + 2 * t + (i & 1)] = acc[i];
}

template <typename T>
T* DeviceCopy(const std::vector<T>& host) {
  T* d = nullptr;
  EXPECT_EQ(cudaMalloc(&d, sizeof(T) * host.size()), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice),
            cudaSuccess);
  return d;
}

template <typename T>
std::vector<T> HostCopy(const T* d, size_t n) {
  std::vector<T> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

TEST(CudaEmulator, BarrierOrdersSharedMemoryAcrossThreadsAndBlocks) {
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&out, 3 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(SharedSumKernel, "SharedSumKernel", 3, 200)(200, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  for (float v : HostCopy(out, 3)) EXPECT_EQ(v, 200.0f * 201.0f / 2.0f);  // 20100
  cudaFree(out);
}

TEST(CudaEmulator, BlockReduceGivesExactSumAndMax) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * sizeof(float)), cudaSuccess);
  // 96 threads (3 warps): Σ (t − 100) for t < 96 = 4560 − 9600 = −5040; max = −5.
  ::kvlens_emu::Launch(ReduceKernel, "ReduceKernel", 1, 96)(d, d + 1);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> h = HostCopy(d, 2);
  EXPECT_EQ(h[0], -5040.0f);
  EXPECT_EQ(h[1], -5.0f);
  cudaFree(d);
}

TEST(CudaEmulator, ShufflesReadTheNamedLane) {
  int* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(int)), cudaSuccess);
  ::kvlens_emu::Launch(ShuffleKernel, "ShuffleKernel", 1, 32)(d);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<int> h = HostCopy(d, 64);
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(h[lane], (lane ^ 5) * 10) << lane;
    EXPECT_EQ(h[32 + lane], lane + 3 < 32 ? lane + 3 : lane) << lane;  // past the end: own
  }
  cudaFree(d);
}

TEST(CudaEmulator, MmaSyncTileEqualsNaiveProduct) {
  std::vector<__half> a(256), b(128);
  std::vector<float> c(128), fa(256), fb(128);
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2half_rn(static_cast<float>((i * 7) % 13) - 6.0f);  // small integers:
    fa[i] = __half2float(a[i]);                                       // exact in fp16/fp32
  }
  for (int i = 0; i < 128; ++i) {
    b[i] = __float2half_rn(static_cast<float>((i * 5) % 11) - 5.0f);
    fb[i] = __half2float(b[i]);
    c[i] = static_cast<float>(i % 9);
  }
  __half* da = DeviceCopy(a);
  __half* db = DeviceCopy(b);
  float* dc = DeviceCopy(c);
  float* dd = nullptr;
  ASSERT_EQ(cudaMalloc(&dd, 128 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(MmaSyncKernel, "MmaSyncKernel", 1, 32)(da, db, dc, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> d = HostCopy(dd, 128);
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 8; ++n) {
      float want = 2.0f * c[r * 8 + n];
      for (int k = 0; k < 16; ++k) want += fa[r * 16 + k] * fb[k * 8 + n];
      EXPECT_EQ(d[r * 8 + n], want) << r << ", " << n;
    }
  }
  cudaFree(da);
  cudaFree(db);
  cudaFree(dc);
  cudaFree(dd);
}

TEST(CudaEmulator, DivergentSyncthreadsIsALaunchFailure) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(DivergentBarrierKernel, "DivergentBarrierKernel", 1, 64)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // read once, then cleared
  cudaFree(d);
}

TEST(CudaEmulator, BadConfigurationsFailLikeAGpu) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 4), cudaSuccess);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 1025)(d);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32, 64 * 1024)(d);  // > 48 KiB
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  ASSERT_EQ(
      cudaFuncSetAttribute(EmptyKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024),
      cudaSuccess);
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32, 64 * 1024)(d);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  float host = 0;
  ::kvlens_emu::Launch(EmptyKernel, "EmptyKernel", 1, 32)(&host);  // a host pointer
  EXPECT_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  cudaFree(d);
}

TEST(CudaEmulator, CopiesCheckTheirDirectionAndBounds) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  std::vector<float> h(32, 1.0f);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 16 * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, h.data(), 17 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // one float past the allocation
  EXPECT_EQ(cudaMemcpy(h.data(), d, 16 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // reversed
  EXPECT_EQ(cudaMemset(h.data(), 0, 4), cudaErrorInvalidValue);
  cudaGetLastError();
  EXPECT_EQ(cudaFree(h.data()), cudaErrorInvalidValue);
  cudaGetLastError();
  // Fresh device memory reads as NaN, like the garbage a GPU would return.
  float* fresh = nullptr;
  ASSERT_EQ(cudaMalloc(&fresh, sizeof(float)), cudaSuccess);
  EXPECT_TRUE(std::isnan(HostCopy(fresh, 1)[0]));
  cudaFree(fresh);
  cudaFree(d);
}

void AddOneKernel(float* x) { x[threadIdx.x] += 1.0f; }

// Stream capture: launches and copies on a capturing stream run only when the graph is
// launched (each launch again, the copy reading its source then); a call that would
// synchronise fails and invalidates the capture, as on a GPU.
TEST(CudaEmulator, CapturedWorkRunsWhenTheGraphIsLaunched) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 2 * sizeof(float)), cudaSuccess);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 2 * sizeof(float)), cudaSuccess);
  pinned[0] = 10.0f;
  pinned[1] = 20.0f;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(d, pinned, 2 * sizeof(float), cudaMemcpyHostToDevice, stream),
            cudaSuccess);
  ::kvlens_emu::Launch(AddOneKernel, "AddOneKernel", 1, 2, 0, stream)(d);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_TRUE(std::isnan(HostCopy(d, 2)[0]));  // nothing ran yet
  cudaGraphExec_t exec = nullptr;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 2), (std::vector<float>{11.0f, 21.0f}));
  pinned[0] = 30.0f;  // the next launch copies the new value
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  EXPECT_EQ(HostCopy(d, 2), (std::vector<float>{31.0f, 21.0f}));

  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  float* more = nullptr;
  EXPECT_EQ(cudaMalloc(&more, 4), cudaErrorStreamCaptureUnsupported);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaErrorStreamCaptureUnsupported);
  cudaGraph_t refused = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &refused), cudaErrorStreamCaptureInvalidated);
  EXPECT_EQ(refused, nullptr);
  cudaGetLastError();
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);  // out of capture again
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFreeHost(pinned);
  cudaFree(d);
  cudaStreamDestroy(stream);
}

TEST(CudaEmulatorDeathTest, ReadingPastAnAllocationFaults) {
  float* in = nullptr;
  float* out = nullptr;
  ASSERT_EQ(cudaMalloc(&in, 64 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&out, sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(ReadPastEndKernel, "ReadPastEndKernel", 1, 1)(in, 63, out);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  // Without ASan: a guard page right after the allocation's 256 bytes (SIGSEGV). With
  // ASan: every byte past the 64 floats is poisoned, and ASan names the overflow.
#ifdef __SANITIZE_ADDRESS__
  constexpr char kReport[] = "heap-buffer-overflow";
#else
  constexpr char kReport[] = "";
#endif
  EXPECT_DEATH(::kvlens_emu::Launch(ReadPastEndKernel, "ReadPastEndKernel", 1, 1)(in, 64, out),
               kReport);
  cudaFree(in);
  cudaFree(out);
}

}  // namespace
}  // namespace kvlens::kernels::cuda

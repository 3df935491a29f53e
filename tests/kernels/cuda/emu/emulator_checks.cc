// The CUDA emulator's own contract, each check against values worked out by hand: a block
// barrier orders shared-memory writes before reads; warp shuffles and the block reduction
// of kernels/cuda/reduce.cuh give the exact sums; WMMA tiles multiply like a naive loop
// (row- and column-major); a divergent __syncthreads, an oversized block, dynamic shared
// memory over the limit, a host pointer passed as a kernel argument and a wrong-direction
// copy all fail as on a GPU; reading past an allocation faults.
// clang-format off
#include "tests/kernels/cuda/emu/emu_device.h"  // first: the device keywords reduce.cuh uses
// clang-format on
#include <cuda_runtime_api.h>
#include <mma.h>

#include <cmath>
#include <vector>

#include "gtest/gtest.h"
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

namespace wmma = nvcuda::wmma;

// D = A·B + C for one 16×16×16 tile; A row-major, B column-major (as the flash kernel reads
// Kᵀ), C and D row-major.
void MmaKernel(const __half* a, const __half* b, const float* c, float* d) {
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> fa;
  wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> fb;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(fb, b, 16);
  wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
  for (int t = 0; t < acc.num_elements; ++t) acc.x[t] *= 2.0f;  // element-wise: 2C
  wmma::mma_sync(acc, fa, fb, acc);
  wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
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

TEST(CudaEmulator, WmmaTileEqualsNaiveProduct) {
  std::vector<__half> a(256), b(256);
  std::vector<float> c(256), fa(256), fb(256);
  for (int i = 0; i < 256; ++i) {
    a[i] = __float2half_rn(static_cast<float>((i * 7) % 13) - 6.0f);  // small integers:
    b[i] = __float2half_rn(static_cast<float>((i * 5) % 11) - 5.0f);  // exact in fp16/fp32
    fa[i] = __half2float(a[i]);
    fb[i] = __half2float(b[i]);
    c[i] = static_cast<float>(i % 9);
  }
  __half* da = DeviceCopy(a);
  __half* db = DeviceCopy(b);
  float* dc = DeviceCopy(c);
  float* dd = nullptr;
  ASSERT_EQ(cudaMalloc(&dd, 256 * sizeof(float)), cudaSuccess);
  ::kvlens_emu::Launch(MmaKernel, "MmaKernel", 1, 32)(da, db, dc, dd);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  const std::vector<float> d = HostCopy(dd, 256);
  for (int r = 0; r < 16; ++r) {
    for (int n = 0; n < 16; ++n) {
      float want = 2.0f * c[r * 16 + n];
      for (int k = 0; k < 16; ++k) want += fa[r * 16 + k] * fb[n * 16 + k];  // B col-major
      EXPECT_EQ(d[r * 16 + n], want) << r << ", " << n;
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

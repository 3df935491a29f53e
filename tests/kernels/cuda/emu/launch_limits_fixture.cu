// Kernels for launch_limits_checks.cc, translated by translate_cu.sh as kernels/cuda's are:
// their __launch_bounds__ written the ways those are (a template argument in the bound, a
// second bound, a declaration spread over lines), and a mention in a comment,
// __launch_bounds__(1), which the translation must leave alone; and static shared memory
// beside dynamic, as DrawTokensKernel has, one kernel's partly in a header (reduce.cuh).
#include <cuda_runtime_api.h>

#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {
namespace {

// Thread t of the block writes t + 1.
template <int W>
__global__ void __launch_bounds__(W * 32, W == 1 ? 4 : 2) NumberThreadsKernel(int* out) {
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  out[t] = static_cast<int>(t) + 1;
}

__global__ void __launch_bounds__(
    // at most two warps
    64) CountThreadsKernel(int* out) {
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    *out = static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
  }
}

// 40 KiB of static shared memory (one array declared by every thread, counted once) and
// `floats` of dynamic: thread 0 writes the sum of the two tiles' first and last values.
// (Two instances, so that each test has one the emulator has not yet seen.)
template <int kInstance>
__global__ void StaticAndDynamicKernel(int floats, float* out) {
  __shared__ float tile[10 * 1024];
  extern __shared__ float dynamic_tile[];
  tile[threadIdx.x] = 1.0f;
  tile[10 * 1024 - 1 - threadIdx.x] = 2.0f;
  dynamic_tile[threadIdx.x] = 3.0f;
  dynamic_tile[floats - 1 - static_cast<int>(threadIdx.x)] = 4.0f;
  __syncthreads();
  if (threadIdx.x == 0)
    *out = tile[0] + tile[10 * 1024 - 1] + dynamic_tile[0] + dynamic_tile[floats - 1];
}

// 40 KiB of static shared memory here and BlockReduce's 128 bytes (reduce.cuh), beside
// `floats` of dynamic: every thread adds its two tiles' values, 1 + 3, and thread 0
// writes the block's sum.
__global__ void StaticDynamicAndReduceKernel(int floats, float* out) {
  __shared__ float tile[10 * 1024];
  extern __shared__ float dynamic_tile[];
  tile[threadIdx.x] = 1.0f;
  dynamic_tile[floats - 1 - static_cast<int>(threadIdx.x)] = 3.0f;
  __syncthreads();
  const float sum = BlockReduce(
      tile[threadIdx.x] + dynamic_tile[floats - 1 - static_cast<int>(threadIdx.x)], SumOp());
  if (threadIdx.x == 0) *out = sum;
}

}  // namespace

cudaError_t LaunchStaticDynamicAndReduce(int floats, float* out) {
  StaticDynamicAndReduceKernel<<<1, 64, sizeof(float) * static_cast<size_t>(floats)>>>(floats, out);
  return cudaGetLastError();
}

template <int kInstance>
cudaError_t LaunchStaticAndDynamicOf(int floats, bool opt_in, float* out) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(floats);
  if (opt_in) {
    const cudaError_t e =
        cudaFuncSetAttribute(StaticAndDynamicKernel<kInstance>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
    if (e != cudaSuccess) return e;
  }
  StaticAndDynamicKernel<kInstance><<<1, 32, bytes>>>(floats, out);
  return cudaGetLastError();
}

cudaError_t LaunchStaticAndDynamic(int instance, int floats, bool opt_in, float* out) {
  return instance == 0 ? LaunchStaticAndDynamicOf<0>(floats, opt_in, out)
                       : LaunchStaticAndDynamicOf<1>(floats, opt_in, out);
}

cudaError_t LaunchNumberThreads(int warps, dim3 block, int* out) {
  if (warps == 1) {
    NumberThreadsKernel<1><<<1, block>>>(out);
  } else {
    NumberThreadsKernel<2><<<1, block>>>(out);
  }
  return cudaGetLastError();
}

cudaError_t LaunchCountThreads(dim3 block, int* out) {
  CountThreadsKernel<<<1, block>>>(out);
  return cudaGetLastError();
}

}  // namespace kvlens::kernels::cuda

// Kernels for static_shared_checks.cc, translated by translate_cu.sh as kernels/cuda's
// are: a __shared__ variable written in one block only and read in every block, and one
// declared in a device function that a block calls twice.
#include <cuda_runtime_api.h>

namespace kvlens::kernels::cuda {
namespace {

// Block 0's thread 0 writes 5 and 7; every block's two threads read them back:
// out[2 · block + thread].
__global__ void WrittenInBlockZeroKernel(float* out) {
  __shared__ float value[2];
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    value[0] = 5.0f;
    value[1] = 7.0f;
  }
  __syncthreads();
  out[2 * blockIdx.x + threadIdx.x] = value[threadIdx.x];
}

// Thread 0 sets the count to 1 on the first call, adds 1 on the next; every thread gets it.
__device__ float Bump(bool first) {
  __shared__ float count;
  if (threadIdx.x == 0) count = first ? 1.0f : count + 1.0f;
  __syncthreads();
  return count;
}

// Every thread of every block writes the count after two calls.
__global__ void BumpTwiceKernel(float* out) {
  Bump(true);
  __syncthreads();  // every thread has read the first count before thread 0 adds to it
  out[blockIdx.x * blockDim.x + threadIdx.x] = Bump(false);
}

}  // namespace

cudaError_t LaunchWrittenInBlockZero(int blocks, float* out) {
  WrittenInBlockZeroKernel<<<blocks, 2>>>(out);
  return cudaGetLastError();
}

cudaError_t LaunchBumpTwice(int blocks, int threads, float* out) {
  BumpTwiceKernel<<<blocks, threads>>>(out);
  return cudaGetLastError();
}

}  // namespace kvlens::kernels::cuda

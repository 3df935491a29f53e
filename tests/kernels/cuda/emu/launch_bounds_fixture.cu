// Kernels for launch_bounds_checks.cc, translated by translate_cu.sh as kernels/cuda's are:
// their __launch_bounds__ written the ways those are (a template argument in the bound, a
// second bound, a declaration spread over lines), and a mention in a comment,
// __launch_bounds__(1), which the translation must leave alone.
#include <cuda_runtime_api.h>

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

}  // namespace

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

// Warp and block reductions shared by the .cu files (sum and max of floats).
#ifndef KVLENS_KERNELS_CUDA_REDUCE_CUH_
#define KVLENS_KERNELS_CUDA_REDUCE_CUH_

namespace kvlens::kernels::cuda {

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
  static constexpr float kIdentity = 0.0f;
};

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
  static constexpr float kIdentity = -__builtin_huge_valf();
};

// Every lane of the warp gets the result. kFromLane (a power of two) > 1 reduces only over
// the lanes equal to this one modulo kFromLane (the 32 / kFromLane lanes that hold one
// column of an mma.sync fragment at 4: split_kv_mma.cu).
template <int kFromLane = 1, typename Op>
__device__ __forceinline__ float WarpReduce(float v, Op op) {
  for (int o = 16; o >= kFromLane; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// blockDim.x a multiple of 32 (at most 1024); every thread gets the result. Each call
// begins with a barrier, so consecutive calls may share the scratch.
template <typename Op>
__device__ float BlockReduce(float v, Op op) {
  __shared__ float partial[32];
  v = WarpReduce(v, op);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x >> 5) ? partial[lane] : Op::kIdentity;
    v = WarpReduce(v, op);
    if (lane == 0) partial[0] = v;
  }
  __syncthreads();
  return partial[0];
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_REDUCE_CUH_

// One element of an f32, f16 or bf16 device array as a float, in device code: the weights
// of the embedding and norm kernels (ops.cu) and of a norm fused into the matvec (matvec.cu).
#ifndef KVLENS_KERNELS_CUDA_LOAD_AS_FLOAT_CUH_
#define KVLENS_KERNELS_CUDA_LOAD_AS_FLOAT_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace kvlens::kernels::cuda {

// p[i], p an array of `dtype` (kF16, kBF16; anything else is read as kF32).
__device__ __forceinline__ float LoadAsFloat(const void* p, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF16:
      return __half2float(static_cast<const __half*>(p)[i]);
    case DType::kBF16:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_LOAD_AS_FLOAT_CUH_

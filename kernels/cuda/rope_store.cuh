// A new token's rotary pair and its store into the KV cache, in device code: shared by
// RopeKernel and StoreKvKernel (ops.cu) and by the rope and store fused into the q/k/v
// matvec (matvec.cu), so that the fused path computes bit for bit the angle, the rotation
// and the cache's rounding the separate launches do.
#ifndef KVLENS_KERNELS_CUDA_ROPE_STORE_CUH_
#define KVLENS_KERNELS_CUDA_ROPE_STORE_CUH_

#include <cuda_bf16.h>

#include <cstdint>

namespace kvlens::kernels::cuda {

// cos and sin of pair p's angle at `position`: position · theta^(−2p/Dh), divided by
// freq_factors[p] when set (RopeSpec), in double (at position 1e5 a float angle would be
// off by ~1e-2 rad), rounded to float.
__device__ __forceinline__ float2 RopeCosSin(int32_t position, int p, int head_dim, double theta,
                                             const float* freq_factors) {
  double freq = pow(theta, -2.0 * p / head_dim);
  if (freq_factors != nullptr) freq /= static_cast<double>(freq_factors[p]);
  const double angle = position * freq;
  double s, c;
  sincos(angle, &s, &c);
  return make_float2(static_cast<float>(c), static_cast<float>(s));
}

// The pair (a, b) turned by the angle whose cos and sin are cs.x, cs.y.
__device__ __forceinline__ float2 RotatePair(float a, float b, float2 cs) {
  return make_float2(a * cs.x - b * cs.y, a * cs.y + b * cs.x);
}

// cache[i] = x, rounded to nearest-even bf16 in a bf16 cache.
__device__ __forceinline__ void StoreCacheElement(void* cache, int64_t i, float x, bool bf16) {
  if (bf16) {
    static_cast<uint16_t*>(cache)[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x));
  } else {
    static_cast<float*>(cache)[i] = x;
  }
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ROPE_STORE_CUH_

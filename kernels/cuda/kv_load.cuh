// Device-side loads of the KV cache's elements for the attention kernels (attention.cu,
// flash_prefill.cu): four at a time (a float4, or 8 bytes of bf16 split into four floats) or one by
// one, as float whatever the cache stores (AttentionParams::kv_dtype: float, or bf16 bits held as
// uint16_t). Widening bf16 is exact: its bits are a float's upper half.
#ifndef KVLENS_KERNELS_CUDA_KV_LOAD_CUH_
#define KVLENS_KERNELS_CUDA_KV_LOAD_CUH_

#include <cstdint>

#include "kernels/cuda/attention.h"

namespace kvlens::kernels::cuda {

// The cache's four-element loads may be vectorised: the row stride a multiple of 4 and
// k and v aligned to four elements (16 bytes of fp32, 8 of bf16). Host side.
inline bool KvVectorized(const AttentionParams& p) {
  const uintptr_t align = p.kv_dtype == KvDtype::kBF16 ? 8 : 16;
  return p.kv_row_stride % 4 == 0 && reinterpret_cast<uintptr_t>(p.k) % align == 0 &&
         reinterpret_cast<uintptr_t>(p.v) % align == 0;
}

__device__ __forceinline__ float4 Zero4() { return make_float4(0.0f, 0.0f, 0.0f, 0.0f); }

// row[d … d+3], zero past D. Vectorised: D % 4 == 0 and row 16-byte aligned.
template <bool kVec>
__device__ __forceinline__ float4 Load4(const float* row, int d, int D) {
  if (d >= D) return Zero4();
  if constexpr (kVec) {
    return *reinterpret_cast<const float4*>(row + d);
  } else {
    return make_float4(row[d], d + 1 < D ? row[d + 1] : 0.0f, d + 2 < D ? row[d + 2] : 0.0f,
                       d + 3 < D ? row[d + 3] : 0.0f);
  }
}

// bf16 bits → float, exactly.
__device__ __forceinline__ float Bf16ToFloat(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

// The same from a bf16 cache row (bits as uint16_t), widened. Vectorised: 8-byte aligned.
template <bool kVec>
__device__ __forceinline__ float4 Load4(const uint16_t* row, int d, int D) {
  if (d >= D) return Zero4();
  if constexpr (kVec) {
    const uint2 u = *reinterpret_cast<const uint2*>(row + d);
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                       __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
  } else {
    return make_float4(Bf16ToFloat(row[d]), d + 1 < D ? Bf16ToFloat(row[d + 1]) : 0.0f,
                       d + 2 < D ? Bf16ToFloat(row[d + 2]) : 0.0f,
                       d + 3 < D ? Bf16ToFloat(row[d + 3]) : 0.0f);
  }
}

// Cache element → float (KT: float, or uint16_t for bf16).
__device__ __forceinline__ float KvToFloat(float x) { return x; }
__device__ __forceinline__ float KvToFloat(uint16_t x) { return Bf16ToFloat(x); }

// The cache arrays of p as KT.
template <typename KT>
__device__ __forceinline__ const KT* KeysOf(const AttentionParams& p) {
  return static_cast<const KT*>(p.k);
}
template <typename KT>
__device__ __forceinline__ const KT* ValuesOf(const AttentionParams& p) {
  return static_cast<const KT*>(p.v);
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_KV_LOAD_CUH_

// kvlens CUDA emulator: __nv_bfloat16 as its bits, converted with kernels/dtype.h.
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_BF16_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_BF16_H_

#include <cstdint>

#include "kernels/dtype.h"

struct __nv_bfloat16 {
  uint16_t bits;
};

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {::kvlens::kernels::F32ToBF16(f)}; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return ::kvlens::kernels::BF16ToF32(b.bits); }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { return {bits}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_BF16_H_

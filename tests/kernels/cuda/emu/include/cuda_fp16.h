// kvlens CUDA emulator: __half as its bits, converted with kernels/dtype.h (round to
// nearest even, exact the other way).
#ifndef KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_FP16_H_
#define KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_FP16_H_

#include <cstdint>

#include "kernels/dtype.h"

struct __half {
  uint16_t bits;
};

inline __half __float2half_rn(float f) { return {::kvlens::kernels::F32ToF16(f)}; }
inline __half __float2half(float f) { return __float2half_rn(f); }
inline float __half2float(__half h) { return ::kvlens::kernels::F16ToF32(h.bits); }
inline __half __ushort_as_half(unsigned short bits) { return {bits}; }
inline unsigned short __half_as_ushort(__half h) { return h.bits; }

#endif  // KVLENS_TESTS_KERNELS_CUDA_EMU_INCLUDE_CUDA_FP16_H_

// Warp-level tensor-core products through PTX `mma.sync` (sm_80 and later), for kernels
// that keep their tiles in registers between products (the flash prefill kernel): unlike
// WMMA, the fragment layout is specified (PTX ISA, "Matrix Fragments for mma.m16n8k16 with
// floating point type"), so an accumulator tile can be reused as the next product's A
// operand without a trip through shared memory. With g = lane / 4 and t = lane % 4:
//
//   A 16×16 fp16, four registers of two halves (low half first):
//     a[0] = A[g][2t, 2t+1]     a[1] = A[g+8][2t, 2t+1]
//     a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   B 16×8 fp16, two registers:  b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   C/D 16×8 fp32:               d[0], d[1] = D[g][2t, 2t+1]   d[2], d[3] = D[g+8][2t, 2t+1]
//
// The bf16 product (MmaBf16) has the same fragment layout with bf16 halves.
// The CUDA emulator runs the same layout on the CPU (MmaM16N8K16F16 and MmaM16N8K16BF16
// in tests/kernels/cuda/emu/emu_device.h, which the emulator force-includes).
#ifndef KVLENS_KERNELS_CUDA_MMA_SYNC_CUH_
#define KVLENS_KERNELS_CUDA_MMA_SYNC_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mma.sync m16n8k16 needs sm_80 or newer: set CMAKE_CUDA_ARCHITECTURES to 80 or above"
#endif

namespace kvlens::kernels::cuda {

// d += a·b (fp16 inputs, fp32 accumulation).
__device__ __forceinline__ void MmaF16(float (&d)[4], const uint32_t (&a)[4],
                                       const uint32_t (&b)[2]) {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::MmaM16N8K16F16(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// d += a·b (bf16 inputs, fp32 accumulation).
__device__ __forceinline__ void MmaBf16(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
#ifdef KVLENS_CUDA_EMULATOR
  ::kvlens_emu::MmaM16N8K16BF16(d, a, b);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// The transpose of an 8×8 matrix of 16-bit elements across the warp (movmatrix, sm_75 and
// later): lane (g, t) passes M[g][2t, 2t+1] (low half first) and receives M[2t][g],
// M[2t+1][g]. So half of a product's C tile, packed in pairs, becomes a B register of a
// product whose k runs over that tile's rows (split_kv_mma.cu: scores with keys as rows,
// then the keys as P·V's k).
__device__ __forceinline__ uint32_t MovMatrixTrans(uint32_t a) {
#ifdef KVLENS_CUDA_EMULATOR
  return ::kvlens_emu::MovMatrixTrans(a);
#else
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(d) : "r"(a));
  return d;
#endif
}

// Two floats rounded to bf16 (nearest even) in one register, lo in the low half.
__device__ __forceinline__ uint32_t PackBf162(float lo, float hi) {
#ifdef KVLENS_CUDA_EMULATOR
  return static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
#else
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}

// Two floats rounded to fp16 (nearest even) in one register, lo in the low half.
__device__ __forceinline__ uint32_t PackHalf2(float lo, float hi) {
#ifdef KVLENS_CUDA_EMULATOR
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
#else
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
#endif
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_MMA_SYNC_CUH_

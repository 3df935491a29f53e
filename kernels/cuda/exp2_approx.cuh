// 2^x as one MUFU.EX2 instruction: PTX's ex2.approx.ftz.f32 (max relative error 2^-22),
// for the attention kernels' softmax weights (flash prefill, split-KV) and split-KV's rescales.
//
// Without --use_fast_math (kvlens compiles its kernels without it), exp2f(x) is PTX's
// ex2.approx.f32, whose subnormal results ptxas makes with three more instructions around
// the MUFU. Counted by scripts/kernel-sizes.py (nvcc 13, sm_90): eight exp2f of a·b − c
// take 72 SASS instructions, eight of these 48; a flash kernel's 64-key tile (32 weights a
// lane) 96 fewer, the default bf16 kernel 2728 → 2632 in all. What flushing changes: an
// input below 2^-126 in magnitude is taken as 0 (2^x is then 1 either way), and a result
// below 2^-126 becomes 0 where exp2f gives a subnormal: a softmax weight under 2^-126 of
// its row's largest (whose weight is 1), which fp32 sums and bf16/fp16 products lose
// beside that 1 anyway. FlashAttention's kernels get the same instruction from
// --use_fast_math.
//
// The CUDA emulator (tests/kernels/cuda/emu) takes the host's exp2f with the same
// flushes: exact where the GPU is within 2^-22, so the parity tables' tolerances cover
// the difference.
#ifndef KVLENS_KERNELS_CUDA_EXP2_APPROX_CUH_
#define KVLENS_KERNELS_CUDA_EXP2_APPROX_CUH_

#include <cfloat>
#include <cmath>

namespace kvlens::kernels::cuda {

// log2(e): the attention kernels' scores are scaled by it once, so that e^x is 2^(x·log2 e).
inline constexpr float kLog2E = 1.4426950408889634f;

__device__ __forceinline__ float Exp2Approx(float x) {
#ifdef KVLENS_CUDA_EMULATOR
  const float r = exp2f(fabsf(x) < FLT_MIN ? 0.0f : x);  // FLT_MIN: 2^-126
  return r < FLT_MIN ? 0.0f : r;                         // (a NaN passes)
#else
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
#endif
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_EXP2_APPROX_CUH_

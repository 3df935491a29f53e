// The feed-forward activations in device code, one definition for the elementwise kernels
// (ops.cu: GeluKernel, SwiGluKernel, GeGluKernel) and the matvec's epilogues (matvec.cu).
#ifndef KVLENS_KERNELS_CUDA_ACTIVATION_CUH_
#define KVLENS_KERNELS_CUDA_ACTIVATION_CUH_

namespace kvlens::kernels::cuda {

// GELU's tanh form: g/2 · (1 + tanh(√(2/π) · (g + 0.044715 g³))).
__device__ __forceinline__ float GeluTanh(float g) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * g * (1.0f + tanhf(kSqrt2OverPi * (g + 0.044715f * g * g * g)));
}

// SiLU: g · σ(g).
__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ACTIVATION_CUH_

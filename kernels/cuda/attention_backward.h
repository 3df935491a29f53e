// Launcher of the attention backward on the GPU (kernels/attention_backward.h has the maths
// and the argument contract; CudaBackend::AttentionBackward checks the arguments and calls
// this). fp32 throughout. Two kernels:
//   rows: block (i, h) computes dA[h, i, :] = G_i · V_jᵀ, dS = A ⊙ (dA − Σ A ⊙ dA) and
//         dQ_i = scale · Σ_j dS_j K_j, writing dS (and dA when asked) to [H, Tq, Tk];
//   keys: block (j, g) sums over the query heads of KV head g and the query rows that see
//         key j: dK_j = scale · Σ dS Q, dV_j = Σ A G.
// Masked entries of dA and dS are written as 0; K and V rows are read only where visible
// (never at or past num_keys).
#ifndef KVLENS_KERNELS_CUDA_ATTENTION_BACKWARD_H_
#define KVLENS_KERNELS_CUDA_ATTENTION_BACKWARD_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/cuda/attention.h"

namespace kvlens::kernels::cuda {

// Device pointers except where AttentionParams says otherwise (its `out` is unused).
struct AttentionBackwardParams {
  AttentionParams fwd;           // the forward call's inputs (q, k, v, masks, shapes)
  const float* probs = nullptr;  // [H, Tq, Tk] the probabilities the forward used
  const float* dout = nullptr;   // [Tq, H, Dh], rows dout_stride apart
  int64_t dout_stride = 0;
  float* dq = nullptr;       // [Tq, H, Dh] contiguous
  float* dk = nullptr;       // [Tk, Hkv, Dh] contiguous
  float* dv = nullptr;       // [Tk, Hkv, Dh] contiguous
  float* dprobs = nullptr;   // [H, Tq, Tk] or null
  float* dscores = nullptr;  // [H, Tq, Tk], required (workspace when not wanted)
  // [H, Tq, Tk], required with fwd.softcap > 0 (workspace): dS through the cap, dR.
  float* dscores_raw = nullptr;
};

absl::Status LaunchAttentionBackward(const AttentionBackwardParams& p, cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ATTENTION_BACKWARD_H_

// The attention backward kernels (attention_backward.h). fp32; the sums over keys (dQ) and
// over query rows and heads (dK, dV) accumulate in fp32 in a fixed order.
#include <algorithm>

#include "kernels/cuda/attention_backward.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kKeyThreads = 128;

// Block (i, h). Pass 1: dA_j = G_i · V_j on visible keys (0 elsewhere), and Σ_j A_j dA_j.
// Pass 2: dS_j = A_j (dA_j − Σ). Then dQ_i = scale Σ_j dS_j K_j (threads over d).
__global__ void __launch_bounds__(kRowThreads) BackwardRowsKernel(AttentionBackwardParams b) {
  const AttentionParams& p = b.fwd;
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int g = h / (p.num_heads / p.num_kv_heads);
  const int64_t row = (static_cast<int64_t>(h) * p.num_queries + i) * p.num_keys;
  const float* grad =
      b.dout + static_cast<int64_t>(i) * b.dout_stride + static_cast<int64_t>(h) * D;
  const float* a = b.probs + row;
  float* ds = b.dscores + row;
  float local = 0.0f;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    float da = 0.0f;
    if (Visible(p, i, j)) {
      const float* v = static_cast<const float*>(p.v) + PhysicalRow(p, j) * p.kv_row_stride +
                       static_cast<int64_t>(g) * D;
      for (int d = 0; d < D; ++d) da += grad[d] * v[d];
      local += a[j] * da;
    }
    ds[j] = da;  // dA for now, dS after the reduction
    if (b.dprobs != nullptr) b.dprobs[row + j] = da;
  }
  const float mean = BlockReduce(local, SumOp());  // ends with a barrier
  // dS; through a soft-cap dR = dS (1 − tanh²(R / cap)), R = scale · q·k_j formed again.
  float* dr = p.softcap > 0.0f ? b.dscores_raw + row : ds;
  const float* q = p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(h) * D;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    ds[j] = Visible(p, i, j) ? a[j] * (ds[j] - mean) : 0.0f;
    if (p.softcap > 0.0f) {
      float r = 0.0f;
      if (ds[j] != 0.0f) {
        const float* k = static_cast<const float*>(p.k) + PhysicalRow(p, j) * p.kv_row_stride +
                         static_cast<int64_t>(g) * D;
        float dot = 0.0f;
        for (int d = 0; d < D; ++d) dot += q[d] * k[d];
        const float t = tanhf(dot * p.scale / p.softcap);
        r = ds[j] * (1.0f - t * t);
      }
      dr[j] = r;
    }
  }
  __syncthreads();  // every dS_j (dR_j) is final before the threads read them all
  const int end = CausalEnd(p, i);
  float* dq = b.dq + (static_cast<int64_t>(i) * p.num_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < end; ++j) {
      if (!Visible(p, i, j)) continue;
      acc +=
          dr[j] * static_cast<const float*>(
                      p.k)[PhysicalRow(p, j) * p.kv_row_stride + static_cast<int64_t>(g) * D + d];
    }
    dq[d] = acc * p.scale;
  }
}

// Block (j, g): key j of KV head g. Threads over d; every thread walks the same (head,
// row) pairs, so dS and A are read once per block (broadcast).
__global__ void __launch_bounds__(kKeyThreads) BackwardKeysKernel(AttentionBackwardParams b) {
  const AttentionParams& p = b.fwd;
  const int j = blockIdx.x, g = blockIdx.y, D = p.head_dim;
  const int group = p.num_heads / p.num_kv_heads;
  // Causal: row i sees key j only when query_offset + i >= j.
  const int first =
      p.causal ? static_cast<int>(max(int64_t{0}, static_cast<int64_t>(j) - p.query_offset)) : 0;
  float* dk = b.dk + (static_cast<int64_t>(j) * p.num_kv_heads + g) * D;
  float* dv = b.dv + (static_cast<int64_t>(j) * p.num_kv_heads + g) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc_k = 0.0f, acc_v = 0.0f;
    for (int hg = 0; hg < group; ++hg) {
      const int h = g * group + hg;
      for (int i = first; i < p.num_queries; ++i) {
        if (!Visible(p, i, j)) continue;
        const int64_t e = (static_cast<int64_t>(h) * p.num_queries + i) * p.num_keys + j;
        const int64_t qd = static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(h) * D + d;
        acc_k += (p.softcap > 0.0f ? b.dscores_raw[e] : b.dscores[e]) * p.q[qd];
        acc_v += b.probs[e] *
                 b.dout[static_cast<int64_t>(i) * b.dout_stride + static_cast<int64_t>(h) * D + d];
      }
    }
    dk[d] = acc_k * p.scale;
    dv[d] = acc_v;
  }
}

}  // namespace

absl::Status LaunchAttentionBackward(const AttentionBackwardParams& b, cudaStream_t stream) {
  const AttentionParams& p = b.fwd;
  if (p.num_queries <= 0 || p.num_keys <= 0) return absl::OkStatus();
  if (b.dscores == nullptr || (p.softcap > 0.0f && b.dscores_raw == nullptr)) {
    return absl::InvalidArgumentError(
        "LaunchAttentionBackward: dscores (or, soft-capped, dscores_raw) is null");
  }
  if (b.fwd.kv_dtype != KvDtype::kActivation) {
    return absl::InvalidArgumentError("LaunchAttentionBackward: K and V must be fp32");
  }
  const dim3 rows(p.num_queries, p.num_heads);
  BackwardRowsKernel<<<rows, kRowThreads, 0, stream>>>(b);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("BackwardRowsKernel");
  const dim3 keys(p.num_keys, p.num_kv_heads);
  BackwardKeysKernel<<<keys, kKeyThreads, 0, stream>>>(b);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("BackwardKeysKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda

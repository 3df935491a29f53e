// Attention kernels: flash prefill (fp16 tensor cores via WMMA, fp32 online softmax),
// split-KV (fp32, decode and fallback) and the probability-materialising kernel (fp32).
// See attention.h for when each runs. Every kernel applies the same visibility rule as
// attention_check.h and never reads a cache row at or past num_keys (those slots may hold
// anything, NaN included).
#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/cuda_status.h"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;

// ---------------------------------------------------------------------------------------
// Flash prefill. One block = 64 query rows of one head, 8 warps. Per 64-key tile:
//   Ks, Vs ← K, V rows (fp16; zeros past num_keys)      S = Qs·Ksᵀ (WMMA, fp32 acc)
//   per row: m' = max(m, max_j s_j), α = e^{m−m'}, p_j = e^{s_j−m'}, l = α·l + Σ p_j
//   Os = α·Os + P·Vs (WMMA, P in fp16, fp32 acc)
// and finally O = Os / l. Shared memory (D = head size, padded rows against bank
// conflicts; every WMMA tile pointer is 32-byte aligned):
//   Qs, Ks, Vs  half [64][D+8]   Ss float [64][68]   Ps half [64][72]   Os float [64][D+4]
//   m, l, α     float [64] each
constexpr int kBlockM = 64;
constexpr int kBlockN = 64;
constexpr int kFlashWarps = 8;

template <int D>
struct FlashSmem {
  static constexpr int kLdH = D + 8;        // halves per row of Qs, Ks, Vs
  static constexpr int kLdS = kBlockN + 4;  // floats per row of Ss
  static constexpr int kLdP = kBlockN + 8;  // halves per row of Ps
  static constexpr int kLdO = D + 4;        // floats per row of Os
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(__half) * kBlockM * kLdH;
  static constexpr size_t kV = kK + sizeof(__half) * kBlockN * kLdH;
  static constexpr size_t kS = kV + sizeof(__half) * kBlockN * kLdH;
  static constexpr size_t kP = kS + sizeof(float) * kBlockM * kLdS;
  static constexpr size_t kO = kP + sizeof(__half) * kBlockM * kLdP;
  static constexpr size_t kRows = kO + sizeof(float) * kBlockM * kLdO;
  static constexpr size_t kBytes = kRows + sizeof(float) * 3 * kBlockM;
  static_assert(kK % 32 == 0 && kV % 32 == 0 && kS % 32 == 0 && kP % 32 == 0 && kO % 32 == 0 &&
                    kRows % 32 == 0,
                "WMMA tiles need 32-byte alignment");
};

template <int D>
__global__ void __launch_bounds__(kFlashWarps * 32) FlashPrefillKernel(AttentionParams p) {
  using L = FlashSmem<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  __half* qs = reinterpret_cast<__half*>(smem + L::kQ);
  __half* ks = reinterpret_cast<__half*>(smem + L::kK);
  __half* vs = reinterpret_cast<__half*>(smem + L::kV);
  float* ss = reinterpret_cast<float*>(smem + L::kS);
  __half* ps = reinterpret_cast<__half*>(smem + L::kP);
  float* os = reinterpret_cast<float*>(smem + L::kO);
  float* row_m = reinterpret_cast<float*>(smem + L::kRows);
  float* row_l = row_m + kBlockM;
  float* row_alpha = row_l + kBlockM;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int q0 = (gridDim.x - 1 - blockIdx.x) * kBlockM;  // longest causal rows first
  const int h = blockIdx.y;
  const int kvh = h / (p.num_heads / p.num_kv_heads);
  const int rows = min(kBlockM, p.num_queries - q0);

  for (int idx = tid; idx < kBlockM * D; idx += blockDim.x) {
    const int r = idx / D, c = idx % D;
    const float x =
        r < rows ? p.q[static_cast<int64_t>(q0 + r) * p.q_stride + static_cast<int64_t>(h) * D + c]
                 : 0.0f;
    qs[r * L::kLdH + c] = __float2half_rn(x);
    os[r * L::kLdO + c] = 0.0f;
  }
  for (int r = tid; r < kBlockM; r += blockDim.x) {
    row_m[r] = -INFINITY;
    row_l[r] = 0.0f;
  }
  // The last row, q0 + rows − 1, sees keys up to query_offset + q0 + rows − 1.
  const int key_end = p.causal
                          ? static_cast<int>(min(static_cast<int64_t>(p.num_keys),
                                                 static_cast<int64_t>(p.query_offset) + q0 + rows))
                          : p.num_keys;

  for (int j0 = 0; j0 < key_end; j0 += kBlockN) {
    __syncthreads();  // the previous tile's Ks, Vs and Ps are consumed
    for (int idx = tid; idx < kBlockN * D; idx += blockDim.x) {
      const int r = idx / D, c = idx % D, j = j0 + r;
      float kx = 0.0f, vx = 0.0f;
      if (j < p.num_keys) {
        const int64_t off = PhysicalRow(p, j) * p.kv_row_stride + static_cast<int64_t>(kvh) * D + c;
        kx = p.k[off];
        vx = p.v[off];
      }
      ks[r * L::kLdH + c] = __float2half_rn(kx);
      vs[r * L::kLdH + c] = __float2half_rn(vx);
    }
    __syncthreads();

    // S = Q·Kᵀ: 16 tiles of 16×16, two per warp. Kᵀ is Ks read column-major.
    for (int t = warp; t < (kBlockM / 16) * (kBlockN / 16); t += kFlashWarps) {
      const int tm = t / (kBlockN / 16), tn = t % (kBlockN / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
        wmma::load_matrix_sync(a, qs + tm * 16 * L::kLdH + kk, L::kLdH);
        wmma::load_matrix_sync(b, ks + tn * 16 * L::kLdH + kk, L::kLdH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(ss + tm * 16 * L::kLdS + tn * 16, acc, L::kLdS, wmma::mem_row_major);
    }
    __syncthreads();

    // Online softmax: warp w owns rows 8w … 8w+7, lane owns columns lane and lane + 32.
    for (int rr = 0; rr < kBlockM / kFlashWarps; ++rr) {
      const int r = warp * (kBlockM / kFlashWarps) + rr;
      const int i = q0 + r;
      float s[2];
      bool vis[2];
      float m_tile = -INFINITY;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int j = j0 + lane + 32 * u;
        vis[u] = r < rows && j < p.num_keys && Visible(p, i, j);
        s[u] = vis[u] ? ss[r * L::kLdS + lane + 32 * u] * p.scale : -INFINITY;
        m_tile = fmaxf(m_tile, s[u]);
      }
      m_tile = WarpReduce(m_tile, MaxOp());
      const float m_old = row_m[r];
      const float m_new = fmaxf(m_old, m_tile);
      // m_old = −∞: nothing seen yet, O and l are 0 (and m_new may still be −∞).
      const float alpha = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);
      float l_tile = 0.0f;
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const float pj = vis[u] ? expf(s[u] - m_new) : 0.0f;
        ps[r * L::kLdP + lane + 32 * u] = __float2half_rn(pj);
        l_tile += pj;
      }
      l_tile = WarpReduce(l_tile, SumOp());
      if (lane == 0) {
        row_m[r] = m_new;
        row_l[r] = row_l[r] * alpha + l_tile;
        row_alpha[r] = alpha;
      }
    }
    __syncthreads();
    for (int idx = tid; idx < kBlockM * D; idx += blockDim.x) {
      const int r = idx / D;
      os[r * L::kLdO + idx % D] *= row_alpha[r];
    }
    __syncthreads();

    // O += P·V: (64/16)·(D/16) tiles spread over the warps.
    for (int t = warp; t < (kBlockM / 16) * (D / 16); t += kFlashWarps) {
      const int tm = t / (D / 16), tn = t % (D / 16);
      wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
      wmma::load_matrix_sync(acc, os + tm * 16 * L::kLdO + tn * 16, L::kLdO, wmma::mem_row_major);
#pragma unroll
      for (int kk = 0; kk < kBlockN; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> b;
        wmma::load_matrix_sync(a, ps + tm * 16 * L::kLdP + kk, L::kLdP);
        wmma::load_matrix_sync(b, vs + kk * L::kLdH + tn * 16, L::kLdH);
        wmma::mma_sync(acc, a, b, acc);
      }
      wmma::store_matrix_sync(os + tm * 16 * L::kLdO + tn * 16, acc, L::kLdO, wmma::mem_row_major);
    }
  }
  __syncthreads();
  // Every real row saw a key (checked on the host), so l > 0.
  for (int idx = tid; idx < rows * D; idx += blockDim.x) {
    const int r = idx / D, c = idx % D;
    p.out[static_cast<int64_t>(q0 + r) * p.out_stride + static_cast<int64_t>(h) * D + c] =
        os[r * L::kLdO + c] / row_l[r];
  }
}

template <int D>
absl::Status LaunchFlash(const AttentionParams& p, cudaStream_t stream) {
  constexpr size_t kBytes = FlashSmem<D>::kBytes;
  KVLENS_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(FlashPrefillKernel<D>,
                                                   cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                   static_cast<int>(kBytes)));
  const dim3 grid((p.num_queries + kBlockM - 1) / kBlockM, p.num_heads);
  FlashPrefillKernel<D><<<grid, kFlashWarps * 32, kBytes, stream>>>(p);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("FlashPrefillKernel");
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------------------
// Split-KV (decode, short chunks, head sizes the flash kernel lacks). Block (i, g, split):
// query row i, KV head g, keys [split·span, (split+1)·span) ∩ [0, key end).
//
// Each K/V row is read once per head tile, by one warp, for every query head of the tile:
// the four warps take turns over steps of kKeysPerStep consecutive keys, and a warp keeps
// its own (m, l, acc) per head. Lane owns dims 128c + 4·lane … +3 (one float4 per chunk
// where the pointers and strides allow, see SplitKvVectorized), so a step has
// 2 · kKeysPerStep rows in flight per warp. The step's kKeysPerStep × heads dot products
// are summed over the lanes together (SumAcrossLanes: 31 shuffles for 32 sums, not 160)
// and handed to every lane through shared memory. At the end of a head tile the warps'
// partial results are merged through shared memory; the block writes O directly with one
// split, else per split (m, l, acc[Dh]) in
//   workspace [Tq, H, splits, Dh + 2]
// merged by SplitKvCombineKernel.
constexpr int kSplitWarps = 4;
constexpr int kKeysPerStep = 4;

// C float4 chunks per lane: head sizes up to 128·C. The head tile keeps registers in check:
// q and acc take 2·4·C floats per head.
template <int C>
struct SplitKvShape {
  static constexpr int kHeadTile = 8 / C;
  static constexpr int kSums = kKeysPerStep * kHeadTile;  // dot products per step: 32 or 16
  static constexpr int kMaxDim = 128 * C;
  static_assert(kSums == 16 || kSums == 32, "SumAcrossLanes needs 16 or 32 values");
};

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

__device__ __forceinline__ float Dot4(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

__device__ __forceinline__ void Axpy4(float a, float4 x, float4& y) {
  y.x += a * x.x;
  y.y += a * x.y;
  y.z += a * x.z;
  y.w += a * x.w;
}

__device__ __forceinline__ void Scale4(float a, float4& y) {
  y.x *= a;
  y.y *= a;
  y.z *= a;
  y.w *= a;
}

// Sums each of the N values over the warp's 32 lanes. Halving: at offset o a lane keeps
// the half of its values selected by its bit o and adds the partner's copy of that half,
// so N − 1 shuffles leave one value per lane (then 5 − log2 N plain steps). Returns the
// total of value lane · N / 32 (lane L holds the sum of value L for N = 32).
template <int N>
__device__ __forceinline__ float SumAcrossLanes(float (&v)[N], int lane) {
#pragma unroll
  for (int n = N, o = 16; n > 1; n /= 2, o /= 2) {
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int k = 0; k < n / 2; ++k) {
      const float keep = upper ? v[k + n / 2] : v[k];
      const float send = upper ? v[k] : v[k + n / 2];
      v[k] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
#pragma unroll
  for (int o = 16 / N; o > 0; o /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  return v[0];
}

template <int C, bool kVec>
__global__ void __launch_bounds__(kSplitWarps * 32)
    SplitKvKernel(AttentionParams p, int num_splits, int span, float* workspace) {
  using S = SplitKvShape<C>;
  constexpr int kTile = S::kHeadTile, kSums = S::kSums;
  __shared__ float step_scores[kSplitWarps][kSums];
  __shared__ float part_ml[kSplitWarps][kTile][2];
  __shared__ float part_acc[kSplitWarps][kTile][S::kMaxDim];

  const int i = blockIdx.x, g = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const int j_begin = split * span;
  const int key_end = p.row_key_end != nullptr ? p.row_key_end[i] : CausalEnd(p, i);
  const int j_end = min(key_end, j_begin + span);
  const int q_doc = p.q_doc != nullptr ? p.q_doc[i] : 0;
  // Batched: this row's sequence's blocks.
  const int32_t* table =
      p.row_table_offset != nullptr ? p.block_table + p.row_table_offset[i] : p.block_table;
  const float* q_group =
      p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(g) * group * D;

  for (int h0 = 0; h0 < group; h0 += kTile) {
    float4 qr[kTile][C], acc[kTile][C];
    float m[kTile], l[kTile];
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        qr[t][c] =
            h0 + t < group ? Load4<kVec>(q_group + (h0 + t) * D, 128 * c + 4 * lane, D) : Zero4();
        acc[t][c] = Zero4();
      }
      m[t] = -INFINITY;
      l[t] = 0.0f;
    }

    for (int j0 = j_begin + warp * kKeysPerStep; j0 < j_end; j0 += kSplitWarps * kKeysPerStep) {
      bool vis[kKeysPerStep];
      float4 kr[kKeysPerStep][C], vr[kKeysPerStep][C];
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
        const int j = j0 + u;
        vis[u] = j < j_end && (p.q_doc == nullptr || p.k_doc[j] == q_doc);
        // Only visible rows are read: a masked key's row may hold anything.
        const int64_t off = vis[u] ? PhysicalRowIn(table, p.block_size, j) * p.kv_row_stride +
                                         static_cast<int64_t>(g) * D
                                   : 0;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          kr[u][c] = vis[u] ? Load4<kVec>(p.k + off, 128 * c + 4 * lane, D) : Zero4();
          vr[u][c] = vis[u] ? Load4<kVec>(p.v + off, 128 * c + 4 * lane, D) : Zero4();
        }
      }
      float s[kSums];  // s[u · kTile + t]: key u, head h0 + t
#pragma unroll
      for (int u = 0; u < kKeysPerStep; ++u) {
#pragma unroll
        for (int t = 0; t < kTile; ++t) {
          float dot = 0.0f;
#pragma unroll
          for (int c = 0; c < C; ++c) dot += Dot4(qr[t][c], kr[u][c]);
          s[u * kTile + t] = dot;
        }
      }
      const float total = SumAcrossLanes(s, lane);
      if (lane % (32 / kSums) == 0) step_scores[warp][lane * kSums / 32] = total * p.scale;
      __syncwarp();
#pragma unroll
      for (int t = 0; t < kTile; ++t) {
        float m_new = m[t];
#pragma unroll
        for (int u = 0; u < kKeysPerStep; ++u) {
          if (vis[u]) m_new = fmaxf(m_new, step_scores[warp][u * kTile + t]);
        }
        if (m_new == -INFINITY) continue;  // nothing visible yet for this warp
        const float alpha = m[t] == -INFINITY ? 0.0f : expf(m[t] - m_new);
        l[t] *= alpha;
#pragma unroll
        for (int c = 0; c < C; ++c) Scale4(alpha, acc[t][c]);
#pragma unroll
        for (int u = 0; u < kKeysPerStep; ++u) {
          if (!vis[u]) continue;  // 0 · NaN would poison acc
          const float pu = expf(step_scores[warp][u * kTile + t] - m_new);
          l[t] += pu;
#pragma unroll
          for (int c = 0; c < C; ++c) Axpy4(pu, vr[u][c], acc[t][c]);
        }
        m[t] = m_new;
      }
      __syncwarp();  // step_scores is read before the next step overwrites it
    }

    // Merge the warps: O = Σ_w e^{m_w − M} acc_w / Σ_w e^{m_w − M} l_w.
#pragma unroll
    for (int t = 0; t < kTile; ++t) {
      if (lane == 0) {
        part_ml[warp][t][0] = m[t];
        part_ml[warp][t][1] = l[t];
      }
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float* a = &part_acc[warp][t][128 * c + 4 * lane];  // < kMaxDim = 128·C
        a[0] = acc[t][c].x;
        a[1] = acc[t][c].y;
        a[2] = acc[t][c].z;
        a[3] = acc[t][c].w;
      }
    }
    __syncthreads();
    const int tile = min(kTile, group - h0);
    for (int idx = threadIdx.x; idx < tile * D; idx += blockDim.x) {
      const int t = idx / D, d = idx % D, h = g * group + h0 + t;
      float m_max = -INFINITY;
      for (int w = 0; w < kSplitWarps; ++w) m_max = fmaxf(m_max, part_ml[w][t][0]);
      float l_sum = 0.0f, a = 0.0f;
      for (int w = 0; w < kSplitWarps; ++w) {
        if (part_ml[w][t][0] == -INFINITY) continue;  // this warp saw no key
        const float e = expf(part_ml[w][t][0] - m_max);
        l_sum += e * part_ml[w][t][1];
        a += e * part_acc[w][t][d];
      }
      if (num_splits == 1) {
        // l_sum > 0: the row sees a key (checked on the host).
        p.out[static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D + d] = a / l_sum;
      } else {
        float* w = workspace +
                   ((static_cast<int64_t>(i) * p.num_heads + h) * num_splits + split) * (D + 2);
        if (d == 0) {
          w[0] = m_max;
          w[1] = l_sum;
        }
        w[2 + d] = a;
      }
    }
    __syncthreads();  // the next head tile reuses part_ml and part_acc
  }
}

// O = Σ_s e^{m_s − M} acc_s / Σ_s e^{m_s − M} l_s over the splits that saw a key.
__global__ void SplitKvCombineKernel(AttentionParams p, int num_splits, const float* workspace) {
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const float* w = workspace + (static_cast<int64_t>(i) * p.num_heads + h) * num_splits * (D + 2);
  float m_max = -INFINITY;
  for (int s = 0; s < num_splits; ++s) m_max = fmaxf(m_max, w[s * (D + 2)]);
  float l_sum = 0.0f;
  for (int s = 0; s < num_splits; ++s) {
    const float m = w[s * (D + 2)];
    if (m != -INFINITY) l_sum += w[s * (D + 2) + 1] * expf(m - m_max);
  }
  float* o = p.out + static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
      const float m = w[s * (D + 2)];
      if (m != -INFINITY) acc += w[s * (D + 2) + 2 + d] * expf(m - m_max);
    }
    o[d] = acc / l_sum;
  }
}

// ---------------------------------------------------------------------------------------
// Materialised. Block (i, h), fp32 throughout:
//   S[h,i,j] = scale · q·k_j (−∞ masked); A = softmax(S) (masked exactly 0); O = A·V,
// with O computed from the very A written out.
constexpr int kMaterializedThreads = 256;

__global__ void __launch_bounds__(kMaterializedThreads)
    MaterializedKernel(AttentionParams p, float* scores, float* probs) {
  const int i = blockIdx.x, h = blockIdx.y, D = p.head_dim;
  const int g = h / (p.num_heads / p.num_kv_heads);
  const int64_t row = (static_cast<int64_t>(h) * p.num_queries + i) * p.num_keys;
  const float* q = p.q + static_cast<int64_t>(i) * p.q_stride + static_cast<int64_t>(h) * D;
  float local_max = -INFINITY;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    float s = -INFINITY;
    if (Visible(p, i, j)) {
      const float* k = p.k + PhysicalRow(p, j) * p.kv_row_stride + static_cast<int64_t>(g) * D;
      float dot = 0.0f;
      for (int d = 0; d < D; ++d) dot += q[d] * k[d];
      s = dot * p.scale;
    }
    scores[row + j] = s;
    local_max = fmaxf(local_max, s);
  }
  const float m = BlockReduce(local_max, MaxOp());
  float local_sum = 0.0f;
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) {
    const float s = scores[row + j];
    const float e = s == -INFINITY ? 0.0f : expf(s - m);
    probs[row + j] = e;
    local_sum += e;
  }
  const float z = BlockReduce(local_sum, SumOp());  // ends with a barrier
  for (int j = threadIdx.x; j < p.num_keys; j += blockDim.x) probs[row + j] /= z;
  __syncthreads();  // every probability is final before any thread reads them all
  const int end = CausalEnd(p, i);
  float* o = p.out + static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int j = 0; j < end; ++j) {
      if (!Visible(p, i, j)) continue;
      acc += probs[row + j] *
             p.v[PhysicalRow(p, j) * p.kv_row_stride + static_cast<int64_t>(g) * D + d];
    }
    o[d] = acc;
  }
}

}  // namespace

bool FlashPrefillSupports(int head_dim) { return head_dim == 64 || head_dim == 128; }

absl::Status LaunchFlashPrefill(const AttentionParams& p, cudaStream_t stream) {
  switch (p.head_dim) {
    case 64:
      return LaunchFlash<64>(p, stream);
    case 128:
      return LaunchFlash<128>(p, stream);
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("flash prefill supports head_dim 64 and 128, got ", p.head_dim));
  }
}

int ChooseNumSplits(const AttentionParams& p, int num_sms) {
  const int64_t blocks = static_cast<int64_t>(p.num_queries) * p.num_kv_heads;
  const int64_t want = (4 * static_cast<int64_t>(num_sms) + blocks - 1) / blocks;
  const int64_t by_keys = std::max<int64_t>(1, p.num_keys / 256);  // >= 256 keys a split
  return static_cast<int>(std::clamp<int64_t>(std::min(want, by_keys), 1, 128));
}

bool SplitKvVectorized(const AttentionParams& p) {
  auto aligned = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  return p.head_dim % 4 == 0 && p.q_stride % 4 == 0 && p.kv_row_stride % 4 == 0 && aligned(p.q) &&
         aligned(p.k) && aligned(p.v);
}

int64_t SplitKvWorkspaceFloats(const AttentionParams& p, int num_splits) {
  if (num_splits <= 1) return 0;
  return static_cast<int64_t>(p.num_queries) * p.num_heads * num_splits * (p.head_dim + 2);
}

absl::Status LaunchSplitKv(const AttentionParams& p, int num_splits, float* workspace,
                           cudaStream_t stream) {
  if (p.head_dim > kSplitKvMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "split-KV attention supports head_dim <= ", kSplitKvMaxHeadDim, ", got ", p.head_dim));
  }
  num_splits = std::max(num_splits, 1);
  const int span = (p.num_keys + num_splits - 1) / num_splits;
  const dim3 grid(p.num_queries, p.num_kv_heads, num_splits);
  const dim3 block(kSplitWarps * 32);
  const bool vec = SplitKvVectorized(p);
  auto* kernel = p.head_dim <= 128 ? (vec ? SplitKvKernel<1, true> : SplitKvKernel<1, false>)
                                   : (vec ? SplitKvKernel<2, true> : SplitKvKernel<2, false>);
  kernel<<<grid, block, 0, stream>>>(p, num_splits, span, workspace);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvKernel");
  if (num_splits > 1) {
    const dim3 combine_grid(p.num_queries, p.num_heads);
    SplitKvCombineKernel<<<combine_grid, 128, 0, stream>>>(p, num_splits, workspace);
    KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("SplitKvCombineKernel");
  }
  return absl::OkStatus();
}

absl::Status LaunchMaterialized(const AttentionParams& p, float* scores, float* probs,
                                cudaStream_t stream) {
  const dim3 grid(p.num_queries, p.num_heads);
  MaterializedKernel<<<grid, kMaterializedThreads, 0, stream>>>(p, scores, probs);
  KVLENS_CUDA_RETURN_IF_LAUNCH_FAILED("MaterializedKernel");
  return absl::OkStatus();
}

}  // namespace kvlens::kernels::cuda

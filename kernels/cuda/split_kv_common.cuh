// What the split-KV kernels (attention.cu's SplitKvKernel on CUDA cores, split_kv_mma.cu's
// on tensor cores) share: the keys of a block's split, the merge of its warps' partial
// results in shared memory, and the merge of a row's splits by the block that finishes
// last (the combine folded into the launch). Block (i, g, split): query row i, KV head g.
// Partial results per split, m in base 2:
//   workspace [Tq, H, splits, Dh + 2] = (m, l, acc[Dh])
#ifndef KVLENS_KERNELS_CUDA_SPLIT_KV_COMMON_CUH_
#define KVLENS_KERNELS_CUDA_SPLIT_KV_COMMON_CUH_

#include <cstdint>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/attention_common.cuh"
#include "kernels/cuda/kv_load.cuh"
#include "kernels/cuda/launch.cuh"
#include "kernels/cuda/reduce.cuh"

namespace kvlens::kernels::cuda {

// Block `split`'s share of row i, walked in steps of kStep keys: its keys [j_begin, j_end),
// keys below key_begin (a sliding window's) and in other documents hidden. The splits share
// the row's keys from b, 0 or under a sliding window the step holding the row's first key
// in it (not 0, where most splits of a long context would be idle), in spans of whole
// steps: the work follows each row's own keys, however unequal the rows' key ends, or
// however far the launch's key count (the longest row's, or a recorded step's padded one)
// exceeds them. With few keys a split the rounding can leave the last splits empty (a key
// end of 40 over 8 splits of 8-key steps fills 5); the merges give an empty split (m = −∞)
// weight 0. A step's keys start at a multiple of kStep, so they share a cache block when
// the block size is one too (in_one_block): then one table lookup serves the step, which
// the kernels make a step ahead (Block), so that a step's loads wait on no table read.
template <int kStep>
struct SplitSteps {
  const int32_t* table;  // the row's sequence's blocks (batched: its own), or null
  const int32_t* k_doc;  // p.k_doc where the call has documents, else null
  int key_begin, j_begin, j_end, q_doc, block_size, block_shift;
  bool in_one_block;

  __device__ __forceinline__ SplitSteps(const AttentionParams& p, int i, int split, int num_splits)
      : table(p.row_table_offset != nullptr ? p.block_table + p.row_table_offset[i]
                                            : p.block_table),
        k_doc(p.q_doc != nullptr ? p.k_doc : nullptr),
        q_doc(p.q_doc != nullptr ? p.q_doc[i] : 0),
        block_size(p.block_size),
        block_shift(BlockShift(p.block_size)),
        in_one_block(p.block_size % kStep == 0) {
    const int key_end = p.row_key_end != nullptr ? p.row_key_end[i] : CausalEnd(p, i);
    key_begin = p.window > 0 ? max(0, key_end - p.window) : 0;  // causal: the row is key_end − 1
    const int steps_begin = key_begin / kStep * kStep;
    const int span =
        ((key_end - steps_begin + num_splits - 1) / num_splits + kStep - 1) / kStep * kStep;
    j_begin = steps_begin + split * span;
    j_end = min(key_end, j_begin + span);
  }
  // The row sees key j (of this split).
  __device__ __forceinline__ bool Visible(int j) const {
    return j < j_end && j >= key_begin && (k_doc == nullptr || k_doc[j] == q_doc);
  }
  // The table entry of the step at j0 where the step is in one block of a paged cache and
  // in the split, else 0 (a 32-bit entry a step ahead: a 64-bit row made three kernels spill).
  __device__ __forceinline__ int32_t Block(int j0) const {
    return in_one_block && table != nullptr && j0 < j_end
               ? table[BlockIndexOf(block_size, block_shift, j0)]
               : 0;
  }
  // The cache row of the step at j0's first key, given Block(j0) (0 where steps span blocks).
  __device__ __forceinline__ int64_t FirstRow(int32_t block, int j0) const {
    return !in_one_block      ? 0
           : table == nullptr ? j0
                              : RowInBlock(block, block_size, block_shift, j0);
  }
  // Every key of the step at j0 is visible and in one block: its rows are FirstRow + u, and
  // its loads need no per-key tests (most steps: all but a split's last, or a window's edge).
  __device__ __forceinline__ bool Whole(int j0) const {
    return in_one_block && k_doc == nullptr && j0 >= key_begin && j0 + kStep <= j_end;
  }
  // The cache row of key j0 + u of a step whose FirstRow is first_row (a visible key: past
  // j_end the table may end).
  __device__ __forceinline__ int64_t RowOf(int64_t first_row, int j0, int u) const {
    return in_one_block ? first_row + u : PhysicalRowIn(table, block_size, block_shift, j0 + u);
  }
};

// Before WaitForPriorGrids, where the launch is programmatic (AttentionParams::prefetch,
// launch.cuh): asks the L2 cache for the K and V rows of the block's KV head of the warp's
// first step in its split (block (i, g, split), warps kStep keys apart), so that while the
// grid before drains, DRAM brings in what the warp loads first. Reads the row's index
// arrays (its key end, block-table offset and its step's table entry), which copies write
// and no kernel, so the copy before the launch has completed (launch.cuh); the rows
// themselves may be the ones the kernel before is storing (a decode step's new key), which
// a prefetch into L2, where every SM's stores meet, cannot make stale. Steps across blocks
// (a block size not a multiple of kStep) are not prefetched.
template <typename KT, int kStep>
__device__ __forceinline__ void PrefetchFirstStep(const AttentionParams& p, int num_splits) {
  const SplitSteps<kStep> steps(p, blockIdx.x, blockIdx.z, num_splits);
  const int g = blockIdx.y, j0 = steps.j_begin + threadIdx.x / 32 * kStep, lane = threadIdx.x % 32;
  if (!steps.in_one_block || j0 >= steps.j_end) return;
  const int keys = min(kStep, steps.j_end - j0);
  const int64_t first_row = steps.FirstRow(steps.Block(j0), j0);
  constexpr int kLineElems = 128 / static_cast<int>(sizeof(KT));
  const int lines = (p.head_dim + kLineElems - 1) / kLineElems;  // of a head's row
  for (int l = lane; l < 2 * keys * lines; l += 32) {
    const int u = l / (2 * lines), part = l % (2 * lines);
    const KT* cache = part < lines ? KeysOf<KT>(p) : ValuesOf<KT>(p);
    PrefetchL2(cache + (first_row + u) * p.kv_row_stride + static_cast<int64_t>(g) * p.head_dim +
               (part % lines) * kLineElems);
  }
}

// The end of a block's head tile: its warps' partial results for heads h0 … h0 + tile − 1
// of KV head g (part_ml[w][t] = {m, l}, part_acc[w][t][d], in shared memory; a barrier
// first, so every warp's are there) merged, O = Σ_w 2^{m_w − M} acc_w / Σ_w 2^{m_w − M} l_w,
// and written: to p.out with one split, else as the split's partials in the workspace. The
// block's threads share the (head, dim) pairs; a barrier last, so the next head tile may
// reuse the arrays.
template <int kWarps, int kTile, int kMaxDim>
__device__ __forceinline__ void MergeWarps(const AttentionParams& p,
                                           const float (&part_ml)[kWarps][kTile][2],
                                           const float (&part_acc)[kWarps][kTile][kMaxDim], int i,
                                           int g, int h0, int split, int num_splits,
                                           float* workspace) {
  const int group = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const int tile = min(kTile, group - h0);
  __syncthreads();
  for (int idx = threadIdx.x; idx < tile * D; idx += blockDim.x) {
    const int t = idx / D, d = idx % D, h = g * group + h0 + t;
    float m_max = -INFINITY;
    for (int w = 0; w < kWarps; ++w) m_max = fmaxf(m_max, part_ml[w][t][0]);
    float l_sum = 0.0f, a = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      if (part_ml[w][t][0] == -INFINITY) continue;  // this warp saw no key
      const float e = exp2f(part_ml[w][t][0] - m_max);
      l_sum += e * part_ml[w][t][1];
      a += e * part_acc[w][t][d];
    }
    if (num_splits == 1) {
      // l_sum > 0: the row sees a key (checked on the host).
      p.out[static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D + d] = a / l_sum;
    } else {
      float* w =
          workspace + ((static_cast<int64_t>(i) * p.num_heads + h) * num_splits + split) * (D + 2);
      if (d == 0) {
        w[0] = m_max;
        w[1] = l_sum;
      }
      w[2 + d] = a;
    }
  }
  __syncthreads();
}

// The merge weights of one head's splits, by one warp: weight[s] = 2^(m_s − M), 0 for a
// split that saw no key (M the largest m_s); returns Σ_s weight[s] · l_s to every lane.
// w: the head's partials, [splits, D + 2]. A lane requests all of its splits' m and l at
// once, past L1 (the splits were written by other blocks, on other SMs).
__device__ __forceinline__ float SplitWeights(const float* w, int num_splits, int D,
                                              float* weight) {
  constexpr int kPerLane = kSplitKvMaxSplits / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  float m[kPerLane], l[kPerLane];
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const int s = lane + 32 * k;
    m[k] = s < num_splits ? __ldcg(w + s * (D + 2)) : -INFINITY;
    l[k] = s < num_splits ? __ldcg(w + s * (D + 2) + 1) : 0.0f;
  }
  float m_max = -INFINITY;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) m_max = fmaxf(m_max, m[k]);
  m_max = WarpReduce(m_max, MaxOp());
  float l_sum = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerLane; ++k) {
    const float e = m[k] == -INFINITY ? 0.0f : exp2f(m[k] - m_max);
    if (lane + 32 * k < num_splits) weight[lane + 32 * k] = e;
    l_sum += e * l[k];
  }
  return WarpReduce(l_sum, SumOp());
}

// The combine folded into the split-KV launch (LaunchSplitKv with `arrivals`): each block
// of (row i, KV head g) counts itself in arrivals[i · kv_heads + g] once its partial
// results are written, and the block that arrives last (all the others' partials are then
// in memory: each made its writes visible before counting) merges the group's heads as
// SplitKvCombineKernel does, and sets the count back to 0 for the next launch (a replayed
// graph's too). Saves the combine's launch, and its wait for the slowest split of all rows:
// a row's merge starts as soon as its own splits are done. The merging block takes up to
// kHeads heads at once: its warps find their weights (SplitWeights, a warp a head), then
// each thread sums (head, dim) pairs, requesting 8 splits' values at a time. (Until
// 2026-12-05 it merged head after head, a warp's loop finding the weights and each
// thread's loop over the splits waiting on one load at a time: on the H200, 35.5 us
// against 25.4 with the combine launch, at 8k keys and 64 splits.)
template <int kWarps>
__device__ void CombineIfLast(const AttentionParams& p, int i, int g, int num_splits,
                              const float* workspace, int* arrivals) {
  constexpr int kHeads = 8;  // heads merged at once
  constexpr int kBatch = 8;  // splits whose values a thread requests together
  __shared__ int last;
  __shared__ float weight[kHeads][kSplitKvMaxSplits];  // SplitWeights
  __shared__ float total[kHeads];
  __threadfence();  // this block's partials, visible to whichever block merges them
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(&arrivals[i * p.num_kv_heads + g], 1) == num_splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int group = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const auto partials = [&](int h) {
    return workspace + (static_cast<int64_t>(i) * p.num_heads + h) * num_splits * (D + 2);
  };
  for (int t0 = 0; t0 < group; t0 += kHeads) {
    const int heads = min(kHeads, group - t0);
    for (int t = warp; t < heads; t += kWarps) {
      const float l_sum = SplitWeights(partials(g * group + t0 + t), num_splits, D, weight[t]);
      if (threadIdx.x % 32 == 0) total[t] = l_sum;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < heads * D; idx += blockDim.x) {
      const int t = idx / D, d = idx % D, h = g * group + t0 + t;
      const float* v = partials(h) + 2 + d;
      float acc = 0.0f;
      for (int s0 = 0; s0 < num_splits; s0 += kBatch) {
        float x[kBatch];
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          x[k] = s0 + k < num_splits ? __ldcg(v + (s0 + k) * (D + 2)) : 0.0f;
#pragma unroll
        for (int k = 0; k < kBatch; ++k)
          if (s0 + k < num_splits) acc += weight[t][s0 + k] * x[k];
      }
      p.out[static_cast<int64_t>(i) * p.out_stride + static_cast<int64_t>(h) * D + d] =
          acc / total[t];
    }
    __syncthreads();  // weight and total are the next heads'
  }
  if (threadIdx.x == 0) arrivals[i * p.num_kv_heads + g] = 0;
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_SPLIT_KV_COMMON_CUH_

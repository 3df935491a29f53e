// Device-side helpers shared by the attention kernels (attention.cu, attention_backward.cu):
// the paged cache's row lookup, the visibility rule of kernels/attention_check.h, the soft-cap.
#ifndef KVLENS_KERNELS_CUDA_ATTENTION_COMMON_CUH_
#define KVLENS_KERNELS_CUDA_ATTENTION_COMMON_CUH_

#include <cstdint>

#include "kernels/cuda/attention.h"

namespace kvlens::kernels::cuda {

// log2 of a power-of-two block size, else −1 (for PhysicalRowIn).
__device__ __forceinline__ int BlockShift(int block_size) {
  return (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
}

// Physical cache row of logical key j of a sequence whose blocks are `table` (null:
// contiguous rows). block_shift: BlockShift(block_size), where the caller has it, so that
// a power of two (the engine's 16, say) takes a shift and a mask rather than an integer
// division and remainder by a run-time value, some 20 instructions each; −1 divides.
// In two parts for a caller that looks the block up early: the index of key j's entry in
// the table, and key j's row given that entry (`block`).
__device__ __forceinline__ int BlockIndexOf(int block_size, int block_shift, int j) {
  return block_shift >= 0 ? j >> block_shift : j / block_size;
}
__device__ __forceinline__ int64_t RowInBlock(int32_t block, int block_size, int block_shift,
                                              int j) {
  return static_cast<int64_t>(block) * block_size +
         (block_shift >= 0 ? j & (block_size - 1) : j % block_size);
}
__device__ __forceinline__ int64_t PhysicalRowIn(const int32_t* table, int block_size,
                                                 int block_shift, int j) {
  if (table == nullptr) return j;
  return RowInBlock(table[BlockIndexOf(block_size, block_shift, j)], block_size, block_shift, j);
}

// Physical cache row of logical key j.
__device__ __forceinline__ int64_t PhysicalRow(const AttentionParams& p, int j) {
  return PhysicalRowIn(p.block_table, p.block_size, -1, j);
}

// Key j (< num_keys) is visible to query row i.
__device__ __forceinline__ bool Visible(const AttentionParams& p, int i, int j) {
  if (p.causal && static_cast<int64_t>(j) > static_cast<int64_t>(p.query_offset) + i) {
    return false;
  }
  if (p.window > 0 && static_cast<int64_t>(p.query_offset) + i - j >= p.window) return false;
  return p.q_doc == nullptr || p.q_doc[i] == p.k_doc[j];
}

// A score soft-capped at cap > 0 (Gemma 2): cap · tanh(s / cap).
__device__ __forceinline__ float SoftCapped(float s, float cap) { return cap * tanhf(s / cap); }

// Keys j >= this are masked by causality for row i.
__device__ __forceinline__ int CausalEnd(const AttentionParams& p, int i) {
  if (!p.causal) return p.num_keys;
  return static_cast<int>(
      min(static_cast<int64_t>(p.num_keys), static_cast<int64_t>(p.query_offset) + i + 1));
}

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_ATTENTION_COMMON_CUH_

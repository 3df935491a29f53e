// An fp32 KV cache's rows, copied to fp16 for a flash prefill launch (kv_f16_copy.cu).
//
// The bf16 flash kernel (flash_prefill_bf16.cu) copies its K/V tiles to shared memory as
// stored, by cp.async, and reads its tensor cores' fragments by ldmatrix; the fp16 kernel
// (flash_prefill.cu), which takes an fp32 cache, has each thread load, convert and store
// its share of a tile while the block waits (on an H200, 2026-12-04: 72–89 TFLOP/s where
// the bf16 kernel ran 182–236). So for an fp32 cache, as an option
// (CudaBackend::SetFlashF16Copy), the blocks a call reads are first copied to fp16 in
// device memory, each once, and the bf16 kernel's loop runs on those with fp16 tensor
// cores: the same rounding of K and V as the fp16 kernel's (nearest-even fp16), and of Q
// and P, so the same bits where the tiles are the same. The copy reads each cached byte
// of the call's keys once and writes half as many, where attention reads each K/V tile
// once a 128-query block: at 8k tokens, 32 heads, 8 KV heads and head size 128, about
// 100 MB moved (some 25 µs at an H200's bandwidth) against 550 GFLOP of products (2.7 ms at
// 200 TFLOP/s).
//
// The copies are laid out as blocks of the cache's block size in the order first read,
// so each call's table is renumbered to them (KvF16CopyPlan); a block two sequences share
// (a common prefix) is copied once. Where the copies do not fit in device memory the
// launch runs on the fp16 kernel instead (CudaBackend::flash_f16_copy_fallbacks).
#ifndef KVLENS_KERNELS_CUDA_KV_F16_COPY_H_
#define KVLENS_KERNELS_CUDA_KV_F16_COPY_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "absl/status/status.h"

namespace kvlens::kernels::cuda {

// The cache blocks a flash launch reads and the tables that find their copies.
class KvF16CopyPlan {
 public:
  // The first key a flash block of a sequence whose first query row sits at query_offset
  // may read: under a sliding window of `window` keys (0: none), the tile holding that
  // row's first visible key (FlashKeysOf); else 0.
  static int FirstKeyRead(int query_offset, int window);

  // Renumbers a sequence's table (`blocks` entries, in place) to the copies: each entry from
  // the block holding key first_key on becomes its copy's index (a block already met, in
  // this sequence or an earlier one, keeps its copy), appending the blocks not met before
  // to sources(); the entries before it, which the launch never reads, become 0.
  void Renumber(int32_t* table, int blocks, int block_size, int first_key);

  // Copy c holds cache block sources()[c].
  const std::vector<int32_t>& sources() const { return sources_; }

 private:
  std::unordered_map<int32_t, int32_t> copy_of_;  // cache block → its copy
  std::vector<int32_t> sources_;
};

// Copies blocks of an fp32 cache to fp16 (nearest even): rows c·block_size … of dst_k and
// dst_v (copies × block_size rows of row_elems, dst_row_stride apart) from cache rows
// sources[c]·block_size … of k and v (src_row_stride apart), each row's first row_elems
// elements. sources null: copy c is cache rows c·block_size …, and rows from src_rows on
// are zeros, not read (a contiguous cache of src_rows rows). row_elems: a multiple of 8;
// dst 16-byte aligned, dst_row_stride a multiple of 8.
absl::Status LaunchKvF16Copy(const float* k, const float* v, int64_t src_row_stride, int block_size,
                             const int32_t* sources, int copies, int64_t src_rows, int row_elems,
                             uint16_t* dst_k, uint16_t* dst_v, int64_t dst_row_stride,
                             cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_KV_F16_COPY_H_

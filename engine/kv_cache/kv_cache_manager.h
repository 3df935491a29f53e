// KvCacheManager: sequence → block table, on top of a BlockPool.
//
//   seq 7: tokens 0…37, block_size 16 → block table [4, 9, 2]   (slots 6…15 of block 2 free)
//
// Reserve grows a sequence's table to cover a number of tokens; it fails without side
// effects (returns false) when the pool cannot supply the blocks, so the caller can queue
// or preempt. Free returns every block of a sequence at once.
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_MANAGER_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_MANAGER_H_

#include <cstdint>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "engine/kv_cache/block_pool.h"

namespace kvlens {

using SequenceId = int64_t;

class KvCacheManager {
 public:
  KvCacheManager(int num_blocks, int block_size) : pool_(num_blocks), block_size_(block_size) {}

  // Ensures `seq` has blocks for tokens 0 … num_tokens−1. False (nothing changed) when
  // the pool has too few free blocks.
  [[nodiscard]] bool Reserve(SequenceId seq, int64_t num_tokens);
  // Releases all of `seq`'s blocks (no-op for an unknown sequence).
  void Free(SequenceId seq);

  // The sequence's block table (empty for an unknown sequence).
  const std::vector<BlockId>& BlockTable(SequenceId seq) const;
  int64_t Capacity(SequenceId seq) const { return BlockTable(seq).size() * block_size_; }
  int BlocksNeeded(int64_t num_tokens) const {
    return static_cast<int>((num_tokens + block_size_ - 1) / block_size_);
  }

  const BlockPool& pool() const { return pool_; }
  int block_size() const { return block_size_; }

 private:
  BlockPool pool_;
  int block_size_;
  absl::flat_hash_map<SequenceId, std::vector<BlockId>> tables_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_MANAGER_H_

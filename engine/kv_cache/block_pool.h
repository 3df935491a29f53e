// BlockPool: a fixed set of KV-cache blocks, handed out by id with reference counts.
//
//   ids:       0   1   2   3   4   5 …  num_blocks−1
//   ref_count: 2   1   0   0   1   0
//   free list: [2, 3, 5, …]   (a block is on it exactly when its ref_count is 0)
//
// The pool knows nothing of tensors; KvCacheStorage maps a block id to its memory.
// Allocation failure is a normal outcome (std::nullopt), never an error: the caller
// decides whether to queue, preempt or reject.
#ifndef KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_
#define KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <vector>

namespace kvlens {

using BlockId = int32_t;

class BlockPool {
 public:
  explicit BlockPool(int num_blocks);

  // Takes a free block (ref_count becomes 1), or nullopt when none is free.
  std::optional<BlockId> Allocate();
  // Another owner of an allocated block.
  void AddRef(BlockId id);
  // Drops one reference; the block returns to the free list at zero.
  void Release(BlockId id);

  int num_blocks() const { return static_cast<int>(ref_counts_.size()); }
  int num_free() const { return static_cast<int>(free_.size()); }
  int num_used() const { return num_blocks() - num_free(); }
  int ref_count(BlockId id) const { return ref_counts_[id]; }

 private:
  std::vector<int32_t> ref_counts_;
  std::deque<BlockId> free_;  // oldest-released first
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_

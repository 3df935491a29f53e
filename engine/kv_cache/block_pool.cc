#include "engine/kv_cache/block_pool.h"

#include <cassert>
#include <cstdlib>

namespace kvlens {

BlockPool::BlockPool(int num_blocks) : ref_counts_(num_blocks, 0) {
  for (BlockId i = 0; i < num_blocks; ++i) free_.push_back(i);
}

std::optional<BlockId> BlockPool::Allocate() {
  if (free_.empty()) return std::nullopt;
  const BlockId id = free_.front();
  free_.pop_front();
  ref_counts_[id] = 1;
  return id;
}

void BlockPool::AddRef(BlockId id) {
  if (ref_counts_.at(id) <= 0) std::abort();  // a free block has no owner to share it
  ++ref_counts_[id];
}

void BlockPool::Release(BlockId id) {
  if (ref_counts_.at(id) <= 0) std::abort();  // double release would corrupt the free list
  if (--ref_counts_[id] == 0) free_.push_back(id);
}

}  // namespace kvlens

#include "engine/kv_cache/block_pool.h"

#include <cstdlib>

namespace kvlens {

BlockHash HashBlock(BlockHash parent, absl::Span<const int32_t> tokens) {
  // FNV-1a over the parent hash and the token ids, then a final avalanche (splitmix64).
  uint64_t h = 0xcbf29ce484222325ull ^ parent;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 0x100000001b3ull;
    }
  };
  mix(tokens.size());
  for (int32_t t : tokens) mix(static_cast<uint32_t>(t));
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebull;
  h ^= h >> 31;
  return h == 0 ? 1 : h;  // 0 means "no hash"
}

BlockPool::BlockPool(int num_blocks) : blocks_(num_blocks) {
  for (BlockId i = 0; i < num_blocks; ++i) blocks_[i].lru = lru_.insert(lru_.end(), i);
}

void BlockPool::Uncache(BlockId id) {
  Block& b = blocks_[id];
  if (b.hash == 0) return;
  by_hash_.erase(b.hash);
  b.hash = 0;
  b.tokens.clear();
  if (b.ref_count == 0) --num_cached_;
}

std::optional<BlockId> BlockPool::Allocate() {
  if (lru_.empty()) return std::nullopt;
  const BlockId id = lru_.front();
  lru_.pop_front();
  Uncache(id);  // eviction of whatever prefix it held
  blocks_[id].ref_count = 1;
  ++num_used_;
  return id;
}

void BlockPool::AddRef(BlockId id) {
  if (blocks_.at(id).ref_count <= 0) std::abort();  // a free block has no owner to share it
  ++blocks_[id].ref_count;
}

void BlockPool::Release(BlockId id) {
  Block& b = blocks_.at(id);
  if (b.ref_count <= 0) std::abort();  // double release would corrupt the LRU list
  if (--b.ref_count > 0) return;
  --num_used_;
  if (b.hash != 0) ++num_cached_;
  b.lru = lru_.insert(lru_.end(), id);
}

std::optional<BlockId> BlockPool::Lookup(BlockHash hash, absl::Span<const int32_t> tokens) {
  auto it = by_hash_.find(hash);
  if (it == by_hash_.end()) return std::nullopt;
  const BlockId id = it->second;
  Block& b = blocks_[id];
  if (absl::MakeConstSpan(b.tokens) != tokens) return std::nullopt;
  if (b.ref_count == 0) {
    lru_.erase(b.lru);
    --num_cached_;
    ++num_used_;
  }
  ++b.ref_count;
  return id;
}

void BlockPool::SetHash(BlockId id, BlockHash hash, absl::Span<const int32_t> tokens) {
  Block& b = blocks_.at(id);
  if (b.hash != 0 || by_hash_.contains(hash)) return;
  b.hash = hash;
  b.tokens.assign(tokens.begin(), tokens.end());
  by_hash_.emplace(hash, id);
  if (b.ref_count == 0) ++num_cached_;
}

}  // namespace kvlens

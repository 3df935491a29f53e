// BlockPool: a fixed set of KV-cache blocks, handed out by id with reference counts, and
// a prefix cache over their contents.
//
//   ids:        0    1    2    3    4    5 …
//   ref_count:  2    1    0    0    1    0
//   hash:       h7   -    h3   -    h9   -
//   LRU list:   [3, 2, 5, …]  every block with ref_count 0, least recently released first
//   states:     used (ref > 0) | cached (ref 0, holds a hash) | free (ref 0, no hash)
//
// A full block gets a content hash = H(parent block's hash, its tokens), so equal prefixes
// map to equal chains of hashes and a new sequence can adopt the blocks of an earlier one
// (prefix caching). Unreferenced blocks keep their contents until Allocate needs them
// again, oldest first (LRU eviction). Allocation failure is a normal outcome
// (std::nullopt), never an error: the caller decides whether to queue, preempt or reject.
#ifndef KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_
#define KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_

#include <cstdint>
#include <list>
#include <optional>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace kvlens {

using BlockId = int32_t;
using BlockHash = uint64_t;

// The hash of a full block of `tokens` following a block whose hash is `parent` (0 for
// the first block of a sequence).
BlockHash HashBlock(BlockHash parent, absl::Span<const int32_t> tokens);

class BlockPool {
 public:
  explicit BlockPool(int num_blocks);

  // Takes the least recently released unreferenced block (ref_count becomes 1), evicting
  // the prefix it cached, or nullopt when every block is referenced.
  std::optional<BlockId> Allocate();
  // Another owner of an allocated block.
  void AddRef(BlockId id);
  // Drops one reference; at zero the block joins the LRU list (keeping its contents).
  void Release(BlockId id);

  // Prefix cache: the block caching (hash, tokens), with a new reference, or nullopt.
  // Tokens are compared too, so a hash collision can never return wrong contents.
  std::optional<BlockId> Lookup(BlockHash hash, absl::Span<const int32_t> tokens);
  // Registers a full, computed block under its hash (no-op when the hash is taken).
  void SetHash(BlockId id, BlockHash hash, absl::Span<const int32_t> tokens);

  int num_blocks() const { return static_cast<int>(blocks_.size()); }
  int num_used() const { return num_used_; }
  int num_cached() const { return num_cached_; }
  int num_free() const { return num_blocks() - num_used_ - num_cached_; }
  int num_available() const { return num_blocks() - num_used_; }  // free + cached
  int ref_count(BlockId id) const { return blocks_[id].ref_count; }

 private:
  struct Block {
    int32_t ref_count = 0;
    BlockHash hash = 0;  // 0: not cached
    std::vector<int32_t> tokens;
    std::list<BlockId>::iterator lru;  // valid while ref_count == 0
  };
  void Uncache(BlockId id);

  std::vector<Block> blocks_;
  std::list<BlockId> lru_;
  absl::flat_hash_map<BlockHash, BlockId> by_hash_;
  int num_used_ = 0;
  int num_cached_ = 0;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_BLOCK_POOL_H_

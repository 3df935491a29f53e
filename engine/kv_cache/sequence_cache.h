// One sequence's KV cache, for the offline runs (Generate, EvaluatePerplexity): blocks
// for `tokens` positions, all reserved for it, unused slots NaN (a read of one shows).
//
// Under a sliding window W, when every Forward takes at most max_chunk tokens, the blocks
// form a ring: logical block b is physical block b mod R, R = ceil((max_chunk + W − 1) /
// block_size), so positions p and p + R·block_size share a row. A chunk [c, c + n) then
// overwrites only positions before c + n − R·block_size ≤ c − W, which no query of it or
// after it sees (its first sees keys from c − W + 1 on; each layer stores its rows before
// it attends); a masked key read through the table (the maps' paths) reads a row some
// position wrote, finite, and masks it. A 32k-token generation of Mistral 7B v0.1 (W 4096,
// prefill chunks of 512, blocks of 16) keeps 288 blocks (4608 positions), not 2048.
#ifndef KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_
#define KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/kv_cache/kv_cache_manager.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/model.h"

namespace kvlens {

template <typename T>
struct SequenceCache {
  KvCacheManager manager;
  KvCacheStorage<T> storage;
  std::vector<BlockId> ring_table;  // logical block → physical block (the ring's)
  // The block table of positions 0 … tokens − 1.
  const std::vector<BlockId>& table() const { return ring_table; }

  // max_chunk: the most tokens one Forward takes (0: unknown, no ring).
  static absl::StatusOr<std::unique_ptr<SequenceCache>> Create(kernels::Memory& memory,
                                                               const ModelConfig& c, int64_t tokens,
                                                               int block_size,
                                                               kernels::KvDtype dtype,
                                                               int64_t max_chunk = 0) {
    const int logical = static_cast<int>((tokens + block_size - 1) / block_size);
    int blocks = logical;
    if (const int window = c.CommonWindow(); window > 0 && max_chunk > 0) {
      const int64_t ring = (max_chunk + window - 1 + block_size - 1) / block_size;
      blocks = static_cast<int>(std::min<int64_t>(logical, ring));
    }
    auto storage = KvCacheStorage<T>::Create(memory, c.num_layers, blocks, block_size, c.kv_dim(),
                                             /*fill_nan=*/true, dtype);
    if (!storage.ok()) return storage.status();
    auto cache = std::unique_ptr<SequenceCache>(
        new SequenceCache{KvCacheManager(blocks, block_size), *std::move(storage), {}});
    if (!cache->manager.Reserve(0, int64_t{blocks} * block_size)) {
      return absl::InternalError("KV cache reservation failed");
    }
    const std::vector<BlockId>& physical = cache->manager.BlockTable(0);
    for (int b = 0; b < logical; ++b) cache->ring_table.push_back(physical[b % blocks]);
    return cache;
  }
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_

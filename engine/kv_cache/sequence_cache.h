// One sequence's KV cache, for the offline runs (Generate, EvaluatePerplexity): blocks
// for `tokens` positions, all reserved for it, unused slots NaN (a read of one shows).
#ifndef KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_
#define KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_

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
  const std::vector<BlockId>& table() const { return manager.BlockTable(0); }

  static absl::StatusOr<std::unique_ptr<SequenceCache>> Create(kernels::Memory& memory,
                                                               const ModelConfig& c, int64_t tokens,
                                                               int block_size,
                                                               kernels::KvDtype dtype) {
    const int blocks = static_cast<int>((tokens + block_size - 1) / block_size);
    auto storage = KvCacheStorage<T>::Create(memory, c.num_layers, blocks, block_size, c.kv_dim(),
                                             /*fill_nan=*/true, dtype);
    if (!storage.ok()) return storage.status();
    auto cache = std::unique_ptr<SequenceCache>(
        new SequenceCache{KvCacheManager(blocks, block_size), *std::move(storage)});
    if (!cache->manager.Reserve(0, tokens)) {
      return absl::InternalError("KV cache reservation failed");
    }
    return cache;
  }
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_SEQUENCE_CACHE_H_

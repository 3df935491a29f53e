#include "engine/kv_cache/kv_cache_manager.h"

namespace kvlens {

bool KvCacheManager::Reserve(SequenceId seq, int64_t num_tokens) {
  std::vector<BlockId>& table = tables_[seq];
  const int needed = BlocksNeeded(num_tokens) - static_cast<int>(table.size());
  if (needed <= 0) return true;
  if (needed > pool_.num_free()) {
    if (table.empty()) tables_.erase(seq);
    return false;
  }
  for (int i = 0; i < needed; ++i) table.push_back(*pool_.Allocate());
  return true;
}

void KvCacheManager::Free(SequenceId seq) {
  auto it = tables_.find(seq);
  if (it == tables_.end()) return;
  for (BlockId b : it->second) pool_.Release(b);
  tables_.erase(it);
}

const std::vector<BlockId>& KvCacheManager::BlockTable(SequenceId seq) const {
  static const std::vector<BlockId> kEmpty;
  auto it = tables_.find(seq);
  return it == tables_.end() ? kEmpty : it->second;
}

}  // namespace kvlens

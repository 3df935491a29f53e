#include "engine/token_counts.h"

namespace kvlens {

void TokenCounts::Update(absl::Span<const int32_t> history) {
  for (; counted_ < history.size(); ++counted_) {
    const int32_t t = history[counted_];
    if (t < 0) continue;
    const auto [it, inserted] = index_.try_emplace(t, entries_.size());
    if (inserted) {
      entries_.emplace_back(t, 1);
    } else {
      ++entries_[it->second].second;
    }
  }
}

}  // namespace kvlens

// TokenCounts: how many times each token occurs in a sequence's tokens so far (the
// penalties' input, kernels::TokenDraw::token_counts), kept up to date as the sequence
// grows: each new token costs one hash lookup, so a step's draw hands a backend the
// counts without recounting the whole history.
#ifndef KVLENS_ENGINE_TOKEN_COUNTS_H_
#define KVLENS_ENGINE_TOKEN_COUNTS_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/types/span.h"

namespace kvlens {

class TokenCounts {
 public:
  // Counts history[Counted() …): `history` must extend the one given before (a sequence's
  // tokens only grow). Negative ids are skipped.
  void Update(absl::Span<const int32_t> history);
  // The distinct tokens counted so far, each with its count (>= 1), in order of first
  // appearance.
  absl::Span<const std::pair<int32_t, int32_t>> entries() const { return entries_; }
  size_t Counted() const { return counted_; }

 private:
  std::vector<std::pair<int32_t, int32_t>> entries_;
  absl::flat_hash_map<int32_t, size_t> index_;  // token → its entry
  size_t counted_ = 0;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKEN_COUNTS_H_

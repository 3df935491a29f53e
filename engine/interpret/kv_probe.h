// Cached-KV probe: the gradient of a next-token objective with respect to the keys and
// values already in the paged KV cache, treating them as leaves. Only the new tokens run
// forward (attending to the cached prefix, which is read, never recomputed) and backward;
// the cost is that of a decode step plus its reverse, whatever the prefix length.
//
//   cache (block table) ─ read rows 0 … P−1 of every layer ─▶ prefix K/V (leaves)
//   new tokens P … P+n−1 ─ tape forward against the prefix ─ log p(target | last row)
//   backward ─▶ dJ/dK, dJ/dV of rows 0 … P−1 for every layer: [L][P, Hkv·Dh]
//
// Because the cached K/V are leaves, a prefix row's gradient counts only the paths from
// that cached tensor into the new tokens' attention; it equals a full tape's gradient for
// the same tensors when the full tape also stops gradients at the prefix K/V
// (BackwardOptions::kv_leaf_end = P). Without that stop the full tape's gradient of an
// earlier layer's K also flows through later layers of the prefix positions.
#ifndef KVLENS_ENGINE_INTERPRET_KV_PROBE_H_
#define KVLENS_ENGINE_INTERPRET_KV_PROBE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"
#include "engine/kv_cache/kv_cache_storage.h"

namespace kvlens::interpret {

struct KvProbeRequest {
  absl::Span<const int32_t> block_table;  // covers num_cached tokens (or more)
  int num_cached = 0;                     // P ≥ 1: positions 0 … P−1 are in the cache
  absl::Span<const int32_t> new_tokens;   // n ≥ 1 tokens at positions P … P+n−1
  int32_t target = 0;                     // J = log p(target | last new token)
  absl::Span<const int32_t> doc_ids;      // [P + n], or empty
};

template <typename T>
struct KvProbeResult {
  double objective = 0.0;          // J
  std::vector<T> logits;           // [V] of the last new token
  std::vector<std::vector<T>> dk;  // [L][P, Hkv·Dh] dJ/dK of the cached rows (post-RoPE)
  std::vector<std::vector<T>> dv;  // [L][P, Hkv·Dh]
  SequenceInput<T> input;          // what ran: the prefix as read from the cache
  Gradients<T> grads;              // every gradient of the new tokens' tape
};

// The prefix K/V of rows 0 … P−1 read from `cache` through the block table (copied out
// when the cache is device memory), plus the new tokens, as a tape input. INVALID_ARGUMENT for a
// short block table or bad block ids.
template <typename T>
absl::StatusOr<SequenceInput<T>> InputFromCache(const ModelConfig& c,
                                                const KvCacheStorage<T>& cache,
                                                const KvProbeRequest& request);

// The forward runs on `backend` (a worker's CPU backend, or its staged GPU backend), the
// backward's heavy ops on `ops` when given (kernels/backward_ops.h), else on the host.
template <typename T>
absl::StatusOr<KvProbeResult<T>> CachedKvProbe(const Model& model, kernels::Backend<T>& backend,
                                               const KvCacheStorage<T>& cache,
                                               const KvProbeRequest& request,
                                               kernels::BackwardOps<T>* ops = nullptr);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_KV_PROBE_H_

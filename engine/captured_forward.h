// One engine step's Forward when some of its entries stream attention rows: the
// Transformer captures the attention probabilities of one entry a call, so those entries
// run one per Forward with a capture, after the others ran batched.
#ifndef KVLENS_ENGINE_CAPTURED_FORWARD_H_
#define KVLENS_ENGINE_CAPTURED_FORWARD_H_

#include <optional>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/transformer.h"

namespace kvlens {

// Runs `batch` into `out`, and for each entry k with a captures[k] its attention
// probabilities into captures[k]->probs (the layers and rows it asks for; its `entry` is
// set here). Entries are independent sequences
// (their cache rows are disjoint), so the split changes no result; it costs extra Forward
// calls only while someone asks for rows. Without any capture this is one Forward. With
// some, `out` is left as one Forward over the batch would leave it, except that every
// logits row is on the host (no entry takes the device's pick): each entry's rows (all
// its new tokens' with all_logits, else the last) in batch order, logits_row[k] the first.
absl::Status ForwardWithCaptures(Transformer<float>& transformer, KvCacheStorage<float>& cache,
                                 absl::Span<const BatchEntry> batch,
                                 std::vector<std::optional<AttentionCapture<float>>>& captures,
                                 ForwardOutput<float>& out);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_CAPTURED_FORWARD_H_

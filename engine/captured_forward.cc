#include "engine/captured_forward.h"

#include <algorithm>

namespace kvlens {

absl::Status ForwardWithCaptures(Transformer<float>& transformer, KvCacheStorage<float>& cache,
                                 absl::Span<const BatchEntry> batch,
                                 std::vector<std::optional<AttentionCapture<float>>>& captures,
                                 ForwardOutput<float>& out) {
  auto captured = [&](size_t k) { return captures[k].has_value(); };
  if (std::none_of(captures.begin(), captures.end(), [](const auto& c) { return c.has_value(); })) {
    return transformer.Forward(batch, cache, out);
  }
  // Every entry's logits rows come back here, so none takes the device's picks.
  std::vector<BatchEntry> rows_batch(batch.begin(), batch.end());
  for (BatchEntry& e : rows_batch) {
    e.pick_only = false;
    e.score_next = {};
  }
  const size_t V = static_cast<size_t>(transformer.config().vocab_size);
  auto rows_of = [&](size_t k) { return batch[k].all_logits ? batch[k].tokens.size() : 1; };
  std::vector<int> first_row(batch.size());
  size_t num_rows = 0;
  for (size_t k = 0; k < batch.size(); ++k) {
    first_row[k] = static_cast<int>(num_rows);
    num_rows += rows_of(k);
  }
  std::vector<float> logits(num_rows * V);
  std::vector<BatchEntry> rest;
  std::vector<size_t> rest_index;
  for (size_t k = 0; k < batch.size(); ++k) {
    if (!captured(k)) {
      rest.push_back(rows_batch[k]);
      rest_index.push_back(k);
    }
  }
  if (!rest.empty()) {
    if (absl::Status s = transformer.Forward(rest, cache, out); !s.ok()) return s;
    for (size_t j = 0; j < rest.size(); ++j) {
      const size_t k = rest_index[j];
      std::copy_n(out.logits.begin() + static_cast<size_t>(out.logits_row[j]) * V, rows_of(k) * V,
                  logits.begin() + static_cast<size_t>(first_row[k]) * V);
    }
  }
  for (size_t k = 0; k < batch.size(); ++k) {
    if (!captured(k)) continue;
    captures[k]->entry = 0;  // of a one-entry batch
    if (absl::Status s =
            transformer.Forward(absl::MakeConstSpan(&rows_batch[k], 1), cache, out, &*captures[k]);
        !s.ok()) {
      return s;
    }
    std::copy_n(out.logits.begin() + static_cast<size_t>(out.logits_row[0]) * V, rows_of(k) * V,
                logits.begin() + static_cast<size_t>(first_row[k]) * V);
  }
  out.logits = std::move(logits);
  out.logits_row = std::move(first_row);
  out.pick_token.clear();
  out.pick_logprob.clear();
  out.pick_top_token.clear();
  out.pick_top_logprob.clear();
  return absl::OkStatus();
}

}  // namespace kvlens

// Transformer: the forward pass of both families, written only against kernels::Backend.
//
// One call processes a batch of sequences at once (continuous batching): each entry
// brings its new tokens, how many of its tokens are already in the KV cache (its query
// offset) and its block table. All entries' tokens are stacked into one [N, D] activation
// so every matrix product runs once per layer; attention runs per entry against that
// entry's paged keys and values.
//
//   entry 0: cached 0,  new 5 (prefill)     rows 0…4   positions 0…4
//   entry 1: cached 37, new 1 (decode)      row  5     position  37
//   entry 2: cached 16, new 8 (chunk)       rows 6…13  positions 16…23
#ifndef KVLENS_ENGINE_MODEL_TRANSFORMER_H_
#define KVLENS_ENGINE_MODEL_TRANSFORMER_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/model.h"
#include "engine/model/residual_add.h"
#include "kernels/backend.h"
#include "kernels/buffer.h"

namespace kvlens {

struct BatchEntry {
  absl::Span<const int32_t> tokens;       // the new tokens, at positions num_cached …
  int num_cached = 0;                     // tokens of this sequence already in the cache
  absl::Span<const int32_t> block_table;  // covers num_cached + tokens.size() tokens
  bool all_logits = false;                // logits for every new token, else the last only
  // Optional document id of every position 0 … num_cached + tokens.size() − 1 (packed
  // inputs: a token attends only to earlier tokens of its own document).
  absl::Span<const int32_t> doc_ids;
  // Only the token `draw` picks from its (last) logits row is wanted (Backend::DrawTokens,
  // the greedy pick by default): a device backend then hands back that token and its
  // log-probability (ForwardOutput::pick_token) instead of the row, and leaves the row's
  // logits unset. Ignored with all_logits, and by host backends, which always give the
  // rows.
  bool pick_only = false;
  kernels::TokenDraw draw;
  // With all_logits, a prompt being scored: the token after each new position (row i's
  // is score_next[i]; tokens.size() of them, or one fewer when the last row samples). A
  // device backend then hands back no row of this entry, only picks: row i < size the
  // forced score_next[i] with its log-probability and score_top (0 … 20) most likely
  // tokens, and a last row past them drawn by `draw`. Host backends give the rows.
  absl::Span<const int32_t> score_next;
  int score_top = 0;

  // Whether a device backend hands back this entry's picks (ForwardOutput::pick_token)
  // rather than its logits rows.
  bool Picks() const { return all_logits ? !score_next.empty() : pick_only; }
  // Vectors added to the new rows' residual stream from their from_position on (activation
  // steering); each delta has dim values.
  absl::Span<const ResidualAdd> residual_adds;
};

// What Forward hands back. Logits rows follow the entries in order: all new tokens of an
// entry with all_logits, else its last token only.
template <typename T>
struct ForwardOutput {
  std::vector<T> logits;        // [rows, V]
  std::vector<int> logits_row;  // per entry: first row of its logits
  // Per logits row, when some entry Picks() on a device backend (else empty): the token
  // its entry's draw picks (or a scored row's score_next token) and its log-probability
  // (Backend::DrawTokens; rows of other entries: the greedy pick). The logits of the
  // picking entries' rows are then not copied out (unspecified values).
  std::vector<int32_t> pick_token;
  std::vector<float> pick_logprob;
  // [rows, kernels::kMaxTopLogprobs], when some picking entry's draw asks for top
  // log-probabilities (else empty): row r's first draw.top_logprobs entries.
  std::vector<int32_t> pick_top_token;
  std::vector<float> pick_top_logprob;
};

// Optional captures for interpretability: attention probabilities of one batch entry.
template <typename T>
struct AttentionCapture {
  int entry = 0;  // in [0, the batch's entries)
  // The layers captured (each in [0, L)); empty: all. The others' probs stay empty, and
  // their attention runs with the other entries', as in a step without captures.
  std::vector<int> layers;
  // Only each head's last query row (whose logits pick the next token): probs[l] is then
  // [H, Tk]. The last query of each captured layer is saved as the step goes, and its
  // attention runs a second time, alone, after the step (its output dropped), so the
  // step's activations and logits are those of the same step without the capture. On a
  // device the chosen layers' rows land side by side there and are copied out once, where
  // full maps are copied out layer by layer.
  bool last_query_only = false;
  // Filled per captured layer: [H, Tq, Tk] with Tq = the entry's new tokens, Tk = all its
  // tokens (or [H, Tk], last_query_only).
  std::vector<std::vector<T>> probs;
};

template <typename T>
class Transformer {
 public:
  Transformer(const Model& model, kernels::Backend<T>& backend);

  // Runs the batch: writes each entry's new keys/values into `cache` (at the rows its
  // block table names) and returns logits. Errors: a token id outside the vocabulary, a
  // position past max_seq_len, a block table too short (each names the entry and field);
  // a cache in other memory than the backend's; a backend failure (device errors).
  // With captures (at most one an entry; an entry or a layer outside the batch or the
  // model is INVALID_ARGUMENT), their probabilities too. A step capturing full maps is run
  // op by op, never a CUDA graph, and a decode step is not padded; one capturing last
  // query rows only is recorded and padded as any other (the queries saved in the step,
  // their attention run again after it).
  absl::Status Forward(absl::Span<const BatchEntry> batch, KvCacheStorage<T>& cache,
                       ForwardOutput<T>& out, absl::Span<AttentionCapture<T>> captures);
  absl::Status Forward(absl::Span<const BatchEntry> batch, KvCacheStorage<T>& cache,
                       ForwardOutput<T>& out, AttentionCapture<T>* capture = nullptr) {
    return Forward(batch, cache, out,
                   capture != nullptr ? absl::Span<AttentionCapture<T>>(capture, 1)
                                      : absl::Span<AttentionCapture<T>>());
  }

  const ModelConfig& config() const { return config_; }

 private:
  absl::Status Validate(absl::Span<const BatchEntry> batch, const KvCacheStorage<T>& cache) const;
  // xn_ = norm(x_) (RmsNorm for Llama, LayerNorm for GPT-2), after x_ += proj_ when
  // add_proj: the residual connection left pending by the previous block.
  void Norm(const WeightView& weight, const WeightView& bias, int n, bool add_proj);
  // Whether the layers hand their RMSNorms to the products that read them (RmsNormMatMul*)
  // and add each residual as its product makes it (MatMulAddTo), which a backend may fuse:
  // Llama-family layers without sandwich norms.
  bool FusedResiduals() const;
  // The feed-forward norm (after x_ += proj_ when add_proj) and block. Its residual is
  // added into x_ (FusedResiduals: returns false) or left in proj_ (returns true).
  bool FeedForward(const LayerWeights& lw, int n, bool add_proj);
  // Adds the batch's residual adds at (layer, mid) to their entries' rows of x_, after the
  // pending residual (proj_) when *proj_pending (then cleared). Nothing when none is there.
  absl::Status AddResiduals(absl::Span<const BatchEntry> batch, int layer, bool mid, int n,
                            bool* proj_pending);

  const Model& model_;
  const ModelConfig& config_;
  kernels::Backend<T>& backend_;
  // Activation buffers in the backend's memory, reused across calls (llama2.c's RunState).
  kernels::Buffer<T> x_;           // [N, D] residual stream
  kernels::Buffer<T> xn_;          // [N, D] normalised
  kernels::Buffer<T> q_;           // [N, D]
  kernels::Buffer<T> k_;           // [N, KVD]
  kernels::Buffer<T> v_;           // [N, KVD]
  kernels::Buffer<T> att_;         // [N, D] attention output (heads concatenated)
  kernels::Buffer<T> proj_;        // [N, D]
  kernels::Buffer<T> hidden_;      // [N, F]
  kernels::Buffer<T> up_;          // [N, F]
  kernels::Buffer<T> logits_;      // [rows, V] (device backends only; else out.logits)
  kernels::Buffer<T> probs_;       // [H, Tq, Tk] one captured layer (device backends only)
  kernels::Buffer<T> last_probs_;  // last query rows, [captured layers, H, Tk] a capture
  kernels::Buffer<T> probe_out_;   // [reruns, QD] the last queries' reruns' outputs (dropped)
  kernels::Buffer<T> saved_q_;     // [captured layers, QD] the last queries, for their reruns
  // One point's residual adds (AddResiduals): the sums added, [rows, D], and each of the
  // N rows' index into them (−1: none).
  std::vector<T> steer_rows_;
  std::vector<int32_t> steer_index_;
  // Index arrays stay on the host (the backend contract).
  std::vector<int32_t> positions_;                // [N]
  std::vector<kernels::RopeSpec> ropes_;          // each layer's (RopeOf)
  std::vector<int64_t> rows_;                     // [N] physical cache row of each new token
  std::vector<kernels::AttentionArgs<T>> calls_;  // one layer's attention, entry by entry
  std::vector<int> call_entries_;                 // the batch entry of each call
};

extern template class Transformer<float>;
extern template class Transformer<double>;

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_TRANSFORMER_H_

// Perplexity of a model on a token stream, scored one of two ways (PerplexityScoring):
//
// - kAll, as the default model's training script measures it: the stream is cut into
//   windows of `context` + 1 tokens that overlap by one (window w is tokens w·C … w·C + C);
//   each window runs from an empty cache, and its first C tokens predict the next C, all of
//   them scored.
// - kSecondHalf, as llama.cpp's llama-perplexity does: disjoint windows of C tokens (window
//   w is tokens w·C … w·C + C − 1), each from an empty cache with its first token replaced
//   by BOS (when bos_token ≥ 0; llama-perplexity does so for models that add BOS), and only
//   the tokens at positions C/2 + 1 … C − 1 scored, so that each has at least C/2 tokens of
//   context. Its numbers are typically lower than kAll's, and comparable with
//   llama-perplexity's at the same context on the same tokens.
//
// The result is the mean negative log-likelihood per predicted token (nats) and its
// exponential.
#ifndef KVLENS_ENGINE_PERPLEXITY_H_
#define KVLENS_ENGINE_PERPLEXITY_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/model.h"
#include "kernels/backend.h"
#include "kernels/kv_dtype.h"

namespace kvlens {

enum class PerplexityScoring { kAll, kSecondHalf };

struct PerplexityOptions {
  int context = 512;    // C: a window's context; at most the model's context length
  int max_windows = 0;  // 0: every whole window of the stream
  int chunk = 512;      // tokens per forward step within a window
  int block_size = 16;  // KV-cache tokens per block
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;
  PerplexityScoring scoring = PerplexityScoring::kAll;
  int32_t bos_token = -1;  // kSecondHalf: each window's first token becomes this (≥ 0)
};

struct PerplexityResult {
  int windows = 0;
  int64_t tokens = 0;              // predicted tokens: windows · C (kSecondHalf: C − 1 − C/2)
  double nll_sum = 0.0;            // Σ −log p(token | its window's earlier tokens), nats
  std::vector<double> window_nll;  // per window: its mean
  double seconds = 0.0;

  double mean_nll() const { return tokens > 0 ? nll_sum / static_cast<double>(tokens) : 0.0; }
  double perplexity() const;
};

// Called after each window with the result so far.
using PerplexityCallback = std::function<void(const PerplexityResult& so_far)>;

// INVALID_ARGUMENT naming the field for a context outside [1, the model's context length]
// (at least 3 for kSecondHalf, which scores C − 1 − C/2 tokens a window), a chunk or block
// size out of range, a bos_token outside the vocabulary, or a stream shorter than one window
// (C + 1 tokens, or C).
template <typename T>
absl::StatusOr<PerplexityResult> EvaluatePerplexity(const Model& model,
                                                    kernels::Backend<T>& backend,
                                                    absl::Span<const int32_t> tokens,
                                                    const PerplexityOptions& options,
                                                    const PerplexityCallback& on_window = nullptr);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_PERPLEXITY_H_

// Perplexity of a model on a token stream, as the default model's training script measures
// it: the stream is cut into windows of `context` + 1 tokens that overlap by one (window w
// is tokens w·C … w·C + C); each window runs from an empty cache, and its first C tokens
// predict the next C, all of them scored. (llama.cpp's llama-perplexity scores only the
// second half of each window, so that every scored token has C/2 tokens of context; its
// numbers are typically lower than these.) The result is the mean negative log-likelihood per
// predicted token (nats) and its exponential.
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

struct PerplexityOptions {
  int context = 512;    // C: tokens each window predicts from; at most the model's context
  int max_windows = 0;  // 0: every whole window of the stream
  int chunk = 512;      // tokens per forward step within a window
  int block_size = 16;  // KV-cache tokens per block
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;
};

struct PerplexityResult {
  int windows = 0;
  int64_t tokens = 0;              // predicted tokens: windows · C
  double nll_sum = 0.0;            // Σ −log p(token | its window's earlier tokens), nats
  std::vector<double> window_nll;  // per window: its mean
  double seconds = 0.0;

  double mean_nll() const { return tokens > 0 ? nll_sum / static_cast<double>(tokens) : 0.0; }
  double perplexity() const;
};

// Called after each window with the result so far.
using PerplexityCallback = std::function<void(const PerplexityResult& so_far)>;

// INVALID_ARGUMENT naming the field for a context outside [1, the model's context length],
// a chunk or block size out of range, or a stream shorter than one window (C + 1 tokens).
template <typename T>
absl::StatusOr<PerplexityResult> EvaluatePerplexity(const Model& model,
                                                    kernels::Backend<T>& backend,
                                                    absl::Span<const int32_t> tokens,
                                                    const PerplexityOptions& options,
                                                    const PerplexityCallback& on_window = nullptr);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_PERPLEXITY_H_

// llama2.c checkpoint format (Karpathy's run.c): seven little-endian int32 — dim,
// hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size (negative: untied classifier
// follows), seq_len — then float32 arrays: token embedding [V, D], attention RMSNorm
// [L, D], wq [L, D, D], wk [L, KVD, D], wv [L, KVD, D], wo [L, D, D], FFN RMSNorm [L, D],
// w1 [L, F, D], w2 [L, D, F], w3 [L, F, D], final RMSNorm [D], RoPE tables
// [seq_len, Dh] (unused), then the classifier [V, D] when untied.
#ifndef KVLENS_ENGINE_MODEL_LLAMA2C_H_
#define KVLENS_ENGINE_MODEL_LLAMA2C_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/model.h"

namespace kvlens {

// Loads the checkpoint at options.path (memory-mapped) and the llama2.c tokenizer at
// options.tokenizer_path (default: tokenizer.bin, else tok<V>.bin, beside the checkpoint;
// none found leaves the model without a tokenizer).
absl::StatusOr<std::unique_ptr<Model>> LoadLlama2c(const LoadOptions& options);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_LLAMA2C_H_

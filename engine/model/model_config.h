// ModelConfig: the blueprint of a model, independent of its file format.
#ifndef KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_
#define KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace kvlens {

// The two decoder-only families kvlens serves.
enum class Architecture : uint8_t {
  kLlama,  // RoPE, RMSNorm, SwiGLU FFN, grouped-query attention; no biases (Qwen2: q, k, v)
  kGpt2,   // learned absolute positions, LayerNorm, GELU (tanh) FFN, biases everywhere
};

std::string_view ArchitectureName(Architecture a);

struct ModelConfig {
  Architecture arch = Architecture::kLlama;
  int dim = 0;             // D: residual stream width
  int hidden_dim = 0;      // F: feed-forward inner width
  int num_layers = 0;      // L
  int num_heads = 0;       // H: query heads
  int num_kv_heads = 0;    // Hkv: key/value heads (divides H; H == Hkv without GQA)
  int head_dim = 0;        // Dh: D / H
  int vocab_size = 0;      // V
  int max_seq_len = 0;     // context length: positions 0 … max_seq_len−1
  double norm_eps = 1e-5;  // RMSNorm / LayerNorm epsilon
  double rope_theta = 10000.0;
  bool qkv_bias = false;  // Llama family: biases on q, k and v (Qwen2)
  kernels::RopeStyle rope_style = kernels::RopeStyle::kAdjacentPairs;
  bool tied_embeddings = true;  // output head shares the token embedding table
  std::string name;             // free-form (file name or general.name)

  int kv_dim() const { return num_kv_heads * head_dim; }
  // Checks every invariant above; errors name the field and the limit.
  absl::Status Validate() const;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_

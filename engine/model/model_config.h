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
  kLlama,  // RoPE, RMSNorm, SwiGLU FFN, grouped-query attention; no biases (Qwen2: q, k, v;
           // Qwen3: RMSNorm on each head of q and k)
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
  int head_dim = 0;        // Dh: D / H, or what the file says (Qwen3, Mistral Nemo: H·Dh ≠ D)
  int vocab_size = 0;      // V
  int max_seq_len = 0;     // context length: positions 0 … max_seq_len−1
  int sliding_window = 0;  // > 0: a query sees only its last this many positions (Mistral v0.1)
  double norm_eps = 1e-5;  // RMSNorm / LayerNorm epsilon
  double rope_theta = 10000.0;
  bool qkv_bias = false;  // Llama family: biases on q, k and v (Qwen2)
  bool qk_norm = false;   // Llama family: RMSNorm over each head of q and k before RoPE (Qwen3)
  kernels::RopeStyle rope_style = kernels::RopeStyle::kAdjacentPairs;
  bool tied_embeddings = true;  // output head shares the token embedding table
  std::string name;             // free-form (file name or general.name)
  // The file's architecture name ("llama", "qwen2", "qwen3", "mistral", "gpt2"); reported,
  // never dispatched on (arch and the flags above say how the model computes).
  std::string family;

  int q_dim() const { return num_heads * head_dim; }  // H·Dh: width of q and of W_O's input
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Checks every invariant above; errors name the field and the limit.
  absl::Status Validate() const;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_

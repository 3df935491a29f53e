// ModelConfig: the blueprint of a model, independent of its file format.
#ifndef KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_
#define KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

// The gate of a Llama-family feed-forward: w_down · (act(w_gate x) ⊙ w_up x).
enum class GateActivation : uint8_t {
  kSilu,      // SwiGLU (Llama, Qwen, Mistral, Phi-3)
  kGeluTanh,  // GeGLU with GELU's tanh approximation (Gemma's gelu_pytorch_tanh)
};

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
  // Per layer, whether it attends through sliding_window; empty: every layer does. Gemma 3:
  // five windowed layers, then one over the whole context.
  std::vector<bool> windowed_layers;
  double norm_eps = 1e-5;  // RMSNorm / LayerNorm epsilon
  double rope_theta = 10000.0;
  // > 0: the RoPE base of the windowed layers, which then take no rope_freqs factors
  // (Gemma 3's rope_local_base_freq, 10000, against rope_theta's 1e6 elsewhere).
  double rope_theta_windowed = 0.0;
  // > 0: attention scores are q·k times this; 0: 1/√head_dim (Gemma 3's
  // query_pre_attn_scalar^−1/2).
  double attention_scale = 0.0;
  // > 0: attention scores are softcap · tanh(s / softcap) (Gemma 2's attn_logit_softcapping,
  // 50), and the logits final_softcap · tanh(l / final_softcap) (final_logit_softcapping, 30).
  double attention_softcap = 0.0;
  double final_softcap = 0.0;
  // Llama family: an RMSNorm on the attention output and one on the feed-forward output,
  // each before its residual add (LayerWeights::post_attn_norm, post_ffn_norm; Gemma 3).
  bool sandwich_norms = false;
  bool qkv_bias = false;  // Llama family: biases on q, k and v (Qwen2)
  bool qk_norm = false;   // Llama family: RMSNorm over each head of q and k before RoPE (Qwen3)
  kernels::RopeStyle rope_style = kernels::RopeStyle::kAdjacentPairs;
  GateActivation gate_activation = GateActivation::kSilu;  // Llama family
  // The token embeddings are multiplied by this before the first layer (Gemma: √D; the
  // output head, tied or not, uses the table as stored).
  double embedding_scale = 1.0;
  bool tied_embeddings = true;  // output head shares the token embedding table
  std::string name;             // free-form (file name or general.name)
  // The file's architecture name ("llama", "qwen2", "qwen3", "mistral", "gpt2"); reported,
  // never dispatched on (arch and the flags above say how the model computes).
  std::string family;

  int q_dim() const { return num_heads * head_dim; }  // H·Dh: width of q and of W_O's input
  int kv_dim() const { return num_kv_heads * head_dim; }
  // Layer l's sliding window (0: none).
  int WindowOf(int layer) const {
    return windowed_layers.empty() || windowed_layers[layer] ? sliding_window : 0;
  }
  // The window every layer keeps to (0 when some layer sees the whole context): what a
  // sequence's KV-cache blocks may be given back by.
  int CommonWindow() const;
  double AttentionScale() const;
  // Checks every invariant above; errors name the field and the limit.
  absl::Status Validate() const;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_MODEL_CONFIG_H_

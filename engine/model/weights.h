// Weights: read-only views of every parameter of a model, in their stored types.
#ifndef KVLENS_ENGINE_MODEL_WEIGHTS_H_
#define KVLENS_ENGINE_MODEL_WEIGHTS_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "engine/model/model_config.h"
#include "kernels/backend.h"
#include "kernels/weight.h"

namespace kvlens {

using kernels::WeightView;

// One transformer block. Linear weights are [out, in]; vectors are [1, n]. Views a family
// does not use stay empty (Llama has no biases; GPT-2 has no up projection).
struct LayerWeights {
  WeightView attn_norm;       // [1, D]  RMSNorm weight / LayerNorm γ
  WeightView attn_norm_bias;  // [1, D]  LayerNorm β (GPT-2)
  WeightView wq, wk, wv;  // [H·Dh, D], [Hkv·Dh, D], [Hkv·Dh, D]  (H·Dh = D but in Qwen3 …)
  WeightView bq, bk, bv;  // [1, H·Dh], [1, Hkv·Dh], [1, Hkv·Dh] (GPT-2, Qwen2)
  WeightView q_norm, k_norm;  // [1, Dh]  RMSNorm weights over each head of q and k (Qwen3)
  WeightView wo;              // [D, H·Dh]
  WeightView bo;              // [1, D] (GPT-2)
  WeightView ffn_norm;        // [1, D]
  WeightView post_attn_norm;  // [1, D]  RMSNorm of the attention output (sandwich_norms)
  WeightView post_ffn_norm;   // [1, D]  RMSNorm of the feed-forward output (sandwich_norms)
  WeightView ffn_norm_bias;   // [1, D] (GPT-2)
  WeightView w_in;            // [F, D]  Llama: gate (w1); GPT-2: c_fc
  WeightView b_in;            // [1, F]  (GPT-2)
  WeightView w_up;            // [F, D]  Llama: up (w3)
  WeightView w_out;           // [D, F]  Llama: down (w2); GPT-2: mlp c_proj
  WeightView b_out;           // [1, D]  (GPT-2)
};

struct Weights {
  WeightView token_embedding;     // [V, D]
  WeightView position_embedding;  // [max_seq_len, D] (GPT-2)
  std::vector<LayerWeights> layers;
  WeightView final_norm;       // [1, D]
  WeightView final_norm_bias;  // [1, D] (GPT-2)
  WeightView output;           // [V, D]; equals token_embedding when tied
  // [1, Dh/2] f32 divisors of RoPE's frequencies (Llama 3.1's rope scaling: GGUF
  // rope_freqs.weight, or computed from config.json's rope_scaling), or empty.
  WeightView rope_freqs;
  // Whatever the views point into (a memory mapping, converted buffers).
  std::vector<std::shared_ptr<const void>> storage;
};

// OK when `w` is present and [rows, cols]; else INVALID_ARGUMENT naming the tensor with
// the expected and the actual shape ("tensor blk.0.attn_q.weight: expected shape [64, 64],
// got [64, 32]"), or NOT_FOUND when it is missing.
absl::Status CheckShape(absl::string_view tensor_name, const WeightView& w, int64_t rows,
                        int64_t cols);

// Layer `layer`'s RoPE: the config's theta and style, with rope_freqs' factors when
// present; a windowed layer's rope_theta_windowed, without factors, when that is set.
kernels::RopeSpec RopeOf(const ModelConfig& c, const Weights& w, int layer);

// The stored types of the linear weights (every layer's projections and the output), most
// parameters first, joined by "+": "f16" for a plain model, "q4_K+q6_K" for a Q4_K_M file.
std::string LinearWeightDTypes(const Weights& w);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_WEIGHTS_H_

// Direct logit attribution: a logit (or a difference of two) at one row, written as the
// sum of what each part of the model wrote into the residual stream, read through the
// final norm and the unembedding with every norm's scale frozen at its value in this run
// (TransformerLens's `logit_attrs` / `apply_ln_to_stack` convention). With the scale
// frozen the read-out is linear, so the parts add up to the logit exactly:
//
//   x_L = embed (+ GPT-2's pos_embed) + Σ_l attn_out_l + Σ_l mlp_out_l
//   logit = x_L · a + final_norm_bias,   u = W_U[token] (− W_U[baseline])
//   RMSNorm:   a = s · w_final ⊙ u,                s = 1/√(mean(x_L²) + ε)
//   LayerNorm: a = s · w_final ⊙ u − mean(…),      s = 1/√(var(x_L) + ε),  bias b_final · u
//
// Within a layer: attn_out = Σ_h result_h (+ b_O) and mlp_out = Σ_i act_i · W_out[:, i]
// (+ b_out); under Gemma 2/3's block-output norms, whose scales are frozen too, a head's and
// a neuron's share are read through that norm (r · w_post ⊙ a). The model's own logit is
// before any final soft-cap (Gemma 2's), which is not linear.
#ifndef KVLENS_ENGINE_INTERPRET_LOGIT_ATTRIBUTION_H_
#define KVLENS_ENGINE_INTERPRET_LOGIT_ATTRIBUTION_H_

#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

struct AttributionOptions {
  bool heads = false;   // per-head shares (and b_O's) of every layer's attention
  int top_neurons = 0;  // per layer, the FFN neurons of largest |share|; 0: none
};

struct NeuronShare {
  int layer = 0;
  int neuron = 0;
  double value = 0.0;
};

struct LogitAttribution {
  double logit = 0.0;                // the model's own (pre-cap) logit or difference at the row
  double scale = 0.0;                // s, the final norm's frozen 1/RMS or 1/σ
  double embed = 0.0;                // token embedding (times Gemma's √D)
  double pos_embed = 0.0;            // GPT-2's learned position embedding; 0 otherwise
  double final_norm_bias = 0.0;      // LayerNorm's b_final · u; 0 for RMSNorm
  std::vector<double> attn, mlp;     // [L]
  std::vector<double> heads;         // [L, H] with options.heads, else empty
  std::vector<double> attn_bias;     // [L] b_O's share (0 without b_O), with options.heads
  std::vector<double> mlp_bias;      // [L] b_out's share (0 without), with top_neurons
  std::vector<NeuronShare> neurons;  // top_neurons per layer, layer-major, largest |value| first
  // embed + pos_embed + Σ attn + Σ mlp + final_norm_bias: equals `logit` up to rounding.
  double Total() const;
};

// `row` is a query row of the tape (position offset + row); baseline < 0 for a single
// logit. INVALID_ARGUMENT naming the field when row, token, baseline or top_neurons are out
// of range.
template <typename T>
absl::StatusOr<LogitAttribution> AttributeLogit(const Model& model, const Tape<T>& tape, int row,
                                                int token, int baseline,
                                                const AttributionOptions& options = {});

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_LOGIT_ATTRIBUTION_H_

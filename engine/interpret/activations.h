// Activations: a tape's intermediates under TransformerLens's hook names (what
// `run_with_cache` returns), for the Interpret service's Activations RPC. Every hook but
// `result` is a slice of what RunForward recorded; `result`, the output of each head on
// its own (z_h · W_O[:, h]ᵀ), is formed here with the backend's matrix product.
//
// Hook (per layer l unless noted)  rows      one row           tape field
//   resid_pre     x_l                    n         [D]               LayerTape::x
//   resid_mid     x_l + attn_out         n         [D]               LayerTape::h
//   resid_post    resid_mid + mlp_out    n         [D]               next x / x_final
//   attn_out      what attention adds    n         [D]               LayerTape::attn_delta
//   mlp_out       what the FFN adds      n         [D]               LayerTape::ffn_delta
//   z             O per head, before W_O n         [H, Dh]           LayerTape::att
//   result        z_h · W_O[:, h]ᵀ        n         [H, D]            (formed here)
//   q             queries before RoPE    n         [H, Dh]           LayerTape::q, turned back
//   k             keys before RoPE       Tk        [Hkv, Dh]         LayerTape::k, turned back
//   v             values                 Tk        [Hkv, Dh]         LayerTape::v
//   rot_q, rot_k  after RoPE (rotary     n, Tk     [H | Hkv, Dh]     LayerTape::q / k
//                 models only)
//   mlp_pre       gate / GELU input      n         [F]               LayerTape::pre
//   mlp_post      the FFN's hidden       n         [F]               LayerTape::act
//   mlp_pre_linear  the gated FFN's up   n         [F]               LayerTape::up
//                 projection (Llama family only): mlp_post = act(mlp_pre) ⊙ it
//   attn_scores   pre-softmax scores     n         [H, Tk]  *        LayerTape::scores
//   pattern       attention probs        n         [H, Tk]  *        LayerTape::probs
//   ln_final      final norm's output    n         [D]  (no layer)   Tape::xf
//   ln1_scale     the attention norm's   n         [1]               from LayerTape::x
//                 divisor √(mean(x̃²) + ε)
//   ln1_normalized  x̃ / scale, before    n         [D]               from LayerTape::x
//                 the norm's weight
//   ln2_scale, ln2_normalized: the FFN norm's, of resid_mid (LayerTape::h)
//   ln1_post_scale, ln1_post_normalized: the norm on the attention output (Gemma 2/3's
//                 block-output norms only), of O·W_Oᵀ (LayerTape::attn_proj)
//   ln2_post_scale, ln2_post_normalized: the norm on the FFN output, of W_out·act
//                 (LayerTape::ffn_out)
//   ln_final_scale, ln_final_normalized: the final norm's (no layer), of Tape::x_final
//   embed         token embeddings       n         [D]  (no layer)   (formed here)
//                 (Gemma's times √D)
//   pos_embed     position embeddings    n         [D]  (no layer)   (formed here)
//                 (GPT-2 only)
//   (x̃ = x − mean(x) under LayerNorm, x under RMSNorm.) These are TransformerLens's
//   blocks.{l}.ln1.hook_scale / hook_normalized, …, blocks.{l}.ln1_post.hook_scale (its
//   Gemma 2 block's ln1_post, whose output is hook_attn_out), ln_final.hook_normalized as its
//   default (LayerNorm-folded) models have them, and as its RMSNorm has them unfolded: the
//   normalized vector before the weight. ln_final is the norm's output, weight in: what
//   the unembedding reads.
// q and k are TransformerLens's hook_q / hook_k: after the projection, its bias and
// Qwen3/Gemma 3's per-head norms, before the rotation (the tape keeps the rotated rows, what
// the scores use; RoPE is a rotation, so turning them back by −angle gives the unrotated
// rows). rot_q and rot_k are hook_rot_q / hook_rot_k, which TransformerLens, like kvlens,
// has only for rotary models; GPT-2's q and k are what its scores use.
// * head first, as TransformerLens's hook_attn_scores / hook_pattern and AttentionMaps:
//   the tensor of rows [b, e) is [H, e − b, Tk], masked keys −∞ (scores) and 0 (pattern).
// attn_out and mlp_out are after Gemma 2/3's block-output norms, b_O and the FFN's bias
// included; result has neither bias nor norm, so Σ_h result = O·W_Oᵀ (and attn_out with b_O
// added, for models without the norms). GradientProbe's `attn_out` is this `z`.
#ifndef KVLENS_ENGINE_INTERPRET_ACTIVATIONS_H_
#define KVLENS_ENGINE_INTERPRET_ACTIVATIONS_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

enum class Hook : uint8_t {
  kResidPre,
  kResidMid,
  kResidPost,
  kAttnOut,
  kMlpOut,
  kZ,
  kResult,
  kQ,
  kK,
  kV,
  kMlpPre,
  kMlpPost,
  kLnFinal,
  kAttnScores,
  kPattern,
  kRotQ,
  kRotK,
  kLn1Scale,
  kLn1Normalized,
  kLn2Scale,
  kLn2Normalized,
  kLnFinalScale,
  kLnFinalNormalized,
  kEmbed,
  kPosEmbed,
  kMlpPreLinear,
  kLn1PostScale,
  kLn1PostNormalized,
  kLn2PostScale,
  kLn2PostNormalized,
};

std::string_view HookName(Hook hook);
// The hook of `name`, or nullopt.
std::optional<Hook> HookByName(std::string_view name);
// "resid_pre, resid_mid, …": every name, for error messages.
std::string HookNameList();
// TransformerLens's full name of `hook` at `layer`: blocks.{layer}.hook_resid_pre,
// blocks.{layer}.attn.hook_pattern, blocks.{layer}.mlp.hook_pre, ln_final.hook_normalized
// (no layer), …; ln_final, which has none, keeps its short name.
std::string HookFullName(Hook hook, int layer);
// A hook named either way: "pattern" (layer nullopt: every layer asked for) or
// "blocks.1.attn.hook_pattern" (layer 1); nullopt when `name` is neither.
struct NamedHook {
  Hook hook;
  std::optional<int> layer;
};
std::optional<NamedHook> ParseHookName(std::string_view name);
// The embeddings and ln_final and its scale and normalized rows are the hooks without a
// layer.
bool HookIsPerLayer(Hook hook);
// OK when the model has `hook`; INVALID_ARGUMENT for rot_q and rot_k on a model without
// rotary embeddings (GPT-2), for pos_embed on one without learned positions, and for
// mlp_pre_linear on one without a gated FFN (GPT-2), and for the ln1_post / ln2_post hooks
// on one without block-output norms (all but Gemma 2 and 3).
absl::Status CheckModelHasHook(const ModelConfig& c, Hook hook);
// k, rot_k and v have a row per key (Tk = offset + n), the others per new token (n).
bool HookRowsAreKeys(Hook hook);
// The shape of one row over `num_keys` keys: {D}, {H, Dh}, {H, D}, {Hkv, Dh}, {F}, {1} (the
// norms' scales) or {H, num_keys} (attn_scores, pattern; the other hooks' rows have no
// keys).
std::vector<int64_t> HookRowShape(const ModelConfig& c, Hook hook, int64_t num_keys);
int64_t HookRowElements(const ModelConfig& c, Hook hook, int64_t num_keys);
// The shape of the tensor of `rows` rows: {rows, HookRowShape…}, or head first for
// attn_scores and pattern, {H, rows, num_keys}.
std::vector<int64_t> HookShape(const ModelConfig& c, Hook hook, int64_t rows, int64_t num_keys);

// Rows [row_begin, row_end) of `hook` at `layer` (ignored for ln_final), row-major in
// HookShape's order. INVALID_ARGUMENT when the layer or the rows are out of range, or the
// model lacks the hook (CheckModelHasHook).
template <typename T>
absl::StatusOr<std::vector<T>> ReadHook(const Model& model, kernels::Backend<T>& backend,
                                        const Tape<T>& tape, Hook hook, int layer, int row_begin,
                                        int row_end);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_ACTIVATIONS_H_

// Gradients under TransformerLens's hook names: what a backward hook on each hook point sees
// (TransformerLens's get_cache_fwd_and_bwd gradient cache), read from Backward's Gradients
// in the layout ReadHook gives the activations (HookShape), so that activation × gradient
// is an elementwise product.
//
// Hook (per layer l unless noted)  Gradients field                          rows
//   resid_pre          residual[l]                                           n
//   resid_mid, attn_out  resid_mid[l] (h = x + attn_out: one gradient)       n
//   resid_post, mlp_out  residual[l + 1] (x_{l+1} = h + mlp_out)             n
//   z                  attn_out[l]                                           n
//   result             [n, H, D]: every head the gradient of Σ_h result_h = O·W_Oᵀ,
//                      resid_mid[l] (Gemma 2/3: through the attention output's norm)
//   q, k               q[l], k[l] turned back by TurnBackRope (before RoPE)  n, Tk
//   rot_q, rot_k, v    q[l], k[l], v[l]                                      n, Tk
//   attn_scores        scores[l] (masked keys: 0, as −∞ passes nothing back) [H, n, Tk]
//   pattern            probs[l]; masked keys 0 (TransformerLens's would be dO·v there:
//                      a masked probability is 0 whatever its gradient)       [H, n, Tk]
//   mlp_pre, mlp_post, mlp_pre_linear  mlp_pre[l], mlp_post[l], mlp_pre_linear[l]: only
//                      for the layers of BackwardOptions::ffn_layers         n
//   embed (no layer)   residual[0]: the input embedding (Gemma's times √D)   n
//   pos_embed (GPT-2)  residual[0] too: it enters as embed + pos_embed       n
//   ln_final (no layer)  ln_final: the final norm's output, what the unembedding reads
//                      (zero for a probe seeded at O only)                   n
// The norms' hooks (scale, normalized) have no gradient kept.
#ifndef KVLENS_ENGINE_INTERPRET_HOOK_GRADIENTS_H_
#define KVLENS_ENGINE_INTERPRET_HOOK_GRADIENTS_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

// The hooks whose gradient Backward keeps (the mlp_ ones for BackwardOptions::ffn_layers), in
// run_with_cache's order; HookHasGradient: whether `hook` is one.
absl::Span<const Hook> HooksWithGradient();
bool HookHasGradient(Hook hook);
// The mlp_pre, mlp_post and mlp_pre_linear hooks: those that need BackwardOptions::ffn_layers.
bool HookGradientNeedsFfn(Hook hook);
// OK when HookHasGradient(hook); else INVALID_ARGUMENT naming it and the hooks that have one.
absl::Status CheckHookHasGradient(Hook hook);

// The gradient at `hook` of layer `layer` (ignored for embed and pos_embed), every row,
// in HookShape's order. INVALID_ARGUMENT when the hook has no gradient (naming it and
// those that have), the model lacks it (CheckModelHasHook), the layer is out of range, or
// `g` kept no FFN gradients of that layer for an mlp_ hook.
template <typename T>
absl::StatusOr<std::vector<T>> ReadHookGradient(const Model& model, const Tape<T>& tape,
                                                const Gradients<T>& g, Hook hook, int layer);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_HOOK_GRADIENTS_H_

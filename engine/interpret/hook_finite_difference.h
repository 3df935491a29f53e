// Centred finite differences of a gradient read at a TransformerLens hook (ReadHookGradient),
// for a probe's `verify` with hooks: K random entries of the hook's activation at one layer
// are each moved by the stencil's steps through an edit of the forward, everything
// downstream recomputed in float64, and compared with the gradient's entry, with the
// errors, floors and stencil of finite_difference.h (the floor is 1e-3 · max|g| over the
// hook's gradient).
//
// The hooks an edit can move at one entry (HookHasFiniteDifference), and how:
//   resid_pre, resid_post, embed, pos_embed  the stream entering layer l (l + 1; 0): a
//                      kResidual perturbation (embed and pos_embed enter as their sum)
//   resid_mid, attn_out, mlp_out  a ResidualPatch of the clean row plus the step (the
//                      clean row read from an unedited float64 forward)
//   z, rot_q, rot_k, v  kAttnOut, kQ, kK, kV perturbations (post-RoPE for rot_q, rot_k)
//   q, k               the tape's q or k along RopeDirection (the entry before RoPE)
//   attn_scores, pattern  kScores, kProbs at a visible (row, key) only
// The others (result, the FFN's hidden hooks, ln_final, the norms' hooks) have no edit that
// moves one entry alone.
#ifndef KVLENS_ENGINE_INTERPRET_HOOK_FINITE_DIFFERENCE_H_
#define KVLENS_ENGINE_INTERPRET_HOOK_FINITE_DIFFERENCE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/finite_difference.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

bool HookHasFiniteDifference(Hook hook);

struct FdHookSample {
  int64_t index = 0;      // the entry, flat in HookShape's order
  double gradient = 0.0;  // the probe's value there
  double fd = 0.0;        // the centred difference
};

struct FdHookReport {
  Hook hook = Hook::kResidPre;
  int layer = 0;
  std::vector<FdHookSample> samples;
  double max_abs_err = 0.0;
  double max_rel_err = 0.0;
  int num_forwards = 0;  // the stencil's forwards, and one unedited where a patch needs it
};

// Checks `gradient` (the values of `hook` at `layer`, every row, in HookShape's order, as
// ReadHookGradient returns them for `objective` on `input`) against float64 centred
// differences; options.tensors is not read. INVALID_ARGUMENT when the hook has no finite
// difference (naming it and those that have), the model lacks it, the layer is out of
// range, or `gradient` is not HookShape's size; anything RunForward or ValidateObjective
// rejects.
absl::StatusOr<FdHookReport> CheckHookGradientByFiniteDifferences(
    const Model& model, const SequenceInput<double>& input, const Objective& objective, Hook hook,
    int layer, absl::Span<const double> gradient, const FdOptions& options = {});

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_HOOK_FINITE_DIFFERENCE_H_

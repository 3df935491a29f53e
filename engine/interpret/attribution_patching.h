// Attribution patching (AtP: Nanda 2023, Kramár et al. 2024; TransformerLens users build it
// from hooks and a backward pass): the activation-patching grid of patch_sweep.h estimated
// to first order from the clean run's gradient, each cell
//   clean + Σ (source activation − clean activation) · ∂objective/∂activation
// over the values the exact cell would patch (a stream row, one head's q, k, v or z, one
// attention row; with all_positions every row of the range). The clean run's one backward
// pass replaces a forward per cell, so a sweep of every head at every position costs about
// three forwards whatever its size. Where the objective is far from linear in the patched
// activation (a large patch through a norm or a softmax, attention patterns especially) the
// estimate and PatchSweep's exact cell part; comparing the two on a few cells is how AtP
// is used.
#ifndef KVLENS_ENGINE_INTERPRET_ATTRIBUTION_PATCHING_H_
#define KVLENS_ENGINE_INTERPRET_ATTRIBUTION_PATCHING_H_

#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/patch_sweep.h"

namespace kvlens::interpret {

// PatchSweep's arguments and result layout; the same INVALID_ARGUMENT cases
// (StartPatchSweep). `ops`: where the backward's heavy ops run (Backward's; null: the
// reference loops on the host).
//
// `qk_fix` (q and k sweeps only; INVALID_ARGUMENT otherwise): AtP*'s QK fix (Kramár et al.
// 2024, §3.1). A query or key reaches the objective through a softmax, where the first
// order misses most when the patch moves the pattern far (saturated rows especially), so
// each cell's pattern is recomputed exactly instead — every row the patch reaches (a q
// cell's own row; a k cell's rows that see the key, in every query head of its group)
// through the forward's scores and softmax with the source's vector — and only the rest
// to first order: clean + Σ (A′ − A) · ∂objective/∂A. No forward: a q cell costs its row's
// scores again, a k cell O(Dh) a row that sees the key (its softmax updated from the row's
// clean sums, formed once a layer).
template <typename T>
absl::StatusOr<PatchSweepResult> AttributionPatchSweep(
    const Model& model, kernels::Backend<T>& backend, const SequenceInput<T>& input,
    const SequenceInput<T>& source, PatchTarget target, const std::vector<int>& layers,
    int row_begin, int row_end, const Objective& objective, bool all_positions = false,
    kernels::BackwardOps<T>* ops = nullptr, bool qk_fix = false);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_ATTRIBUTION_PATCHING_H_

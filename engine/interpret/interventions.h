// Interventions and the logit lens, built on the tape's Edits (see tape.h):
//   - head ablation: O[:, head] of a layer set to 0, or to its mean over the sequence's rows;
//   - attention-row overrides between softmax and A·V: a given row, or keys masked and the
//     rest renormalised;
//   - activation patching: the residual stream entering layer l at one row replaced by
//     another run's, or the stream after its attention, or what its attention or FFN adds
//     (PatchFrom), or one head's output, query, key or value there (HeadPatchFrom).
// Intervene runs the clean and the edited forward and returns both logits and the
// log-probabilities of chosen tokens side by side.
//
// LogitLens: the residual stream entering each layer, through the final norm and the
// unembedding. Layer L (the stream after the last block) is exactly the model's logits.
#ifndef KVLENS_ENGINE_INTERPRET_INTERVENTIONS_H_
#define KVLENS_ENGINE_INTERPRET_INTERVENTIONS_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

struct InterventionResult {
  std::vector<double> clean_logits;     // [n, V]
  std::vector<double> edited_logits;    // [n, V]
  std::vector<double> clean_logprobs;   // [targets]: log p(token | row), clean run
  std::vector<double> edited_logprobs;  // [targets], edited run
};

template <typename T>
absl::StatusOr<InterventionResult> Intervene(const Model& model, kernels::Backend<T>& backend,
                                             const SequenceInput<T>& input, const Edits& edits,
                                             absl::Span<const TokenTarget> targets);

// A patch that puts `source`'s `site` of `layer` at `source_row` (by default the residual
// stream entering `layer`, 0 … L; resid_mid, attn_out and mlp_out: 0 … L − 1) into row
// `target_row` of the run it is applied to.
template <typename T>
absl::StatusOr<ResidualPatch> PatchFrom(const Tape<T>& source, const ModelConfig& c, int layer,
                                        int source_row, int target_row,
                                        PatchSite site = PatchSite::kResidPre);

// A patch that puts `source`'s vector `kind` of head `head` in layer `layer` at
// `source_row` into row `target_row` of the run it is applied to: by default its output (O,
// before W_O; the hook z), or its q, or (a KV head's) k or v (see HeadPatch).
template <typename T>
absl::StatusOr<HeadPatch> HeadPatchFrom(const Tape<T>& source, const ModelConfig& c, int layer,
                                        int head, int source_row, int target_row,
                                        TensorKind kind = TensorKind::kAttnOut);

struct LensEntry {
  int32_t token = 0;
  double logit = 0.0;
  double logprob = 0.0;
};

// Logits [n, V] of the residual stream entering `layer` (0 … L) through the final norm and
// the unembedding.
template <typename T>
absl::StatusOr<std::vector<T>> LensLogits(const Model& model, kernels::Backend<T>& backend,
                                          const Tape<T>& tape, int layer);

// Top-k per layer and row: [L + 1][n][k], best first (ties: lower token id first).
template <typename T>
absl::StatusOr<std::vector<std::vector<std::vector<LensEntry>>>> LogitLens(
    const Model& model, kernels::Backend<T>& backend, const Tape<T>& tape, int k);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_INTERVENTIONS_H_

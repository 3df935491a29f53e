// Activation patching swept over layers and positions, as TransformerLens's `patching`
// module does it (get_act_patch_resid_pre, …_resid_mid, …_attn_out, …_mlp_out,
// …_attn_head_out_by_pos, …_attn_head_q_by_pos, …_k_by_pos, …_v_by_pos,
// …_attn_head_pattern_by_pos): for every cell (layer, [head,] row) one run of the input with
// that one activation replaced by the source run's at the same row, scored by an objective.
// The input's clean run and the source's run are computed once; each cell is one edited
// forward (the edits of interventions.h: PatchFrom / HeadPatchFrom) from the patched layer
// on (RunForwardFrom: the layers before it are the clean run's).
//
// Sites by TransformerLens's hook name: resid_pre (the stream entering the layer),
// resid_mid, resid_post (= resid_pre of the next layer, or the stream the final norm
// reads), attn_out, mlp_out; and per head, one cell each: q, k, v and z (the head's query,
// key, value or output, a HeadPatch: k and v once per KV head, as TransformerLens hooks
// them in grouped-query attention) and pattern (its attention row, a RowOverride with the
// source's probabilities).
#ifndef KVLENS_ENGINE_INTERPRET_PATCH_SWEEP_H_
#define KVLENS_ENGINE_INTERPRET_PATCH_SWEEP_H_

#include <optional>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/tape.h"

namespace kvlens::interpret {

// A patching site named as TransformerLens names it.
struct PatchTarget {
  enum class Kind : uint8_t {
    kStream,       // a row of the stream or of a block's output: `site`, `next_layer`
    kHeadVector,   // q, k, v or z: one head's `tensor` (HeadPatch)
    kHeadPattern,  // pattern: one head's attention row (RowOverride)
  };
  Kind kind = Kind::kStream;
  PatchSite site = PatchSite::kResidPre;
  bool next_layer = false;                   // resid_post: resid_pre of layer + 1
  TensorKind tensor = TensorKind::kAttnOut;  // kHeadVector: kQ, kK, kV or kAttnOut (z)
  bool per_head() const { return kind != Kind::kStream; }
  bool per_kv_head() const {  // k and v
    return kind == Kind::kHeadVector && IsPerKvHead(tensor);
  }
  bool query_or_key() const {  // q and k: what reaches the objective through a softmax
    return kind == Kind::kHeadVector && (tensor == TensorKind::kQ || tensor == TensorKind::kK);
  }
  // Cells per (layer, row): the KV heads for k and v, the heads for q, z and pattern, else 1.
  int Heads(const ModelConfig& c) const;
};
// "" and "resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out", "q", "k", "v", "z",
// "pattern"; nullopt otherwise.
std::optional<PatchTarget> PatchTargetByName(std::string_view hook);
// "resid_pre, resid_mid, resid_post, attn_out, mlp_out, q, k, v, z, pattern", for error
// messages.
std::string_view PatchTargetNames();

struct PatchSweepResult {
  double clean = 0.0;   // the objective on the input's own run
  double source = 0.0;  // on the source's own run (same rows and tokens)
  int heads = 1;        // cells per (layer, row): PatchTarget::Heads
  // [layers.size()][heads][row_end − row_begin] (all_positions: [layers.size()][heads][1]):
  // the objective with that one activation (that head's at every row) patched.
  std::vector<double> metric;
};

// The sweep over `layers` (each in [0, L)) and rows [row_begin, row_end) of `input`, each
// patched from the same row of `source` (of the same length). With `all_positions`, one
// cell per layer (and head) patches every row of the range at once (TransformerLens's
// get_act_patch_attn_head_out_all_pos, …_q_all_pos, …_pattern_all_pos; for a stream site
// over every row, the source's own run from that layer on). INVALID_ARGUMENT when the
// lengths differ, a layer or the rows are out of range, or the objective does not fit
// (ValidateObjective; kAttnOutProbe is refused: it reads O, which a z patch replaces); a
// pattern cell whose source row puts weight where the input's mask has none (other
// document ids) fails as that RowOverride does.
// What both sweeps (this and attribution_patching.h) start from: the checks above, then
// the input's and the source's runs, and a result with clean, source and heads set.
template <typename T>
struct SweepStart {
  Tape<T> clean, source;
  PatchSweepResult result;
};
template <typename T>
absl::StatusOr<SweepStart<T>> StartPatchSweep(const Model& model, kernels::Backend<T>& backend,
                                              const SequenceInput<T>& input,
                                              const SequenceInput<T>& source, PatchTarget target,
                                              const std::vector<int>& layers, int row_begin,
                                              int row_end, const Objective& objective);

template <typename T>
absl::StatusOr<PatchSweepResult> PatchSweep(const Model& model, kernels::Backend<T>& backend,
                                            const SequenceInput<T>& input,
                                            const SequenceInput<T>& source, PatchTarget target,
                                            const std::vector<int>& layers, int row_begin,
                                            int row_end, const Objective& objective,
                                            bool all_positions = false);

// The mean of sweeps of the same layout (one per prompt pair of a dataset): clean, source
// and every cell averaged. INVALID_ARGUMENT when there are none or their layouts differ.
absl::StatusOr<PatchSweepResult> MeanOfSweeps(const std::vector<PatchSweepResult>& sweeps);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_PATCH_SWEEP_H_

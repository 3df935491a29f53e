// Interpret service: proto → engine conversion with validation (every rejected field named
// as the client spelled it, every limit named by its server flag) and engine → proto
// encoding of dense tensors. Only messages here, no gRPC.
#ifndef KVLENS_SERVER_INTERPRET_CONVERT_H_
#define KVLENS_SERVER_INTERPRET_CONVERT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/objective.h"
#include "engine/interpret/patch_sweep.h"
#include "engine/interpret/tape.h"
#include "engine/model/model.h"
#include "kvlens/v1/interpret.pb.h"
#include "server/index_convert.h"

namespace kvlens::server {

// Per-request limits of the Interpret service (server flags; errors name the flag).
struct InterpLimits {
  int max_positions = 1024;        // --max-interp-positions: tokens of one sequence
  int64_t max_layer_heads = 4096;  // --max-interp-layer-heads: layers × heads asked for
  int64_t max_bytes = 64 << 20;    // --max-interp-bytes: bytes of one response (all chunks)
  int64_t max_tape_bytes = int64_t{8} << 30;  // --max-interp-tape-bytes: working memory
  int max_targets = 256;                      // targets, edits, lens positions per request
  int max_sweep_runs = 4096;                  // --max-interp-sweep-runs: PatchSweep's cells
  int max_verify_samples = 64;                // K of `verify`
  int max_top_k = 100;                        // LogitLens top_k
  int64_t chunk_bytes = 1 << 20;              // AttentionMaps chunks stay near this size
};

// A sequence to run on: tokens and optional document ids (same length).
struct SequenceSpec {
  std::vector<int32_t> tokens;
  std::vector<int32_t> doc_ids;
};

// Text or token ids of `input` → tokens (session ids are resolved by the caller and passed
// as `session_tokens`). Checks vocabulary, document ids and --max-interp-positions.
absl::StatusOr<SequenceSpec> ToSequence(const v1::PromptInput& input, const Model& model,
                                        const InterpLimits& limits, const std::string& field,
                                        const std::vector<int32_t>* session_tokens = nullptr);

// [begin, end) within [0, n): each bound may count from the end (ToIndex; end −1 stops
// before the last), and end 0 means n. Non-empty.
struct PositionRange {
  int begin = 0;
  int end = 0;
  int size() const { return end - begin; }
};
absl::StatusOr<PositionRange> ToRange(const v1::Range& range, int n, const std::string& field);

// Layers × heads against --max-interp-layer-heads.
absl::Status CheckLayerHeads(int64_t layers, int64_t heads, const InterpLimits& limits);
// Bytes of a response against --max-interp-bytes.
absl::Status CheckBytes(int64_t bytes, const InterpLimits& limits, const char* what);
// Working memory of a request's tapes and gradients (interpret::TapeBytes) against
// --max-interp-tape-bytes, before anything is allocated: RESOURCE_EXHAUSTED naming the flag,
// the positions and the bytes.
absl::Status CheckTapeBytes(int64_t bytes, int positions, const InterpLimits& limits,
                            const std::string& what);

// The objective of a GradientProbe request (positions are rows: prompts start at 0).
// The objectives that read the logits, as GradientProbe and PatchSweep take them: fields
// named log_prob.targets[k], logit_diff.position, … in errors.
absl::StatusOr<interpret::Objective> ToLogProbObjective(const v1::LogProbObjective& lp,
                                                        const ModelConfig& config, int n,
                                                        const InterpLimits& limits);
absl::StatusOr<interpret::Objective> ToLogitDiffObjective(const v1::LogitDiffObjective& diff,
                                                          const ModelConfig& config, int n);

absl::StatusOr<interpret::Objective> ToObjective(const v1::GradientProbeRequest& request,
                                                 const ModelConfig& config, int n,
                                                 const InterpLimits& limits);

// A patching site by name (interpret::PatchTargetByName): "" or "resid_pre", "resid_mid",
// "attn_out", "mlp_out", "resid_post" (leaving the layer: resid_pre of the next), and with
// `heads_allowed` "z" and "pattern" (per head). INVALID_ARGUMENT naming `field` and the names
// otherwise.
absl::StatusOr<interpret::PatchTarget> ToPatchTarget(const std::string& hook,
                                                     const std::string& field, bool heads_allowed);

// The (hook, layer) reads of a `hooks` list, in the order asked: a short name ("pattern")
// at every layer of `layers`, a full one ("blocks.1.attn.hook_pattern") at its own, those
// without a layer (ln_final, embed, …) at -1. INVALID_ARGUMENT naming `hooks`: an unknown
// name, a hook the model lacks, a layer out of range, a (hook, layer) asked twice.
absl::StatusOr<std::vector<std::pair<interpret::Hook, int>>> ToHookReads(
    const google::protobuf::RepeatedPtrField<std::string>& hooks, const ModelConfig& config,
    const std::vector<int>& layers);

// Ablations and attention-row overrides of an Intervene request (patches need the source
// run and are built by the caller), after checking the counts of every kind of edit.
absl::StatusOr<interpret::Edits> ToEdits(const v1::InterveneRequest& request,
                                         const ModelConfig& config, int n,
                                         const InterpLimits& limits);

absl::StatusOr<std::vector<interpret::TokenTarget>> ToTargets(
    const google::protobuf::RepeatedPtrField<v1::TokenTarget>& targets, const ModelConfig& config,
    int n, const InterpLimits& limits, const std::string& field);

// fp32 unless fp64 asked; dtype fp32 unless fp16 asked (fp64 refused for maps).
inline bool WantsFp64(v1::Precision p) { return p == v1::PRECISION_FP64; }
absl::StatusOr<v1::DType> ToWireDType(v1::DType requested, const std::string& field);

// Bytes per element of a wire dtype.
int DTypeBytes(v1::DType dtype);

// Appends `values` to `out` as little-endian `dtype` (fp16 rounds to nearest even).
template <typename T>
void AppendValues(absl::Span<const T> values, v1::DType dtype, std::string* out);

// A named tensor; `values` already in row-major order of `shape`.
template <typename T>
void AddTensor(const std::string& name, int layer, int head, std::vector<int64_t> shape,
               absl::Span<const T> values, v1::DType dtype,
               google::protobuf::RepeatedPtrField<v1::Tensor>* out);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INTERPRET_CONVERT_H_

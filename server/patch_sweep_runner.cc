// Interpret.PatchSweep: activation patching over layers × positions (engine/interpret/
// patch_sweep.h) from the request's prompts, site, layers, positions and objective.
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/attribution_patching.h"
#include "engine/interpret/patch_sweep.h"
#include "server/interpret_common.h"

namespace kvlens::server {
namespace {

template <typename T>
absl::Status SweepAt(const InterpContext& ctx, const SequenceSpec& input,
                     const SequenceSpec& source, interpret::PatchTarget target,
                     const std::vector<int>& layers, PositionRange rows,
                     const interpret::Objective& objective, bool all_positions, bool attribution,
                     v1::PatchSweepResponse* response) {
  const Model& model = ctx.model();
  const int n = static_cast<int>(input.tokens.size());
  // The clean and the source tapes, and one patched tape at a time; or with attribution,
  // the two tapes and the clean one's gradients.
  if (absl::Status s =
          CheckTapeBytes(WorkBytes<T>(model.config, n, n, attribution ? 2 : 3, attribution), n,
                         ctx.limits, "PatchSweep");
      !s.ok()) {
    return s;
  }
  kernels::Backend<T>& be = BackendOf<T>(ctx.backends);
  auto r = attribution
               ? interpret::AttributionPatchSweep(model, be, InputOf<T>(input), InputOf<T>(source),
                                                  target, layers, rows.begin, rows.end, objective,
                                                  all_positions, BackwardOpsOf<T>(ctx.backends))
               : interpret::PatchSweep(model, be, InputOf<T>(input), InputOf<T>(source), target,
                                       layers, rows.begin, rows.end, objective, all_positions);
  if (!r.ok()) return r.status();
  response->set_clean(r->clean);
  response->set_source(r->source);
  response->set_num_heads(r->heads);
  response->mutable_metric()->Assign(r->metric.begin(), r->metric.end());
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPatchSweep(const InterpContext& ctx, const v1::PatchSweepRequest& request,
                           v1::PatchSweepResponse* response) {
  const ModelConfig& c = ctx.model().config;
  auto input = Resolve(ctx, request.input(), "input", true);
  if (!input.ok()) return input.status();
  if (request.patch_source().prompt_case() == v1::PromptInput::PROMPT_NOT_SET) {
    return absl::InvalidArgumentError("patch_source: required");
  }
  auto source = Resolve(ctx, request.patch_source(), "patch_source", true);
  if (!source.ok()) return source.status();
  const int n = static_cast<int>(input->tokens.size());
  if (source->tokens.size() != input->tokens.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch_source has ", source->tokens.size(), " tokens and input ", n,
                     "; a sweep patches each position from the same position, so they must match"));
  }
  auto target = ToPatchTarget(request.hook(), "hook", true);
  if (!target.ok()) return target.status();
  auto layers = ToIndexList(request.layers(), c.num_layers, "layers");
  if (!layers.ok()) return layers.status();
  auto rows = ToRange(request.positions(), n, "positions");
  if (!rows.ok()) return rows.status();
  absl::StatusOr<interpret::Objective> objective;
  switch (request.objective_case()) {
    case v1::PatchSweepRequest::kLogProb:
      objective = ToLogProbObjective(request.log_prob(), c, n, ctx.limits);
      break;
    case v1::PatchSweepRequest::kLogitDiff:
      objective = ToLogitDiffObjective(request.logit_diff(), c, n);
      break;
    case v1::PatchSweepRequest::OBJECTIVE_NOT_SET:
      return absl::InvalidArgumentError("objective: set one of log_prob, logit_diff");
  }
  if (!objective.ok()) return objective.status();
  const bool all = request.all_positions();
  const int64_t runs =
      static_cast<int64_t>(layers->size()) * target->Heads(c) * (all ? 1 : rows->size());
  if (runs > ctx.limits.max_sweep_runs && !request.attribution()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sweep has ", runs, " cells (layers", target->per_head() ? " × heads" : "",
        all ? "" : " × positions", "), more than --max-interp-sweep-runs = ",
        ctx.limits.max_sweep_runs, "; ask for fewer layers", all ? "" : " or positions"));
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  response->mutable_layers()->Assign(layers->begin(), layers->end());
  response->mutable_positions()->set_begin(rows->begin);
  response->mutable_positions()->set_end(rows->end);
  response->mutable_token_ids()->Assign(input->tokens.begin(), input->tokens.end());
  response->mutable_source_token_ids()->Assign(source->tokens.begin(), source->tokens.end());
  const bool atp = request.attribution();
  return fp64 ? SweepAt<double>(ctx, *input, *source, *target, *layers, *rows, *objective, all, atp,
                                response)
              : SweepAt<float>(ctx, *input, *source, *target, *layers, *rows, *objective, all, atp,
                               response);
}

}  // namespace kvlens::server

// Interpret.PatchSweep: activation patching over layers × positions (engine/interpret/
// patch_sweep.h) from the request's prompt pairs, site, layers, positions and objectives;
// with more than one pair, the mean of their sweeps (and with per_pair, each pair's own).
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/interpret/attribution_patching.h"
#include "engine/interpret/patch_sweep.h"
#include "server/interpret_common.h"

namespace kvlens::server {
namespace {

// One prompt pair and its objective, resolved.
struct SweepPair {
  SequenceSpec input, source;
  interpret::Objective objective;
};

// The pair of `msg` (the request itself, or one of its more_pairs), its fields named under
// `prefix` ("" or "more_pairs[k]."); input and source of `length` tokens when length ≥ 0.
template <typename Msg>
absl::StatusOr<SweepPair> ToSweepPair(const InterpContext& ctx, const Msg& msg,
                                      const std::string& prefix, int length) {
  const ModelConfig& c = ctx.model().config;
  auto input = Resolve(ctx, msg.input(), prefix + "input", true);
  if (!input.ok()) return input.status();
  if (msg.patch_source().prompt_case() == v1::PromptInput::PROMPT_NOT_SET) {
    return absl::InvalidArgumentError(prefix + "patch_source: required");
  }
  auto source = Resolve(ctx, msg.patch_source(), prefix + "patch_source", true);
  if (!source.ok()) return source.status();
  const int n = static_cast<int>(input->tokens.size());
  if (source->tokens.size() != input->tokens.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        prefix, "patch_source has ", source->tokens.size(), " tokens and ", prefix, "input ", n,
        "; a sweep patches each position from the same position, so they must match"));
  }
  if (length >= 0 && n != length) {
    return absl::InvalidArgumentError(
        absl::StrCat(prefix, "input has ", n, " tokens and the first pair's input ", length,
                     "; every pair's cells share the positions, so they must match"));
  }
  absl::StatusOr<interpret::Objective> objective;
  if (msg.has_log_prob()) {
    objective = ToLogProbObjective(msg.log_prob(), c, n, ctx.limits);
  } else if (msg.has_logit_diff()) {
    objective = ToLogitDiffObjective(msg.logit_diff(), c, n);
  } else {
    return absl::InvalidArgumentError(prefix + "objective: set one of log_prob, logit_diff");
  }
  if (!objective.ok()) {
    return absl::Status(objective.status().code(),
                        absl::StrCat(prefix, objective.status().message()));
  }
  return SweepPair{*std::move(input), *std::move(source), *std::move(objective)};
}

template <typename T>
absl::Status SweepAt(const InterpContext& ctx, const std::vector<SweepPair>& pairs,
                     interpret::PatchTarget target, const std::vector<int>& layers,
                     PositionRange rows, bool all_positions, bool attribution, bool qk_fix,
                     bool per_pair, v1::PatchSweepResponse* response) {
  const Model& model = ctx.model();
  const int n = static_cast<int>(pairs.front().input.tokens.size());
  // The clean and the source tapes, and one patched tape at a time; or with attribution,
  // the two tapes and the clean one's gradients (one pair at a time).
  if (absl::Status s =
          CheckTapeBytes(WorkBytes<T>(model.config, n, n, attribution ? 2 : 3, attribution), n,
                         ctx.limits, "PatchSweep");
      !s.ok()) {
    return s;
  }
  kernels::Backend<T>& be = BackendOf<T>(ctx.backends);
  std::vector<interpret::PatchSweepResult> sweeps;
  for (const SweepPair& p : pairs) {
    auto r =
        attribution
            ? interpret::AttributionPatchSweep(
                  model, be, InputOf<T>(p.input), InputOf<T>(p.source), target, layers, rows.begin,
                  rows.end, p.objective, all_positions, BackwardOpsOf<T>(ctx.backends), qk_fix)
            : interpret::PatchSweep(model, be, InputOf<T>(p.input), InputOf<T>(p.source), target,
                                    layers, rows.begin, rows.end, p.objective, all_positions);
    if (!r.ok()) return r.status();
    sweeps.push_back(*std::move(r));
  }
  auto mean = interpret::MeanOfSweeps(sweeps);
  if (!mean.ok()) return mean.status();
  response->set_clean(mean->clean);
  response->set_source(mean->source);
  response->set_num_heads(mean->heads);
  response->mutable_metric()->Assign(mean->metric.begin(), mean->metric.end());
  if (per_pair) {
    for (const interpret::PatchSweepResult& s : sweeps) {
      v1::PatchSweepPairResult* out = response->add_pairs();
      out->set_clean(s.clean);
      out->set_source(s.source);
      out->mutable_metric()->Assign(s.metric.begin(), s.metric.end());
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunPatchSweep(const InterpContext& ctx, const v1::PatchSweepRequest& request,
                           v1::PatchSweepResponse* response) {
  const ModelConfig& c = ctx.model().config;
  if (request.more_pairs_size() + 1 > ctx.limits.max_targets) {
    return absl::InvalidArgumentError(absl::StrCat("more_pairs has ", request.more_pairs_size(),
                                                   " entries, more than the server allows (",
                                                   ctx.limits.max_targets - 1, ")"));
  }
  std::vector<SweepPair> pairs;
  auto first = ToSweepPair(ctx, request, "", -1);
  if (!first.ok()) return first.status();
  pairs.push_back(*std::move(first));
  const int n = static_cast<int>(pairs.front().input.tokens.size());
  for (int k = 0; k < request.more_pairs_size(); ++k) {
    auto pair = ToSweepPair(ctx, request.more_pairs(k), absl::StrCat("more_pairs[", k, "]."), n);
    if (!pair.ok()) return pair.status();
    pairs.push_back(*std::move(pair));
  }
  auto target = ToPatchTarget(request.hook(), "hook", true);
  if (!target.ok()) return target.status();
  if (request.qk_fix() && !(request.attribution() && target->query_or_key())) {
    return absl::InvalidArgumentError(
        absl::StrCat("qk_fix: only with attribution and hook q or k (hook = \"", request.hook(),
                     "\"", request.attribution() ? "" : ", attribution unset", ")"));
  }
  auto layers = ToIndexList(request.layers(), c.num_layers, "layers");
  if (!layers.ok()) return layers.status();
  auto rows = ToRange(request.positions(), n, "positions");
  if (!rows.ok()) return rows.status();
  const bool all = request.all_positions();
  const int64_t cells =
      static_cast<int64_t>(layers->size()) * target->Heads(c) * (all ? 1 : rows->size());
  const int64_t runs = cells * static_cast<int64_t>(pairs.size());
  if (runs > ctx.limits.max_sweep_runs && !request.attribution()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the sweep has ", runs, " cells (layers", target->per_head() ? " × heads" : "",
        all ? "" : " × positions", pairs.size() > 1 ? " × pairs" : "",
        "), more than --max-interp-sweep-runs = ", ctx.limits.max_sweep_runs,
        "; ask for fewer layers", all ? "" : " or positions", pairs.size() > 1 ? " or pairs" : ""));
  }
  // The grids come back as doubles: the mean's, and with per_pair each pair's as well.
  const int64_t grids = 1 + (request.per_pair() ? static_cast<int64_t>(pairs.size()) : 0);
  if (const int64_t bytes = cells * grids * 8; bytes > ctx.limits.max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "PatchSweep would return ", bytes, " bytes of metric (", cells, " cells × ", grids,
        request.per_pair() ? " grids: the mean and each pair's" : " grid",
        "), more than --max-interp-bytes = ", ctx.limits.max_bytes, "; ask for fewer layers",
        all ? "" : " or positions", request.per_pair() ? ", or without per_pair" : ""));
  }
  const bool fp64 = WantsFp64(request.precision());
  response->set_precision(PrecisionOf(fp64));
  response->mutable_layers()->Assign(layers->begin(), layers->end());
  response->mutable_positions()->set_begin(rows->begin);
  response->mutable_positions()->set_end(rows->end);
  const SweepPair& p0 = pairs.front();
  response->mutable_token_ids()->Assign(p0.input.tokens.begin(), p0.input.tokens.end());
  response->mutable_source_token_ids()->Assign(p0.source.tokens.begin(), p0.source.tokens.end());
  response->set_num_pairs(static_cast<int>(pairs.size()));
  const bool atp = request.attribution(), qk = request.qk_fix(), per = request.per_pair();
  return fp64 ? SweepAt<double>(ctx, pairs, *target, *layers, *rows, all, atp, qk, per, response)
              : SweepAt<float>(ctx, pairs, *target, *layers, *rows, all, atp, qk, per, response);
}

}  // namespace kvlens::server

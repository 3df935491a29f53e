#include "engine/interpret/patch_sweep.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/interpret/interventions.h"

namespace kvlens::interpret {

std::optional<PatchTarget> PatchTargetByName(std::string_view hook) {
  using Kind = PatchTarget::Kind;
  if (hook.empty() || hook == "resid_pre") return PatchTarget{};
  if (hook == "resid_post") return PatchTarget{Kind::kStream, PatchSite::kResidPre, true};
  for (TensorKind t : {TensorKind::kQ, TensorKind::kK, TensorKind::kV}) {
    if (hook == TensorKindName(t)) return PatchTarget{Kind::kHeadVector, {}, false, t};
  }
  if (hook == "z") return PatchTarget{Kind::kHeadVector};
  if (hook == "pattern") return PatchTarget{Kind::kHeadPattern};
  for (PatchSite site : {PatchSite::kResidMid, PatchSite::kAttnOut, PatchSite::kMlpOut}) {
    if (hook == PatchSiteName(site)) return PatchTarget{Kind::kStream, site, false};
  }
  return std::nullopt;
}

std::string_view PatchTargetNames() {
  return "resid_pre, resid_mid, resid_post, attn_out, mlp_out, q, k, v, z, pattern";
}

int PatchTarget::Heads(const ModelConfig& c) const {
  if (!per_head()) return 1;
  return per_kv_head() ? c.num_kv_heads : c.num_heads;
}

namespace {

absl::Status ValidatePatchSweep(const ModelConfig& c, int n, int source_n,
                                const std::vector<int>& layers, int row_begin, int row_end,
                                const Objective& objective) {
  if (source_n != n) {
    return absl::InvalidArgumentError(absl::StrCat("patch sweep: the source has ", source_n,
                                                   " tokens and the input ", n,
                                                   "; each row is patched from the same row"));
  }
  if (row_begin < 0 || row_end > n || row_begin >= row_end) {
    return absl::InvalidArgumentError(absl::StrCat("patch sweep: rows [", row_begin, ", ", row_end,
                                                   ") are not a range within [0, ", n, ")"));
  }
  for (int l : layers) {
    if (l < 0 || l >= c.num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("patch sweep: layer ", l, " is outside [0, ", c.num_layers, ")"));
    }
  }
  if (objective.kind == Objective::Kind::kAttnOutProbe) {
    return absl::InvalidArgumentError(
        "patch sweep: the objective must read the logits (log_prob or logit_diff)");
  }
  return ValidateObjective(objective, c, n);
}

}  // namespace

template <typename T>
absl::StatusOr<SweepStart<T>> StartPatchSweep(const Model& model, kernels::Backend<T>& be,
                                              const SequenceInput<T>& input,
                                              const SequenceInput<T>& source, PatchTarget target,
                                              const std::vector<int>& layers, int row_begin,
                                              int row_end, const Objective& objective) {
  const ModelConfig& c = model.config;
  if (absl::Status s = ValidatePatchSweep(c, static_cast<int>(input.tokens.size()),
                                          static_cast<int>(source.tokens.size()), layers, row_begin,
                                          row_end, objective);
      !s.ok()) {
    return s;
  }
  auto clean = RunForward(model, be, input);
  if (!clean.ok()) return clean.status();
  auto src = RunForward(model, be, source);
  if (!src.ok()) return src.status();
  SweepStart<T> start{*std::move(clean), *std::move(src), {}};
  start.result.clean = EvaluateObjective(objective, c, start.clean);
  start.result.source = EvaluateObjective(objective, c, start.source);
  start.result.heads = target.Heads(c);
  return start;
}

template <typename T>
absl::StatusOr<PatchSweepResult> PatchSweep(const Model& model, kernels::Backend<T>& be,
                                            const SequenceInput<T>& input,
                                            const SequenceInput<T>& source, PatchTarget target,
                                            const std::vector<int>& layers, int row_begin,
                                            int row_end, const Objective& objective,
                                            bool all_positions) {
  const ModelConfig& c = model.config;
  auto start =
      StartPatchSweep(model, be, input, source, target, layers, row_begin, row_end, objective);
  if (!start.ok()) return start.status();
  const Tape<T>* clean = &start->clean;
  const Tape<T>* src = &start->source;
  PatchSweepResult& r = start->result;
  // The layer a patch of layer l acts in (resid_post: the next): everything before it is
  // the clean run's.
  auto first_layer = [&](int l) { return l + (target.next_layer ? 1 : 0); };
  // One row's patch of head h in layer l into `e`.
  auto add_patch = [&](Edits& e, int l, int h, int row) -> absl::Status {
    if (target.kind == PatchTarget::Kind::kHeadVector) {
      auto p = HeadPatchFrom(*src, c, l, h, row, row, target.tensor);
      if (!p.ok()) return p.status();
      e.head_patches.push_back(*std::move(p));
    } else if (target.kind == PatchTarget::Kind::kHeadPattern) {
      const int64_t tk = src->num_keys;
      const T* probs = src->layers[l].probs.data() + (int64_t{h} * src->n + row) * tk;
      e.row_overrides.push_back({l, h, row, std::vector<double>(probs, probs + tk), {}});
    } else {
      auto p = PatchFrom(*src, c, first_layer(l), row, row, target.site);
      if (!p.ok()) return p.status();
      e.patches.push_back(*std::move(p));
    }
    return absl::OkStatus();
  };
  const int cells_per_head = all_positions ? 1 : row_end - row_begin;
  r.metric.reserve(layers.size() * r.heads * cells_per_head);
  for (int l : layers) {
    for (int h = 0; h < r.heads; ++h) {
      for (int cell = 0; cell < cells_per_head; ++cell) {
        Edits e;
        const int lo = row_begin + cell, hi = all_positions ? row_end : lo + 1;
        for (int row = lo; row < hi; ++row) {
          if (absl::Status s = add_patch(e, l, h, row); !s.ok()) return s;
        }
        // (only the logits are read: the clean layers are not copied)
        auto t = RunForwardFrom(model, be, *clean, first_layer(l), e, /*copy_skipped=*/false);
        if (!t.ok()) return t.status();
        r.metric.push_back(EvaluateObjective(objective, c, *t));
      }
    }
  }
  return std::move(r);
}

absl::StatusOr<PatchSweepResult> MeanOfSweeps(const std::vector<PatchSweepResult>& sweeps) {
  if (sweeps.empty()) return absl::InvalidArgumentError("mean of sweeps: none given");
  PatchSweepResult mean = sweeps.front();
  for (size_t k = 1; k < sweeps.size(); ++k) {
    const PatchSweepResult& s = sweeps[k];
    if (s.heads != mean.heads || s.metric.size() != mean.metric.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("mean of sweeps: sweep ", k, " has ", s.metric.size(), " cells of ", s.heads,
                       " head(s), the first ", mean.metric.size(), " of ", mean.heads));
    }
    mean.clean += s.clean;
    mean.source += s.source;
    for (size_t e = 0; e < s.metric.size(); ++e) mean.metric[e] += s.metric[e];
  }
  const double count = static_cast<double>(sweeps.size());
  mean.clean /= count;
  mean.source /= count;
  for (double& m : mean.metric) m /= count;
  return mean;
}

#define KVLENS_INSTANTIATE_PATCH_SWEEP(T)                                                   \
  template absl::StatusOr<SweepStart<T>> StartPatchSweep<T>(                                \
      const Model&, kernels::Backend<T>&, const SequenceInput<T>&, const SequenceInput<T>&, \
      PatchTarget, const std::vector<int>&, int, int, const Objective&);                    \
  template absl::StatusOr<PatchSweepResult> PatchSweep<T>(                                  \
      const Model&, kernels::Backend<T>&, const SequenceInput<T>&, const SequenceInput<T>&, \
      PatchTarget, const std::vector<int>&, int, int, const Objective&, bool);

KVLENS_INSTANTIATE_PATCH_SWEEP(float)
KVLENS_INSTANTIATE_PATCH_SWEEP(double)
#undef KVLENS_INSTANTIATE_PATCH_SWEEP

}  // namespace kvlens::interpret

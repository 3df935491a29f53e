#include "engine/interpret/attribution_patching.h"

#include <cstdint>
#include <utility>

namespace kvlens::interpret {
namespace {

// The values a cell of `target` patches at (layer l, head h, row): `len` entries from
// `at` in `act` (a tape's tensor) and in `grad` (the same tensor's gradient, same layout).
template <typename T>
struct CellSpan {
  const std::vector<T>* act = nullptr;
  const std::vector<T>* grad = nullptr;
  int64_t at = 0;
  int64_t len = 0;
};

template <typename T>
CellSpan<T> SpanOf(const ModelConfig& c, const PatchTarget& target, const Tape<T>& t,
                   const Gradients<T>& g, int l, int h, int row) {
  const int64_t dh = c.head_dim, D = c.dim;
  if (target.kind == PatchTarget::Kind::kHeadPattern) {
    return {&t.layers[l].probs, &g.probs[l], (int64_t{h} * t.n + row) * t.num_keys, t.num_keys};
  }
  if (target.kind == PatchTarget::Kind::kHeadVector) {
    const TensorKind kind = target.tensor;
    const std::vector<T>& grad = kind == TensorKind::kQ   ? g.q[l]
                                 : kind == TensorKind::kK ? g.k[l]
                                 : kind == TensorKind::kV ? g.v[l]
                                                          : g.attn_out[l];
    return {&HeadTensor(t.layers[l], kind), &grad, HeadVectorAt(c, kind, t.input.offset, row, h),
            dh};
  }
  const int64_t at = int64_t{row} * D;
  switch (target.site) {
    case PatchSite::kResidMid:
      return {&t.layers[l].h, &g.resid_mid[l], at, D};
    case PatchSite::kAttnOut:  // h = x + attn_out: its gradient is resid_mid's
      return {&t.layers[l].attn_delta, &g.resid_mid[l], at, D};
    case PatchSite::kMlpOut:  // x_{l+1} = h + mlp_out
      return {&t.layers[l].ffn_delta, &g.residual[l + 1], at, D};
    case PatchSite::kResidPre:
      break;
  }
  const int s = l + (target.next_layer ? 1 : 0);  // resid_post: resid_pre of l + 1
  return {s < c.num_layers ? &t.layers[s].x : &t.x_final, &g.residual[s], at, D};
}

}  // namespace

template <typename T>
absl::StatusOr<PatchSweepResult> AttributionPatchSweep(
    const Model& model, kernels::Backend<T>& be, const SequenceInput<T>& input,
    const SequenceInput<T>& source, PatchTarget target, const std::vector<int>& layers,
    int row_begin, int row_end, const Objective& objective, bool all_positions,
    kernels::BackwardOps<T>* ops) {
  const ModelConfig& c = model.config;
  auto start =
      StartPatchSweep(model, be, input, source, target, layers, row_begin, row_end, objective);
  if (!start.ok()) return start.status();
  const Tape<T>* clean = &start->clean;
  const Tape<T>* src = &start->source;
  auto g = ObjectiveGradients(model, *clean, objective, {}, ops);
  if (!g.ok()) return g.status();
  PatchSweepResult& r = start->result;
  const int cells_per_head = all_positions ? 1 : row_end - row_begin;
  r.metric.reserve(layers.size() * r.heads * cells_per_head);
  for (int l : layers) {
    for (int h = 0; h < r.heads; ++h) {
      for (int cell = 0; cell < cells_per_head; ++cell) {
        double estimate = r.clean;
        const int lo = row_begin + cell, hi = all_positions ? row_end : lo + 1;
        for (int row = lo; row < hi; ++row) {
          const CellSpan<T> at = SpanOf(c, target, *clean, *g, l, h, row);
          const CellSpan<T> from = SpanOf(c, target, *src, *g, l, h, row);
          for (int64_t d = 0; d < at.len; ++d) {
            estimate += (static_cast<double>((*from.act)[from.at + d]) -
                         static_cast<double>((*at.act)[at.at + d])) *
                        static_cast<double>((*at.grad)[at.at + d]);
          }
        }
        r.metric.push_back(estimate);
      }
    }
  }
  return std::move(r);
}

#define KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING(T)                                          \
  template absl::StatusOr<PatchSweepResult> AttributionPatchSweep<T>(                       \
      const Model&, kernels::Backend<T>&, const SequenceInput<T>&, const SequenceInput<T>&, \
      PatchTarget, const std::vector<int>&, int, int, const Objective&, bool,               \
      kernels::BackwardOps<T>*);

KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING(float)
KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING(double)
#undef KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING

}  // namespace kvlens::interpret

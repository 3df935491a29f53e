#include "engine/interpret/attribution_patching.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
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

// AtP*'s QK fix for a q or k cell of layer l (query head `head` for q, KV head for k) over
// rows [lo, hi): every attention row the patch reaches recomputed exactly, by the forward's
// scores (scale, soft cap) and softmax over the keys it sees, with the source's q (or k) in
// place of the clean run's, and only what follows the pattern taken to first order:
// Σ (A′ − A) · ∂objective/∂A over those rows.
template <typename T>
double QkFixedDelta(const ModelConfig& c, const Tape<T>& clean, const Tape<T>& src,
                    const Gradients<T>& g, TensorKind kind, int l, int head, int lo, int hi) {
  const LayerTape<T>& lt = clean.layers[l];
  const int n = clean.n, tk = clean.num_keys, dh = c.head_dim;
  const int group = c.num_heads / c.num_kv_heads, window = c.WindowOf(l);
  const double scale = c.AttentionScale(), cap = c.attention_softcap;
  const std::vector<T>& q = HeadTensor(lt, TensorKind::kQ);
  auto score = [&](const T* qv, const T* kv) {
    double dot = 0.0;
    for (int e = 0; e < dh; ++e) dot += static_cast<double>(qv[e]) * static_cast<double>(kv[e]);
    dot *= scale;
    return cap > 0.0 ? cap * std::tanh(dot / cap) : dot;
  };
  auto key_of = [&](const Tape<T>& t, int j, int kv_head) {
    return HeadTensor(t.layers[l], TensorKind::kK).data() +
           HeadVectorAt(c, TensorKind::kK, 0, j, kv_head);
  };
  // key j's score in query head h's row i, with the source's q or k where the cell patches
  auto patched = [&](int h, int i, int j) {
    if (kind == TensorKind::kQ) {
      return score(HeadTensor(src.layers[l], TensorKind::kQ).data() +
                       HeadVectorAt(c, TensorKind::kQ, src.input.offset, i, h),
                   key_of(clean, j, h / group));
    }
    const int row = j - clean.input.offset;
    if (row < lo || row >= hi) return static_cast<double>(lt.scores[(int64_t{h} * n + i) * tk + j]);
    return score(q.data() + HeadVectorAt(c, TensorKind::kQ, clean.input.offset, i, h),
                 key_of(src, src.input.offset + row, h / group));
  };
  std::vector<double> s(static_cast<size_t>(tk));
  double delta = 0.0;
  // one query row recomputed
  auto row_delta = [&](int h, int i) {
    double max_s = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < tk; ++j) {
      s[j] = KeyVisible(clean.input, i, j, window) ? patched(h, i, j)
                                                   : -std::numeric_limits<double>::infinity();
      max_s = std::max(max_s, s[j]);
    }
    double z = 0.0;
    for (int j = 0; j < tk; ++j) {
      s[j] = std::isinf(s[j]) ? 0.0 : std::exp(s[j] - max_s);
      z += s[j];
    }
    const int64_t at = (int64_t{h} * n + i) * tk;
    for (int j = 0; j < tk; ++j) {
      delta += (s[j] / z - static_cast<double>(lt.probs[at + j])) *
               static_cast<double>(g.probs[l][at + j]);
    }
  };
  if (kind == TensorKind::kQ) {
    for (int i = lo; i < hi; ++i) row_delta(head, i);  // a query reaches its own row
    return delta;
  }
  for (int h = head * group; h < (head + 1) * group; ++h) {  // a key: every row that sees it
    for (int i = 0; i < n; ++i) {
      bool reached = false;
      for (int row = lo; row < hi && !reached; ++row) {
        reached = KeyVisible(clean.input, i, clean.input.offset + row, window);
      }
      if (reached) row_delta(h, i);
    }
  }
  return delta;
}

}  // namespace

template <typename T>
absl::StatusOr<PatchSweepResult> AttributionPatchSweep(
    const Model& model, kernels::Backend<T>& be, const SequenceInput<T>& input,
    const SequenceInput<T>& source, PatchTarget target, const std::vector<int>& layers,
    int row_begin, int row_end, const Objective& objective, bool all_positions,
    kernels::BackwardOps<T>* ops, bool qk_fix) {
  const ModelConfig& c = model.config;
  const bool q_or_k = target.kind == PatchTarget::Kind::kHeadVector &&
                      (target.tensor == TensorKind::kQ || target.tensor == TensorKind::kK);
  if (qk_fix && !q_or_k) {
    return absl::InvalidArgumentError(
        "qk_fix: only for a q or k sweep (the other sites do not reach a softmax's input)");
  }
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
        if (qk_fix) {
          r.metric.push_back(estimate +
                             QkFixedDelta(c, *clean, *src, *g, target.tensor, l, h, lo, hi));
          continue;
        }
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
      kernels::BackwardOps<T>*, bool);

KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING(float)
KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING(double)
#undef KVLENS_INSTANTIATE_ATTRIBUTION_PATCHING

}  // namespace kvlens::interpret

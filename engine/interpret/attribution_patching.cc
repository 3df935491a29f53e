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

// Per (query head, row) of one layer, over the keys the row sees: the largest clean score m,
// z = Σ exp(s − m) and num = Σ exp(s − m) · ∂objective/∂A, so that num / z = Σ A · ∂J/∂A.
// A k cell changes a few scores of a row; these turn its new Σ A′ · ∂J/∂A into O(1) work
// a changed score instead of the row's softmax again.
struct RowSums {
  std::vector<double> max, z, num;  // [H, n]
};

template <typename T>
RowSums RowSumsOf(const ModelConfig& c, const Tape<T>& clean, const Gradients<T>& g, int l) {
  const int n = clean.n, tk = clean.num_keys, H = c.num_heads;
  const std::vector<T>& scores = clean.layers[l].scores;
  RowSums r;
  for (auto* v : {&r.max, &r.z, &r.num}) v->assign(static_cast<size_t>(H) * n, 0.0);
  for (int64_t hi = 0; hi < int64_t{H} * n; ++hi) {
    const T* s = scores.data() + hi * tk;
    const T* grad = g.probs[l].data() + hi * tk;
    double m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < tk; ++j) m = std::max(m, static_cast<double>(s[j]));  // masked: −∞
    double z = 0.0, num = 0.0;
    for (int j = 0; j < tk; ++j) {
      if (std::isinf(static_cast<double>(s[j]))) continue;
      const double e = std::exp(static_cast<double>(s[j]) - m);
      z += e;
      num += e * static_cast<double>(grad[j]);
    }
    r.max[hi] = m;
    r.z[hi] = z;
    r.num[hi] = num;
  }
  return r;
}

// AtP*'s QK fix for a q or k cell of layer l (query head `head` for q, KV head for k) over
// rows [lo, hi): every attention row the patch reaches recomputed exactly, by the forward's
// scores (scale, soft cap) and softmax over the keys it sees, with the source's q (or k) in
// place of the clean run's, and only what follows the pattern taken to first order:
// Σ (A′ − A) · ∂objective/∂A over those rows. `sums`: layer l's RowSums (k cells).
template <typename T>
double QkFixedDelta(const ModelConfig& c, const Tape<T>& clean, const Tape<T>& src,
                    const Gradients<T>& g, const RowSums* sums, TensorKind kind, int l, int head,
                    int lo, int hi) {
  const LayerTape<T>& lt = clean.layers[l];
  const int n = clean.n, tk = clean.num_keys, dh = c.head_dim, offset = clean.input.offset;
  const int group = c.num_heads / c.num_kv_heads, window = c.WindowOf(l);
  const double scale = c.AttentionScale(), cap = c.attention_softcap;
  auto score = [&](const T* qv, const T* kv) {
    double dot = 0.0;
    for (int e = 0; e < dh; ++e) dot += static_cast<double>(qv[e]) * static_cast<double>(kv[e]);
    dot *= scale;
    return cap > 0.0 ? cap * std::tanh(dot / cap) : dot;
  };
  auto vector_of = [&](const Tape<T>& t, TensorKind k, int row, int h) {
    return HeadTensor(t.layers[l], k).data() + HeadVectorAt(c, k, t.input.offset, row, h);
  };
  double delta = 0.0;
  if (kind == TensorKind::kQ) {
    // a query reaches its own row: the row's softmax again with the source's query
    std::vector<double> p(static_cast<size_t>(tk));
    const T* keys = HeadTensor(lt, TensorKind::kK).data();
    for (int i = lo; i < hi; ++i) {
      const T* q = vector_of(src, TensorKind::kQ, i, head);
      double max_s = -std::numeric_limits<double>::infinity();
      for (int j = 0; j < tk; ++j) {
        p[j] = KeyVisible(clean.input, i, j, window)
                   ? score(q, keys + HeadVectorAt(c, TensorKind::kK, 0, j, head / group))
                   : -std::numeric_limits<double>::infinity();
        max_s = std::max(max_s, p[j]);
      }
      double z = 0.0;
      for (int j = 0; j < tk; ++j) {
        p[j] = std::isinf(p[j]) ? 0.0 : std::exp(p[j] - max_s);
        z += p[j];
      }
      const int64_t at = (int64_t{head} * n + i) * tk;
      for (int j = 0; j < tk; ++j) {
        delta += (p[j] / z - static_cast<double>(lt.probs[at + j])) *
                 static_cast<double>(g.probs[l][at + j]);
      }
    }
    return delta;
  }
  // A key: every row that sees it, in each query head of its group. Only the patched keys'
  // scores change, so with the row's clean sums (m, z, num) the new softmax's
  // Σ A′ · ∂J/∂A is (num − Σ_J e_j G_j + Σ_J e′_j G_j) / (z − Σ_J e_j + Σ_J e′_j), e the
  // clean and e′ the new exp(score − m), rescaled to the new largest score.
  std::vector<std::pair<double, double>> added;  // (new score, ∂J/∂A) of the patched keys
  for (int h = head * group; h < (head + 1) * group; ++h) {
    for (int i = 0; i < n; ++i) {
      const int64_t hrow = int64_t{h} * n + i, at = hrow * tk;
      const double m = sums->max[hrow];
      double gone_z = 0.0, gone_num = 0.0, m_new = m;
      bool reached = false;
      added.clear();
      for (int row = lo; row < hi; ++row) {
        const int j = offset + row;
        if (!KeyVisible(clean.input, i, j, window)) continue;
        reached = true;
        const double e = std::exp(static_cast<double>(lt.scores[at + j]) - m);
        const double grad = static_cast<double>(g.probs[l][at + j]);
        gone_z += e;
        gone_num += e * grad;
        const double s_new = score(vector_of(clean, TensorKind::kQ, i, h),
                                   vector_of(src, TensorKind::kK, row, head));
        m_new = std::max(m_new, s_new);
        added.push_back({s_new, grad});
      }
      if (!reached) continue;
      const double shrink = std::exp(m - m_new);
      double z = (sums->z[hrow] - gone_z) * shrink, num = (sums->num[hrow] - gone_num) * shrink;
      for (const auto& [s_new, grad] : added) {
        const double e = std::exp(s_new - m_new);
        z += e;
        num += e * grad;
      }
      delta += num / z - sums->num[hrow] / sums->z[hrow];
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
  if (qk_fix && !target.query_or_key()) {
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
  const bool sums_needed = qk_fix && target.tensor == TensorKind::kK;
  for (int l : layers) {
    const RowSums sums = sums_needed ? RowSumsOf(c, *clean, *g, l) : RowSums{};
    for (int h = 0; h < r.heads; ++h) {
      for (int cell = 0; cell < cells_per_head; ++cell) {
        double estimate = r.clean;
        const int lo = row_begin + cell, hi = all_positions ? row_end : lo + 1;
        if (qk_fix) {
          r.metric.push_back(estimate +
                             QkFixedDelta(c, *clean, *src, *g, &sums, target.tensor, l, h, lo, hi));
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

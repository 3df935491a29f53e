#include "engine/interpret/finite_difference.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>

#include "kernels/cpu/reference_backend.h"

namespace kvlens::interpret {
namespace {

// A uniformly random entry of `kind` (visible entries only for scores and probabilities).
Coord RandomCoord(const ModelConfig& c, const SequenceInput<double>& in, TensorKind kind,
                  std::mt19937_64& rng) {
  const int n = static_cast<int>(in.tokens.size()), tk = in.offset + n;
  auto pick = [&](int hi) { return static_cast<int>(rng() % static_cast<uint64_t>(hi)); };
  Coord at;
  at.kind = kind;
  at.layer = pick(kind == TensorKind::kResidual ? c.num_layers + 1 : c.num_layers);
  switch (kind) {
    case TensorKind::kScores:
    case TensorKind::kProbs: {
      at.head = pick(c.num_heads);
      at.row = pick(n);
      std::vector<int> visible;
      for (int j = 0; j < tk; ++j) {
        if (KeyVisible(in, at.row, j, c.WindowOf(at.layer))) visible.push_back(j);
      }
      at.col = visible[pick(static_cast<int>(visible.size()))];
      break;
    }
    case TensorKind::kQ:
    case TensorKind::kAttnOut:
      at.row = pick(n);
      at.head = pick(c.num_heads);
      at.col = pick(c.head_dim);
      break;
    case TensorKind::kK:
    case TensorKind::kV:
      at.row = pick(tk);
      at.head = pick(c.num_kv_heads);
      at.col = pick(c.head_dim);
      break;
    case TensorKind::kResidual:
      at.row = pick(n);
      at.col = pick(c.dim);
      break;
  }
  return at;
}

template <typename G>
double TensorScale(const Gradients<G>& g, TensorKind kind) {
  const std::vector<std::vector<G>>* t = nullptr;
  switch (kind) {
    case TensorKind::kScores:
      t = &g.scores;
      break;
    case TensorKind::kProbs:
      t = &g.probs;
      break;
    case TensorKind::kQ:
      t = &g.q;
      break;
    case TensorKind::kK:
      t = &g.k;
      break;
    case TensorKind::kV:
      t = &g.v;
      break;
    case TensorKind::kAttnOut:
      t = &g.attn_out;
      break;
    case TensorKind::kResidual:
      t = &g.residual;
      break;
  }
  double m = 0.0;
  for (const auto& layer : *t) {
    for (G v : layer) m = std::max(m, std::abs(static_cast<double>(v)));
  }
  return m;
}

}  // namespace

std::vector<std::pair<Coord, double>> RopeDirection(const Model& model,
                                                    const SequenceInput<double>& in,
                                                    kernels::Backend<double>& be, const Coord& at) {
  const ModelConfig& c = model.config;
  if (c.arch != Architecture::kLlama) return {{at, 1.0}};
  std::vector<double> u(c.head_dim, 0.0);
  u[at.col] = 1.0;
  const int32_t position = at.kind == TensorKind::kQ ? in.offset + at.row : at.row;
  be.Rope(u.data(), 1, c.head_dim, 1, c.head_dim, &position, RopeOf(c, model.weights, at.layer));
  std::vector<std::pair<Coord, double>> dir;
  for (int d = 0; d < c.head_dim; ++d) {
    if (u[d] == 0.0) continue;
    Coord e = at;
    e.col = d;
    dir.emplace_back(e, u[d]);
  }
  return dir;
}

absl::StatusOr<Stencil> CentredDifference(
    const FdOptions& options, const std::function<absl::StatusOr<double>(double)>& j_at) {
  if (options.order != 2 && options.order != 4) {
    return absl::InvalidArgumentError("finite differences: order must be 2 or 4");
  }
  auto p1 = j_at(1), m1 = j_at(-1);
  if (!p1.ok()) return p1.status();
  if (!m1.ok()) return m1.status();
  Stencil st;
  st.j_max = std::max(std::abs(*p1), std::abs(*m1));
  if (options.order == 4) {
    auto p2 = j_at(2), m2 = j_at(-2);
    if (!p2.ok()) return p2.status();
    if (!m2.ok()) return m2.status();
    st.fd = (-*p2 + 8 * *p1 - 8 * *m1 + *m2) / (12 * options.step);
    st.j_max = std::max({st.j_max, std::abs(*p2), std::abs(*m2)});
  } else {
    st.fd = (*p1 - *m1) / (2 * options.step);
  }
  return st;
}

absl::StatusOr<double> ObjectiveUnder(const Model& model, kernels::Backend<double>& be,
                                      const SequenceInput<double>& input,
                                      const Objective& objective, const Edits& edits,
                                      int* num_forwards) {
  auto tape = RunForward(model, be, input, edits);
  if (!tape.ok()) return tape.status();
  ++*num_forwards;
  return EvaluateObjective(objective, model.config, *tape);
}

double FdRelativeError(double gradient, const Stencil& st, double floor, const FdOptions& options) {
  const double noise = 1000 * std::numeric_limits<double>::epsilon() * st.j_max / options.step;
  const double den = std::max({std::abs(gradient), std::abs(st.fd), floor, noise});
  return den > 0 ? std::abs(gradient - st.fd) / den : 0.0;
}

template <typename T>
SequenceInput<double> ToDouble(const SequenceInput<T>& in) {
  SequenceInput<double> out;
  out.tokens = in.tokens;
  out.offset = in.offset;
  out.doc_ids = in.doc_ids;
  for (const auto& l : in.prefix_k) out.prefix_k.emplace_back(l.begin(), l.end());
  for (const auto& l : in.prefix_v) out.prefix_v.emplace_back(l.begin(), l.end());
  return out;
}

template <typename G>
absl::StatusOr<FdReport> CheckByFiniteDifferences(const Model& model,
                                                  const SequenceInput<double>& input,
                                                  const Objective& objective,
                                                  const Gradients<G>& grads,
                                                  const FdOptions& options) {
  const ModelConfig& c = model.config;
  kernels::ReferenceBackend be;
  const int n = static_cast<int>(input.tokens.size()), tk = input.offset + n;
  if (absl::Status s = ValidateObjective(objective, c, n); !s.ok()) return s;
  if (options.order != 2 && options.order != 4) {
    return absl::InvalidArgumentError("finite differences: order must be 2 or 4");
  }
  std::mt19937_64 rng(options.seed);
  FdReport report;
  for (const FdTensor& tensor : options.tensors) {
    const TensorKind kind = tensor.kind;
    FdTensorReport tr;
    tr.kind = kind;
    tr.before_rope = tensor.before_rope;
    const double floor = 1e-3 * TensorScale(grads, kind);
    for (int s = 0; s < options.samples_per_tensor; ++s) {
      FdSample sample;
      sample.at = RandomCoord(c, input, kind, rng);
      const std::vector<std::pair<Coord, double>> dir =
          tensor.before_rope ? RopeDirection(model, input, be, sample.at)
                             : std::vector<std::pair<Coord, double>>{{sample.at, 1.0}};
      // J at x + m·h·u for the stencil's offsets m
      auto j_at = [&](double m) -> absl::StatusOr<double> {
        Edits e;
        for (const auto& [at, u] : dir) e.perturbations.push_back({at, m * options.step * u});
        return ObjectiveUnder(model, be, input, objective, e, &report.num_forwards);
      };
      auto st = CentredDifference(options, j_at);
      if (!st.ok()) return st.status();
      sample.fd = st->fd;
      for (const auto& [at, u] : dir) {
        sample.gradient += u * static_cast<double>(GradientValue(grads, n, tk, c, at));
      }
      const double abs_err = std::abs(sample.gradient - sample.fd);
      const double rel_err = FdRelativeError(sample.gradient, *st, floor, options);
      tr.max_abs_err = std::max(tr.max_abs_err, abs_err);
      tr.max_rel_err = std::max(tr.max_rel_err, rel_err);
      tr.samples.push_back(sample);
    }
    report.max_abs_err = std::max(report.max_abs_err, tr.max_abs_err);
    report.max_rel_err = std::max(report.max_rel_err, tr.max_rel_err);
    report.tensors.push_back(std::move(tr));
  }
  return report;
}

template SequenceInput<double> ToDouble<float>(const SequenceInput<float>&);
template SequenceInput<double> ToDouble<double>(const SequenceInput<double>&);
template absl::StatusOr<FdReport> CheckByFiniteDifferences<float>(const Model&,
                                                                  const SequenceInput<double>&,
                                                                  const Objective&,
                                                                  const Gradients<float>&,
                                                                  const FdOptions&);
template absl::StatusOr<FdReport> CheckByFiniteDifferences<double>(const Model&,
                                                                   const SequenceInput<double>&,
                                                                   const Objective&,
                                                                   const Gradients<double>&,
                                                                   const FdOptions&);

}  // namespace kvlens::interpret

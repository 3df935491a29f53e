#include "engine/interpret/logit_attribution.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/weight.h"

namespace kvlens::interpret {
namespace {

std::vector<double> Row(const kernels::WeightView& w, int64_t r) {
  std::vector<double> out(static_cast<size_t>(w.cols));
  kernels::DequantizeRow(w, r, out.data());
  return out;
}

template <typename T>
double Dot(const T* x, const std::vector<double>& a) {
  double s = 0.0;
  for (size_t j = 0; j < a.size(); ++j) s += static_cast<double>(x[j]) * a[j];
  return s;
}

// 1/√(mean(x²) + ε) of one row.
template <typename T>
double InvRms(const T* x, int dim, double eps) {
  double ss = 0.0;
  for (int j = 0; j < dim; ++j) ss += static_cast<double>(x[j]) * x[j];
  return 1.0 / std::sqrt(ss / dim + eps);
}

// The direction a block's pre-norm output is read along: a itself, or through a frozen
// block-output RMSNorm, r · w_post ⊙ a (r from that norm's input row `pre`).
template <typename T>
std::vector<double> ThroughPostNorm(const std::vector<double>& a, const kernels::WeightView& norm,
                                    const T* pre, const ModelConfig& c) {
  if (norm.empty()) return a;
  const double r = InvRms(pre, c.dim, c.norm_eps);
  const std::vector<double> w = Row(norm, 0);
  std::vector<double> out(a.size());
  for (size_t j = 0; j < a.size(); ++j) out[j] = r * w[j] * a[j];
  return out;
}

// Wᵀ · a for W [D, cols]: the direction each input column of W is read along.
std::vector<double> TransposedTimes(const kernels::WeightView& w, const std::vector<double>& a) {
  std::vector<double> g(static_cast<size_t>(w.cols), 0.0), row(static_cast<size_t>(w.cols));
  for (int64_t j = 0; j < w.rows; ++j) {
    kernels::DequantizeRow(w, j, row.data());
    for (int64_t k = 0; k < w.cols; ++k) g[k] += a[j] * row[k];
  }
  return g;
}

double BiasShare(const kernels::WeightView& bias, const std::vector<double>& a) {
  return bias.empty() ? 0.0 : Dot(Row(bias, 0).data(), a);
}

}  // namespace

double LogitAttribution::Total() const {
  return embed + pos_embed + final_norm_bias + std::accumulate(attn.begin(), attn.end(), 0.0) +
         std::accumulate(mlp.begin(), mlp.end(), 0.0);
}

template <typename T>
absl::StatusOr<LogitAttribution> AttributeLogit(const Model& model, const Tape<T>& tape, int row,
                                                int token, int baseline,
                                                const AttributionOptions& options) {
  const ModelConfig& c = model.config;
  const Weights& w = model.weights;
  const int D = c.dim, L = c.num_layers, V = c.vocab_size;
  if (row < 0 || row >= tape.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("position: row ", row, " is outside [0, ", tape.n, ")"));
  }
  if (token < 0 || token >= V) {
    return absl::InvalidArgumentError(
        absl::StrCat("token = ", token, " is outside the vocabulary [0, ", V, ")"));
  }
  if (baseline >= V) {
    return absl::InvalidArgumentError(
        absl::StrCat("baseline_token = ", baseline, " is outside the vocabulary [0, ", V, ")"));
  }
  if (options.top_neurons < 0 || options.top_neurons > c.hidden_dim) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_neurons = ", options.top_neurons, " is outside [0, ", c.hidden_dim, "]"));
  }
  const int64_t at = int64_t{row} * D;

  // u: the unembedding direction; a: the residual stream's direction through the final norm.
  std::vector<double> u = Row(w.output, token);
  if (baseline >= 0) {
    const std::vector<double> ub = Row(w.output, baseline);
    for (int j = 0; j < D; ++j) u[j] -= ub[j];
  }
  LogitAttribution r;
  r.logit = Dot(tape.xf.data() + at, u);
  const T* x = tape.x_final.data() + at;
  const std::vector<double> wf = Row(w.final_norm, 0);
  std::vector<double> a(D);
  if (c.arch == Architecture::kLlama) {
    r.scale = InvRms(x, D, c.norm_eps);
    for (int j = 0; j < D; ++j) a[j] = r.scale * wf[j] * u[j];
  } else {
    double mean = 0.0, var = 0.0;
    for (int j = 0; j < D; ++j) mean += x[j];
    mean /= D;
    for (int j = 0; j < D; ++j) var += (x[j] - mean) * (x[j] - mean);
    r.scale = 1.0 / std::sqrt(var / D + c.norm_eps);
    double a_mean = 0.0;
    for (int j = 0; j < D; ++j) a_mean += (a[j] = r.scale * wf[j] * u[j]);
    a_mean /= D;
    for (double& v : a) v -= a_mean;  // (c − mean(c)) · a = c · (a − mean(a))
    r.final_norm_bias = BiasShare(w.final_norm_bias, u);
  }

  const int32_t tok = tape.input.tokens[row];
  std::vector<double> e = Row(w.token_embedding, tok);
  r.embed = Dot(e.data(), a) * c.embedding_scale;
  if (c.arch == Architecture::kGpt2) {
    e = Row(w.position_embedding, tape.positions[row]);
    r.pos_embed = Dot(e.data(), a);
  }
  for (int l = 0; l < L; ++l) {
    const LayerTape<T>& lt = tape.layers[l];
    const LayerWeights& lw = w.layers[l];
    r.attn.push_back(Dot(lt.attn_delta.data() + at, a));
    r.mlp.push_back(Dot(lt.ffn_delta.data() + at, a));
    if (options.heads) {
      const std::vector<double> g = TransposedTimes(
          lw.wo, c.sandwich_norms
                     ? ThroughPostNorm(a, lw.post_attn_norm, lt.attn_proj.data() + at, c)
                     : a);
      const int64_t dh = c.head_dim, QD = c.q_dim();
      for (int64_t h = 0; h < c.num_heads; ++h) {
        double s = 0.0;
        for (int64_t d = 0; d < dh; ++d) {
          s += static_cast<double>(lt.att[int64_t{row} * QD + h * dh + d]) * g[h * dh + d];
        }
        r.heads.push_back(s);
      }
      r.attn_bias.push_back(BiasShare(lw.bo, a));
    }
    if (options.top_neurons > 0) {
      const std::vector<double> g = TransposedTimes(
          lw.w_out,
          c.sandwich_norms ? ThroughPostNorm(a, lw.post_ffn_norm, lt.ffn_out.data() + at, c) : a);
      const int64_t F = c.hidden_dim;
      std::vector<NeuronShare> all(F);
      for (int64_t i = 0; i < F; ++i) {
        all[i] = {l, static_cast<int>(i), static_cast<double>(lt.act[int64_t{row} * F + i]) * g[i]};
      }
      std::partial_sort(all.begin(), all.begin() + options.top_neurons, all.end(),
                        [](const NeuronShare& p, const NeuronShare& q) {
                          const double ap = std::abs(p.value), aq = std::abs(q.value);
                          return ap > aq || (ap == aq && p.neuron < q.neuron);
                        });
      r.neurons.insert(r.neurons.end(), all.begin(), all.begin() + options.top_neurons);
      r.mlp_bias.push_back(BiasShare(lw.b_out, a));
    }
  }
  return r;
}

#define KVLENS_INSTANTIATE_ATTRIBUTION(T)                      \
  template absl::StatusOr<LogitAttribution> AttributeLogit<T>( \
      const Model&, const Tape<T>&, int, int, int, const AttributionOptions&);

KVLENS_INSTANTIATE_ATTRIBUTION(float)
KVLENS_INSTANTIATE_ATTRIBUTION(double)
#undef KVLENS_INSTANTIATE_ATTRIBUTION

}  // namespace kvlens::interpret

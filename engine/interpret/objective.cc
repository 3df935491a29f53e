#include "engine/interpret/objective.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens::interpret {
namespace {

absl::Status Bad(const std::string& msg) {
  return absl::InvalidArgumentError(absl::StrCat("objective: ", msg));
}

}  // namespace

Objective Objective::LogProb(std::vector<TokenTarget> targets) {
  Objective o;
  o.kind = Kind::kLogProb;
  o.targets = std::move(targets);
  return o;
}

Objective Objective::LogitDiff(int row, int32_t token_a, int32_t token_b) {
  Objective o;
  o.kind = Kind::kLogitDiff;
  o.row = row;
  o.token_a = token_a;
  o.token_b = token_b;
  return o;
}

Objective Objective::AttnOutProbe(int layer, int head, std::vector<double> g) {
  Objective o;
  o.kind = Kind::kAttnOutProbe;
  o.layer = layer;
  o.head = head;
  o.g = std::move(g);
  return o;
}

absl::Status ValidateObjective(const Objective& o, const ModelConfig& c, int n) {
  auto token_ok = [&](int32_t t) { return t >= 0 && t < c.vocab_size; };
  switch (o.kind) {
    case Objective::Kind::kLogProb:
      if (o.targets.empty()) return Bad("targets is empty");
      for (const TokenTarget& t : o.targets) {
        if (t.row < 0 || t.row >= n) {
          return Bad(absl::StrCat("target row ", t.row, " outside [0, ", n, ")"));
        }
        if (!token_ok(t.token)) {
          return Bad(absl::StrCat("target token ", t.token, " outside the vocabulary"));
        }
      }
      return absl::OkStatus();
    case Objective::Kind::kLogitDiff:
      if (o.row < 0 || o.row >= n) return Bad(absl::StrCat("row ", o.row, " outside [0, ", n, ")"));
      if (!token_ok(o.token_a) || !token_ok(o.token_b)) {
        return Bad("token_a / token_b outside the vocabulary");
      }
      return absl::OkStatus();
    case Objective::Kind::kAttnOutProbe:
      if (o.layer < 0 || o.layer >= c.num_layers) {
        return Bad(absl::StrCat("layer ", o.layer, " outside [0, ", c.num_layers, ")"));
      }
      if (o.head < 0 || o.head >= c.num_heads) {
        return Bad(absl::StrCat("head ", o.head, " outside [0, ", c.num_heads, ")"));
      }
      if (static_cast<int64_t>(o.g.size()) != int64_t{n} * c.head_dim) {
        return Bad(
            absl::StrCat("g has ", o.g.size(), " values, expected [", n, ", ", c.head_dim, "]"));
      }
      return absl::OkStatus();
  }
  return Bad("unknown kind");
}

template <typename T>
std::vector<double> LogSoftmax(const T* logits, int vocab) {
  double m = -INFINITY;
  for (int v = 0; v < vocab; ++v) m = std::max(m, static_cast<double>(logits[v]));
  double z = 0.0;
  for (int v = 0; v < vocab; ++v) z += std::exp(logits[v] - m);
  const double lz = m + std::log(z);
  std::vector<double> out(vocab);
  for (int v = 0; v < vocab; ++v) out[v] = logits[v] - lz;
  return out;
}

template <typename T>
double EvaluateObjective(const Objective& o, const ModelConfig& c, const Tape<T>& t) {
  const int V = c.vocab_size;
  switch (o.kind) {
    case Objective::Kind::kLogProb: {
      double j = 0.0;
      for (const TokenTarget& tg : o.targets) {
        j += LogSoftmax(t.logits.data() + int64_t{tg.row} * V, V)[tg.token];
      }
      return j;
    }
    case Objective::Kind::kLogitDiff:
      return static_cast<double>(t.logits[int64_t{o.row} * V + o.token_a]) -
             static_cast<double>(t.logits[int64_t{o.row} * V + o.token_b]);
    case Objective::Kind::kAttnOutProbe: {
      const int dh = c.head_dim;
      const int64_t D = c.q_dim();  // O: heads side by side
      double j = 0.0;
      for (int i = 0; i < t.n; ++i) {
        for (int d = 0; d < dh; ++d) {
          j += o.g[int64_t{i} * dh + d] * t.layers[o.layer].att[i * D + int64_t{o.head} * dh + d];
        }
      }
      return j;
    }
  }
  return 0.0;
}

template <typename T>
absl::StatusOr<Seed<T>> SeedFor(const Objective& o, const ModelConfig& c, const Tape<T>& t) {
  if (absl::Status s = ValidateObjective(o, c, t.n); !s.ok()) return s;
  const int V = c.vocab_size;
  Seed<T> seed;
  switch (o.kind) {
    case Objective::Kind::kLogProb: {
      std::vector<double> d(int64_t{t.n} * V, 0.0);
      for (const TokenTarget& tg : o.targets) {
        const std::vector<double> lp = LogSoftmax(t.logits.data() + int64_t{tg.row} * V, V);
        double* row = d.data() + int64_t{tg.row} * V;
        for (int v = 0; v < V; ++v) row[v] -= std::exp(lp[v]);
        row[tg.token] += 1.0;
      }
      seed.dlogits.assign(d.begin(), d.end());
      break;
    }
    case Objective::Kind::kLogitDiff:
      seed.dlogits.assign(int64_t{t.n} * V, T(0));
      seed.dlogits[int64_t{o.row} * V + o.token_a] += T(1);
      seed.dlogits[int64_t{o.row} * V + o.token_b] -= T(1);
      break;
    case Objective::Kind::kAttnOutProbe: {
      const int dh = c.head_dim;
      const int64_t D = c.q_dim();  // O: heads side by side
      seed.probe_layer = o.layer;
      seed.probe_dout.assign(int64_t{t.n} * D, T(0));
      for (int i = 0; i < t.n; ++i) {
        for (int d = 0; d < dh; ++d) {
          seed.probe_dout[i * D + int64_t{o.head} * dh + d] =
              static_cast<T>(o.g[int64_t{i} * dh + d]);
        }
      }
      break;
    }
  }
  return seed;
}

template <typename T>
absl::StatusOr<Gradients<T>> ObjectiveGradients(const Model& model, const Tape<T>& tape,
                                                const Objective& o, const BackwardOptions& options,
                                                kernels::BackwardOps<T>* ops) {
  auto seed = SeedFor(o, model.config, tape);
  if (!seed.ok()) return seed.status();
  return Backward(model, tape, *seed, options, ops);
}

template <typename T>
std::vector<double> InputTimesGradient(const Tape<T>& t, const Gradients<T>& g, int dim) {
  std::vector<double> out(t.n, 0.0);
  const std::vector<T>& x0 = t.layers.empty() ? t.x_final : t.layers[0].x;
  for (int i = 0; i < t.n; ++i) {
    for (int d = 0; d < dim; ++d) {
      out[i] += static_cast<double>(x0[int64_t{i} * dim + d]) * g.residual[0][int64_t{i} * dim + d];
    }
  }
  return out;
}

template <typename T>
std::vector<double> AttentionTimesGradient(const Tape<T>& t, const Gradients<T>& g, int layer) {
  const std::vector<T>& a = t.layers[layer].probs;
  std::vector<double> out(a.size());
  for (size_t e = 0; e < a.size(); ++e) out[e] = static_cast<double>(a[e]) * g.probs[layer][e];
  return out;
}

#define KVLENS_INSTANTIATE_OBJECTIVE(T)                                                         \
  template std::vector<double> LogSoftmax<T>(const T*, int);                                    \
  template double EvaluateObjective<T>(const Objective&, const ModelConfig&, const Tape<T>&);   \
  template absl::StatusOr<Seed<T>> SeedFor<T>(const Objective&, const ModelConfig&,             \
                                              const Tape<T>&);                                  \
  template absl::StatusOr<Gradients<T>> ObjectiveGradients<T>(                                  \
      const Model&, const Tape<T>&, const Objective&, const BackwardOptions&,                   \
      kernels::BackwardOps<T>*);                                                                \
  template std::vector<double> InputTimesGradient<T>(const Tape<T>&, const Gradients<T>&, int); \
  template std::vector<double> AttentionTimesGradient<T>(const Tape<T>&, const Gradients<T>&, int);

KVLENS_INSTANTIATE_OBJECTIVE(float)
KVLENS_INSTANTIATE_OBJECTIVE(double)
#undef KVLENS_INSTANTIATE_OBJECTIVE

}  // namespace kvlens::interpret

#include "engine/interpret/interventions.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace kvlens::interpret {

template <typename T>
absl::StatusOr<InterventionResult> Intervene(const Model& model, kernels::Backend<T>& be,
                                             const SequenceInput<T>& input, const Edits& edits,
                                             absl::Span<const TokenTarget> targets) {
  const ModelConfig& c = model.config;
  const int V = c.vocab_size;
  auto clean = RunForward(model, be, input);
  if (!clean.ok()) return clean.status();
  for (const TokenTarget& t : targets) {
    if (t.row < 0 || t.row >= clean->n || t.token < 0 || t.token >= V) {
      return absl::InvalidArgumentError(
          absl::StrCat("intervene: target (row ", t.row, ", token ", t.token, ") is out of range"));
    }
  }
  auto edited = RunForward(model, be, input, edits);
  if (!edited.ok()) return edited.status();
  InterventionResult r;
  r.clean_logits.assign(clean->logits.begin(), clean->logits.end());
  r.edited_logits.assign(edited->logits.begin(), edited->logits.end());
  for (const TokenTarget& t : targets) {
    r.clean_logprobs.push_back(LogSoftmax(clean->logits.data() + int64_t{t.row} * V, V)[t.token]);
    r.edited_logprobs.push_back(LogSoftmax(edited->logits.data() + int64_t{t.row} * V, V)[t.token]);
  }
  return r;
}

template <typename T>
absl::StatusOr<ResidualPatch> PatchFrom(const Tape<T>& source, const ModelConfig& c, int layer,
                                        int source_row, int target_row, PatchSite site) {
  const int last = site == PatchSite::kResidPre ? c.num_layers : c.num_layers - 1;
  if (layer < 0 || layer > last || source_row < 0 || source_row >= source.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("patch source of ", std::string(PatchSiteName(site)), " (layer ", layer,
                     ", row ", source_row, ") is out of range"));
  }
  const std::vector<T>* from = nullptr;
  switch (site) {
    case PatchSite::kResidPre:
      from = layer == c.num_layers ? &source.x_final : &source.layers[layer].x;
      break;
    case PatchSite::kResidMid:
      from = &source.layers[layer].h;
      break;
    case PatchSite::kAttnOut:
      from = &source.layers[layer].attn_delta;
      break;
    case PatchSite::kMlpOut:
      from = &source.layers[layer].ffn_delta;
      break;
  }
  const std::vector<T>& x = *from;
  ResidualPatch p;
  p.site = site;
  p.layer = layer;
  p.row = target_row;
  p.value.assign(x.begin() + int64_t{source_row} * c.dim,
                 x.begin() + int64_t{source_row + 1} * c.dim);
  return p;
}

template <typename T>
absl::StatusOr<HeadPatch> HeadPatchFrom(const Tape<T>& source, const ModelConfig& c, int layer,
                                        int head, int source_row, int target_row, TensorKind kind) {
  if (!IsHeadVector(kind)) {
    return absl::InvalidArgumentError(absl::StrCat("head patch source of ",
                                                   std::string(TensorKindName(kind)),
                                                   ": only q, k, v and attn_out are a head's"));
  }
  const int heads = IsPerKvHead(kind) ? c.num_kv_heads : c.num_heads;
  if (layer < 0 || layer >= c.num_layers || head < 0 || head >= heads || source_row < 0 ||
      source_row >= source.n) {
    return absl::InvalidArgumentError(
        absl::StrCat("head patch source of ", std::string(TensorKindName(kind)), " (layer ", layer,
                     ", head ", head, ", row ", source_row, ") is out of range"));
  }
  const T* o = HeadTensor(source.layers[layer], kind).data() +
               HeadVectorAt(c, kind, source.input.offset, source_row, head);
  HeadPatch p;
  p.layer = layer;
  p.head = head;
  p.row = target_row;
  p.value.assign(o, o + c.head_dim);
  p.kind = kind;
  return p;
}

template <typename T>
absl::StatusOr<std::vector<T>> LensLogits(const Model& model, kernels::Backend<T>& be,
                                          const Tape<T>& tape, int layer) {
  const ModelConfig& c = model.config;
  const Weights& w = model.weights;
  if (layer < 0 || layer > c.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("logit lens: layer ", layer, " outside [0, ", c.num_layers, "]"));
  }
  const std::vector<T>& x = layer == c.num_layers ? tape.x_final : tape.layers[layer].x;
  std::vector<T> xn(x.size()), logits(int64_t{tape.n} * c.vocab_size);
  if (c.arch == Architecture::kLlama) {
    be.RmsNorm(x.data(), tape.n, c.dim, w.final_norm, c.norm_eps, xn.data());
  } else {
    be.LayerNorm(x.data(), tape.n, c.dim, w.final_norm, w.final_norm_bias, c.norm_eps, xn.data());
  }
  be.MatMul(xn.data(), tape.n, w.output, kernels::WeightView{}, logits.data());
  if (c.final_softcap > 0.0)
    be.SoftCap(logits.data(), int64_t{tape.n} * c.vocab_size, c.final_softcap);
  return logits;
}

template <typename T>
absl::StatusOr<std::vector<std::vector<std::vector<LensEntry>>>> LogitLens(const Model& model,
                                                                           kernels::Backend<T>& be,
                                                                           const Tape<T>& tape,
                                                                           int k) {
  const int V = model.config.vocab_size;
  if (k < 1 || k > V) {
    return absl::InvalidArgumentError(absl::StrCat("logit lens: k = ", k, " outside [1, ", V, "]"));
  }
  std::vector<std::vector<std::vector<LensEntry>>> out;
  std::vector<int32_t> order(V);
  for (int l = 0; l <= model.config.num_layers; ++l) {
    auto logits = LensLogits(model, be, tape, l);
    if (!logits.ok()) return logits.status();
    auto& layer = out.emplace_back(tape.n);
    for (int i = 0; i < tape.n; ++i) {
      const T* row = logits->data() + int64_t{i} * V;
      const std::vector<double> lp = LogSoftmax(row, V);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      for (int r = 0; r < k; ++r) layer[i].push_back({order[r], row[order[r]], lp[order[r]]});
    }
  }
  return out;
}

#define KVLENS_INSTANTIATE_INTERVENTIONS(T)                                                       \
  template absl::StatusOr<InterventionResult> Intervene<T>(const Model&, kernels::Backend<T>&,    \
                                                           const SequenceInput<T>&, const Edits&, \
                                                           absl::Span<const TokenTarget>);        \
  template absl::StatusOr<ResidualPatch> PatchFrom<T>(const Tape<T>&, const ModelConfig&, int,    \
                                                      int, int, PatchSite);                       \
  template absl::StatusOr<HeadPatch> HeadPatchFrom<T>(const Tape<T>&, const ModelConfig&, int,    \
                                                      int, int, int, TensorKind);                 \
  template absl::StatusOr<std::vector<T>> LensLogits<T>(const Model&, kernels::Backend<T>&,       \
                                                        const Tape<T>&, int);                     \
  template absl::StatusOr<std::vector<std::vector<std::vector<LensEntry>>>> LogitLens<T>(         \
      const Model&, kernels::Backend<T>&, const Tape<T>&, int);

KVLENS_INSTANTIATE_INTERVENTIONS(float)
KVLENS_INSTANTIATE_INTERVENTIONS(double)
#undef KVLENS_INSTANTIATE_INTERVENTIONS

}  // namespace kvlens::interpret

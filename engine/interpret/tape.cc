// The recording forward pass (see tape.h). Backward lives in tape_backward.cc.
#include "engine/interpret/tape.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/reference_backward.h"

namespace kvlens::interpret {
namespace {

using kernels::Backend;

absl::Status Bad(const std::string& msg) { return absl::InvalidArgumentError(msg); }

// Shape of one layer's tensor of `kind`: {heads-or-rows, …} flattened size per layer.
int64_t PerLayerSize(const ModelConfig& c, int n, int tk, TensorKind kind) {
  switch (kind) {
    case TensorKind::kScores:
    case TensorKind::kProbs:
      return int64_t{c.num_heads} * n * tk;
    case TensorKind::kQ:
    case TensorKind::kAttnOut:
      return int64_t{n} * c.num_heads * c.head_dim;
    case TensorKind::kK:
    case TensorKind::kV:
      return int64_t{tk} * c.kv_dim();
    case TensorKind::kResidual:
      return int64_t{n} * c.dim;
  }
  return 0;
}

template <typename T>
absl::Status ValidateInput(const ModelConfig& c, const SequenceInput<T>& in) {
  const int n = static_cast<int>(in.tokens.size());
  if (n == 0) return Bad("tokens is empty");
  if (in.offset < 0) return Bad(absl::StrCat("offset = ", in.offset, " is negative"));
  if (in.offset + n > c.max_seq_len) {
    return absl::OutOfRangeError(
        absl::StrCat(in.offset + n, " tokens exceed the context length ", c.max_seq_len));
  }
  for (int i = 0; i < n; ++i) {
    if (in.tokens[i] < 0 || in.tokens[i] >= c.vocab_size) {
      return Bad(absl::StrCat("token id ", in.tokens[i], " at index ", i,
                              " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
  }
  if (!in.doc_ids.empty() && static_cast<int>(in.doc_ids.size()) != in.offset + n) {
    return Bad(
        absl::StrCat("doc_ids has ", in.doc_ids.size(), " entries, expected ", in.offset + n));
  }
  const size_t prefix = static_cast<size_t>(in.offset) * c.kv_dim();
  if (in.offset > 0) {
    if (static_cast<int>(in.prefix_k.size()) != c.num_layers ||
        static_cast<int>(in.prefix_v.size()) != c.num_layers) {
      return Bad(absl::StrCat("prefix_k/prefix_v need ", c.num_layers, " layers"));
    }
    for (int l = 0; l < c.num_layers; ++l) {
      if (in.prefix_k[l].size() != prefix || in.prefix_v[l].size() != prefix) {
        return Bad(absl::StrCat("prefix_k/prefix_v layer ", l, " must hold ", in.offset, " × ",
                                c.kv_dim(), " values"));
      }
    }
  }
  for (int i = 0; i < n; ++i) {
    bool any = false;
    for (int j = 0; j <= in.offset + i && !any; ++j) any = KeyVisible(in, i, j, c.sliding_window);
    if (!any) {
      return Bad(absl::StrCat("attention query row ", i, " (position ", in.offset + i,
                              ") has no visible key"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateEdits(const ModelConfig& c, int n, int tk, const Edits& e) {
  const int L = c.num_layers, H = c.num_heads;
  for (const Perturbation& p : e.perturbations) {
    if (FlatIndex(c, n, tk, p.at) < 0) {
      return Bad(absl::StrCat("perturbation of ", std::string(TensorKindName(p.at.kind)),
                              " at layer ", p.at.layer, " (head ", p.at.head, ", row ", p.at.row,
                              ", col ", p.at.col, ") is out of range"));
    }
  }
  for (const HeadAblation& a : e.ablations) {
    if (a.layer < 0 || a.layer >= L || a.head < 0 || a.head >= H) {
      return Bad(absl::StrCat("ablation of layer ", a.layer, " head ", a.head, " is out of range"));
    }
  }
  for (const NeuronAblation& a : e.neuron_ablations) {
    if (a.layer < 0 || a.layer >= L || a.neuron < 0 || a.neuron >= c.hidden_dim || a.row < -1 ||
        a.row >= n) {
      return Bad(absl::StrCat("neuron ablation (layer ", a.layer, ", neuron ", a.neuron, ", row ",
                              a.row, ") is out of range"));
    }
  }
  for (const RowOverride& r : e.row_overrides) {
    if (r.layer < 0 || r.layer >= L || r.head < 0 || r.head >= H || r.row < 0 || r.row >= n) {
      return Bad(absl::StrCat("row override (layer ", r.layer, ", head ", r.head, ", row ", r.row,
                              ") is out of range"));
    }
    if (!r.probs.empty() && static_cast<int>(r.probs.size()) != tk) {
      return Bad(
          absl::StrCat("row override probs has ", r.probs.size(), " entries, expected ", tk));
    }
    for (int j : r.masked_keys) {
      if (j < 0 || j >= tk)
        return Bad(absl::StrCat("row override masks key ", j, " outside [0, ", tk, ")"));
    }
  }
  for (const HeadPatch& p : e.head_patches) {
    if (!IsHeadVector(p.kind)) {
      return Bad(absl::StrCat("head patch of ", std::string(TensorKindName(p.kind)),
                              ": only q, k, v and attn_out are a head's vectors"));
    }
    const int heads = IsPerKvHead(p.kind) ? c.num_kv_heads : H;
    if (p.layer < 0 || p.layer >= L || p.head < 0 || p.head >= heads || p.row < 0 || p.row >= n) {
      return Bad(absl::StrCat("head patch of ", std::string(TensorKindName(p.kind)), " (layer ",
                              p.layer, ", head ", p.head, ", row ", p.row, ") is out of range"));
    }
    if (static_cast<int>(p.value.size()) != c.head_dim) {
      return Bad(
          absl::StrCat("head patch value has ", p.value.size(), " entries, expected ", c.head_dim));
    }
  }
  for (const ResidualPatch& p : e.patches) {
    const int last = p.site == PatchSite::kResidPre ? L : L - 1;
    if (p.layer < 0 || p.layer > last || p.row < 0 || p.row >= n) {
      return Bad(absl::StrCat("residual patch of ", std::string(PatchSiteName(p.site)), " (layer ",
                              p.layer, ", row ", p.row, ") is out of range"));
    }
    if (static_cast<int>(p.value.size()) != c.dim) {
      return Bad(
          absl::StrCat("residual patch value has ", p.value.size(), " entries, expected ", c.dim));
    }
  }
  return absl::OkStatus();
}

// Applies perturbations of `kind` at `layer` to `data` (the per-layer tensor).
template <typename T>
void Perturb(const ModelConfig& c, int n, int tk, const Edits& e, TensorKind kind, int layer,
             std::vector<T>& data) {
  for (const Perturbation& p : e.perturbations) {
    if (p.at.kind != kind || p.at.layer != layer) continue;
    const int64_t idx = FlatIndex(c, n, tk, p.at) - int64_t{layer} * PerLayerSize(c, n, tk, kind);
    if (std::isinf(static_cast<double>(data[idx]))) continue;  // a masked score stays −∞
    data[idx] = static_cast<T>(static_cast<double>(data[idx]) + p.delta);
  }
}

template <typename T>
void ApplyPatches(const ModelConfig& c, const Edits& e, PatchSite site, int layer,
                  std::vector<T>& x) {
  for (const ResidualPatch& p : e.patches) {
    if (p.layer != layer || p.site != site) continue;
    for (int d = 0; d < c.dim; ++d) x[int64_t{p.row} * c.dim + d] = static_cast<T>(p.value[d]);
  }
}

// The head patches of `kind` at `layer`, on `data`, that layer's tensor of the kind (k and
// v after `offset` cached keys).
template <typename T>
void ApplyHeadPatches(const ModelConfig& c, const Edits& e, TensorKind kind, int layer, int offset,
                      std::vector<T>& data) {
  for (const HeadPatch& p : e.head_patches) {
    if (p.layer != layer || p.kind != kind) continue;
    T* dst = data.data() + HeadVectorAt(c, kind, offset, p.row, p.head);
    for (int d = 0; d < c.head_dim; ++d) dst[d] = static_cast<T>(p.value[d]);
  }
}

template <typename T>
void Norm(Backend<T>& be, const ModelConfig& c, const kernels::WeightView& w,
          const kernels::WeightView& b, const T* x, int n, T* y) {
  if (c.arch == Architecture::kLlama) {
    be.RmsNorm(x, n, c.dim, w, c.norm_eps, y);
  } else {
    be.LayerNorm(x, n, c.dim, w, b, c.norm_eps, y);
  }
}

// The head ablations, z patches and attention-output perturbations of `layer`, on O.
template <typename T>
void EditAttentionOutput(const ModelConfig& c, int n, int tk, int layer, const Edits& e,
                         LayerTape<T>& lt) {
  const int dh = c.head_dim;
  const int64_t D = int64_t{c.num_heads} * dh;
  for (const HeadAblation& a : e.ablations) {
    if (a.layer != layer) continue;
    std::vector<double> mean(dh, 0.0);
    if (a.mode == AblationMode::kMean) {
      for (int i = 0; i < n; ++i) {
        for (int d = 0; d < dh; ++d) mean[d] += lt.att[i * D + int64_t{a.head} * dh + d];
      }
      for (double& m : mean) m /= n;
    }
    for (int i = 0; i < n; ++i) {
      for (int d = 0; d < dh; ++d)
        lt.att[i * D + int64_t{a.head} * dh + d] = static_cast<T>(mean[d]);
    }
  }
  ApplyHeadPatches(c, e, TensorKind::kAttnOut, layer, 0, lt.att);
  Perturb(c, n, tk, e, TensorKind::kAttnOut, layer, lt.att);
}

// The neuron ablations of `layer`, on the FFN's hidden activations act [n, F].
template <typename T>
void AblateNeurons(const ModelConfig& c, int n, int layer, const Edits& e, std::vector<T>& act) {
  const int64_t F = c.hidden_dim;
  for (const NeuronAblation& a : e.neuron_ablations) {
    if (a.layer != layer) continue;
    double mean = 0.0;
    if (a.mode == AblationMode::kMean) {
      for (int i = 0; i < n; ++i) mean += act[i * F + a.neuron];
      mean /= n;
    }
    for (int i = a.row < 0 ? 0 : a.row; i < (a.row < 0 ? n : a.row + 1); ++i) {
      act[i * F + a.neuron] = static_cast<T>(mean);
    }
  }
}

// S, A and O of one layer, every head, with the attention edits applied. The backend's
// Attention computes them, its probabilities and scores materialized (a CPU backend's
// threads and vectors, a staged device's kernel; ReferenceBackend's arithmetic for a
// double tape, so it reproduces the reference forward exactly). An edit acting inside
// the softmax (a perturbation of the scores or the probabilities, a row override) then
// redoes only the (head, row) pairs it reaches, with the loops below: the row's softmax
// where its scores changed, its O where its probabilities changed. An edit that changes
// nothing (an override by the row's own probabilities) leaves the backend's values, so
// the edited run equals the clean one bit for bit.
template <typename T>
absl::Status AttentionLayer(Backend<T>& be, const ModelConfig& c, const SequenceInput<T>& in,
                            int layer, const Edits& e, LayerTape<T>& lt) {
  const int n = static_cast<int>(in.tokens.size()), tk = in.offset + n;
  const int H = c.num_heads, dh = c.head_dim, group = c.num_heads / c.num_kv_heads;
  const int64_t D = int64_t{H} * dh, KVD = c.kv_dim();
  lt.scores.resize(int64_t{H} * n * tk);
  lt.probs.resize(lt.scores.size());
  lt.att.resize(n * D);
  kernels::AttentionArgs<T> a;
  a.q = lt.q.data();
  a.q_stride = D;
  a.num_queries = n;
  a.num_keys = tk;
  a.num_heads = H;
  a.num_kv_heads = c.num_kv_heads;
  a.head_dim = dh;
  a.query_offset = in.offset;
  a.causal = true;
  a.window = c.WindowOf(layer);
  a.scale = c.AttentionScale();
  a.softcap = c.attention_softcap;
  if (!in.doc_ids.empty()) {
    a.q_doc_ids = in.doc_ids.data() + in.offset;
    a.k_doc_ids = in.doc_ids.data();
  }
  a.kv.k = lt.k.data();
  a.kv.v = lt.v.data();
  a.kv.row_stride = KVD;
  a.out = lt.att.data();
  a.out_stride = D;
  a.probs = lt.probs.data();
  a.scores = lt.scores.data();
  if (absl::Status s = be.Attention(a); !s.ok()) return s;

  // The (head, row) pairs an edit inside the softmax reaches, with their clean scores and
  // probabilities.
  std::vector<std::pair<int, int>> pairs;
  for (const Perturbation& p : e.perturbations) {
    if (p.at.layer == layer &&
        (p.at.kind == TensorKind::kScores || p.at.kind == TensorKind::kProbs)) {
      pairs.push_back({p.at.head, p.at.row});
    }
  }
  for (const RowOverride& r : e.row_overrides) {
    if (r.layer == layer) pairs.push_back({r.head, r.row});
  }
  if (pairs.empty()) {
    EditAttentionOutput(c, n, tk, layer, e, lt);
    return absl::OkStatus();
  }
  std::sort(pairs.begin(), pairs.end());
  pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
  auto map_row = [&](std::vector<T>& m, int h, int i) {
    return m.data() + (int64_t{h} * n + i) * tk;
  };
  std::vector<T> clean_s, clean_p;
  for (const auto& [h, i] : pairs) {
    clean_s.insert(clean_s.end(), map_row(lt.scores, h, i), map_row(lt.scores, h, i) + tk);
    clean_p.insert(clean_p.end(), map_row(lt.probs, h, i), map_row(lt.probs, h, i) + tk);
  }
  Perturb(c, n, tk, e, TensorKind::kScores, layer, lt.scores);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (size_t u = 0; u < pairs.size(); ++u) {
    const auto [h, i] = pairs[u];
    const T* s = map_row(lt.scores, h, i);
    if (std::equal(s, s + tk, clean_s.begin() + static_cast<int64_t>(u) * tk)) continue;
    T* p = map_row(lt.probs, h, i);
    const int end = in.offset + i + 1;
    T max_s = neg_inf;
    for (int j = 0; j < end; ++j) max_s = std::max(max_s, s[j]);
    T z = 0;
    for (int j = 0; j < end; ++j) {
      p[j] = KeyVisible(in, i, j, c.WindowOf(layer)) ? std::exp(s[j] - max_s) : T(0);
      z += p[j];
    }
    for (int j = 0; j < end; ++j) p[j] /= z;
  }
  for (const RowOverride& r : e.row_overrides) {
    if (r.layer != layer) continue;
    T* p = map_row(lt.probs, r.head, r.row);
    if (!r.probs.empty()) {
      for (int j = 0; j < tk; ++j) {
        if (r.probs[j] < 0 || (r.probs[j] != 0 && !KeyVisible(in, r.row, j, c.WindowOf(layer)))) {
          return Bad(absl::StrCat("row override (layer ", layer, ", head ", r.head, ", row ", r.row,
                                  "): probability of key ", j,
                                  " must be ≥ 0, and 0 for a masked key"));
        }
        p[j] = static_cast<T>(r.probs[j]);
      }
    } else {
      for (int j : r.masked_keys) p[j] = T(0);
      T z = 0;
      for (int j = 0; j < tk; ++j) z += p[j];
      if (!(z > T(0))) {
        return Bad(absl::StrCat("row override (layer ", layer, ", head ", r.head, ", row ", r.row,
                                ") masks every visible key"));
      }
      for (int j = 0; j < tk; ++j) p[j] /= z;
    }
  }
  Perturb(c, n, tk, e, TensorKind::kProbs, layer, lt.probs);
  for (size_t u = 0; u < pairs.size(); ++u) {
    const auto [h, i] = pairs[u];
    const T* p = map_row(lt.probs, h, i);
    if (std::equal(p, p + tk, clean_p.begin() + static_cast<int64_t>(u) * tk)) continue;
    const int kvh = h / group;
    T* o = lt.att.data() + i * D + int64_t{h} * dh;
    std::fill(o, o + dh, T(0));
    for (int j = 0; j < in.offset + i + 1; ++j) {
      // never read a masked key's value row
      if (!KeyVisible(in, i, j, c.WindowOf(layer))) continue;
      const T* v = lt.v.data() + j * KVD + int64_t{kvh} * dh;
      for (int d = 0; d < dh; ++d) o[d] += p[j] * v[d];
    }
  }
  EditAttentionOutput(c, n, tk, layer, e, lt);
  return absl::OkStatus();
}

}  // namespace

std::string_view TensorKindName(TensorKind kind) {
  switch (kind) {
    case TensorKind::kScores:
      return "scores";
    case TensorKind::kProbs:
      return "probs";
    case TensorKind::kQ:
      return "q";
    case TensorKind::kK:
      return "k";
    case TensorKind::kV:
      return "v";
    case TensorKind::kAttnOut:
      return "attn_out";
    case TensorKind::kResidual:
      return "residual";
  }
  return "?";
}

bool IsHeadVector(TensorKind kind) {
  return kind == TensorKind::kQ || kind == TensorKind::kK || kind == TensorKind::kV ||
         kind == TensorKind::kAttnOut;
}

bool IsPerKvHead(TensorKind kind) { return kind == TensorKind::kK || kind == TensorKind::kV; }

int64_t HeadVectorAt(const ModelConfig& c, TensorKind kind, int offset, int row, int head) {
  if (!IsPerKvHead(kind)) return (int64_t{row} * c.num_heads + head) * c.head_dim;
  return ((int64_t{offset} + row) * c.num_kv_heads + head) * c.head_dim;
}

std::string_view PatchSiteName(PatchSite site) {
  switch (site) {
    case PatchSite::kResidPre:
      return "resid_pre";
    case PatchSite::kResidMid:
      return "resid_mid";
    case PatchSite::kAttnOut:
      return "attn_out";
    case PatchSite::kMlpOut:
      return "mlp_out";
  }
  return "?";
}

int64_t FfnGradientBytes(const ModelConfig& c, int n, int elem_bytes, int layers) {
  return int64_t{3} * layers * n * c.hidden_dim * elem_bytes;
}

int64_t TapeBytes(const ModelConfig& c, int n, int num_keys, int elem_bytes, bool backward) {
  const int64_t D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), F = c.hidden_dim, L = c.num_layers;
  const int64_t H = c.num_heads, N = n, tk = num_keys;
  const int64_t maps = H * N * tk;  // one [H, n, Tk] map
  // LayerTape: x, xn, h, hn, attn_delta, ffn_delta; q, att; k, v; scores, probs; pre, act
  // (+ up); q_pre, k_pre; attn_proj, ffn_out.
  int64_t layer = 6 * N * D + 2 * N * QD + 2 * tk * KVD + 2 * maps + 2 * N * F;
  if (c.arch == Architecture::kLlama) layer += N * F;
  if (c.qk_norm) layer += N * QD + N * KVD;
  if (c.sandwich_norms) layer += 2 * N * D;  // attn_proj, ffn_out
  // Tape: its layers, the prefix keys and values it copies, x_final, xf, logits.
  int64_t elems = L * layer + 2 * L * (tk - N) * KVD + 2 * N * D + N * c.vocab_size;
  // Gradients: scores, probs, q, k, v, attn_out, resid_mid per layer; L + 1 residuals and
  // ln_final.
  if (backward) elems += L * (2 * maps + 2 * N * QD + 2 * tk * KVD + N * D) + (L + 2) * N * D;
  return elems * elem_bytes;
}

int64_t FlatIndex(const ModelConfig& c, int n, int tk, const Coord& at) {
  const int L = c.num_layers, H = c.num_heads, dh = c.head_dim;
  const int max_layer = at.kind == TensorKind::kResidual ? L : L - 1;
  if (at.layer < 0 || at.layer > max_layer || at.row < 0 || at.col < 0 || at.head < 0) return -1;
  const int64_t base = int64_t{at.layer} * PerLayerSize(c, n, tk, at.kind);
  switch (at.kind) {
    case TensorKind::kScores:
    case TensorKind::kProbs:
      if (at.head >= H || at.row >= n || at.col >= tk) return -1;
      return base + (int64_t{at.head} * n + at.row) * tk + at.col;
    case TensorKind::kQ:
    case TensorKind::kAttnOut:
      if (at.head >= H || at.row >= n || at.col >= dh) return -1;
      return base + (int64_t{at.row} * H + at.head) * dh + at.col;
    case TensorKind::kK:
    case TensorKind::kV:
      if (at.head >= c.num_kv_heads || at.row >= tk || at.col >= dh) return -1;
      return base + (int64_t{at.row} * c.num_kv_heads + at.head) * dh + at.col;
    case TensorKind::kResidual:
      if (at.row >= n || at.col >= c.dim) return -1;
      return base + int64_t{at.row} * c.dim + at.col;
  }
  return -1;
}

template <typename T>
T TapeValue(const Tape<T>& tape, const ModelConfig& c, const Coord& at) {
  const int64_t idx = FlatIndex(c, tape.n, tape.num_keys, at) -
                      int64_t{at.layer} * PerLayerSize(c, tape.n, tape.num_keys, at.kind);
  if (at.kind == TensorKind::kResidual) {
    return at.layer == c.num_layers ? tape.x_final[idx] : tape.layers[at.layer].x[idx];
  }
  const LayerTape<T>& lt = tape.layers[at.layer];
  switch (at.kind) {
    case TensorKind::kScores:
      return lt.scores[idx];
    case TensorKind::kProbs:
      return lt.probs[idx];
    case TensorKind::kQ:
      return lt.q[idx];
    case TensorKind::kK:
      return lt.k[idx];
    case TensorKind::kV:
      return lt.v[idx];
    default:
      return lt.att[idx];
  }
}

template <typename T>
T GradientValue(const Gradients<T>& g, int n, int tk, const ModelConfig& c, const Coord& at) {
  const int64_t idx = FlatIndex(c, n, tk, at) - int64_t{at.layer} * PerLayerSize(c, n, tk, at.kind);
  switch (at.kind) {
    case TensorKind::kScores:
      return g.scores[at.layer][idx];
    case TensorKind::kProbs:
      return g.probs[at.layer][idx];
    case TensorKind::kQ:
      return g.q[at.layer][idx];
    case TensorKind::kK:
      return g.k[at.layer][idx];
    case TensorKind::kV:
      return g.v[at.layer][idx];
    case TensorKind::kAttnOut:
      return g.attn_out[at.layer][idx];
    case TensorKind::kResidual:
      return g.residual[at.layer][idx];
  }
  return T(0);
}

namespace {

// The lowest layer an edit acts in (its loop iteration; L for the final stream's).
int FirstEditedLayer(const ModelConfig& c, const Edits& e) {
  int first = c.num_layers;
  for (const Perturbation& p : e.perturbations) first = std::min(first, p.at.layer);
  for (const HeadAblation& a : e.ablations) first = std::min(first, a.layer);
  for (const RowOverride& r : e.row_overrides) first = std::min(first, r.layer);
  for (const ResidualPatch& p : e.patches) first = std::min(first, p.layer);
  for (const HeadPatch& p : e.head_patches) first = std::min(first, p.layer);
  for (const NeuronAblation& a : e.neuron_ablations) first = std::min(first, a.layer);
  return first;
}

// RunForward, or with `resume` RunForwardFrom: layers before `first` copied from it (or left
// empty when not `copy_skipped`).
template <typename T>
absl::StatusOr<Tape<T>> Forward(const Model& model, Backend<T>& be, const SequenceInput<T>& input,
                                const Edits& edits, const Tape<T>* resume, int first,
                                bool copy_skipped) {
  const ModelConfig& c = model.config;
  const Weights& w = model.weights;
  if (absl::Status s = ValidateInput(c, input); !s.ok()) return s;
  const int n = static_cast<int>(input.tokens.size()), tk = input.offset + n;
  if (absl::Status s = ValidateEdits(c, n, tk, edits); !s.ok()) return s;
  const int64_t D = c.dim, QD = c.q_dim(), KVD = c.kv_dim(), F = c.hidden_dim, V = c.vocab_size;
  const int64_t off_rows = int64_t{input.offset} * KVD;

  Tape<T> t;
  t.input = input;
  t.n = n;
  t.num_keys = tk;
  t.edited = !edits.empty();
  t.positions.resize(n);
  for (int i = 0; i < n; ++i) t.positions[i] = input.offset + i;
  t.layers.resize(c.num_layers);

  std::vector<T> x(n * D), proj(n * D);
  if (resume != nullptr) {  // the layers no edit reaches, as the clean run computed them
    for (int l = 0; l < first && copy_skipped; ++l) t.layers[l] = resume->layers[l];
    x = first < c.num_layers ? resume->layers[first].x : resume->x_final;
  } else {
    // token (and, for GPT-2, position) embeddings; Gemma's times √D
    be.Embedding(w.token_embedding, input.tokens.data(), n, x.data());
    if (c.embedding_scale != 1.0) be.Scale(x.data(), n * D, c.embedding_scale);
    if (c.arch == Architecture::kGpt2) {
      be.Embedding(w.position_embedding, t.positions.data(), n, proj.data());
      be.Add(x.data(), proj.data(), n * D);
    }
  }

  for (int l = first; l < c.num_layers; ++l) {
    const LayerWeights& lw = w.layers[l];
    LayerTape<T>& lt = t.layers[l];
    ApplyPatches(c, edits, PatchSite::kResidPre, l, x);
    Perturb(c, n, tk, edits, TensorKind::kResidual, l, x);
    lt.x = x;
    // attention norm and q/k/v projections of the new tokens
    lt.xn.resize(n * D);
    Norm(be, c, lw.attn_norm, lw.attn_norm_bias, x.data(), n, lt.xn.data());
    lt.q.resize(n * QD);
    std::vector<T> k_new(n * KVD), v_new(n * KVD);
    be.MatMul(lt.xn.data(), n, lw.wq, lw.bq, lt.q.data());
    be.MatMul(lt.xn.data(), n, lw.wk, lw.bk, k_new.data());
    be.MatMul(lt.xn.data(), n, lw.wv, lw.bv, v_new.data());
    if (c.qk_norm) {  // Qwen3: RMSNorm over each head of q and k
      lt.q_pre = lt.q;
      lt.k_pre = k_new;
      be.RmsNorm(lt.q_pre.data(), n * c.num_heads, c.head_dim, lw.q_norm, c.norm_eps, lt.q.data());
      be.RmsNorm(lt.k_pre.data(), n * c.num_kv_heads, c.head_dim, lw.k_norm, c.norm_eps,
                 k_new.data());
    }
    if (c.arch == Architecture::kLlama) {
      const kernels::RopeSpec rope = RopeOf(c, w, l);
      be.Rope(lt.q.data(), n, QD, c.num_heads, c.head_dim, t.positions.data(), rope);
      be.Rope(k_new.data(), n, KVD, c.num_kv_heads, c.head_dim, t.positions.data(), rope);
    }
    ApplyHeadPatches(c, edits, TensorKind::kQ, l, 0, lt.q);
    Perturb(c, n, tk, edits, TensorKind::kQ, l, lt.q);
    // every key: the cached prefix (leaves), then the new tokens
    lt.k.resize(tk * KVD);
    lt.v.resize(tk * KVD);
    if (input.offset > 0) {
      std::copy_n(input.prefix_k[l].data(), off_rows, lt.k.data());
      std::copy_n(input.prefix_v[l].data(), off_rows, lt.v.data());
    }
    std::copy(k_new.begin(), k_new.end(), lt.k.begin() + off_rows);
    std::copy(v_new.begin(), v_new.end(), lt.v.begin() + off_rows);
    ApplyHeadPatches(c, edits, TensorKind::kK, l, input.offset, lt.k);
    ApplyHeadPatches(c, edits, TensorKind::kV, l, input.offset, lt.v);
    Perturb(c, n, tk, edits, TensorKind::kK, l, lt.k);
    Perturb(c, n, tk, edits, TensorKind::kV, l, lt.v);
    if (absl::Status s = AttentionLayer(be, c, input, l, edits, lt); !s.ok()) return s;
    // output projection and residual
    be.MatMul(lt.att.data(), n, lw.wo, lw.bo, proj.data());
    if (c.sandwich_norms) {
      lt.attn_proj = proj;
      be.RmsNorm(lt.attn_proj.data(), n, c.dim, lw.post_attn_norm, c.norm_eps, proj.data());
    }
    ApplyPatches(c, edits, PatchSite::kAttnOut, l, proj);
    lt.attn_delta = proj;
    be.Add(x.data(), proj.data(), n * D);
    ApplyPatches(c, edits, PatchSite::kResidMid, l, x);
    lt.h = x;
    // feed-forward block and residual
    lt.hn.resize(n * D);
    Norm(be, c, lw.ffn_norm, lw.ffn_norm_bias, x.data(), n, lt.hn.data());
    lt.pre.resize(n * F);
    lt.act.resize(n * F);
    if (c.arch == Architecture::kLlama) {
      lt.up.resize(n * F);
      be.MatMul(lt.hn.data(), n, lw.w_in, kernels::WeightView{}, lt.pre.data());
      be.MatMul(lt.hn.data(), n, lw.w_up, kernels::WeightView{}, lt.up.data());
      if (c.gate_activation == GateActivation::kGeluTanh) {
        be.GeGlu(lt.pre.data(), lt.up.data(), n * F, lt.act.data());
      } else {
        be.SwiGlu(lt.pre.data(), lt.up.data(), n * F, lt.act.data());
      }
    } else {
      be.MatMul(lt.hn.data(), n, lw.w_in, lw.b_in, lt.pre.data());
      lt.act = lt.pre;
      be.Gelu(lt.act.data(), n * F);
    }
    AblateNeurons(c, n, l, edits, lt.act);
    be.MatMul(lt.act.data(), n, lw.w_out, lw.b_out, proj.data());
    if (c.sandwich_norms) {
      lt.ffn_out = proj;
      be.RmsNorm(lt.ffn_out.data(), n, c.dim, lw.post_ffn_norm, c.norm_eps, proj.data());
    }
    ApplyPatches(c, edits, PatchSite::kMlpOut, l, proj);
    lt.ffn_delta = proj;
    be.Add(x.data(), proj.data(), n * D);
  }

  // final norm and classifier, for every row
  ApplyPatches(c, edits, PatchSite::kResidPre, c.num_layers, x);
  Perturb(c, n, tk, edits, TensorKind::kResidual, c.num_layers, x);
  t.x_final = x;
  t.xf.resize(n * D);
  Norm(be, c, w.final_norm, w.final_norm_bias, x.data(), n, t.xf.data());
  t.logits.resize(n * V);
  be.MatMul(t.xf.data(), n, w.output, kernels::WeightView{}, t.logits.data());
  if (c.final_softcap > 0.0) be.SoftCap(t.logits.data(), n * V, c.final_softcap);
  // A backend whose ops can fail (a device behind kernels/staged_backend.h) reports it here.
  if (absl::Status s = be.Synchronize(); !s.ok()) return s;
  return t;
}

}  // namespace

template <typename T>
absl::StatusOr<Tape<T>> RunForward(const Model& model, Backend<T>& be,
                                   const SequenceInput<T>& input, const Edits& edits) {
  return Forward(model, be, input, edits, static_cast<const Tape<T>*>(nullptr), 0, true);
}

template <typename T>
absl::StatusOr<Tape<T>> RunForwardFrom(const Model& model, Backend<T>& be, const Tape<T>& clean,
                                       int first_layer, const Edits& edits, bool copy_skipped) {
  const ModelConfig& c = model.config;
  if (clean.edited || static_cast<int>(clean.layers.size()) != c.num_layers) {
    return absl::InvalidArgumentError(
        "resumed forward: the tape to resume is edited or not this "
        "model's");
  }
  if (first_layer < 0 || first_layer > c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("resumed forward: layer ", first_layer,
                                                   " is outside [0, ", c.num_layers, "]"));
  }
  if (const int at = FirstEditedLayer(c, edits); at < first_layer) {
    return absl::InvalidArgumentError(absl::StrCat("resumed forward: an edit at layer ", at,
                                                   " comes before layer ", first_layer));
  }
  return Forward(model, be, clean.input, edits, &clean, first_layer, copy_skipped);
}

template <typename T>
void TurnBackRope(const Model& model, const Tape<T>& tape, TensorKind kind, int layer,
                  int row_begin, int count, T* rows) {
  const ModelConfig& c = model.config;
  if (c.arch != Architecture::kLlama) return;
  std::vector<int32_t> at(count);
  for (int i = 0; i < count; ++i) {
    at[i] = kind == TensorKind::kQ ? tape.positions[row_begin + i] : row_begin + i;
  }
  const int heads = kind == TensorKind::kQ ? c.num_heads : c.num_kv_heads;
  kernels::RopeBackward(rows, count, int64_t{heads} * c.head_dim, heads, c.head_dim, at.data(),
                        RopeOf(c, model.weights, layer));
}

#define KVLENS_INSTANTIATE_TAPE(T)                                                              \
  template absl::StatusOr<Tape<T>> RunForward<T>(const Model&, Backend<T>&,                     \
                                                 const SequenceInput<T>&, const Edits&);        \
  template absl::StatusOr<Tape<T>> RunForwardFrom<T>(const Model&, Backend<T>&, const Tape<T>&, \
                                                     int, const Edits&, bool);                  \
  template T TapeValue<T>(const Tape<T>&, const ModelConfig&, const Coord&);                    \
  template T GradientValue<T>(const Gradients<T>&, int, int, const ModelConfig&, const Coord&); \
  template void TurnBackRope<T>(const Model&, const Tape<T>&, TensorKind, int, int, int, T*);

KVLENS_INSTANTIATE_TAPE(float)
KVLENS_INSTANTIATE_TAPE(double)
#undef KVLENS_INSTANTIATE_TAPE

}  // namespace kvlens::interpret

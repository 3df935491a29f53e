#include "engine/interpret/activations.h"

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvlens::interpret {
namespace {

struct HookNames {
  Hook hook;
  const char* name;  // kvlens's short name
  const char* full;  // TransformerLens's, after "blocks.{layer}." for a hook per layer
};

constexpr std::array<HookNames, 30> kHooks = {{
    {Hook::kResidPre, "resid_pre", "hook_resid_pre"},
    {Hook::kResidMid, "resid_mid", "hook_resid_mid"},
    {Hook::kResidPost, "resid_post", "hook_resid_post"},
    {Hook::kAttnOut, "attn_out", "hook_attn_out"},
    {Hook::kMlpOut, "mlp_out", "hook_mlp_out"},
    {Hook::kZ, "z", "attn.hook_z"},
    {Hook::kResult, "result", "attn.hook_result"},
    {Hook::kQ, "q", "attn.hook_q"},
    {Hook::kK, "k", "attn.hook_k"},
    {Hook::kV, "v", "attn.hook_v"},
    {Hook::kMlpPre, "mlp_pre", "mlp.hook_pre"},
    {Hook::kMlpPost, "mlp_post", "mlp.hook_post"},
    {Hook::kLnFinal, "ln_final", nullptr},
    {Hook::kAttnScores, "attn_scores", "attn.hook_attn_scores"},
    {Hook::kPattern, "pattern", "attn.hook_pattern"},
    {Hook::kRotQ, "rot_q", "attn.hook_rot_q"},
    {Hook::kRotK, "rot_k", "attn.hook_rot_k"},
    {Hook::kLn1Scale, "ln1_scale", "ln1.hook_scale"},
    {Hook::kLn1Normalized, "ln1_normalized", "ln1.hook_normalized"},
    {Hook::kLn2Scale, "ln2_scale", "ln2.hook_scale"},
    {Hook::kLn2Normalized, "ln2_normalized", "ln2.hook_normalized"},
    {Hook::kLnFinalScale, "ln_final_scale", "ln_final.hook_scale"},
    {Hook::kLnFinalNormalized, "ln_final_normalized", "ln_final.hook_normalized"},
    {Hook::kEmbed, "embed", "hook_embed"},
    {Hook::kPosEmbed, "pos_embed", "hook_pos_embed"},
    {Hook::kMlpPreLinear, "mlp_pre_linear", "mlp.hook_pre_linear"},
    {Hook::kLn1PostScale, "ln1_post_scale", "ln1_post.hook_scale"},
    {Hook::kLn1PostNormalized, "ln1_post_normalized", "ln1_post.hook_normalized"},
    {Hook::kLn2PostScale, "ln2_post_scale", "ln2_post.hook_scale"},
    {Hook::kLn2PostNormalized, "ln2_post_normalized", "ln2_post.hook_normalized"},
}};

bool IsScale(Hook hook) {
  return hook == Hook::kLn1Scale || hook == Hook::kLn2Scale || hook == Hook::kLnFinalScale ||
         hook == Hook::kLn1PostScale || hook == Hook::kLn2PostScale;
}
bool IsNormalized(Hook hook) {
  return hook == Hook::kLn1Normalized || hook == Hook::kLn2Normalized ||
         hook == Hook::kLnFinalNormalized || hook == Hook::kLn1PostNormalized ||
         hook == Hook::kLn2PostNormalized;
}
bool IsBlockOutputNorm(Hook hook) {
  return hook == Hook::kLn1PostScale || hook == Hook::kLn1PostNormalized ||
         hook == Hook::kLn2PostScale || hook == Hook::kLn2PostNormalized;
}

// x̃ = x − mean(x) (LayerNorm) or x (RMSNorm) of each of `rows` rows [D]: the divisor
// √(mean(x̃²) + ε) ([rows, 1]) or x̃ over it ([rows, D]).
template <typename T>
std::vector<T> NormParts(const ModelConfig& c, const T* x, int64_t rows, bool scale_only) {
  const int64_t D = c.dim;
  std::vector<T> out(scale_only ? rows : rows * D);
  std::vector<double> centred(D);
  for (int64_t i = 0; i < rows; ++i) {
    double mean = 0;
    if (c.arch == Architecture::kGpt2) {
      for (int64_t j = 0; j < D; ++j) mean += x[i * D + j];
      mean /= D;
    }
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) {
      centred[j] = x[i * D + j] - mean;
      ss += centred[j] * centred[j];
    }
    const double scale = std::sqrt(ss / D + c.norm_eps);
    if (scale_only) {
      out[i] = static_cast<T>(scale);
    } else {
      for (int64_t j = 0; j < D; ++j) out[i * D + j] = static_cast<T>(centred[j] / scale);
    }
  }
  return out;
}

// The tape's [rows, width] tensor behind every hook but result.
template <typename T>
const std::vector<T>& Source(const Tape<T>& t, Hook hook, int l) {
  const LayerTape<T>& lt = t.layers[l];
  switch (hook) {
    case Hook::kResidPre:
      return lt.x;
    case Hook::kResidMid:
      return lt.h;
    case Hook::kResidPost:
      return l + 1 < static_cast<int>(t.layers.size()) ? t.layers[l + 1].x : t.x_final;
    case Hook::kAttnOut:
      return lt.attn_delta;
    case Hook::kMlpOut:
      return lt.ffn_delta;
    case Hook::kZ:
      return lt.att;
    case Hook::kQ:
    case Hook::kRotQ:
      return lt.q;
    case Hook::kK:
    case Hook::kRotK:
      return lt.k;
    case Hook::kV:
      return lt.v;
    case Hook::kMlpPre:
      return lt.pre;
    case Hook::kMlpPost:
      return lt.act;
    case Hook::kMlpPreLinear:
      return lt.up;
    case Hook::kAttnScores:
      return lt.scores;
    case Hook::kPattern:
      return lt.probs;
    case Hook::kLn1Scale:
    case Hook::kLn1Normalized:
      return lt.x;
    case Hook::kLn2Scale:
    case Hook::kLn2Normalized:
      return lt.h;
    case Hook::kLnFinalScale:
    case Hook::kLnFinalNormalized:
      return t.x_final;
    case Hook::kLn1PostScale:
    case Hook::kLn1PostNormalized:
      return lt.attn_proj;
    case Hook::kLn2PostScale:
    case Hook::kLn2PostNormalized:
      return lt.ffn_out;
    case Hook::kLnFinal:
    case Hook::kResult:
    case Hook::kEmbed:
    case Hook::kPosEmbed:
      break;
  }
  return t.xf;
}

// attn_scores and pattern: the tape's [H, n, Tk] maps, kept head first.
bool HeadFirst(Hook hook) { return hook == Hook::kAttnScores || hook == Hook::kPattern; }

// result: each head's rows of O alone (the others zero) through W_O, no bias:
// [rows, H, D].
template <typename T>
std::vector<T> HeadResults(const Model& model, kernels::Backend<T>& be, const Tape<T>& t, int l,
                           int begin, int rows) {
  const ModelConfig& c = model.config;
  const int64_t H = c.num_heads, dh = c.head_dim, QD = c.q_dim(), D = c.dim;
  std::vector<T> one(rows * QD), proj(rows * D), out(rows * H * D);
  const T* att = t.layers[l].att.data() + int64_t{begin} * QD;
  for (int64_t h = 0; h < H; ++h) {
    std::fill(one.begin(), one.end(), T(0));
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(att + i * QD + h * dh, dh, one.data() + i * QD + h * dh);
    }
    be.MatMul(one.data(), rows, model.weights.layers[l].wo, kernels::WeightView{}, proj.data());
    for (int64_t i = 0; i < rows; ++i) {
      std::copy_n(proj.data() + i * D, D, out.data() + (i * H + h) * D);
    }
  }
  return out;
}

}  // namespace

std::string_view HookName(Hook hook) {
  for (const HookNames& h : kHooks) {
    if (h.hook == hook) return h.name;
  }
  return "?";
}

std::optional<Hook> HookByName(std::string_view name) {
  for (const HookNames& h : kHooks) {
    if (std::string_view(h.name) == name) return h.hook;
  }
  return std::nullopt;
}

std::string HookNameList() {
  std::string s;
  for (const HookNames& h : kHooks) absl::StrAppend(&s, s.empty() ? "" : ", ", h.name);
  return s;
}

std::string HookFullName(Hook hook, int layer) {
  for (const HookNames& h : kHooks) {
    if (h.hook != hook) continue;
    if (h.full == nullptr) return h.name;
    return HookIsPerLayer(hook) ? absl::StrCat("blocks.", layer, ".", h.full) : h.full;
  }
  return "?";
}

std::optional<NamedHook> ParseHookName(std::string_view name) {
  if (const std::optional<Hook> h = HookByName(name)) return NamedHook{*h, std::nullopt};
  for (const HookNames& h : kHooks) {
    if (!HookIsPerLayer(h.hook) && h.full != nullptr && name == h.full) {
      return NamedHook{h.hook, std::nullopt};
    }
  }
  constexpr std::string_view kBlocks = "blocks.";
  if (name.substr(0, kBlocks.size()) != kBlocks) return std::nullopt;
  std::string_view rest = name.substr(kBlocks.size());
  const size_t dot = rest.find('.');
  if (dot == std::string_view::npos || dot == 0) return std::nullopt;
  int layer = 0;
  const auto [end, ec] = std::from_chars(rest.data(), rest.data() + dot, layer);
  if (ec != std::errc() || end != rest.data() + dot || layer < 0) return std::nullopt;
  rest = rest.substr(dot + 1);
  for (const HookNames& h : kHooks) {
    if (HookIsPerLayer(h.hook) && rest == h.full) return NamedHook{h.hook, layer};
  }
  return std::nullopt;
}

bool HookIsPerLayer(Hook hook) {
  return hook != Hook::kLnFinal && hook != Hook::kLnFinalScale &&
         hook != Hook::kLnFinalNormalized && hook != Hook::kEmbed && hook != Hook::kPosEmbed;
}

absl::Status CheckModelHasHook(const ModelConfig& c, Hook hook) {
  if ((hook == Hook::kRotQ || hook == Hook::kRotK) && c.arch != Architecture::kLlama) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(HookName(hook)), ": the model (",
                     std::string(ArchitectureName(c.arch)), ") has no rotary embedding; its ",
                     hook == Hook::kRotQ ? "q" : "k", " is what the attention scores use"));
  }
  if (hook == Hook::kMlpPreLinear && c.arch != Architecture::kLlama) {
    return absl::InvalidArgumentError(
        absl::StrCat("mlp_pre_linear: the model (", std::string(ArchitectureName(c.arch)),
                     ") has no gated feed-forward; its mlp_post is GELU(mlp_pre)"));
  }
  if (hook == Hook::kPosEmbed && c.arch != Architecture::kGpt2) {
    return absl::InvalidArgumentError(
        absl::StrCat("pos_embed: the model (", std::string(ArchitectureName(c.arch)),
                     ") has no learned position embeddings; its positions turn q and k "
                     "(rot_q, rot_k)"));
  }
  if (IsBlockOutputNorm(hook) && !c.sandwich_norms) {
    const bool attention = hook == Hook::kLn1PostScale || hook == Hook::kLn1PostNormalized;
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(HookName(hook)), ": the model (",
                     c.family.empty() ? std::string(ArchitectureName(c.arch)) : c.family,
                     ") has no norm on the ", attention ? "attention" : "feed-forward",
                     " output (Gemma 2 and 3 have one)"));
  }
  return absl::OkStatus();
}

bool HookRowsAreKeys(Hook hook) {
  return hook == Hook::kK || hook == Hook::kRotK || hook == Hook::kV;
}

std::vector<int64_t> HookRowShape(const ModelConfig& c, Hook hook, int64_t num_keys) {
  switch (hook) {
    case Hook::kAttnScores:
    case Hook::kPattern:
      return {c.num_heads, num_keys};
    case Hook::kZ:
    case Hook::kQ:
    case Hook::kRotQ:
      return {c.num_heads, c.head_dim};
    case Hook::kK:
    case Hook::kRotK:
    case Hook::kV:
      return {c.num_kv_heads, c.head_dim};
    case Hook::kResult:
      return {c.num_heads, c.dim};
    case Hook::kMlpPre:
    case Hook::kMlpPost:
    case Hook::kMlpPreLinear:
      return {c.hidden_dim};
    case Hook::kLn1Scale:
    case Hook::kLn2Scale:
    case Hook::kLnFinalScale:
    case Hook::kLn1PostScale:
    case Hook::kLn2PostScale:
      return {1};
    default:
      return {c.dim};
  }
}

int64_t HookRowElements(const ModelConfig& c, Hook hook, int64_t num_keys) {
  int64_t e = 1;
  for (int64_t d : HookRowShape(c, hook, num_keys)) e *= d;
  return e;
}

std::vector<int64_t> HookShape(const ModelConfig& c, Hook hook, int64_t rows, int64_t num_keys) {
  if (HeadFirst(hook)) return {c.num_heads, rows, num_keys};
  std::vector<int64_t> shape = {rows};
  for (int64_t d : HookRowShape(c, hook, num_keys)) shape.push_back(d);
  return shape;
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadHook(const Model& model, kernels::Backend<T>& be,
                                        const Tape<T>& tape, Hook hook, int layer, int row_begin,
                                        int row_end) {
  const ModelConfig& c = model.config;
  if (absl::Status s = CheckModelHasHook(c, hook); !s.ok()) return s;
  if (HookIsPerLayer(hook) && (layer < 0 || layer >= c.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(HookName(hook)), ": layer ", layer,
                                                   " is outside [0, ", c.num_layers, ")"));
  }
  const int rows = HookRowsAreKeys(hook) ? tape.num_keys : tape.n;
  if (row_begin < 0 || row_end > rows || row_begin >= row_end) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(HookName(hook)), ": rows [",
                                                   row_begin, ", ", row_end,
                                                   ") are not a range within [0, ", rows, ")"));
  }
  if (hook == Hook::kResult)
    return HeadResults(model, be, tape, layer, row_begin, row_end - row_begin);
  if (hook == Hook::kEmbed || hook == Hook::kPosEmbed) {  // as RunForward looks them up
    const int count = row_end - row_begin;
    std::vector<T> out(int64_t{count} * c.dim);
    if (hook == Hook::kEmbed) {
      be.Embedding(model.weights.token_embedding, tape.input.tokens.data() + row_begin, count,
                   out.data());
      if (c.embedding_scale != 1.0) be.Scale(out.data(), out.size(), c.embedding_scale);
    } else {
      be.Embedding(model.weights.position_embedding, tape.positions.data() + row_begin, count,
                   out.data());
    }
    return out;
  }
  const std::vector<T>& src = Source(tape, hook, HookIsPerLayer(hook) ? layer : 0);
  if (HeadFirst(hook)) {  // [H, n, Tk] → [H, rows, Tk]
    const int64_t tk = tape.num_keys, n = tape.n;
    std::vector<T> out;
    out.reserve(static_cast<size_t>(c.num_heads * (row_end - row_begin) * tk));
    for (int64_t h = 0; h < c.num_heads; ++h) {
      out.insert(out.end(), src.begin() + (h * n + row_begin) * tk,
                 src.begin() + (h * n + row_end) * tk);
    }
    return out;
  }
  if (IsScale(hook) || IsNormalized(hook)) {
    return NormParts(c, src.data() + int64_t{row_begin} * c.dim, row_end - row_begin,
                     IsScale(hook));
  }
  const int64_t width = HookRowElements(c, hook, tape.num_keys);
  std::vector<T> out(src.begin() + row_begin * width, src.begin() + row_end * width);
  if (hook == Hook::kQ || hook == Hook::kK) {  // the rows before RoPE
    TurnBackRope(model, tape, hook == Hook::kQ ? TensorKind::kQ : TensorKind::kK, layer, row_begin,
                 row_end - row_begin, out.data());
  }
  return out;
}

#define KVLENS_INSTANTIATE_ACTIVATIONS(T)                                                 \
  template absl::StatusOr<std::vector<T>> ReadHook<T>(const Model&, kernels::Backend<T>&, \
                                                      const Tape<T>&, Hook, int, int, int);

KVLENS_INSTANTIATE_ACTIVATIONS(float)
KVLENS_INSTANTIATE_ACTIVATIONS(double)
#undef KVLENS_INSTANTIATE_ACTIVATIONS

}  // namespace kvlens::interpret

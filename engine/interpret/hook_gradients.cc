#include "engine/interpret/hook_gradients.h"

#include <algorithm>
#include <array>
#include <string>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/reference_backward.h"

namespace kvlens::interpret {
namespace {

// The hooks with a gradient, in run_with_cache's order.
constexpr std::array kWithGradient = {
    Hook::kEmbed,   Hook::kPosEmbed, Hook::kResidPre,  Hook::kAttnScores,
    Hook::kPattern, Hook::kQ,        Hook::kK,         Hook::kV,
    Hook::kRotQ,    Hook::kRotK,     Hook::kZ,         Hook::kResult,
    Hook::kAttnOut, Hook::kResidMid, Hook::kMlpPre,    Hook::kMlpPreLinear,
    Hook::kMlpPost, Hook::kMlpOut,   Hook::kResidPost, Hook::kLnFinal};

}  // namespace

absl::Span<const Hook> HooksWithGradient() { return kWithGradient; }

bool HookHasGradient(Hook hook) {
  for (Hook h : kWithGradient) {
    if (h == hook) return true;
  }
  return false;
}

bool HookGradientNeedsFfn(Hook hook) {
  return hook == Hook::kMlpPre || hook == Hook::kMlpPost || hook == Hook::kMlpPreLinear;
}

absl::Status CheckHookHasGradient(Hook hook) {
  if (HookHasGradient(hook)) return absl::OkStatus();
  std::string names;
  for (Hook h : kWithGradient) {
    absl::StrAppend(&names, names.empty() ? "" : ", ", std::string(HookName(h)));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(std::string(HookName(hook)),
                   ": no gradient is kept there (the backward forms none for the norms' scales "
                   "and normalized rows); hooks with one: ",
                   names));
}

template <typename T>
absl::StatusOr<std::vector<T>> ReadHookGradient(const Model& model, const Tape<T>& tape,
                                                const Gradients<T>& g, Hook hook, int layer) {
  const ModelConfig& c = model.config;
  if (absl::Status s = CheckHookHasGradient(hook); !s.ok()) return s;
  if (absl::Status s = CheckModelHasHook(c, hook); !s.ok()) return s;
  if (HookIsPerLayer(hook) && (layer < 0 || layer >= c.num_layers)) {
    return absl::InvalidArgumentError(absl::StrCat(std::string(HookName(hook)), ": layer ", layer,
                                                   " is outside [0, ", c.num_layers, ")"));
  }
  if (HookGradientNeedsFfn(hook) &&
      (g.mlp_post.size() <= static_cast<size_t>(layer) || g.mlp_post[layer].empty())) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(HookName(hook)), ": layer ", layer,
                     "'s FFN gradients were not kept (BackwardOptions::ffn_layers)"));
  }
  switch (hook) {
    case Hook::kEmbed:
    case Hook::kPosEmbed:
      return g.residual[0];
    case Hook::kResidPre:
      return g.residual[layer];
    case Hook::kResidMid:
    case Hook::kAttnOut:
      return g.resid_mid[layer];
    case Hook::kResidPost:
    case Hook::kMlpOut:
      return g.residual[layer + 1];
    case Hook::kLnFinal:
      return g.ln_final;
    case Hook::kZ:
      return g.attn_out[layer];
    case Hook::kResult: {
      // Σ_h result_h = O·W_Oᵀ, so each head's result has that sum's gradient: attn_out's,
      // or with Gemma 2/3's norm on the attention output, its gradient through that norm.
      const int64_t n = tape.n, D = c.dim;
      std::vector<T> dproj = g.resid_mid[layer];
      if (c.sandwich_norms) {
        kernels::RmsNormBackward(tape.layers[layer].attn_proj.data(), tape.n, c.dim,
                                 model.weights.layers[layer].post_attn_norm, c.norm_eps,
                                 g.resid_mid[layer].data(), dproj.data());
      }
      std::vector<T> out(n * c.num_heads * D);
      for (int64_t i = 0; i < n; ++i) {
        for (int h = 0; h < c.num_heads; ++h) {
          std::copy_n(dproj.begin() + i * D, D, out.begin() + (i * c.num_heads + h) * D);
        }
      }
      return out;
    }
    case Hook::kQ: {
      std::vector<T> out = g.q[layer];
      TurnBackRope(model, tape, TensorKind::kQ, layer, 0, tape.n, out.data());
      return out;
    }
    case Hook::kK: {
      std::vector<T> out = g.k[layer];
      TurnBackRope(model, tape, TensorKind::kK, layer, 0, tape.num_keys, out.data());
      return out;
    }
    case Hook::kRotQ:
      return g.q[layer];
    case Hook::kRotK:
      return g.k[layer];
    case Hook::kV:
      return g.v[layer];
    case Hook::kAttnScores:
      return g.scores[layer];
    case Hook::kPattern:
      return g.probs[layer];
    case Hook::kMlpPre:
      return g.mlp_pre[layer];
    case Hook::kMlpPost:
      return g.mlp_post[layer];
    case Hook::kMlpPreLinear:
      return g.mlp_pre_linear[layer];
    default:
      return absl::InternalError("unreachable: a hook without a gradient");
  }
}

#define KVLENS_INSTANTIATE_HOOK_GRADIENTS(T)                                                \
  template absl::StatusOr<std::vector<T>> ReadHookGradient<T>(const Model&, const Tape<T>&, \
                                                              const Gradients<T>&, Hook, int);

KVLENS_INSTANTIATE_HOOK_GRADIENTS(float)
KVLENS_INSTANTIATE_HOOK_GRADIENTS(double)
#undef KVLENS_INSTANTIATE_HOOK_GRADIENTS

}  // namespace kvlens::interpret

#include "engine/model/model_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace kvlens {

std::string_view ArchitectureName(Architecture a) {
  switch (a) {
    case Architecture::kLlama:
      return "llama";
    case Architecture::kGpt2:
      return "gpt2";
  }
  return "unknown";
}

namespace {
absl::Status Positive(absl::string_view field, int64_t v, int64_t limit) {
  if (v <= 0 || v > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: ", field, " = ", v, " must be in [1, ", limit, "]"));
  }
  return absl::OkStatus();
}
}  // namespace

int ModelConfig::CommonWindow() const {
  for (bool windowed : windowed_layers) {
    if (!windowed) return 0;
  }
  return sliding_window;
}

double ModelConfig::AttentionScale() const {
  return attention_scale > 0.0 ? attention_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));
}

absl::Status ModelConfig::Validate() const {
  constexpr int64_t kMax = 1 << 20;
  for (auto [field, v] : {std::pair<absl::string_view, int64_t>{"dim", dim},
                          {"hidden_dim", hidden_dim},
                          {"num_layers", num_layers},
                          {"num_heads", num_heads},
                          {"num_kv_heads", num_kv_heads},
                          {"head_dim", head_dim},
                          {"vocab_size", vocab_size},
                          {"max_seq_len", max_seq_len}}) {
    if (absl::Status s = Positive(field, v, kMax); !s.ok()) return s;
  }
  if (num_heads % num_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: num_heads = ", num_heads,
                     " is not a multiple of num_kv_heads = ", num_kv_heads));
  }
  // GPT-2's fused c_attn splits in three equal parts; a Llama may have H·Dh ≠ D.
  if (arch == Architecture::kGpt2 && num_heads * head_dim != dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config: num_heads * head_dim = ", num_heads * head_dim, " != dim = ", dim));
  }
  if (int64_t{num_heads} * head_dim > kMax) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: num_heads * head_dim = ", int64_t{num_heads} * head_dim,
                     " must be at most ", kMax));
  }
  if (qk_norm && arch != Architecture::kLlama) {
    return absl::InvalidArgumentError("model config: qk_norm needs the llama architecture");
  }
  if (arch == Architecture::kLlama && head_dim % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: head_dim = ", head_dim, " must be even for RoPE"));
  }
  if (sliding_window < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config: sliding_window = ", sliding_window, " must be non-negative (0: none)"));
  }
  if (!(norm_eps > 0.0 && norm_eps < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: norm_eps = ", norm_eps, " must be in (0, 1)"));
  }
  if (!windowed_layers.empty() && static_cast<int>(windowed_layers.size()) != num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model config: windowed_layers has ",
                                                   windowed_layers.size(),
                                                   " entries, expected num_layers = ", num_layers));
  }
  if (!(rope_theta_windowed >= 0.0) || !(attention_scale >= 0.0 && attention_scale < 1e6)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config: rope_theta_windowed = ", rope_theta_windowed, " and attention_scale = ",
        attention_scale, " must be non-negative (0: the default) and finite"));
  }
  for (auto [field, cap] :
       {std::pair<absl::string_view, double>{"attention_softcap", attention_softcap},
        {"final_softcap", final_softcap}}) {
    if (!(cap >= 0.0 && cap < 1e6)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config: ", field, " = ", cap, " must be in [0, 1e6) (0: none)"));
    }
  }
  if (sandwich_norms && arch != Architecture::kLlama) {
    return absl::InvalidArgumentError("model config: sandwich_norms needs the llama architecture");
  }
  if (!(embedding_scale > 0.0 && embedding_scale < 1e6)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: embedding_scale = ", embedding_scale, " must be in (0, 1e6)"));
  }
  if (gate_activation != GateActivation::kSilu && arch != Architecture::kLlama) {
    return absl::InvalidArgumentError(
        "model config: gate_activation applies to the llama architecture only");
  }
  if (!(rope_theta > 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config: rope_theta = ", rope_theta, " must be positive"));
  }
  return absl::OkStatus();
}

}  // namespace kvlens

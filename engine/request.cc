#include "engine/request.h"

#include "absl/strings/str_cat.h"
#include "engine/prompt_logprobs.h"

namespace kvlens {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kContext:
      return "context";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

absl::Status AttentionRowsRequest::Validate(int num_layers, int num_heads) const {
  if (layers.empty() != heads.empty()) {
    return absl::InvalidArgumentError("attention_rows: give both layers and heads");
  }
  for (int l : layers) {
    if (l < 0 || l >= num_layers) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention_rows layer ", l, " is outside [0, ", num_layers, ")"));
    }
  }
  for (int h : heads) {
    if (h < 0 || h >= num_heads) {
      return absl::InvalidArgumentError(
          absl::StrCat("attention_rows head ", h, " is outside [0, ", num_heads, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status StopParams::Validate() const {
  if (max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens = ", max_new_tokens, " must be >= 0 (0: up to the context)"));
  }
  if (min_new_tokens < 0 || (max_new_tokens > 0 && min_new_tokens > max_new_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_new_tokens = ", min_new_tokens,
                     " must be in [0, max_new_tokens = ", max_new_tokens, "]"));
  }
  if (stop_strings.size() > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop_strings has ", stop_strings.size(), " entries, at most 16"));
  }
  for (size_t i = 0; i < stop_strings.size(); ++i) {
    const size_t n = stop_strings[i].size();
    if (n == 0 || n > 256) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_strings[", i, "] has ", n, " bytes, must be 1 … 256"));
    }
  }
  return absl::OkStatus();
}

absl::Status GenerationRequest::Validate(int32_t vocab_size) const {
  if (prompt.empty()) return absl::InvalidArgumentError("prompt: no tokens");
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("prompt token ", i, " = ", prompt[i],
                                                     " is outside the vocabulary [0, ", vocab_size,
                                                     ")"));
    }
  }
  if (absl::Status s = sampling.Validate(vocab_size); !s.ok()) return s;
  if (top_logprobs < 0 || top_logprobs > 20) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_logprobs = ", top_logprobs, " must be in [0, 20]"));
  }
  if (absl::Status s = CheckPromptLogprobs(prompt_logprobs); !s.ok()) return s;
  if (absl::Status s = stop.Validate(); !s.ok()) return s;
  for (int32_t t : stop.stop_token_ids) {
    if (t < 0 || t >= vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop_token_ids: ", t, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvlens

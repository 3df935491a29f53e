#include "server/request_convert.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/tokenizer/chat_template.h"
#include "server/index_convert.h"

namespace kvlens::server {
namespace {

absl::Status Bad(const std::string& field, double value, const char* range) {
  return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " must be ", range));
}

absl::Status CheckToken(const std::string& field, int64_t id, int32_t vocab_size) {
  if (id < 0 || id >= vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " = ", id, " must be a token id in [0, ", vocab_size, ")"));
  }
  return absl::OkStatus();
}

absl::Status ConvertSampling(const v1::SamplingParams& in, int32_t vocab_size,
                             const GenerationConfig& defaults, SamplingParams* out) {
  // The ranges are the engine's (SamplingParams::Validate); checked here to name the field
  // the way the client wrote it.
  if (!(in.temperature() >= 0 && in.temperature() <= 100)) {
    return Bad("sampling.temperature", in.temperature(), "in [0, 100]");
  }
  if (in.top_k() < 0) return Bad("sampling.top_k", in.top_k(), ">= 0");
  const double top_p = in.has_top_p() ? in.top_p() : 1.0;
  if (!(top_p > 0 && top_p <= 1)) return Bad("sampling.top_p", top_p, "in (0, 1]");
  if (!(in.min_p() >= 0 && in.min_p() < 1)) return Bad("sampling.min_p", in.min_p(), "in [0, 1)");
  // Unset: the model's generation_config.json default, as Hugging Face and vLLM apply it.
  const double rep = in.has_repetition_penalty() ? in.repetition_penalty()
                                                 : defaults.repetition_penalty.value_or(1.0);
  if (!(rep > 0 && rep <= 10)) return Bad("sampling.repetition_penalty", rep, "in (0, 10]");
  if (!(std::abs(in.frequency_penalty()) <= 2)) {
    return Bad("sampling.frequency_penalty", in.frequency_penalty(), "in [-2, 2]");
  }
  if (!(std::abs(in.presence_penalty()) <= 2)) {
    return Bad("sampling.presence_penalty", in.presence_penalty(), "in [-2, 2]");
  }
  out->temperature = in.temperature();
  out->top_k = in.top_k();
  out->top_p = top_p;
  out->min_p = in.min_p();
  out->seed = in.seed();
  out->repetition_penalty = rep;
  out->frequency_penalty = in.frequency_penalty();
  out->presence_penalty = in.presence_penalty();
  for (const auto& [id, bias] : in.logit_bias()) {
    const std::string field = absl::StrCat("sampling.logit_bias[", id, "]");
    if (absl::Status s = CheckToken(absl::StrCat("sampling.logit_bias key"), id, vocab_size);
        !s.ok()) {
      return s;
    }
    if (!(std::abs(bias) <= 100.0f)) return Bad(field, bias, "finite and in [-100, 100]");
    out->logit_bias.emplace_back(id, bias);
  }
  // A map has no order on the wire; sort so equal requests give equal engine inputs.
  std::sort(out->logit_bias.begin(), out->logit_bias.end());
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateTokenIds(const google::protobuf::RepeatedField<int32_t>& ids,
                              const char* field, int32_t vocab_size) {
  for (int i = 0; i < ids.size(); ++i) {
    if (absl::Status s = CheckToken(absl::StrCat(field, "[", i, "]"), ids[i], vocab_size);
        !s.ok()) {
      return s;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> EncodeChat(const Model& model, const v1::ChatPrompt& chat,
                                                std::optional<bool> add_bos,
                                                const std::string& field) {
  if (model.tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(field, ": the model has no tokenizer; send token_ids"));
  }
  if (!model.chat_format.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(
        field, ": the model's chat template is ",
        model.tokenizer->chat_template().empty() ? "missing" : "none kvlens writes",
        "; start the server with --chat-template (", ChatFormatNames(), ") or send text"));
  }
  std::vector<ChatMessage> messages;
  for (const v1::ChatMessage& m : chat.messages()) messages.push_back({m.role(), m.content()});
  const bool open = !chat.has_add_generation_prompt() || chat.add_generation_prompt();
  auto text = ApplyChatTemplate(*model.chat_format, messages, open);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".", text.status().message()));
  }
  return model.tokenizer->EncodeWithSpecialTokens(*text,
                                                  add_bos.value_or(model.tokenizer->adds_bos()));
}

absl::StatusOr<GenerationRequest> ToGenerationRequest(const v1::GenerateRequest& request,
                                                      const Model& model, SaeList saes) {
  const int32_t vocab = model.config.vocab_size;
  const int context = model.config.max_seq_len;
  GenerationRequest out;

  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (model.tokenizer == nullptr) {
        return absl::FailedPreconditionError("text: the model has no tokenizer; send token_ids");
      }
      out.prompt = EncodeText(*model.tokenizer, request);
      if (out.prompt.empty()) {
        return absl::InvalidArgumentError("text: the prompt is empty (and add_bos is off)");
      }
      break;
    }
    case v1::GenerateRequest::kTokenIds: {
      const auto& ids = request.token_ids().ids();
      if (ids.empty()) return absl::InvalidArgumentError("token_ids.ids: the prompt is empty");
      if (absl::Status s = ValidateTokenIds(ids, "token_ids.ids", vocab); !s.ok()) return s;
      out.prompt.assign(ids.begin(), ids.end());
      break;
    }
    case v1::GenerateRequest::kChat: {
      auto ids = EncodeChat(
          model, request.chat(),
          request.has_add_bos() ? std::optional<bool>(request.add_bos()) : std::nullopt, "chat");
      if (!ids.ok()) return ids.status();
      out.prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError("prompt: set text, token_ids or chat");
  }
  if (static_cast<int64_t>(out.prompt.size()) >= context) {
    return absl::OutOfRangeError(absl::StrCat("prompt: ", out.prompt.size(),
                                              " tokens leave no room in the context of ", context,
                                              " tokens"));
  }

  if (absl::Status s =
          ConvertSampling(request.sampling(), vocab, model.generation_config, &out.sampling);
      !s.ok()) {
    return s;
  }

  const v1::StoppingParams& stop = request.stopping();
  if (stop.has_max_new_tokens()) {
    if (stop.max_new_tokens() < 1 || stop.max_new_tokens() > context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stopping.max_new_tokens = ", stop.max_new_tokens(), " must be in [1, ", context, "]"));
    }
    out.stop.max_new_tokens = stop.max_new_tokens();
  } else if (request.session_id() != 0) {
    out.stop.max_new_tokens = 0;  // the engine knows the session's history: up to the context
  } else {
    out.stop.max_new_tokens =
        std::min<int>(kDefaultMaxNewTokens, context - static_cast<int>(out.prompt.size()));
  }
  if (stop.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(
        absl::StrCat("stopping.stop: ", stop.stop_size(), " strings, at most ", kMaxStopStrings));
  }
  for (int i = 0; i < stop.stop_size(); ++i) {
    if (stop.stop(i).empty() || stop.stop(i).size() > kMaxStopBytes) {
      return absl::InvalidArgumentError(absl::StrCat("stopping.stop[", i, "] has ",
                                                     stop.stop(i).size(), " bytes, must be 1 … ",
                                                     kMaxStopBytes));
    }
    out.stop.stop_strings.push_back(stop.stop(i));
  }
  if (absl::Status s = ValidateTokenIds(stop.stop_token_ids(), "stopping.stop_token_ids", vocab);
      !s.ok()) {
    return s;
  }
  out.stop.stop_token_ids.assign(stop.stop_token_ids().begin(), stop.stop_token_ids().end());
  out.stop.ignore_eos = stop.ignore_eos();
  if (stop.min_new_tokens() < 0 ||
      (out.stop.max_new_tokens > 0 && stop.min_new_tokens() > out.stop.max_new_tokens)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stopping.min_new_tokens = ", stop.min_new_tokens(), " must be in [0, ",
        out.stop.max_new_tokens > 0 ? absl::StrCat("max_new_tokens = ", out.stop.max_new_tokens)
                                    : std::string("max_new_tokens"),
        "]"));
  }
  out.stop.min_new_tokens = stop.min_new_tokens();

  if (request.top_logprobs() < 0 || request.top_logprobs() > kMaxTopLogprobs) {
    return Bad("top_logprobs", request.top_logprobs(), "in [0, 20]");
  }
  out.top_logprobs = request.top_logprobs();
  if (request.has_prompt_logprobs()) {
    if (request.prompt_logprobs() < 0 || request.prompt_logprobs() > kMaxTopLogprobs) {
      return Bad("prompt_logprobs", request.prompt_logprobs(), "in [0, 20]");
    }
    if (request.session_id() != 0) {
      return absl::InvalidArgumentError(
          "prompt_logprobs: not with session_id (the session's history has no logits left)");
    }
    out.prompt_logprobs = request.prompt_logprobs();
  }
  if (request.session_id() < 0) return Bad("session_id", request.session_id(), ">= 0");
  out.session = request.session_id();
  if (request.has_attention_rows()) {
    // Empty lists mean every layer / head; the engine checks the ranges again.
    const v1::AttentionRowsRequest& rows = request.attention_rows();
    auto layers = ToIndexList(rows.layers(), model.config.num_layers, "attention_rows.layers");
    if (!layers.ok()) return layers.status();
    auto heads = ToIndexList(rows.heads(), model.config.num_heads, "attention_rows.heads");
    if (!heads.ok()) return heads.status();
    out.attention_rows.layers = *std::move(layers);
    out.attention_rows.heads = *std::move(heads);
  }
  if (!request.steering().empty()) {
    if (request.session_id() != 0) {
      return absl::InvalidArgumentError(
          "steering: not with session_id (the session's earlier tokens were computed unsteered)");
    }
    absl::StatusOr<std::vector<ResidualAdd>> adds =
        ToResidualAdds(request.steering(), model.config, saes, static_cast<int>(out.prompt.size()));
    if (!adds.ok()) return adds.status();
    out.steering = *std::move(adds);
  }
  return out;
}

v1::FinishReason ToProto(FinishReason reason) {
  switch (reason) {
    case FinishReason::kLength:
      return v1::FINISH_REASON_LENGTH;
    case FinishReason::kEos:
      return v1::FINISH_REASON_EOS;
    case FinishReason::kStop:
      return v1::FINISH_REASON_STOP;
    case FinishReason::kCancelled:
      return v1::FINISH_REASON_CANCELLED;
    case FinishReason::kContext:
      return v1::FINISH_REASON_CONTEXT;
    case FinishReason::kError:
      break;  // an error ends the stream with a status instead
  }
  return v1::FINISH_REASON_UNSPECIFIED;
}

void ToProto(const TokenEvent& event, bool with_logprobs, const AttentionRowsRequest& rows,
             v1::GenerateResponse* out) {
  out->add_token_ids(event.token);
  out->mutable_text()->append(event.text);
  if (!event.attention.empty()) {
    v1::AttentionRow* row = out->add_attention_rows();
    row->set_query_position(event.attention_keys - 1);
    row->set_num_keys(event.attention_keys);
    row->mutable_probs()->Add(event.attention.begin(), event.attention.end());
    row->mutable_layers()->Add(rows.layers.begin(), rows.layers.end());
    row->mutable_heads()->Add(rows.heads.begin(), rows.heads.end());
  }
  if (!with_logprobs) return;
  v1::TokenLogprob* lp = out->add_logprobs();
  lp->set_token(event.token);
  lp->set_logprob(event.logprob);
  for (const TokenLogprob& top : event.top_logprobs) {
    v1::TopLogprob* t = lp->add_top();
    t->set_token(top.token);
    t->set_logprob(top.logprob);
  }
}

void ToProto(const PromptLogprobsEvent& event, size_t begin, size_t end,
             v1::GenerateResponse* out) {
  if (out->prompt_logprobs().empty()) {
    out->set_prompt_logprobs_position(event.first_position + static_cast<int>(begin));
  }
  for (size_t i = begin; i < end; ++i) {
    v1::TokenLogprob* lp = out->add_prompt_logprobs();
    lp->set_token(event.tokens[i]);
    lp->set_logprob(event.logprobs[i]);
    if (event.top.empty()) continue;
    for (const TokenLogprob& top : event.top[i]) {
      v1::TopLogprob* t = lp->add_top();
      t->set_token(top.token);
      t->set_logprob(top.logprob);
    }
  }
}

void ToProto(const FinishEvent& event, v1::GenerateFinal* out) {
  out->set_finish_reason(ToProto(event.reason));
  v1::Usage* usage = out->mutable_usage();
  usage->set_prompt_tokens(event.usage.prompt_tokens);
  usage->set_generated_tokens(event.usage.generated_tokens);
  usage->set_cached_tokens(event.usage.cached_tokens);
  v1::Timings* t = out->mutable_timings();
  t->set_queue_seconds(event.timings.queue_seconds);
  t->set_prefill_seconds(event.timings.prefill_seconds);
  t->set_first_token_seconds(event.timings.first_token_seconds);
  t->set_decode_seconds(event.timings.decode_seconds);
}

}  // namespace kvlens::server

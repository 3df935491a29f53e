// Proto → engine conversion with validation: every rejected field is named as the client
// spelled it ("sampling.top_p = 1.5 must be in (0, 1]"). Engine → proto for the streamed
// events. No gRPC here, only messages, so it is testable on its own.
#ifndef KVLENS_SERVER_REQUEST_CONVERT_H_
#define KVLENS_SERVER_REQUEST_CONVERT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/model.h"
#include "engine/request.h"
#include "kvlens/v1/generation.pb.h"
#include "server/steering_convert.h"

namespace kvlens::server {

inline constexpr int kDefaultMaxNewTokens = 256;
inline constexpr int kMaxTopLogprobs = 20;
inline constexpr int kMaxStopStrings = 16;  // the engine's limits
inline constexpr size_t kMaxStopBytes = 256;

// INVALID_ARGUMENT naming the field for anything out of range. The callbacks are left
// empty for the caller to fill. `saes`: the SAEs steering vectors may name.
absl::StatusOr<GenerationRequest> ToGenerationRequest(const v1::GenerateRequest& request,
                                                      const Model& model, SaeList saes = {});

// A text prompt's ids under the message's optional add_bos (absent: the model's own
// setting, Tokenizer::adds_bos) and parse_special (absent: true). Msg: GenerateRequest,
// TokenizeRequest or Interpret's PromptInput.
template <typename Msg>
std::vector<int32_t> EncodeText(const Tokenizer& tokenizer, const Msg& m) {
  const bool add_bos = m.has_add_bos() ? m.add_bos() : tokenizer.adds_bos();
  return !m.has_parse_special() || m.parse_special()
             ? tokenizer.EncodeWithSpecialTokens(m.text(), add_bos)
             : tokenizer.Encode(m.text(), add_bos);
}

// A conversation's ids: written by the model's chat format (Model::chat_format), encoded
// with special tokens parsed and BOS per add_bos (absent: the model's own setting).
// FAILED_PRECONDITION naming --chat-template when the model has no chat format,
// INVALID_ARGUMENT naming field (e.g. "chat.messages[1].role") for a bad conversation.
absl::StatusOr<std::vector<int32_t>> EncodeChat(const Model& model, const v1::ChatPrompt& chat,
                                                std::optional<bool> add_bos,
                                                const std::string& field);

// Token ids of a Detokenize call, each in [0, vocab_size).
absl::Status ValidateTokenIds(const google::protobuf::RepeatedField<int32_t>& ids,
                              const char* field, int32_t vocab_size);

v1::FinishReason ToProto(FinishReason reason);
// A token; with its attention row (when the event has one), `rows` its resolved layers and
// heads.
void ToProto(const TokenEvent& event, bool with_logprobs, const AttentionRowsRequest& rows,
             v1::GenerateResponse* out);
// Positions [begin, end) of the event appended to out's prompt_logprobs (which must then
// continue them: the first sets prompt_logprobs_position).
void ToProto(const PromptLogprobsEvent& event, size_t begin, size_t end, v1::GenerateResponse* out);
void ToProto(const FinishEvent& event, v1::GenerateFinal* out);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_REQUEST_CONVERT_H_

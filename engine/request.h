// A generation request as the engine sees it (never protobuf), and the events it streams.
#ifndef KVLENS_ENGINE_REQUEST_H_
#define KVLENS_ENGINE_REQUEST_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/model/residual_add.h"
#include "engine/sampler.h"

namespace kvlens {

using RequestId = int64_t;
using SessionId = int64_t;
using Clock = std::chrono::steady_clock;

struct StopParams {
  int max_new_tokens = 256;  // 0: as many as the context leaves
  // The tokens that would end the generation (end-of-generation unless ignore_eos, and
  // stop_token_ids) get logit −∞ until this many were generated (Hugging Face's
  // min_new_tokens, vLLM's min_tokens); stop strings still apply. <= max_new_tokens.
  int min_new_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::string> stop_strings;  // generation ends before the first occurrence
  bool ignore_eos = false;

  // The counts and the stop strings (not the token ids, which need the vocabulary):
  // INVALID_ARGUMENT naming the first bad one. Cheap: Engine::Submit checks again once it
  // has turned max_new_tokens 0 into the room the context leaves.
  absl::Status Validate() const;
};

enum class FinishReason { kLength, kEos, kStop, kCancelled, kContext, kError };
const char* FinishReasonName(FinishReason r);

// One generated token as streamed.
struct TokenEvent {
  int32_t token = 0;
  std::string text;      // UTF-8 delta that became complete with this token (may be empty)
  float logprob = 0.0f;  // log p(token) under the model (before sampling filters)
  std::vector<TokenLogprob> top_logprobs;  // the N most likely, when asked
  Clock::time_point time;
  // With GenerationRequest::attention_rows: the attention row of the query whose logits
  // produced this token (position p − 1 for a token at position p) over keys 0 … p − 1,
  // for each chosen layer, then head: [layers][heads][attention_keys]. Else empty.
  std::vector<float> attention;
  int attention_keys = 0;
};

struct Usage {
  int prompt_tokens = 0;
  int generated_tokens = 0;
  int cached_tokens = 0;  // prompt tokens found in the prefix cache or the session
};

struct Timings {
  double queue_seconds = 0;        // arrival → first scheduled step
  double prefill_seconds = 0;      // first scheduled step → prompt fully computed
  double first_token_seconds = 0;  // arrival → first generated token
  double decode_seconds = 0;       // first → last generated token
};

struct FinishEvent {
  FinishReason reason = FinishReason::kLength;
  absl::Status status;  // non-OK only with kError
  Usage usage;
  Timings timings;
  std::string text;  // any text held back until the end (incomplete UTF-8 as U+FFFD)
};

// With GenerationRequest::prompt_logprobs: log p(prompt token at p | tokens 0 … p − 1) for
// the prompt positions p = first_position … first_position + tokens.size() − 1, from the
// logits row of position p − 1 (so position 0 has none). A request's events cover
// positions 1 … prompt size − 1 in order, one a step (its prompt chunk), all before its
// first TokenEvent.
struct PromptLogprobsEvent {
  int first_position = 1;
  std::vector<int32_t> tokens;  // the prompt's tokens at those positions
  std::vector<float> logprobs;  // log p of each, under the model (no sampling filters)
  std::vector<std::vector<TokenLogprob>> top;  // per position the N most likely, when asked
};

// Called on the engine's step thread; must not block (queue the event and return).
struct RequestCallbacks {
  std::function<void(const PromptLogprobsEvent&)> on_prompt_logprobs;  // may be empty
  std::function<void(const TokenEvent&)> on_token;
  std::function<void(const FinishEvent&)> on_finish;  // exactly once, last
};

// Interpretability: stream each generated token's attention row for these layers and
// query heads (both non-empty), read from the live forward pass.
struct AttentionRowsRequest {
  std::vector<int> layers;
  std::vector<int> heads;

  // Both given or neither, each layer and head in the model's range: INVALID_ARGUMENT
  // naming the field and the limit.
  absl::Status Validate(int num_layers, int num_heads) const;
};

struct GenerationRequest {
  std::vector<int32_t> prompt;  // token ids (BOS included if wanted)
  SamplingParams sampling;
  StopParams stop;
  int top_logprobs = 0;                 // 0 … 20
  SessionId session = 0;                // 0: none; else an open session this request appends to
  AttentionRowsRequest attention_rows;  // empty: none streamed
  // Interpretability: vectors added to the residual stream at the positions this request
  // computes from each one's from_position on (activation steering;
  // engine/model/residual_add.h). Not with a session; a steered request shares
  // prefix-cache blocks (reuses and fills them) only wholly before its first steered
  // position.
  std::vector<ResidualAdd> steering;
  // −1: none; 0 … 20: score the prompt (PromptLogprobsEvent) with that many most likely
  // tokens at each position, as vLLM's prompt_logprobs. Not with a session; the request
  // computes every prompt position (it takes nothing from the prefix cache, and fills it).
  int prompt_logprobs = -1;
  RequestCallbacks callbacks;

  // The fields that need no engine state (prompt and stop token ids within the
  // vocabulary, sampling, top_logprobs, prompt_logprobs, stop.Validate()): INVALID_ARGUMENT
  // naming the first bad one, else OK.
  absl::Status Validate(int32_t vocab_size) const;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_REQUEST_H_

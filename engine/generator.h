// Offline generation for one sequence: chunked prefill of the prompt, then one decode step
// per token, each a Transformer::Forward whose query offset is the number of tokens
// already cached. The server's continuous-batching engine builds on the same pieces.
#ifndef KVLENS_ENGINE_GENERATOR_H_
#define KVLENS_ENGINE_GENERATOR_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/kv_cache/sequence_cache.h"
#include "engine/model/model.h"
#include "engine/model/residual_add.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "kernels/backend.h"

namespace kvlens {

struct GenerateOptions {
  int max_new_tokens = 64;
  int prefill_chunk = 512;  // prompt tokens per forward step
  int block_size = 16;      // KV-cache tokens per block
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;  // the cache's elements
  SamplingParams sampling;
  bool stop_at_eos = true;
  std::vector<int32_t> stop_token_ids;
  // Until this many tokens, the end-of-generation tokens (with stop_at_eos) and
  // stop_token_ids are never drawn (GenerationRequest's StopParams::min_new_tokens: a −∞
  // logit bias in the draw; the reported log-probabilities stay the model's).
  // [0, max_new_tokens].
  int min_new_tokens = 0;
  // Vectors added to the residual stream at every position (activation steering); the
  // Transformer checks their layers and lengths.
  std::vector<ResidualAdd> steering;
  // −1: none; 0 … 20: score the prompt as the engine does (GenerationRequest::
  // prompt_logprobs): each prefill chunk takes every row's logits and hands
  // on_prompt_logprobs its positions' log-probabilities, in order, before the first token.
  int prompt_logprobs = -1;
  std::function<void(const PromptLogprobsEvent&)> on_prompt_logprobs;
  // 0 … 20: with each generated token's log-probability (always kept), its this many most
  // likely tokens (GenerationRequest::top_logprobs).
  int top_logprobs = 0;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated tokens (not the prompt)
  // Per generated token: log p(token) under the model (before the draw's bias, penalties
  // and filters, as the engine reports it), and with top_logprobs its most likely tokens.
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top_logprobs;
  FinishReason finish_reason = FinishReason::kLength;
  int cached_prompt_tokens = 0;  // the prompt's first tokens taken from a GenerateCache
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;  // all decode steps after the first generated token
};

// Called with each generated token; return false to stop (finish reason kCancelled).
using TokenCallback = std::function<bool(int32_t token)>;

// A sequence's KV cache kept from one Generate call to the next, as a conversation goes
// turn by turn (kvlens-cli generate --interactive on a local model): a call given one
// prefills only its prompt after the longest prefix the cache holds (its last token is
// always computed, for the first draw), as kvlens-server's prefix cache spares a
// conversation's earlier turns, and leaves it holding its own prompt and the tokens it ran.
// On the CPU the kept rows are the bits a fresh run computes (its products and attention
// give a row the same bits whatever the chunk); on a GPU, within the rounding of its
// kernels' other tilings, as with the server's prefix cache.
//
// The rows are taken with the same steering, or under other steering up to the first
// position either steers (the rows before it are the unsteered model's in both), and never
// with prompt_logprobs (which scores every row). The storage serves a call on the same backend
// memory, block size and cache type whose sequence fits; otherwise it is allocated anew with the
// same room, or with twice the room when that was too little (up to the context length; the rows
// copied along), so a growing conversation reallocates rarely. It keeps every position (no
// sliding-window ring).
template <typename T>
struct GenerateCache {
  std::unique_ptr<SequenceCache<T>> sequence;
  std::vector<int32_t> tokens;        // the positions whose keys and values it holds, in order
  std::vector<ResidualAdd> steering;  // what they were computed with

  int64_t capacity() const {  // positions it has room for
    return sequence
               ? static_cast<int64_t>(sequence->table().size()) * sequence->storage.block_size()
               : 0;
  }
};

template <typename T>
absl::StatusOr<GenerateResult> Generate(const Model& model, kernels::Backend<T>& backend,
                                        absl::Span<const int32_t> prompt,
                                        const GenerateOptions& options,
                                        const TokenCallback& on_token = nullptr,
                                        GenerateCache<T>* reuse = nullptr);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_GENERATOR_H_

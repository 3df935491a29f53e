// Scoring a prompt: the log-probability the model gives each prompt token after the tokens
// before it (vLLM's prompt_logprobs), read from the logits rows of a prefill chunk.
#ifndef KVLENS_ENGINE_PROMPT_LOGPROBS_H_
#define KVLENS_ENGINE_PROMPT_LOGPROBS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/model/transformer.h"
#include "engine/request.h"
#include "kernels/cpu/thread_pool.h"

namespace kvlens {

// INVALID_ARGUMENT unless `top` is −1 (no scoring) or in [0, 20].
absl::Status CheckPromptLogprobs(int top);

// logits: [n, vocab], the rows of positions p = first_row … first_row + n − 1; next: the
// n tokens at positions first_row + 1 …. Each position p + 1 gets log p(next[p − first_row])
// = l − LogSumExp(row), in double as the sampler forms it, and its `top` (0 … 20) most
// likely tokens (ties: lower id first). Rows are independent: spread over `pool` when given.
PromptLogprobsEvent ScorePromptRows(absl::Span<const float> logits, int vocab, int first_row,
                                    absl::Span<const int32_t> next, int top,
                                    kernels::ThreadPool* pool);

// The event of a scored chunk from Forward's output: rows first … first + next.size() − 1
// of `out` score positions first_position + 1 … (their tokens `next`). A device's picks
// (out.pick_token non-empty: the entry's score_next was `next`, its score_top `top`) are
// read as they are; else ScorePromptRows over the logits rows (as float).
template <typename T>
PromptLogprobsEvent ScoreForwardRows(const ForwardOutput<T>& out, size_t first, int vocab,
                                     int first_position, absl::Span<const int32_t> next, int top,
                                     kernels::ThreadPool* pool);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_PROMPT_LOGPROBS_H_

// Sampler: logits → next token, seeded and reproducible.
//
// Order of operations (as in llama.cpp / vLLM): logit bias → repetition, frequency and
// presence penalties over the tokens so far → greedy if temperature == 0 → temperature →
// top-k → top-p (nucleus) → min-p → draw from the renormalised distribution.
#ifndef KVLENS_ENGINE_SAMPLER_H_
#define KVLENS_ENGINE_SAMPLER_H_

#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "engine/token_counts.h"
#include "kernels/token_draw.h"

namespace kvlens {

struct SamplingParams {
  double temperature = 0.0;         // 0: greedy (argmax, lowest id on ties)
  int top_k = 0;                    // 0: off; keep the k most likely tokens
  double top_p = 1.0;               // 1: off; keep the smallest set whose mass reaches top_p
  double min_p = 0.0;               // 0: off; drop tokens with p < min_p · p_max
  double repetition_penalty = 1.0;  // 1: off; CTRL-style: logit/θ if > 0 else logit·θ
  double frequency_penalty = 0.0;   // subtract count(token) · value
  double presence_penalty = 0.0;    // subtract value once per token seen
  uint64_t seed = 0;
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the raw logits

  // INVALID_ARGUMENT naming the field and its allowed range.
  absl::Status Validate(int32_t vocab_size) const;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

  // Picks the next token. `logits` [V] is modified (bias, penalties, temperature).
  // `history` holds the tokens the penalties look at (prompt and generated so far).
  int32_t Sample(absl::Span<float> logits, absl::Span<const int32_t> history);

  const SamplingParams& params() const { return params_; }

  // The next draw (temperature, filters, logit bias and penalties, a view of these
  // params' and of the counts of `history`'s tokens, valid until the next call) for a
  // backend to run where the logits are (Backend::DrawTokens): the token Sample(logits,
  // history) would pick. Its uniform number is taken from the generator now (at a
  // temperature) and kept until a draw uses it (Sample) or ClearReserved: the same number
  // a Sample here would have taken, so the stream of draws stays one per sampled token
  // whichever path samples. Calls before that reuse the number. The counts are kept from
  // call to call (TokenCounts): each call's `history` must extend the one before.
  kernels::TokenDraw ReserveDraw(absl::Span<const int32_t> history);
  // Forgets a reserved number that a draw elsewhere has used.
  void ClearReserved() { reserved_ = false; }

 private:
  // Whether the penalties look at the tokens so far.
  bool NeedsHistory() const {
    return params_.repetition_penalty != 1.0 || params_.frequency_penalty != 0.0 ||
           params_.presence_penalty != 0.0;
  }
  void ApplyBiasAndPenalties(absl::Span<float> logits, absl::Span<const int32_t> history) const;
  // The draw these params make, u01 left 0 and no token counts.
  kernels::TokenDraw Draw() const;
  // The reserved number, or a fresh one.
  double NextUniform();

  SamplingParams params_;
  TokenCounts counts_;  // ReserveDraw's, with penalties
  std::mt19937_64 rng_;
  bool reserved_ = false;
  double reserved_u01_ = 0.0;
};

// `bias` followed by (id, −∞) for each of `banned`: a logit bias under which the draw never
// picks a banned token (a sampled row keeps at least one other).
std::vector<std::pair<int32_t, float>> BiasBanning(absl::Span<const std::pair<int32_t, float>> bias,
                                                   absl::Span<const int32_t> banned);

// log softmax of one row of logits: out[i] = l_i − kernels::LogSumExp(l), in double.
void LogSoftmax(absl::Span<const float> logits, std::vector<double>& out);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;
};

// One logits row as the engine handles it: the model's log-probabilities (LogSoftmax,
// before penalties and filters), the token `sampler` picks (penalties from `history`), and
// the `top_logprobs` most likely tokens (ties: lower id first). Its scratch buffers are
// per thread: rows of different samplers may be handled on different threads at once.
struct RowSample {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<TokenLogprob> top_logprobs;
};
RowSample SampleRow(Sampler& sampler, absl::Span<const float> logits,
                    absl::Span<const int32_t> history, int top_logprobs);
// The same for a draw `sampler` reserved (Sampler::ReserveDraw, its token counts and
// uniform number; draw.top_logprobs of the row's most likely tokens), drawn on the host as
// a backend's DrawTokens draws it (kernels::DrawRows), which then clears the reservation:
// SampleRow's result without recounting the history, and without copying a row that has
// no bias or penalty.
RowSample DrawRow(Sampler& sampler, absl::Span<const float> logits, const kernels::TokenDraw& draw);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_SAMPLER_H_

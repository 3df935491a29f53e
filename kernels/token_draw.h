// A temperature draw from one row of logits, given the draw's uniform number: the part of
// sampling (engine/sampler.h) that a device backend can run where the logits are
// (Backend::DrawTokens), defined once here for the host.
//
// Order: weights w_i = e^((l_i − max) / T) in float (kernels::TemperatureWeights) → the
// candidates sorted by (weight desc, id asc) → top-k → top-p (the shortest prefix whose
// mass, each weight over the kept sum, reaches top_p) → min-p (weights >= min_p · the
// largest) → u = u01 · the kept mass, and the first candidate whose running mass exceeds u
// (the last kept one if rounding leaves none).
#ifndef KVLENS_KERNELS_TOKEN_DRAW_H_
#define KVLENS_KERNELS_TOKEN_DRAW_H_

#include <cstdint>
#include <utility>

#include "absl/types/span.h"

namespace kvlens::kernels {

struct TokenDraw {
  double temperature = 0.0;  // 0 (or < ~3e-39): the greedy pick; the filters, u01 unused
  int top_k = 0;             // 0: off
  double top_p = 1.0;        // 1: off
  double min_p = 0.0;        // 0: off
  double u01 = 0.0;          // the draw's uniform number in [0, 1): 53 random bits · 2^−53
  int top_logprobs = 0;      // also the row's this many most likely tokens (0 … 20)
  // >= 0: no draw; the row's token is this one (a prompt being scored: the token that
  // follows the row), reported with its log-probability and top_logprobs as a drawn one
  // would be; the bias, penalties and filters are then unused. In [0, vocab), or −1.
  int32_t forced_token = -1;
  // Added to the logits, entry by entry in order, before the draw (not before the reported
  // log-probabilities): by DrawRows and Backend::DrawTokens; DrawToken's caller applies
  // it (ApplyLogitBias). Ids in [0, vocab).
  absl::Span<const std::pair<int32_t, float>> logit_bias;
  // The repetition, frequency and presence penalties (engine/sampler.h's SamplingParams;
  // 1, 0, 0: off) over the tokens so far, each distinct token once with its count (>= 1):
  // applied after the logit bias, before the draw (not before the reported
  // log-probabilities), by DrawRows and Backend::DrawTokens. Ids in [0, vocab), distinct.
  double repetition_penalty = 1.0;
  double frequency_penalty = 0.0;
  double presence_penalty = 0.0;
  absl::Span<const std::pair<int32_t, int32_t>> token_counts;

  bool HasPenalties() const {
    return !token_counts.empty() &&
           (repetition_penalty != 1.0 || frequency_penalty != 0.0 || presence_penalty != 0.0);
  }
};

// logits[id] += bias for each entry in order (a repeated id adds each time).
inline void ApplyLogitBias(absl::Span<float> logits,
                           absl::Span<const std::pair<int32_t, float>> bias) {
  for (const auto& [id, b] : bias) logits[static_cast<size_t>(id)] += b;
}

// One token's logit under the penalties, seen `count` times: CTRL's repetition penalty
// (l / θ if l > 0, else l · θ, in double rounded to float), then
// l − float(frequency · count + presence) (each operation rounded on its own: no FMA).
float PenalizedLogit(float logit, int32_t count, double repetition, double frequency,
                     double presence);

// logits[id] = PenalizedLogit(logits[id], count, …) for each of draw.token_counts (when
// draw.HasPenalties()).
void ApplyPenalties(absl::Span<float> logits, const TokenDraw& draw);

// The most top log-probabilities a row reports (the API's limit).
inline constexpr int kMaxTopLogprobs = 20;

// 53 random bits of a 64-bit generator's output as a uniform number in [0, 1).
inline double UniformFromBits(uint64_t bits) { return static_cast<double>(bits >> 11) * 0x1.0p-53; }

// The token `draw` picks from `logits` (bias and penalties already applied); the greedy
// pick (kernels::ArgMax) at temperature 0. The logits are not modified; draw.logit_bias
// is not applied (the caller has).
int32_t DrawToken(absl::Span<const float> logits, const TokenDraw& draw);

// The k most likely tokens of a row (k <= its size), by log-probability l − lse desc,
// then id asc, into ids[0 … k) and their log-probabilities into logprobs.
void TopLogprobs(absl::Span<const float> logits, double lse, int k, int32_t* ids, float* logprobs);

// Each of `rows` rows of logits [rows, vocab]: token[r] = DrawToken(row r with
// draws[r].logit_bias and then its penalties applied, draws[r]) (draws[r].forced_token
// where that is >= 0) and
// logprob[r] = l[token[r]] − LogSumExp(row r) (kernels/cpu/row_reduce.h), the model's
// log-probability of the token, as the engine reports it; and where draws[r].top_logprobs
// is k > 0, TopLogprobs(row r, min(k, vocab)) into top_token and top_logprob, each
// [rows, kMaxTopLogprobs] (row r's first entries; may be null when no row asks).
void DrawRows(const float* logits, int rows, int vocab, const TokenDraw* draws, int32_t* token,
              float* logprob, int32_t* top_token, float* top_logprob);

}  // namespace kvlens::kernels

#endif  // KVLENS_KERNELS_TOKEN_DRAW_H_

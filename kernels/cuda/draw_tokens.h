// Token draws on the device (CudaBackend::DrawTokens): kernels/token_draw.h's DrawToken,
// row by row where the logits are, so a sampling step copies back 8 bytes a row rather
// than the row.
#ifndef KVLENS_KERNELS_CUDA_DRAW_TOKENS_H_
#define KVLENS_KERNELS_CUDA_DRAW_TOKENS_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/token_draw.h"

namespace kvlens::kernels::cuda {

// One row's draw as the kernel reads it (uploaded as an array, one per row).
struct DeviceDraw {
  float inv_temperature = 0.0f;  // float(1 / temperature), as TemperatureWeights; 0: greedy
  float min_p = 0.0f;            // float(min_p), as DrawToken's threshold
  int32_t top_k = 0;
  int32_t top_logprobs = 0;  // 0 … kMaxTopLogprobs
  double top_p = 1.0;
  double u01 = 0.0;
  int32_t bias_offset = 0;          // the row's logit bias: entries [offset, offset + count) of
  int32_t bias_count = 0;           // LaunchDrawTokens' `bias`
  double repetition_penalty = 1.0;  // TokenDraw's penalties
  double frequency_penalty = 0.0;
  double presence_penalty = 0.0;
  int32_t penalty_offset = 0;  // the row's token counts: entries [offset, offset + count)
  int32_t penalty_count = 0;   // of LaunchDrawTokens' `penalties` (0: no penalty applies)
  int32_t forced_token = -1;   // TokenDraw's: >= 0, no draw (nor bias, penalties, filters)
  // A row with a bias or penalties past kDrawCachedVocab: its row of LaunchDrawTokens'
  // `adjusted` (the adjusted rows in order, so the scratch holds only theirs).
  int32_t adjusted_row = 0;
};

// One logit-bias entry: logits[id] += value.
struct DeviceBias {
  int32_t id = 0;
  float value = 0.0f;
};

// One token the penalties count: logits[id] = PenalizedLogit(logits[id], count, …).
struct DevicePenalty {
  int32_t id = 0;
  int32_t count = 0;
};

DeviceDraw ToDeviceDraw(const TokenDraw& draw);

// The largest vocabulary the kernel takes: the candidates' masses are summed as 42-bit
// fixed-point integers (exact and in any order the same) in 64 bits.
inline constexpr int kDrawMaxVocab = 1 << 21;
// The largest vocabulary whose rows the kernel keeps in shared memory (their weights, or
// an adjusted row's logits: 160 KB, with the histograms' 28 KB within an SM's 227 KB), so
// each of a draw's ~15 passes reads a weight rather than recomputing an exponential;
// longer rows recompute the weights each pass, and an adjusted one is written to
// `adjusted`.
inline constexpr int kDrawCachedVocab = 40960;

// For each of `rows` rows of logits [rows, vocab] (device arrays): token[r] the token
// draws[r] picks (DrawToken, the greedy pick at inv_temperature 0; its forced_token where
// that is >= 0, in [0, vocab)), logprob[r] =
// l[token] − LogSumExp(row) (row_reduce.h's), and the row's draws[r].top_logprobs most
// likely tokens (logit desc, id asc: TopLogprobs' order) with theirs in top_token and
// top_logprob [rows, kMaxTopLogprobs] (null when no row asks). A row with a logit bias
// (`bias`, ids in [0, vocab)) or penalties (`penalties`, distinct ids in [0, vocab)) draws
// from its adjusted logits (the bias entries added in order, then each counted token
// penalized: ApplyLogitBias, ApplyPenalties): in shared memory for vocab <=
// kDrawCachedVocab, else in row draws[r].adjusted_row of `adjusted` [adjusted rows, vocab]
// (device scratch, one row for each row with a bias or penalties, not [rows, vocab]: a
// scored chunk's 511 forced rows of Llama 3's vocabulary and its last row drawn with a
// bias take 0.5 MB, not 262; null when no row is adjusted or the rows fit); its reported
// log-probabilities are the raw logits'. The
// same token as DrawToken for the same u01 except where u01 · the kept mass falls within
// ~vocab · 2^−43 of a boundary between two candidates (the masses here are fixed-point
// sums of the same float weights; the host sums them in double), or a top-p cut within as
// much of top_p · the sum.
absl::Status LaunchDrawTokens(const float* logits, int rows, int vocab, const DeviceDraw* draws,
                              const DeviceBias* bias, const DevicePenalty* penalties,
                              float* adjusted, int32_t* token, float* logprob, int32_t* top_token,
                              float* top_logprob, cudaStream_t stream);

}  // namespace kvlens::kernels::cuda

#endif  // KVLENS_KERNELS_CUDA_DRAW_TOKENS_H_

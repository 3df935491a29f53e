// Per-head summaries of one layer's attention probabilities A [H, n, Tk] (query row i is
// absolute position offset + i; key j is position j). Definitions (docs/interpretability.md):
//
//   entropy      mean over rows of −Σ_j A[i, j] ln A[i, j]            (nats; 0 ln 0 = 0)
//   prev_token   mean over rows with position p ≥ 1 of A[i, p − 1]
//   sink         mean over rows of A[i, 0]
//   induction    for a sequence whose positions s … s+P−1 are repeated at s+P … s+2P−1
//                (P = period, s = start): mean over rows with position p in [s+P, s+2P)
//                of A[i, p − P + 1], the token after p's previous occurrence
//
// A score whose set of rows is empty is NaN.
#ifndef KVLENS_ENGINE_INTERPRET_HEAD_SCORES_H_
#define KVLENS_ENGINE_INTERPRET_HEAD_SCORES_H_

#include <cstdint>
#include <vector>

namespace kvlens::interpret {

struct HeadScores {
  double entropy = 0.0;
  double prev_token = 0.0;
  double sink = 0.0;
  double induction = 0.0;  // NaN without a period
};

struct InductionLayout {
  int period = 0;  // P; 0: no induction score
  int start = 0;   // s: position of the first token of the first copy
};

// One entry per head.
template <typename T>
std::vector<HeadScores> ScoreHeads(const std::vector<T>& probs, int num_heads, int num_queries,
                                   int num_keys, int query_offset, InductionLayout induction = {});

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_HEAD_SCORES_H_

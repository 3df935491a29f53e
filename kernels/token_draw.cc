#include "kernels/token_draw.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/cpu/row_reduce.h"

namespace kvlens::kernels {

namespace {

// A draw's buffers.
struct DrawScratch {
  std::vector<float> weights;        // e^((l − max) / T) of each id
  std::vector<uint64_t> candidates;  // (~weight bits) << 32 | id: ascending is (p desc, id asc)
  std::vector<uint32_t> counters;
  std::vector<uint32_t> bucket_ends;
};

// Lays out the keys of `weights` (see DrawToken) in `candidates` by their top
// kBucketBits bits, the complement of the weight's sign, 8 exponent and 2 mantissa bits (a
// quarter of a binade of weight): a counting sort, unordered within a bucket. Lists where
// each non-empty bucket ends in `bucket_ends`.
void BucketByWeight(const std::vector<float>& weights, std::vector<uint32_t>& counters,
                    std::vector<uint64_t>& candidates, std::vector<uint32_t>& bucket_ends) {
  // Bucket of weight bits w: kBuckets − 1 − (w >> kShift), the top bits of the key's ~w.
  // Ids i ≡ s (mod kLanes) count and place through lane s's counters, so a run of weights
  // in one bucket (the zeros of a peaked row) is kLanes chains of increments, not one
  // chain through a single counter. Within a bucket the order is then not the ids'; the
  // bucket is sorted by its keys when it is reached. (The loops are unrolled by lane: one
  // loop with the lane as i % kLanes measured 5–10% slower.)
  constexpr int kBucketBits = 11;
  constexpr int kShift = 32 - kBucketBits;
  constexpr uint32_t kBuckets = uint32_t{1} << kBucketBits;
  constexpr uint32_t kLanes = 4;
  auto bucket_of = [](float w) {
    uint32_t bits;
    std::memcpy(&bits, &w, sizeof(bits));
    return kBuckets - 1 - (bits >> kShift);
  };
  const uint32_t n = static_cast<uint32_t>(weights.size());
  const float* w = weights.data();
  counters.assign(kLanes * kBuckets, 0);  // lane s's counter of bucket b at b·kLanes+s
  uint32_t* counter = counters.data();
  uint32_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (uint32_t s = 0; s < kLanes; ++s) ++counter[bucket_of(w[i + s]) * kLanes + s];
  }
  for (; i < n; ++i) ++counter[bucket_of(w[i]) * kLanes + i % kLanes];
  bucket_ends.clear();
  uint32_t at = 0;
  for (uint32_t b = 0; b < kBuckets; ++b) {
    const uint32_t before = at;
    for (uint32_t s = 0; s < kLanes; ++s) {
      const uint32_t count = counter[b * kLanes + s];
      counter[b * kLanes + s] = at;  // now where lane s's next key of bucket b goes
      at += count;
    }
    if (at > before) bucket_ends.push_back(at);
  }
  candidates.resize(n);
  uint64_t* out = candidates.data();
  auto place = [&](uint32_t id, uint32_t s) {
    uint32_t bits;
    std::memcpy(&bits, &w[id], sizeof(bits));
    out[counter[(kBuckets - 1 - (bits >> kShift)) * kLanes + s]++] =
        static_cast<uint64_t>(~bits) << 32 | id;
  };
  for (i = 0; i + kLanes <= n; i += kLanes) {
    for (uint32_t s = 0; s < kLanes; ++s) place(i + s, s);
  }
  for (; i < n; ++i) place(i, i % kLanes);
}

}  // namespace

int32_t DrawToken(absl::Span<const float> logits, const TokenDraw& draw) {
  const int32_t n = static_cast<int32_t>(logits.size());
  // A temperature so small that 1/T overflows float (below ~3e-39) is greedy too: its
  // weights would be 0 · inf = NaN at the max and 0 elsewhere.
  if (draw.temperature == 0.0 || std::isinf(static_cast<float>(1.0 / draw.temperature))) {
    return ArgMax(logits);
  }
  // softmax at temperature, max subtracted first (in float, vectorised: std::exp in double
  // took ~5 ns an element, 160 µs a 32000-token row)
  const float max_l = MaxLogit(logits);
  // Per thread, not per sampler: a step's rows then reuse the same few hundred KB, warm in
  // the cache, rather than each request's own (cold by its next step).
  thread_local DrawScratch scratch;
  std::vector<float>& weights = scratch.weights;
  std::vector<uint64_t>& candidates = scratch.candidates;
  std::vector<uint32_t>& bucket_ends = scratch.bucket_ends;
  weights.resize(n);
  TemperatureWeights(logits, max_l, draw.temperature, weights.data());
  // The candidates as keys whose ascending order is (probability desc, id asc): a weight is
  // a finite float >= +0 (TemperatureWeights), so its bits order as it does, and
  // ~bits << 32 | id sorts the larger weight, then the lower id, first. They are laid out
  // by a counting sort on the keys' top bits (a bucket spans a quarter of a binade of
  // weight), and each bucket is sorted when the filters or the draw reach it: a peaked
  // row's draw sorts a bucket or two, and a few hundred candidates passing top-p cost a few
  // dozen small sorts. Widening partial sorts of the row instead took ~0.5 ms a 32000-token
  // row when a few hundred candidates pass.
  BucketByWeight(weights, scratch.counters, candidates, bucket_ends);
  auto weight = [&](size_t k) { return weights[static_cast<uint32_t>(candidates[k])]; };
  size_t sorted = 0;  // [0, sorted) is in its final order
  size_t bucket = 0;  // the next bucket_ends to sort
  auto sort_to = [&](size_t k) {
    k = std::min(k, candidates.size());
    while (sorted < k) {
      const size_t end = bucket_ends[bucket++];
      std::sort(candidates.begin() + static_cast<ptrdiff_t>(sorted),
                candidates.begin() + static_cast<ptrdiff_t>(end));
      sorted = end;
    }
  };
  size_t keep = candidates.size();
  if (draw.top_k > 0 && static_cast<size_t>(draw.top_k) < keep) {
    keep = draw.top_k;
    sort_to(keep);
  }
  // Mass of the kept candidates: in sorted order when they are a sorted prefix, else (all
  // of them) in id order, which differs from the sorted order's sum only in rounding.
  auto mass_of = [&](size_t k) {
    double m = 0.0;
    for (size_t i = 0; i < k; ++i) m += weight(i);
    return m;
  };
  double sum = 0.0;
  if (keep == candidates.size()) {
    for (float w : weights) sum += w;
  } else {
    sum = mass_of(keep);
  }
  const size_t summed = keep;
  if (draw.top_p < 1.0) {
    double mass = 0.0;
    size_t k = 0;
    while (k < keep) {
      sort_to(k + 1);
      mass += weight(k) / sum;
      ++k;
      if (mass >= draw.top_p) break;
    }
    keep = k;
  }
  if (draw.min_p > 0.0) {
    sort_to(1);
    const float threshold = static_cast<float>(draw.min_p) * weight(0);
    size_t k = 1;
    while (k < keep) {
      sort_to(k + 1);
      if (weight(k) < threshold) break;
      ++k;
    }
    keep = k;
  }
  const double total = keep == summed ? sum : mass_of(keep);
  // u ∈ [0, total): u01 has 53 random bits (UniformFromBits), so a seed gives the same
  // token everywhere.
  const double u = draw.u01 * total;
  double acc = 0.0;
  for (size_t k = 0; k < keep; ++k) {
    sort_to(k + 1);
    acc += weight(k);
    if (u < acc) return static_cast<int32_t>(static_cast<uint32_t>(candidates[k]));
  }
  sort_to(keep);
  return static_cast<int32_t>(static_cast<uint32_t>(candidates[keep - 1]));
}

float PenalizedLogit(float logit, int32_t count, double repetition, double frequency,
                     double presence) {
  float l = logit;
  if (repetition != 1.0) {
    l = l > 0 ? static_cast<float>(static_cast<double>(l) / repetition)
              : static_cast<float>(static_cast<double>(l) * repetition);
  }
  const double scaled = frequency * static_cast<double>(count);
  return l - static_cast<float>(scaled + presence);
}

void ApplyPenalties(absl::Span<float> logits, const TokenDraw& draw) {
  if (!draw.HasPenalties()) return;
  for (const auto& [id, count] : draw.token_counts) {
    float& l = logits[static_cast<size_t>(id)];
    l = PenalizedLogit(l, count, draw.repetition_penalty, draw.frequency_penalty,
                       draw.presence_penalty);
  }
}

void TopLogprobs(absl::Span<const float> logits, double lse, int k, int32_t* ids, float* logprobs) {
  thread_local std::vector<int32_t> order;
  const int V = static_cast<int>(logits.size());
  order.resize(static_cast<size_t>(V));
  for (int i = 0; i < V; ++i) order[static_cast<size_t>(i)] = i;
  auto logprob = [&](int32_t i) { return static_cast<double>(logits[i]) - lse; };
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    const double la = logprob(a), lb = logprob(b);
    return la != lb ? la > lb : a < b;
  });
  for (int i = 0; i < k; ++i) {
    ids[i] = order[static_cast<size_t>(i)];
    logprobs[i] = static_cast<float>(logprob(ids[i]));
  }
}

void DrawRows(const float* logits, int rows, int vocab, const TokenDraw* draws, int32_t* token,
              float* logprob, int32_t* top_token, float* top_logprob) {
  for (int r = 0; r < rows; ++r) {
    if (vocab <= 0) {
      token[r] = 0;
      logprob[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    const absl::Span<const float> row(logits + static_cast<size_t>(r) * vocab,
                                      static_cast<size_t>(vocab));
    if (draws[r].forced_token >= 0) {
      token[r] = draws[r].forced_token;
    } else if (draws[r].logit_bias.empty() && !draws[r].HasPenalties()) {
      token[r] = DrawToken(row, draws[r]);
    } else {
      thread_local std::vector<float> adjusted;
      adjusted.assign(row.begin(), row.end());
      ApplyLogitBias(absl::MakeSpan(adjusted), draws[r].logit_bias);
      ApplyPenalties(absl::MakeSpan(adjusted), draws[r]);
      token[r] = DrawToken(adjusted, draws[r]);
    }
    // the model's log-probabilities: before the bias and the penalties
    const double lse = LogSumExp(row);
    logprob[r] = static_cast<float>(static_cast<double>(row[token[r]]) - lse);
    if (const int k = std::min({draws[r].top_logprobs, vocab, kMaxTopLogprobs}); k > 0) {
      const size_t at = static_cast<size_t>(r) * kMaxTopLogprobs;
      TopLogprobs(row, lse, k, top_token + at, top_logprob + at);
    }
  }
}

}  // namespace kvlens::kernels

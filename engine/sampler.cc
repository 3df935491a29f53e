#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/row_reduce.h"

namespace kvlens {

absl::Status SamplingParams::Validate(int32_t vocab_size) const {
  auto bad = [](absl::string_view field, double v, absl::string_view range) {
    return absl::InvalidArgumentError(
        absl::StrCat("sampling: ", field, " = ", v, " must be ", range));
  };
  if (!(temperature >= 0.0 && temperature <= 100.0))
    return bad("temperature", temperature, "in [0, 100]");
  if (top_k < 0) return bad("top_k", top_k, ">= 0");
  if (!(top_p > 0.0 && top_p <= 1.0)) return bad("top_p", top_p, "in (0, 1]");
  if (!(min_p >= 0.0 && min_p < 1.0)) return bad("min_p", min_p, "in [0, 1)");
  if (!(repetition_penalty > 0.0 && repetition_penalty <= 10.0)) {
    return bad("repetition_penalty", repetition_penalty, "in (0, 10]");
  }
  if (!(std::abs(frequency_penalty) <= 2.0))
    return bad("frequency_penalty", frequency_penalty, "in [-2, 2]");
  if (!(std::abs(presence_penalty) <= 2.0))
    return bad("presence_penalty", presence_penalty, "in [-2, 2]");
  for (const auto& [id, bias] : logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sampling: logit_bias token id ", id, " outside the vocabulary [0, ", vocab_size, ")"));
    }
    if (!std::isfinite(bias) || std::abs(bias) > 100.0f) {
      return bad(absl::StrCat("logit_bias[", id, "]"), bias, "finite and in [-100, 100]");
    }
  }
  return absl::OkStatus();
}

void Sampler::ApplyBiasAndPenalties(absl::Span<float> logits,
                                    absl::Span<const int32_t> history) const {
  for (const auto& [id, bias] : params_.logit_bias) logits[id] += bias;
  const bool any_penalty = params_.repetition_penalty != 1.0 || params_.frequency_penalty != 0.0 ||
                           params_.presence_penalty != 0.0;
  if (!any_penalty || history.empty()) return;
  absl::flat_hash_map<int32_t, int> counts;
  for (int32_t t : history) {
    if (t >= 0 && t < static_cast<int32_t>(logits.size())) ++counts[t];
  }
  for (const auto& [t, n] : counts) {
    float& l = logits[t];
    if (params_.repetition_penalty != 1.0) {
      l = l > 0 ? static_cast<float>(l / params_.repetition_penalty)
                : static_cast<float>(l * params_.repetition_penalty);
    }
    l -= static_cast<float>(params_.frequency_penalty * n + params_.presence_penalty);
  }
}

namespace {

// A draw's buffers.
struct DrawScratch {
  std::vector<float> weights;        // e^((l − max) / T) of each id
  std::vector<uint64_t> candidates;  // (~weight bits) << 32 | id: ascending is (p desc, id asc)
  std::vector<uint32_t> counters;
  std::vector<uint32_t> bucket_ends;
};

// Lays out the keys of `weights` (see Sampler::Sample) in `candidates` by their top
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

int32_t Sampler::Sample(absl::Span<float> logits, absl::Span<const int32_t> history) {
  ApplyBiasAndPenalties(logits, history);
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params_.temperature == 0.0) return kernels::ArgMax(logits);
  // softmax at temperature, max subtracted first (in float, vectorised: std::exp in double
  // took ~5 ns an element, 160 µs a 32000-token row)
  const float max_l = kernels::MaxLogit(logits);
  // Per thread, not per sampler: a step's rows then reuse the same few hundred KB, warm in
  // the cache, rather than each request's own (cold by its next step).
  thread_local DrawScratch scratch;
  std::vector<float>& weights = scratch.weights;
  std::vector<uint64_t>& candidates = scratch.candidates;
  std::vector<uint32_t>& bucket_ends = scratch.bucket_ends;
  weights.resize(n);
  kernels::TemperatureWeights(logits, max_l, params_.temperature, weights.data());
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
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = params_.top_k;
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
  if (params_.top_p < 1.0) {
    double mass = 0.0;
    size_t k = 0;
    while (k < keep) {
      sort_to(k + 1);
      mass += weight(k) / sum;
      ++k;
      if (mass >= params_.top_p) break;
    }
    keep = k;
  }
  if (params_.min_p > 0.0) {
    sort_to(1);
    const float threshold = static_cast<float>(params_.min_p) * weight(0);
    size_t k = 1;
    while (k < keep) {
      sort_to(k + 1);
      if (weight(k) < threshold) break;
      ++k;
    }
    keep = k;
  }
  const double total = keep == summed ? sum : mass_of(keep);
  // Draw u ∈ [0, total) with 53 random bits so a seed gives the same token everywhere.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0.0;
  for (size_t k = 0; k < keep; ++k) {
    sort_to(k + 1);
    acc += weight(k);
    if (u < acc) return static_cast<int32_t>(static_cast<uint32_t>(candidates[k]));
  }
  sort_to(keep);
  return static_cast<int32_t>(static_cast<uint32_t>(candidates[keep - 1]));
}

void LogSoftmax(absl::Span<const float> logits, std::vector<double>& out) {
  const double lse = kernels::LogSumExp(logits);
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

RowSample SampleRow(Sampler& sampler, absl::Span<const float> logits,
                    absl::Span<const int32_t> history, int top_logprobs) {
  // Reused per thread: a fresh 32000-entry row (128 KB) a row costs more in page faults
  // than the arithmetic (the heap's top is trimmed and regrown).
  thread_local std::vector<float> row;
  thread_local std::vector<int32_t> ids;
  row.assign(logits.begin(), logits.end());
  RowSample out;
  // Only the log-probabilities reported are formed (each as LogSoftmax forms it): the
  // whole row in double would be 256 KB written a row for one or a few values read.
  const double lse = kernels::LogSumExp(logits);
  auto logprob = [&](int32_t i) { return static_cast<double>(logits[i]) - lse; };
  out.token = sampler.Sample(absl::MakeSpan(row), history);
  out.logprob = static_cast<float>(logprob(out.token));
  if (top_logprobs > 0) {
    const int V = static_cast<int>(logits.size());
    ids.resize(V);
    for (int i = 0; i < V; ++i) ids[i] = i;
    const int k = std::min(top_logprobs, V);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t b) {
      const double la = logprob(a), lb = logprob(b);
      return la != lb ? la > lb : a < b;
    });
    for (int i = 0; i < k; ++i) {
      out.top_logprobs.push_back({ids[i], static_cast<float>(logprob(ids[i]))});
    }
  }
  return out;
}

}  // namespace kvlens

#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
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

int32_t Sampler::Sample(absl::Span<float> logits, absl::Span<const int32_t> history) {
  ApplyBiasAndPenalties(logits, history);
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params_.temperature == 0.0) return kernels::ArgMax(logits);
  // softmax at temperature, max subtracted first (in float, vectorised: std::exp in double
  // took ~5 ns an element, 160 µs a 32000-token row)
  const float max_l = kernels::MaxLogit(logits);
  weights_.resize(n);
  kernels::TemperatureWeights(logits, max_l, params_.temperature, weights_.data());
  candidates_.resize(n);
  for (int32_t i = 0; i < n; ++i) candidates_[i] = {weights_[i], i};
  // The candidates in the order (probability desc, id asc), sorted only as far as the
  // filters and the draw look: [0, sorted) is final. A peaked distribution needs its top
  // few dozen, not all V (a full sort of 32000 candidates took ~2.5 ms a row).
  auto by_prob = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t sorted = 0;
  auto sort_to = [&](size_t k) {
    if (k <= sorted) return;
    k = std::min(candidates_.size(), std::max(k, 2 * sorted + 64));
    std::partial_sort(candidates_.begin() + static_cast<ptrdiff_t>(sorted),
                      candidates_.begin() + static_cast<ptrdiff_t>(k), candidates_.end(), by_prob);
    sorted = k;
  };
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = params_.top_k;
    sort_to(keep);
  }
  // Mass of the kept candidates: in sorted order when they are a sorted prefix, else (all
  // of them) in id order, which differs from the sorted order's sum only in rounding.
  auto mass_of = [&](size_t k) {
    double m = 0.0;
    for (size_t i = 0; i < k; ++i) m += candidates_[i].first;
    return m;
  };
  const double sum = mass_of(keep);
  const size_t summed = keep;
  if (params_.top_p < 1.0) {
    double mass = 0.0;
    size_t k = 0;
    while (k < keep) {
      sort_to(k + 1);
      mass += candidates_[k].first / sum;
      ++k;
      if (mass >= params_.top_p) break;
    }
    keep = k;
  }
  if (params_.min_p > 0.0) {
    sort_to(1);
    const float threshold = static_cast<float>(params_.min_p) * candidates_.front().first;
    size_t k = 1;
    while (k < keep) {
      sort_to(k + 1);
      if (candidates_[k].first < threshold) break;
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
    acc += candidates_[k].first;
    if (u < acc) return candidates_[k].second;
  }
  sort_to(keep);
  return candidates_[keep - 1].second;
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

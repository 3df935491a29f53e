#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"

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
  if (params_.temperature == 0.0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  // softmax at temperature, max subtracted first
  const float max_l = *std::max_element(logits.begin(), logits.end());
  candidates_.resize(n);
  double sum = 0.0;
  for (int32_t i = 0; i < n; ++i) {
    const double p = std::exp((static_cast<double>(logits[i]) - max_l) / params_.temperature);
    candidates_[i] = {static_cast<float>(p), i};
    sum += p;
  }
  auto by_prob = [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  };
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = params_.top_k;
    std::partial_sort(candidates_.begin(), candidates_.begin() + keep, candidates_.end(), by_prob);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_prob);
  }
  candidates_.resize(keep);
  sum = 0.0;
  for (const auto& c : candidates_) sum += c.first;
  if (params_.top_p < 1.0) {
    double mass = 0.0;
    size_t k = 0;
    while (k < candidates_.size()) {
      mass += candidates_[k].first / sum;
      ++k;
      if (mass >= params_.top_p) break;
    }
    candidates_.resize(k);
  }
  if (params_.min_p > 0.0) {
    const float threshold = static_cast<float>(params_.min_p) * candidates_.front().first;
    size_t k = 1;
    while (k < candidates_.size() && candidates_[k].first >= threshold) ++k;
    candidates_.resize(k);
  }
  double total = 0.0;
  for (const auto& c : candidates_) total += c.first;
  // Draw u ∈ [0, total) with 53 random bits so a seed gives the same token everywhere.
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0.0;
  for (const auto& c : candidates_) {
    acc += c.first;
    if (u < acc) return c.second;
  }
  return candidates_.back().second;
}

void LogSoftmax(absl::Span<const float> logits, std::vector<double>& out) {
  double max_l = -std::numeric_limits<double>::infinity();
  for (float l : logits) max_l = std::max(max_l, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_l);
  const double lse = max_l + std::log(sum);
  out.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

}  // namespace kvlens

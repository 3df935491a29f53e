#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

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
  kernels::ApplyLogitBias(logits, params_.logit_bias);
  if (!NeedsHistory() || history.empty()) return;
  TokenCounts counts;
  counts.Update(history);
  for (const auto& [id, count] : counts.entries()) {
    if (id >= static_cast<int32_t>(logits.size())) continue;  // past the row: none applies
    float& l = logits[static_cast<size_t>(id)];
    l = kernels::PenalizedLogit(l, count, params_.repetition_penalty, params_.frequency_penalty,
                                params_.presence_penalty);
  }
}

int32_t Sampler::Sample(absl::Span<float> logits, absl::Span<const int32_t> history) {
  ApplyBiasAndPenalties(logits, history);
  if (params_.temperature == 0.0) return kernels::ArgMax(logits);
  kernels::TokenDraw draw = Draw();  // (its logit_bias is applied above)
  draw.u01 = NextUniform();
  return kernels::DrawToken(logits, draw);
}

kernels::TokenDraw Sampler::Draw() const {
  kernels::TokenDraw d;
  d.temperature = params_.temperature;
  d.top_k = params_.top_k;
  d.top_p = params_.top_p;
  d.min_p = params_.min_p;
  d.logit_bias = params_.logit_bias;
  d.repetition_penalty = params_.repetition_penalty;
  d.frequency_penalty = params_.frequency_penalty;
  d.presence_penalty = params_.presence_penalty;
  return d;
}

kernels::TokenDraw Sampler::ReserveDraw(absl::Span<const int32_t> history) {
  kernels::TokenDraw d = Draw();
  if (NeedsHistory()) {
    counts_.Update(history);
    d.token_counts = counts_.entries();
  }
  if (d.temperature > 0.0) {  // as Sample, which draws a number only then
    if (!reserved_) {
      reserved_u01_ = kernels::UniformFromBits(rng_());
      reserved_ = true;
    }
    d.u01 = reserved_u01_;
  }
  return d;
}

double Sampler::NextUniform() {
  if (reserved_) {
    reserved_ = false;
    return reserved_u01_;
  }
  return kernels::UniformFromBits(rng_());
}

std::vector<std::pair<int32_t, float>> BiasBanning(absl::Span<const std::pair<int32_t, float>> bias,
                                                   absl::Span<const int32_t> banned) {
  std::vector<std::pair<int32_t, float>> out(bias.begin(), bias.end());
  for (int32_t id : banned) out.emplace_back(id, -std::numeric_limits<float>::infinity());
  return out;
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
  row.assign(logits.begin(), logits.end());
  RowSample out;
  // Only the log-probabilities reported are formed (each as LogSoftmax forms it): the
  // whole row in double would be 256 KB written a row for one or a few values read.
  const double lse = kernels::LogSumExp(logits);
  auto logprob = [&](int32_t i) { return static_cast<double>(logits[i]) - lse; };
  out.token = sampler.Sample(absl::MakeSpan(row), history);
  out.logprob = static_cast<float>(logprob(out.token));
  if (const int k =
          std::min({top_logprobs, static_cast<int>(logits.size()), kernels::kMaxTopLogprobs});
      k > 0) {
    int32_t ids[kernels::kMaxTopLogprobs];
    float lps[kernels::kMaxTopLogprobs];
    kernels::TopLogprobs(logits, lse, k, ids, lps);
    for (int i = 0; i < k; ++i) out.top_logprobs.push_back({ids[i], lps[i]});
  }
  return out;
}

RowSample DrawRow(Sampler& sampler, absl::Span<const float> logits,
                  const kernels::TokenDraw& draw) {
  const int vocab = static_cast<int>(logits.size());
  kernels::TokenDraw d = draw;
  d.top_logprobs = std::clamp(d.top_logprobs, 0, std::min(vocab, kernels::kMaxTopLogprobs));
  RowSample out;
  int32_t ids[kernels::kMaxTopLogprobs];
  float lps[kernels::kMaxTopLogprobs];
  kernels::DrawRows(logits.data(), 1, vocab, &d, &out.token, &out.logprob, ids, lps);
  for (int i = 0; i < d.top_logprobs; ++i) out.top_logprobs.push_back({ids[i], lps[i]});
  sampler.ClearReserved();  // its number was this draw's
  return out;
}

}  // namespace kvlens

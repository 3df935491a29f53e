#include "kernels/attention_tuning.h"

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace kvlens::kernels {

absl::Status AttentionTuneShape::Validate() const {
  auto bad = [](const char* field, int value, const std::string& limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention tuning: ", field, " ", value, " ", limit));
  };
  if (num_heads < 1) return bad("num_heads", num_heads, "must be >= 1");
  if (num_kv_heads < 1 || num_heads % num_kv_heads != 0) {
    return bad("num_kv_heads", num_kv_heads,
               absl::StrCat("must be >= 1 and divide num_heads ", num_heads));
  }
  if (head_dim < 1 || head_dim > kMaxHeadDim) {
    return bad("head_dim", head_dim, absl::StrCat("must be in [1, ", kMaxHeadDim, "]"));
  }
  if (block_size < 1 || block_size > 1024)
    return bad("block_size", block_size, "must be in [1, 1024]");
  if (prefill_tokens < 0 || prefill_tokens > kMaxTokens) {
    return bad("prefill_tokens", prefill_tokens, absl::StrCat("must be in [0, ", kMaxTokens, "]"));
  }
  if (decode_keys < 0 || decode_keys > kMaxTokens) {
    return bad("decode_keys", decode_keys, absl::StrCat("must be in [0, ", kMaxTokens, "]"));
  }
  if (decode_batches.empty() || decode_batches.size() > kMaxDecodeBatches) {
    return bad("decode_batches size", static_cast<int>(decode_batches.size()),
               absl::StrCat("must be in [1, ", kMaxDecodeBatches, "]"));
  }
  for (size_t i = 0; i < decode_batches.size(); ++i) {
    if (decode_batches[i] < 1 || decode_batches[i] > kMaxDecodeBatch) {
      return bad(absl::StrCat("decode_batches[", i, "]").c_str(), decode_batches[i],
                 absl::StrCat("must be in [1, ", kMaxDecodeBatch, "]"));
    }
  }
  if (!(softcap >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention tuning: softcap ", softcap, " must be >= 0"));
  }
  return absl::OkStatus();
}

std::string TunedCandidate::Microseconds() const {
  return absl::StrJoin(seconds, " / ", [](std::string* o, double sec) {
    absl::StrAppendFormat(o, "%.1f", sec * 1e6);
  });
}

std::vector<double> RelativeTimes(absl::Span<const TunedCandidate> candidates) {
  std::vector<double> out(candidates.size(), 0.0);
  const auto ran = [](const TunedCandidate& c) { return c.failure.empty() && !c.seconds.empty(); };
  const auto ref = std::find_if(candidates.begin(), candidates.end(), ran);
  if (ref == candidates.end()) return out;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const TunedCandidate& c = candidates[i];
    if (!ran(c) || c.seconds.size() != ref->seconds.size()) continue;
    double sum = 0.0;
    for (size_t j = 0; j < c.seconds.size(); ++j) sum += c.seconds[j] / ref->seconds[j];
    out[i] = sum / static_cast<double>(c.seconds.size());
  }
  return out;
}

int FastestAccepted(absl::Span<const TunedCandidate> candidates) {
  const std::vector<double> relative = RelativeTimes(candidates);
  int best = -1;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    if (!candidates[i].accepted() || !(relative[i] > 0.0)) continue;
    if (best < 0 || relative[i] < relative[best]) best = i;
  }
  return best;
}

std::string AttentionTuneReport::ToString() const {
  std::string out = absl::StrCat("attention tuning: ", shape, "\n");
  auto lines = [&](const char* what, const std::vector<TunedCandidate>& list) {
    const std::vector<double> relative = RelativeTimes(list);
    for (size_t i = 0; i < list.size(); ++i) {
      const TunedCandidate& c = list[i];
      if (!c.failure.empty()) {
        absl::StrAppendFormat(&out, "  %-7s %-58s not run: %s\n", what, c.name, c.failure);
        continue;
      }
      absl::StrAppendFormat(&out, "  %-7s %-58s %10s us  %.2fx  error %.2g of %.2g%s\n", what,
                            c.name, c.Microseconds(), relative[i], c.max_error, c.tolerance,
                            c.chosen ? "  chosen" : (c.accepted() ? "" : "  rejected"));
    }
  };
  lines("prefill", prefill);
  lines("decode", decode);
  return out;
}

std::string AttentionTuneReport::Choice() const {
  std::string out;
  auto add = [&](const char* what, const std::vector<TunedCandidate>& list) {
    for (const TunedCandidate& c : list) {
      if (c.chosen) absl::StrAppend(&out, out.empty() ? "" : "; ", what, " ", c.name);
    }
  };
  add("prefill", prefill);
  add("decode", decode);
  return out;
}

}  // namespace kvlens::kernels

#include "kernels/attention_tuning.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

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
  if (decode_batch < 1 || decode_batch > kMaxDecodeBatch) {
    return bad("decode_batch", decode_batch, absl::StrCat("must be in [1, ", kMaxDecodeBatch, "]"));
  }
  if (!(softcap >= 0.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("attention tuning: softcap ", softcap, " must be >= 0"));
  }
  return absl::OkStatus();
}

int FastestAccepted(absl::Span<const TunedCandidate> candidates) {
  int best = -1;
  for (int i = 0; i < static_cast<int>(candidates.size()); ++i) {
    if (!candidates[i].accepted()) continue;
    if (best < 0 || candidates[i].seconds < candidates[best].seconds) best = i;
  }
  return best;
}

std::string AttentionTuneReport::ToString() const {
  std::string out = absl::StrCat("attention tuning: ", shape, "\n");
  auto lines = [&](const char* what, const std::vector<TunedCandidate>& list) {
    for (const TunedCandidate& c : list) {
      if (!c.failure.empty()) {
        absl::StrAppendFormat(&out, "  %-7s %-58s not run: %s\n", what, c.name, c.failure);
        continue;
      }
      absl::StrAppendFormat(&out, "  %-7s %-58s %10.1f us  error %.2g of %.2g%s\n", what, c.name,
                            c.seconds * 1e6, c.max_error, c.tolerance,
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

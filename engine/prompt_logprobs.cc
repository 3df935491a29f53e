#include "engine/prompt_logprobs.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/row_reduce.h"
#include "kernels/token_draw.h"

namespace kvlens {

absl::Status CheckPromptLogprobs(int top) {
  if (top < -1 || top > kernels::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs = ", top, " must be in [0, ",
                                                   kernels::kMaxTopLogprobs, "] (or -1: none)"));
  }
  return absl::OkStatus();
}

PromptLogprobsEvent ScorePromptRows(absl::Span<const float> logits, int vocab, int first_row,
                                    absl::Span<const int32_t> next, int top,
                                    kernels::ThreadPool* pool) {
  const int64_t n = static_cast<int64_t>(next.size());
  const int k = std::clamp(top, 0, std::min(vocab, kernels::kMaxTopLogprobs));
  PromptLogprobsEvent ev;
  ev.first_position = first_row + 1;
  ev.tokens.assign(next.begin(), next.end());
  ev.logprobs.resize(static_cast<size_t>(n));
  if (k > 0) ev.top.resize(static_cast<size_t>(n));
  auto score = [&](int64_t r) {
    const auto row = logits.subspan(static_cast<size_t>(r) * vocab, static_cast<size_t>(vocab));
    const double lse = kernels::LogSumExp(row);
    ev.logprobs[static_cast<size_t>(r)] =
        static_cast<float>(static_cast<double>(row[static_cast<size_t>(next[r])]) - lse);
    if (k == 0) return;
    int32_t ids[kernels::kMaxTopLogprobs];
    float lps[kernels::kMaxTopLogprobs];
    kernels::TopLogprobs(row, lse, k, ids, lps);
    std::vector<TokenLogprob>& t = ev.top[static_cast<size_t>(r)];
    for (int i = 0; i < k; ++i) t.push_back({ids[i], lps[i]});
  };
  if (pool != nullptr && n > 1) {
    pool->ParallelFor(n, score);
  } else {
    for (int64_t r = 0; r < n; ++r) score(r);
  }
  return ev;
}

}  // namespace kvlens

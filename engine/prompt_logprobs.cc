#include "engine/prompt_logprobs.h"

#include <algorithm>
#include <type_traits>
#include <vector>

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

template <typename T>
PromptLogprobsEvent ScoreForwardRows(const ForwardOutput<T>& out, size_t first, int vocab,
                                     int first_position, absl::Span<const int32_t> next, int top,
                                     kernels::ThreadPool* pool) {
  const size_t n = next.size();
  const size_t V = static_cast<size_t>(vocab);
  if (out.pick_token.empty()) {
    const auto rows = absl::MakeConstSpan(out.logits).subspan(first * V, n * V);
    if constexpr (std::is_same_v<T, float>) {
      return ScorePromptRows(rows, vocab, first_position, next, top, pool);
    } else {
      const std::vector<float> rows_f(rows.begin(), rows.end());
      return ScorePromptRows(rows_f, vocab, first_position, next, top, pool);
    }
  }
  const int k = std::clamp(top, 0, std::min(vocab, kernels::kMaxTopLogprobs));
  PromptLogprobsEvent ev;
  ev.first_position = first_position + 1;
  ev.tokens.assign(next.begin(), next.end());
  ev.logprobs.assign(out.pick_logprob.begin() + static_cast<ptrdiff_t>(first),
                     out.pick_logprob.begin() + static_cast<ptrdiff_t>(first + n));
  if (k > 0) ev.top.resize(n);
  for (size_t r = 0; r < n && k > 0; ++r) {
    const size_t at = (first + r) * kernels::kMaxTopLogprobs;
    for (int i = 0; i < k; ++i) {
      ev.top[r].push_back({out.pick_top_token[at + static_cast<size_t>(i)],
                           out.pick_top_logprob[at + static_cast<size_t>(i)]});
    }
  }
  return ev;
}

template PromptLogprobsEvent ScoreForwardRows<float>(const ForwardOutput<float>&, size_t, int, int,
                                                     absl::Span<const int32_t>, int,
                                                     kernels::ThreadPool*);
template PromptLogprobsEvent ScoreForwardRows<double>(const ForwardOutput<double>&, size_t, int,
                                                      int, absl::Span<const int32_t>, int,
                                                      kernels::ThreadPool*);

}  // namespace kvlens

#include "engine/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/kv_cache/sequence_cache.h"
#include "engine/model/transformer.h"

namespace kvlens {

double PerplexityResult::perplexity() const { return std::exp(mean_nll()); }

namespace {

// −log softmax(row)[target] in double: log Σ exp(row − max) + max − row[target].
template <typename T>
double NegLogProb(const T* row, int vocab, int32_t target) {
  double max = -INFINITY;
  for (int v = 0; v < vocab; ++v) max = std::max(max, static_cast<double>(row[v]));
  double sum = 0.0;
  for (int v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(row[v]) - max);
  return std::log(sum) + max - static_cast<double>(row[target]);
}

}  // namespace

template <typename T>
absl::StatusOr<PerplexityResult> EvaluatePerplexity(const Model& model,
                                                    kernels::Backend<T>& backend,
                                                    absl::Span<const int32_t> tokens,
                                                    const PerplexityOptions& options,
                                                    const PerplexityCallback& on_window) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = model.config;
  const int ctx = options.context;
  if (ctx < 1 || ctx > c.max_seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context = ", ctx, " must be in [1, ", c.max_seq_len, "] (the model's context length)"));
  }
  if (options.chunk <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("chunk = ", options.chunk, " must be > 0"));
  }
  if (options.block_size <= 0 || options.block_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", options.block_size, " must be in [1, 1024]"));
  }
  if (options.max_windows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_windows = ", options.max_windows, " must be >= 0"));
  }
  const bool second_half = options.scoring == PerplexityScoring::kSecondHalf;
  if (second_half && ctx < 3) {
    return absl::InvalidArgumentError(absl::StrCat(
        "context = ", ctx, " must be at least 3 when only the second half of a window is scored"));
  }
  if (options.bos_token >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bos_token = ", options.bos_token, " is outside the vocabulary [0, ", c.vocab_size, ")"));
  }
  // A window is inputs + 1 tokens from w·C: its first `inputs` predict the next ones, from
  // position `first` on.
  const int inputs = second_half ? ctx - 1 : ctx;
  const int first = second_half ? ctx / 2 : 0;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (n < inputs + 1) {
    return absl::InvalidArgumentError(absl::StrCat("the text has ", n, " tokens; a context of ",
                                                   ctx, " needs at least ", inputs + 1));
  }
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "token ", i, " = ", tokens[i], " is outside the vocabulary [0, ", c.vocab_size, ")"));
    }
  }
  int64_t windows = (n - (inputs + 1 - ctx)) / ctx;
  if (options.max_windows > 0) windows = std::min<int64_t>(windows, options.max_windows);

  auto cache = SequenceCache<T>::Create(backend.memory(), c, ctx, options.block_size,
                                        options.kv_cache_dtype, options.chunk);
  if (!cache.ok()) return cache.status();
  const std::vector<BlockId>& table = (*cache)->table();

  Transformer<T> transformer(model, backend);
  ForwardOutput<T> out;
  PerplexityResult result;
  const auto t0 = Clock::now();
  std::vector<int32_t> window;
  for (int64_t w = 0; w < windows; ++w) {
    window.assign(tokens.begin() + w * ctx, tokens.begin() + w * ctx + inputs + 1);
    if (second_half && options.bos_token >= 0) window[0] = options.bos_token;
    double window_sum = 0.0;
    // Every window starts from an empty cache: its rows are overwritten from position 0.
    for (int done = 0; done < inputs;) {
      const int len = std::min(options.chunk, inputs - done);
      BatchEntry entry;
      entry.tokens = absl::MakeConstSpan(window).subspan(done, len);
      entry.num_cached = done;
      entry.block_table = table;
      entry.all_logits = true;
      // (a device backend reads each row's log-probability of the next token where the
      // logits are: out.pick_logprob, in double rounded to float, instead of the rows)
      entry.score_next = absl::MakeConstSpan(window).subspan(done + 1, len);
      if (absl::Status s = transformer.Forward({&entry, 1}, (*cache)->storage, out); !s.ok())
        return s;
      for (int r = std::max(0, first - done); r < len; ++r) {
        window_sum += !out.pick_logprob.empty()
                          ? -static_cast<double>(out.pick_logprob[static_cast<size_t>(r)])
                          : NegLogProb(out.logits.data() + static_cast<int64_t>(r) * c.vocab_size,
                                       c.vocab_size, window[done + r + 1]);
      }
      done += len;
    }
    result.windows += 1;
    result.tokens += inputs - first;
    result.nll_sum += window_sum;
    result.window_nll.push_back(window_sum / (inputs - first));
    result.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    if (on_window) on_window(result);
  }
  return result;
}

template absl::StatusOr<PerplexityResult> EvaluatePerplexity<double>(const Model&,
                                                                     kernels::Backend<double>&,
                                                                     absl::Span<const int32_t>,
                                                                     const PerplexityOptions&,
                                                                     const PerplexityCallback&);
template absl::StatusOr<PerplexityResult> EvaluatePerplexity<float>(const Model&,
                                                                    kernels::Backend<float>&,
                                                                    absl::Span<const int32_t>,
                                                                    const PerplexityOptions&,
                                                                    const PerplexityCallback&);

}  // namespace kvlens

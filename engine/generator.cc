#include "engine/generator.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/kv_cache/sequence_cache.h"
#include "engine/model/transformer.h"
#include "engine/prompt_logprobs.h"

namespace kvlens {
namespace {

// The keys and values of positions 0 … rows − 1 of `from` into the same positions of `to`
// (the same layout), a block of a layer at a time.
template <typename T>
absl::Status CopyBlocks(SequenceCache<T>& from, SequenceCache<T>& to, int rows, int num_layers) {
  KvCacheStorage<T>& src = from.storage;
  KvCacheStorage<T>& dst = to.storage;
  const int64_t block_bytes =
      int64_t{src.block_size()} * src.kv_dim() * kernels::KvElementBytes<T>(src.dtype());
  const int blocks = (rows + src.block_size() - 1) / src.block_size();
  for (int layer = 0; layer < num_layers; ++layer) {
    for (int b = 0; b < blocks; ++b) {
      for (auto [d, s] :
           {std::pair{dst.k(layer), src.k(layer)}, std::pair{dst.v(layer), src.v(layer)}}) {
        if (absl::Status st = dst.memory().Copy(
                static_cast<unsigned char*>(d) + to.table()[b] * block_bytes,
                static_cast<const unsigned char*>(s) + from.table()[b] * block_bytes, block_bytes);
            !st.ok()) {
          return st;
        }
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

template <typename T>
absl::StatusOr<GenerateResult> Generate(const Model& model, kernels::Backend<T>& backend,
                                        absl::Span<const int32_t> prompt,
                                        const GenerateOptions& options,
                                        const TokenCallback& on_token, GenerateCache<T>* reuse) {
  using Clock = std::chrono::steady_clock;
  const ModelConfig& c = model.config;
  if (prompt.empty()) return absl::InvalidArgumentError("prompt: no tokens");
  if (options.max_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_new_tokens = ", options.max_new_tokens, " must be >= 0"));
  }
  if (options.prefill_chunk <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefill_chunk = ", options.prefill_chunk, " must be > 0"));
  }
  if (options.block_size <= 0 || options.block_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size = ", options.block_size, " must be in [1, 1024]"));
  }
  if (static_cast<int64_t>(prompt.size()) > c.max_seq_len) {
    return absl::OutOfRangeError(absl::StrCat("prompt has ", prompt.size(),
                                              " tokens, the context length is ", c.max_seq_len));
  }
  if (absl::Status s = options.sampling.Validate(c.vocab_size); !s.ok()) return s;
  if (absl::Status s = CheckPromptLogprobs(options.prompt_logprobs); !s.ok()) return s;
  if (options.top_logprobs < 0 || options.top_logprobs > kernels::kMaxTopLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("top_logprobs = ", options.top_logprobs,
                                                   " must be in [0, ", kernels::kMaxTopLogprobs,
                                                   "]"));
  }
  if (options.min_new_tokens < 0 || options.min_new_tokens > options.max_new_tokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("min_new_tokens = ", options.min_new_tokens,
                     " must be in [0, max_new_tokens = ", options.max_new_tokens, "]"));
  }

  const int64_t total = std::min<int64_t>(
      c.max_seq_len, static_cast<int64_t>(prompt.size()) + options.max_new_tokens);
  int num_cached = 0;
  std::unique_ptr<SequenceCache<T>> own;
  SequenceCache<T>* sequence = nullptr;
  if (reuse == nullptr) {
    // (a ring of a window and a chunk under a sliding window: SequenceCache)
    auto cache_or = SequenceCache<T>::Create(backend.memory(), c, total, options.block_size,
                                             options.kv_cache_dtype, options.prefill_chunk);
    if (!cache_or.ok()) return cache_or.status();
    own = *std::move(cache_or);
    sequence = own.get();
  } else {
    // The rows serve when they were computed with this steering, or under other steering
    // those before either's first steered position (prompt_logprobs scores every row), into
    // a cache of this backend's and this layout; the storage when it also has room. Grown,
    // it takes the rows along.
    const KvCacheStorage<T>* kept = reuse->sequence ? &reuse->sequence->storage : nullptr;
    const bool same_layout = kept != nullptr && &kept->memory() == &backend.memory() &&
                             kept->block_size() == options.block_size &&
                             kept->dtype() == options.kv_cache_dtype;
    if (same_layout && options.prompt_logprobs < 0) {
      size_t most = std::min(reuse->tokens.size(), prompt.size() - 1);
      if (reuse->steering != options.steering) {
        most = std::min<size_t>(most, std::min(FirstSteeredPosition(reuse->steering),
                                               FirstSteeredPosition(options.steering)));
      }
      while (num_cached < static_cast<int>(most) &&
             reuse->tokens[num_cached] == prompt[num_cached]) {
        ++num_cached;
      }
    }
    const int64_t room = reuse->capacity();
    if (!same_layout || room < total) {  // the same room, or twice too little
      const int64_t capacity =
          std::min<int64_t>(c.max_seq_len, std::max(total, room < total ? 2 * room : room));
      auto grown = SequenceCache<T>::Create(backend.memory(), c, capacity, options.block_size,
                                            options.kv_cache_dtype, /*max_chunk=*/0);
      absl::Status s = grown.status();
      if (s.ok() && num_cached > 0) {
        s = CopyBlocks(*reuse->sequence, **grown, num_cached, c.num_layers);
      }
      if (!s.ok()) {
        *reuse = GenerateCache<T>();
        return s;
      }
      reuse->sequence = *std::move(grown);
    }
    reuse->steering = options.steering;
    reuse->tokens.clear();  // until this call's rows are all written
    sequence = reuse->sequence.get();
  }
  KvCacheStorage<T>& cache = sequence->storage;
  const std::vector<BlockId>& table = sequence->table();

  Transformer<T> transformer(model, backend);
  Sampler sampler(options.sampling);
  GenerateResult result;
  std::vector<int32_t> history(prompt.begin(), prompt.end());
  ForwardOutput<T> out;
  std::vector<float> logits(c.vocab_size);

  // A device backend draws the next token where the logits are (Backend::DrawTokens),
  // penalties included, with the uniform number Sample would take (Sampler::ReserveDraw);
  // a host backend returns the row and DrawRow draws the same there.
  kernels::TokenDraw draw;  // the step's (its counts valid until the next ReserveDraw)
  // Before min_new_tokens, the stopping tokens are banned from the draw.
  std::vector<std::pair<int32_t, float>> early_bias;
  if (options.min_new_tokens > 0) {
    std::vector<int32_t> stoppers = options.stop_token_ids;
    if (options.stop_at_eos && model.tokenizer) {
      for (int32_t id : model.tokenizer->EndOfGenerationIds()) stoppers.push_back(id);
    }
    early_bias = BiasBanning(options.sampling.logit_bias, stoppers);
  }
  auto prepare = [&](BatchEntry& entry) {
    draw = sampler.ReserveDraw(history);
    draw.top_logprobs = options.top_logprobs;
    if (static_cast<int>(result.tokens.size()) < options.min_new_tokens) {
      draw.logit_bias = early_bias;
    }
    entry.pick_only = true;
    entry.draw = draw;
  };

  // prefill in chunks; only the last chunk's last row needs logits (the middle chunks'
  // are not even copied out of a device)
  const auto t0 = Clock::now();
  result.cached_prompt_tokens = num_cached;
  while (num_cached < static_cast<int>(prompt.size())) {
    const int n =
        std::min<int>(options.prefill_chunk, static_cast<int>(prompt.size()) - num_cached);
    BatchEntry entry;
    entry.tokens = prompt.subspan(num_cached, n);
    entry.num_cached = num_cached;
    entry.block_table = table;
    entry.residual_adds = options.steering;
    if (num_cached + n < static_cast<int>(prompt.size())) {
      entry.pick_only = true;
    } else {
      prepare(entry);
    }
    // Rows num_cached … end − 1 score the prompt tokens after them (all rows but the last
    // prompt position's; a device backend reads their log-probabilities where the logits
    // are); the last chunk's sample is then drawn from its last row.
    const int end = std::min<int>(num_cached + n, static_cast<int>(prompt.size()) - 1);
    const bool scores = options.prompt_logprobs >= 0 && num_cached < end;
    entry.all_logits = scores;
    if (scores) {
      entry.score_next = prompt.subspan(num_cached + 1, end - num_cached);
      entry.score_top = options.prompt_logprobs;
    }
    if (absl::Status s = transformer.Forward({&entry, 1}, cache, out); !s.ok()) return s;
    if (scores) {
      const PromptLogprobsEvent ev = ScoreForwardRows(
          out, 0, c.vocab_size, num_cached, entry.score_next, options.prompt_logprobs, nullptr);
      if (options.on_prompt_logprobs) options.on_prompt_logprobs(ev);
    }
    num_cached += n;
  }
  auto t_first = Clock::now();
  result.prefill_seconds = std::chrono::duration<double>(t_first - t0).count();

  while (true) {
    if (static_cast<int>(result.tokens.size()) >= options.max_new_tokens) {
      result.finish_reason = FinishReason::kLength;
      break;
    }
    RowSample picked;
    if (!out.pick_token.empty()) {
      const size_t row = out.pick_token.size() - 1;
      picked.token = out.pick_token[row];
      picked.logprob = out.pick_logprob[row];
      for (int t = 0; t < std::min(options.top_logprobs, c.vocab_size); ++t) {
        const size_t at = row * kernels::kMaxTopLogprobs + static_cast<size_t>(t);
        picked.top_logprobs.push_back({out.pick_top_token[at], out.pick_top_logprob[at]});
      }
      sampler.ClearReserved();  // its number was the device's draw
    } else {
      std::copy(out.logits.end() - c.vocab_size, out.logits.end(), logits.begin());  // (as float)
      picked = DrawRow(sampler, logits, draw);
    }
    const int32_t next = picked.token;
    result.tokens.push_back(next);
    result.logprobs.push_back(picked.logprob);
    if (options.top_logprobs > 0) result.top_logprobs.push_back(std::move(picked.top_logprobs));
    history.push_back(next);
    if (on_token && !on_token(next)) {
      result.finish_reason = FinishReason::kCancelled;
      break;
    }
    if (options.stop_at_eos && model.tokenizer && model.tokenizer->IsEndOfGeneration(next)) {
      result.finish_reason = FinishReason::kEos;
      break;
    }
    if (std::find(options.stop_token_ids.begin(), options.stop_token_ids.end(), next) !=
        options.stop_token_ids.end()) {
      result.finish_reason = FinishReason::kStop;
      break;
    }
    if (static_cast<int>(result.tokens.size()) >= options.max_new_tokens) {
      result.finish_reason = FinishReason::kLength;
      break;
    }
    if (num_cached >= c.max_seq_len) {
      result.finish_reason = FinishReason::kContext;
      break;
    }
    // decode step: one query row at offset num_cached
    BatchEntry entry;
    entry.tokens = absl::MakeConstSpan(&history.back(), 1);
    entry.num_cached = num_cached;
    entry.block_table = table;
    entry.residual_adds = options.steering;
    prepare(entry);
    if (absl::Status s = transformer.Forward({&entry, 1}, cache, out); !s.ok()) return s;
    ++num_cached;
  }
  result.decode_seconds = std::chrono::duration<double>(Clock::now() - t_first).count();
  if (reuse != nullptr) reuse->tokens.assign(history.begin(), history.begin() + num_cached);
  return result;
}

template absl::StatusOr<GenerateResult> Generate<float>(const Model&, kernels::Backend<float>&,
                                                        absl::Span<const int32_t>,
                                                        const GenerateOptions&,
                                                        const TokenCallback&,
                                                        GenerateCache<float>*);
template absl::StatusOr<GenerateResult> Generate<double>(const Model&, kernels::Backend<double>&,
                                                         absl::Span<const int32_t>,
                                                         const GenerateOptions&,
                                                         const TokenCallback&,
                                                         GenerateCache<double>*);

}  // namespace kvlens

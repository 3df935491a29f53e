#include "engine/kv_cache/kv_cache_sizing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/transformer.h"

namespace kvlens {
namespace {

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / double(1 << 30)); }

// The draw that asks most of a device's sampling workspaces: a temperature, a logit bias
// and a penalty (DrawTokens then adjusts a copy of the row past kDrawCachedVocab) and
// the most top log-probabilities.
kernels::TokenDraw CostliestDraw(absl::Span<const std::pair<int32_t, float>> bias,
                                 absl::Span<const std::pair<int32_t, int32_t>> counts) {
  kernels::TokenDraw draw;
  draw.temperature = 1.0;
  draw.top_p = 0.9;
  draw.u01 = 0.5;
  draw.top_logprobs = kernels::kMaxTopLogprobs;
  draw.logit_bias = bias;
  draw.repetition_penalty = 1.1;
  draw.token_counts = counts;
  return draw;
}

}  // namespace

absl::StatusOr<KvCacheSizing> SizeKvCacheForUtilization(const Model& model,
                                                        kernels::Backend<float>& backend,
                                                        const KvCacheSizingLimits& limits,
                                                        double utilization,
                                                        kernels::KvDtype kv_dtype) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU memory utilization must be in (0, 1], got ", utilization));
  }
  const ModelConfig& config = model.config;
  const int block_size = limits.block_size;
  const int profile_tokens = std::min(limits.max_batch_tokens, config.max_seq_len);
  for (const auto& [name, value] : {std::pair{"block_size", block_size},
                                    {"max_batch_tokens", limits.max_batch_tokens},
                                    {"max_running", limits.max_running}}) {
    if (value < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV-cache sizing: ", name, " is ", value, ", must be at least 1"));
    }
  }
  // The decode step's sequences: no more than a step's tokens.
  const int decode_rows = std::min(limits.max_running, limits.max_batch_tokens);
  kernels::Memory& memory = backend.memory();
  absl::StatusOr<kernels::Memory::Usage> before = memory.usage();
  if (!before.ok()) return before.status();
  const int64_t token_bytes = KvCacheStorage<float>::BlockBytes(config.num_layers, /*block_size=*/1,
                                                                config.kv_dim(), kv_dtype);

  // Two profile steps on a cache of just the blocks they need (zeroed). They upload the
  // weights (which stay) and size every activation buffer and workspace as the largest
  // steps a server runs would:
  // - prefill: max_batch_tokens new tokens of one sequence with every row's logits, its
  //   prompt scored (each row's next token forced, with the top log-probabilities) and its
  //   last row drawn;
  // - decode: a token for each of decode_rows sequences, drawn with the costliest draw
  //   (CostliestDraw), one sequence at max_seq_len keys (its block table names block 0
  //   throughout) and the others at one: as many split-KV partials as any step of that
  //   many rows takes, on a balanced launch too (SplitKvImbalance: the longest row over
  //   the mean), and the sampling workspaces for each row.
  const int prefill_blocks = (profile_tokens + block_size - 1) / block_size;
  const int blocks = std::max(prefill_blocks, decode_rows);
  const int64_t temp_bytes = int64_t{blocks} * block_size * token_bytes;
  int64_t model_and_step = 0;
  {
    absl::StatusOr<KvCacheStorage<float>> cache =
        KvCacheStorage<float>::Create(memory, config.num_layers, blocks, block_size,
                                      config.kv_dim(), /*fill_nan=*/false, kv_dtype);
    if (!cache.ok()) return cache.status();
    Transformer<float> transformer(model, backend);
    const std::pair<int32_t, float> bias[] = {{0, 1.0f}};
    const std::pair<int32_t, int32_t> counts[] = {{0, 1}};
    ForwardOutput<float> out;

    const std::vector<int32_t> tokens(profile_tokens, 0);
    std::vector<int32_t> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    BatchEntry prompt;
    prompt.tokens = tokens;
    prompt.block_table = table;
    prompt.all_logits = true;
    prompt.score_next = absl::MakeConstSpan(tokens).first(profile_tokens - 1);
    prompt.score_top = kernels::kMaxTopLogprobs;
    prompt.draw = CostliestDraw(bias, counts);
    if (absl::Status s = transformer.Forward({&prompt, 1}, *cache, out); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the KV-cache sizing step (", profile_tokens,
                                                 " tokens) failed: ", s.message()));
    }

    const int long_keys = config.max_seq_len;
    const std::vector<int32_t> long_table((long_keys + block_size - 1) / block_size, 0);
    std::vector<BatchEntry> decode(decode_rows);
    for (int r = 0; r < decode_rows; ++r) {
      BatchEntry& e = decode[r];
      e.tokens = absl::MakeConstSpan(tokens).first(1);
      // Row 0 stores its key at max_seq_len − 1 in block 0, row r > 0 at 0 in block r.
      e.num_cached = r == 0 ? long_keys - 1 : 0;
      e.block_table = r == 0 ? absl::MakeConstSpan(long_table) : absl::MakeConstSpan(&table[r], 1);
      e.pick_only = true;
      e.draw = CostliestDraw(bias, counts);
    }
    if (absl::Status s = transformer.Forward(decode, *cache, out); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the KV-cache sizing decode step (", decode_rows,
                                                 " sequences) failed: ", s.message()));
    }
    absl::StatusOr<kernels::Memory::Usage> after = memory.usage();
    if (!after.ok()) return after.status();
    model_and_step = std::max<int64_t>(
        0, static_cast<int64_t>(before->free) - static_cast<int64_t>(after->free) - temp_bytes);
  }

  KvCacheSizing sizing;
  sizing.total = static_cast<int64_t>(before->total);
  sizing.in_use_before = static_cast<int64_t>(before->total - before->free);
  sizing.model_and_step = model_and_step;
  const int64_t budget = static_cast<int64_t>(std::floor(utilization * sizing.total)) -
                         sizing.in_use_before - sizing.model_and_step;
  const int64_t block_bytes = token_bytes * block_size;
  const int64_t num_blocks = budget > 0 ? budget / block_bytes : 0;
  if (num_blocks < 1) {
    return absl::ResourceExhaustedError(
        absl::StrCat("GPU memory utilization ", utilization, " of ", GiB(sizing.total), " leaves ",
                     GiB(std::max<int64_t>(budget, 0)), " for the KV cache after ",
                     GiB(sizing.in_use_before), " already in use and ", GiB(sizing.model_and_step),
                     " for the weights and the profile steps (", profile_tokens, " tokens; ",
                     decode_rows, " sequences decoding); one block of ", block_size,
                     " tokens needs ", block_bytes, " bytes"));
  }
  sizing.tokens = num_blocks * block_size;
  sizing.cache_bytes = num_blocks * block_bytes;
  return sizing;
}

}  // namespace kvlens

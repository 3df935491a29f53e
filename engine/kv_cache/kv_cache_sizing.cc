#include "engine/kv_cache/kv_cache_sizing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/kv_cache/kv_cache_storage.h"
#include "engine/model/transformer.h"

namespace kvlens {
namespace {

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", bytes / double(1 << 30)); }

}  // namespace

absl::StatusOr<KvCacheSizing> SizeKvCacheForUtilization(const Model& model,
                                                        kernels::Backend<float>& backend,
                                                        int block_size, int max_batch_tokens,
                                                        double utilization,
                                                        kernels::KvDtype kv_dtype) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU memory utilization must be in (0, 1], got ", utilization));
  }
  const ModelConfig& config = model.config;
  const int profile_tokens = std::min(max_batch_tokens, config.max_seq_len);
  if (block_size < 1 || profile_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("block size (", block_size,
                                                   ") and max batch tokens (", max_batch_tokens,
                                                   ") must be at least 1"));
  }
  kernels::Memory& memory = backend.memory();
  absl::StatusOr<kernels::Memory::Usage> before = memory.usage();
  if (!before.ok()) return before.status();
  const int64_t token_bytes = KvCacheStorage<float>::BlockBytes(config.num_layers, /*block_size=*/1,
                                                                config.kv_dim(), kv_dtype);

  // The profile step: max_batch_tokens new tokens of one sequence, every row's logits, on
  // a cache of just the blocks they need. It uploads the weights (they stay) and sizes
  // every activation buffer and workspace for the largest step.
  const int blocks = (profile_tokens + block_size - 1) / block_size;
  const int64_t temp_bytes = int64_t{blocks} * block_size * token_bytes;
  int64_t model_and_step = 0;
  {
    absl::StatusOr<KvCacheStorage<float>> cache =
        KvCacheStorage<float>::Create(memory, config.num_layers, blocks, block_size,
                                      config.kv_dim(), /*fill_nan=*/false, kv_dtype);
    if (!cache.ok()) return cache.status();
    Transformer<float> transformer(model, backend);
    const std::vector<int32_t> tokens(profile_tokens, 0);
    std::vector<int32_t> table(blocks);
    std::iota(table.begin(), table.end(), 0);
    BatchEntry entry;
    entry.tokens = tokens;
    entry.block_table = table;
    entry.all_logits = true;
    ForwardOutput<float> out;
    if (absl::Status s = transformer.Forward({&entry, 1}, *cache, out); !s.ok()) {
      return absl::Status(s.code(), absl::StrCat("the KV-cache sizing step (", profile_tokens,
                                                 " tokens) failed: ", s.message()));
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
                     " for the weights and a step of ", profile_tokens, " tokens; one block of ",
                     block_size, " tokens needs ", block_bytes, " bytes"));
  }
  sizing.tokens = num_blocks * block_size;
  sizing.cache_bytes = num_blocks * block_bytes;
  return sizing;
}

}  // namespace kvlens

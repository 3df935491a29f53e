#include "engine/attention_tune_shape.h"

#include <algorithm>

namespace kvlens {

kernels::AttentionTuneShape AttentionTuneShapeFor(const ModelConfig& config, kernels::KvDtype cache,
                                                  int block_size, int max_prefill_tokens,
                                                  int max_decode_batch) {
  kernels::AttentionTuneShape shape;
  shape.num_heads = config.num_heads;
  shape.num_kv_heads = config.num_kv_heads;
  shape.head_dim = config.head_dim;
  shape.cache_dtype = cache;
  shape.block_size = block_size;
  shape.softcap = config.attention_softcap;
  shape.prefill_tokens =
      std::max(0, std::min({kTunePrefillTokens, config.max_seq_len, max_prefill_tokens}));
  shape.decode_keys = std::max(0, std::min(kTuneDecodeKeys, config.max_seq_len));
  const int loaded = std::min(
      {max_decode_batch, max_prefill_tokens, kernels::AttentionTuneShape::kMaxDecodeBatch});
  shape.decode_batches = {1};
  if (loaded > 1) shape.decode_batches.push_back(loaded);
  return shape;
}

}  // namespace kvlens

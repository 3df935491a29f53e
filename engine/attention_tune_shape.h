// The attention calls that --attention-tune (kvlens-server, kvlens-cli) times for a model:
// kernels/attention_tuning.h's shape, from the model's configuration and the cache's.
#ifndef KVLENS_ENGINE_ATTENTION_TUNE_SHAPE_H_
#define KVLENS_ENGINE_ATTENTION_TUNE_SHAPE_H_

#include "engine/model/model_config.h"
#include "kernels/attention_tuning.h"
#include "kernels/kv_dtype.h"

namespace kvlens {

// The model's heads, KV heads, head size and attention soft cap over a cache of `cache`
// elements in blocks of block_size rows; one prompt of min(kTunePrefillTokens, context,
// max_prefill_tokens) tokens (a step's prefill is at most max_prefill_tokens); decoding
// over min(kTuneDecodeKeys, context) keys, one sequence and, where a step may decode more,
// min(max_decode_batch, max_prefill_tokens, kMaxDecodeBatch) of them (a server's
// --max-running and --max-batch-tokens: its decode steps under load).
inline constexpr int kTunePrefillTokens = 2048;
inline constexpr int kTuneDecodeKeys = 4096;
kernels::AttentionTuneShape AttentionTuneShapeFor(const ModelConfig& config, kernels::KvDtype cache,
                                                  int block_size, int max_prefill_tokens,
                                                  int max_decode_batch);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_ATTENTION_TUNE_SHAPE_H_

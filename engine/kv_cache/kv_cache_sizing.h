// How many tokens of KV cache a device can hold: vLLM's --gpu-memory-utilization.
//
// The cache gets what is left of `utilization` × the device's total memory once
// everything else the server keeps there is counted: what was in use before (the CUDA
// context, other processes), the model's weights, and the activations and workspaces of
// the largest steps. The last two are measured, not estimated: two profile steps run on a
// temporary cache, and the device's free memory is read before and after them. One is
// max_batch_tokens tokens of a prompt (every row's logits, scored), the largest
// activations; the other a token for each of max_running sequences (at most
// max_batch_tokens), one of them at max_seq_len keys and the rest at one, each drawn at a
// temperature with a logit bias, a penalty and the top log-probabilities: the most
// split-KV partials such a step takes, and the sampling workspaces. Not counted (the
// fraction's margin is theirs; docs/cuda.md, Engine wiring, lists them): CUDA graphs'
// memory, the attention rows streamed to interpretability requests, interpretability
// workers' device scratch, and the index ring's growth for long penalty histories. A step
// that runs out anyway runs again in halves (docs/cuda.md, Memory contract). A bf16 cache
// (kv_dtype) fits twice the tokens of a float one.
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/model/model.h"
#include "kernels/backend.h"

namespace kvlens {

// The server's step limits that the profile steps take.
struct KvCacheSizingLimits {
  int block_size = 16;
  int max_batch_tokens = 512;  // tokens a step
  int max_running = 64;        // sequences decoding at once
};

struct KvCacheSizing {
  int64_t tokens = 0;          // cache capacity (whole blocks)
  int64_t cache_bytes = 0;     // what those tokens take (K and V, every layer)
  int64_t in_use_before = 0;   // device bytes in use before the profile steps
  int64_t model_and_step = 0;  // weights + the profile steps' activations and workspaces
  int64_t total = 0;           // the device's memory
};

// Errors: INVALID_ARGUMENT for utilization outside (0, 1] or a limit below 1;
// UNIMPLEMENTED when the backend's memory has no device budget (the CPU backends);
// RESOURCE_EXHAUSTED, with the numbers, when not one block fits; a failed profile step's
// own status.
absl::StatusOr<KvCacheSizing> SizeKvCacheForUtilization(
    const Model& model, kernels::Backend<float>& backend, const KvCacheSizingLimits& limits,
    double utilization, kernels::KvDtype kv_dtype = kernels::KvDtype::kActivation);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_

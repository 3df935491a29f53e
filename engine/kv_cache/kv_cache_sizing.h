// How many tokens of KV cache a device can hold: vLLM's --gpu-memory-utilization.
//
// The cache gets what is left of `utilization` × the device's total memory once
// everything else the server keeps there is counted: what was in use before (the CUDA
// context, other processes), the model's weights, and the activations and workspaces of
// the largest step. The last two are measured, not estimated: one profile step of
// max_batch_tokens tokens (every row's logits, the worst case) runs on a temporary cache,
// and the device's free memory is read before and after it. A bf16 cache (kv_dtype) fits
// twice the tokens of a float one.
#ifndef KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_
#define KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "engine/model/model.h"
#include "kernels/backend.h"

namespace kvlens {

struct KvCacheSizing {
  int64_t tokens = 0;          // cache capacity (whole blocks)
  int64_t cache_bytes = 0;     // what those tokens take (K and V, every layer)
  int64_t in_use_before = 0;   // device bytes in use before the profile step
  int64_t model_and_step = 0;  // weights + the profile step's activations and workspaces
  int64_t total = 0;           // the device's memory
};

// Errors: INVALID_ARGUMENT for utilization outside (0, 1] or a profile size below one
// token; UNIMPLEMENTED when the backend's memory has no device budget (the CPU backends);
// RESOURCE_EXHAUSTED, with the numbers, when not one block fits; a failed profile step's
// own status.
absl::StatusOr<KvCacheSizing> SizeKvCacheForUtilization(
    const Model& model, kernels::Backend<float>& backend, int block_size, int max_batch_tokens,
    double utilization, kernels::KvDtype kv_dtype = kernels::KvDtype::kActivation);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_KV_CACHE_KV_CACHE_SIZING_H_

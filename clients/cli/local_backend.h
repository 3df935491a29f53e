// The flags of the offline commands that run a model here (generate, perplexity): where
// and how precisely it runs, and the backend they make.
#ifndef KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_
#define KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "clients/cli/args.h"
#include "engine/model/model_config.h"
#include "kernels/backend_factory.h"
#include "kernels/kv_dtype.h"

namespace kvlens::cli {

// --device, --precision, --threads, --int8-activations, --attention-tensor-cores,
// --programmatic-launches, --attention-tune, --kv-cache-dtype.
std::vector<FlagSpec> LocalBackendFlags();

struct LocalBackend {
  bool fp64 = false;             // --precision fp64: the caller runs ReferenceBackend
  kernels::CreatedBackend fp32;  // otherwise: the fp32 backend on --device
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;
  bool tune = false;  // --attention-tune: TuneLocalBackend once the model is loaded
};

// Reads the flags and makes the fp32 backend (before any model loads, so a missing GPU fails
// fast). Returns 0, or the exit code with *error set: 2 for a bad flag or combination, 1
// for a device that cannot start.
int MakeLocalBackend(const Args& args, LocalBackend* out, absl::Status* error);

// With --attention-tune, tunes the fp32 backend's attention kernels for `config`'s shapes
// (engine/attention_tune_shape.h; prompts of up to max_prefill_tokens a step, decode of
// one sequence) and prints
// the report to stderr; otherwise nothing. The tuner's error, naming the flag.
absl::Status TuneLocalBackend(LocalBackend& local, const ModelConfig& config, int block_size,
                              int max_prefill_tokens);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_

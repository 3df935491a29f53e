// The flags of the offline commands that run a model here (generate, perplexity): where
// and how precisely it runs, and the backend they make.
#ifndef KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_
#define KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "clients/cli/args.h"
#include "kernels/backend_factory.h"
#include "kernels/kv_dtype.h"

namespace kvlens::cli {

// --device, --precision, --threads, --int8-activations, --attention-tensor-cores,
// --kv-cache-dtype.
std::vector<FlagSpec> LocalBackendFlags();

struct LocalBackend {
  bool fp64 = false;             // --precision fp64: the caller runs ReferenceBackend
  kernels::CreatedBackend fp32;  // otherwise: the fp32 backend on --device
  kernels::KvDtype kv_cache_dtype = kernels::KvDtype::kActivation;
};

// Reads the flags and makes the fp32 backend (before any model loads, so a missing GPU fails
// fast). Returns 0, or the exit code with *error set: 2 for a bad flag or combination, 1
// for a device that cannot start.
int MakeLocalBackend(const Args& args, LocalBackend* out, absl::Status* error);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_LOCAL_BACKEND_H_

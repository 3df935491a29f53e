// kvlens-cli generate --steer: "SPEC[;SPEC…]", each SPEC one steering vector of the
// Generate request (kvlens.v1.SteeringVector):
//   HOOK:PATH[:COEF]           PATH a text file of d_model numbers (whitespace-separated),
//                              added at HOOK (blocks.L.hook_resid_pre / _mid / _post)
//   sae:NAME:FEATURE[:COEF]    the decoder direction of feature FEATURE of the server's
//                              SAE NAME (kvlens-cli sae --list), at that SAE's hook
// COEF (default 1) multiplies the vector. The server checks hooks, lengths and features.
#ifndef KVLENS_CLIENTS_CLI_STEERING_FLAG_H_
#define KVLENS_CLIENTS_CLI_STEERING_FLAG_H_

#include <string>

#include "absl/status/status.h"
#include "kvlens/v1/generation.pb.h"

namespace kvlens::cli {

// Appends the specs of `flag` to request.steering; INVALID_ARGUMENT naming --steer and the
// spec for a malformed one or an unreadable file.
absl::Status AddSteeringFlag(const std::string& flag, v1::GenerateRequest* request);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_STEERING_FLAG_H_

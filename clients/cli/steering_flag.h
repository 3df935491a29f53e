// kvlens-cli generate --steer: "SPEC[;SPEC…]", each SPEC one steering vector:
//   HOOK:PATH[:COEF]           PATH a text file of d_model numbers (whitespace-separated),
//                              added at HOOK (blocks.L.hook_resid_pre / _mid / _post)
//   sae:NAME:FEATURE[:COEF]    the decoder direction of feature FEATURE of the server's
//                              SAE NAME (kvlens-cli sae --list), at that SAE's hook
// COEF (default 1) multiplies the vector; @START (default 0) is the first position it is
// added at, negative from the end of the prompt (-1 its last: every generated token).
// With --server the specs become the Generate request's SteeringVectors (the server
// checks them); on a local model, HOOK:PATH specs become the generator's ResidualAdds
// (checked against the model here).
#ifndef KVLENS_CLIENTS_CLI_STEERING_FLAG_H_
#define KVLENS_CLIENTS_CLI_STEERING_FLAG_H_

#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/model/model_config.h"
#include "engine/model/residual_add.h"
#include "kvlens/v1/generation.pb.h"

namespace kvlens::cli {

struct SteeringSpec {
  std::string text;  // the spec as written, for messages
  std::string hook;  // HOOK:PATH
  std::vector<float> vector;
  std::string sae;  // sae:NAME:FEATURE
  int feature = 0;
  std::optional<double> coefficient;
  int start = 0;  // @START: the first position steered (negative: from the prompt's end)
};

// INVALID_ARGUMENT naming --steer and the spec for a malformed one or an unreadable file.
absl::StatusOr<std::vector<SteeringSpec>> ParseSteeringFlag(const std::string& flag);

// The specs as the Generate request's steering.
void AddSteering(const std::vector<SteeringSpec>& specs, v1::GenerateRequest* request);

// The specs as residual adds for a local model: INVALID_ARGUMENT naming the spec for an
// SAE feature (those need --server), a hook the model lacks, a vector of other than
// d_model numbers or a start before the first of the prompt's `prompt_length` tokens.
absl::StatusOr<std::vector<ResidualAdd>> ToResidualAdds(const std::vector<SteeringSpec>& specs,
                                                        const ModelConfig& c, int prompt_length);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_STEERING_FLAG_H_

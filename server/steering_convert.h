// Generate's steering vectors (v1::SteeringVector) → the engine's residual adds, each
// field checked and named as the client spelled it ("steering[1].vector has 63 values,
// the model's d_model is 64"). A vector is given as d_model floats at a hook, or as an SAE
// feature's decoder direction (W_dec[feature]) of an SAE the server loaded.
#ifndef KVLENS_SERVER_STEERING_CONVERT_H_
#define KVLENS_SERVER_STEERING_CONVERT_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/interpret/sae.h"
#include "engine/model/model_config.h"
#include "engine/model/residual_add.h"
#include "kvlens/v1/generation.pb.h"

namespace kvlens::server {

inline constexpr int kMaxSteeringVectors = 16;

using SaeList = absl::Span<const std::shared_ptr<const interpret::Sae>>;

// INVALID_ARGUMENT naming the field for: more than kMaxSteeringVectors entries; a hook
// that is not blocks.L.hook_resid_pre/mid/post, or a layer the model lacks; a vector of
// other than d_model values, or a value or coefficient that is not finite; an unknown SAE,
// a feature outside [0, d_sae), an SAE on another hook kind, or a hook other than the
// SAE's; both or neither of vector and sae; a start_position before the prompt's first
// token. A negative start_position counts from the end of the request's prompt of
// `prompt_length` tokens (ResolveFromPosition); the adds carry it absolute.
absl::StatusOr<std::vector<ResidualAdd>> ToResidualAdds(
    const google::protobuf::RepeatedPtrField<v1::SteeringVector>& steering, const ModelConfig& c,
    SaeList saes, int prompt_length);

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_STEERING_CONVERT_H_

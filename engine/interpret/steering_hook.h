// Where a TransformerLens residual-stream hook name adds a steering vector: the engine's
// ResidualAdd point for blocks.L.hook_resid_pre (layer L), hook_resid_mid (layer L, mid)
// and hook_resid_post (layer L + 1: the stream entering the next block, or for the last
// block the final norm). Shared by the server's steering conversion and kvlens-cli.
#ifndef KVLENS_ENGINE_INTERPRET_STEERING_HOOK_H_
#define KVLENS_ENGINE_INTERPRET_STEERING_HOOK_H_

#include <string_view>

#include "absl/status/statusor.h"
#include "engine/model/residual_add.h"

namespace kvlens::interpret {

// A ResidualAdd with layer and mid set (delta empty) for `hook` in a model of `num_layers`
// layers; INVALID_ARGUMENT ("hook = \"…\" must be blocks.{layer}.hook_resid_pre, …", or
// "…: layer L is outside [0, num_layers)") otherwise.
absl::StatusOr<ResidualAdd> SteeringPoint(std::string_view hook, int num_layers);

}  // namespace kvlens::interpret

#endif  // KVLENS_ENGINE_INTERPRET_STEERING_HOOK_H_

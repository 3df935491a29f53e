#include "engine/interpret/steering_hook.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "engine/interpret/activations.h"
#include "engine/interpret/sae.h"

namespace kvlens::interpret {

absl::StatusOr<ResidualAdd> SteeringPoint(std::string_view hook, int num_layers) {
  Hook h = Hook::kResidPre;
  int layer = 0;
  if (!ParseSaeHook(hook, &h, &layer).ok() ||
      (h != Hook::kResidPre && h != Hook::kResidMid && h != Hook::kResidPost)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hook = \"", std::string(hook),
        "\" must be blocks.{layer}.hook_resid_pre, hook_resid_mid or hook_resid_post"));
  }
  if (layer >= num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("hook = \"", std::string(hook), "\": layer ",
                                                   layer, " is outside [0, ", num_layers, ")"));
  }
  ResidualAdd add;
  add.layer = h == Hook::kResidPost ? layer + 1 : layer;
  add.mid = h == Hook::kResidMid;
  return add;
}

}  // namespace kvlens::interpret

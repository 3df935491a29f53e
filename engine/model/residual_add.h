// A vector added to the residual stream during the serving forward pass: activation
// steering (ActAdd; TransformerLens's hooks that add to blocks.L.hook_resid_*), applied by
// Transformer::Forward to the new rows of the batch entry that carries it from a position on.
#ifndef KVLENS_ENGINE_MODEL_RESIDUAL_ADD_H_
#define KVLENS_ENGINE_MODEL_RESIDUAL_ADD_H_

#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "engine/model/model_config.h"

namespace kvlens {

struct ResidualAdd {
  // 0 … L (layers): the stream entering block `layer` (hook_resid_pre; L: the stream
  // entering the final norm, the last block's hook_resid_post).
  int layer = 0;
  // Instead, between block `layer`'s attention and its feed-forward (hook_resid_mid, after
  // the attention's residual add; layer < L).
  bool mid = false;
  std::vector<float> delta;  // [dim], the coefficient applied
  // Added to the rows at positions >= this (0: every row; a prompt's length: the generated
  // tokens only, as Contrastive Activation Addition steers).
  int from_position = 0;

  bool operator==(const ResidualAdd&) const = default;  // (the same rows' keys and values)
};

// The first position any of `adds` changes (INT_MAX when there are none): the rows before
// it, their keys and values, are the unsteered model's.
int FirstSteeredPosition(absl::Span<const ResidualAdd> adds);

// A steering start as requests write it, made absolute for a prompt of `prompt_length`
// tokens: a position >= 0 as it is; a negative one counted from the prompt's end (−1 its
// last position, whose row reads the first generated token; −prompt_length its first).
// INVALID_ARGUMENT for a start before the first, its message starting " = START" for the
// caller to prefix with the field's name.
absl::StatusOr<int> ResolveFromPosition(int start, int prompt_length);

// INVALID_ARGUMENT naming field[k] for an add at a layer outside [0, L] ([0, L) mid), of
// other than dim values, with a value that is not finite, or from a negative position.
absl::Status CheckResidualAdds(absl::Span<const ResidualAdd> adds, const ModelConfig& c,
                               std::string_view field);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_RESIDUAL_ADD_H_

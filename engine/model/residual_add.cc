#include "engine/model/residual_add.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens {

int FirstSteeredPosition(absl::Span<const ResidualAdd> adds) {
  int first = std::numeric_limits<int>::max();
  for (const ResidualAdd& a : adds) first = std::min(first, a.from_position);
  return first;
}

absl::StatusOr<int> ResolveFromPosition(int start, int prompt_length) {
  if (start < -prompt_length) {
    return absl::InvalidArgumentError(absl::StrCat(" = ", start, " must be >= -", prompt_length,
                                                   " (negative: from the end of the ",
                                                   prompt_length, "-token prompt, -1 its last)"));
  }
  return start < 0 ? start + prompt_length : start;
}

absl::Status CheckResidualAdds(absl::Span<const ResidualAdd> adds, const ModelConfig& c,
                               std::string_view field) {
  for (size_t k = 0; k < adds.size(); ++k) {
    const ResidualAdd& a = adds[k];
    const std::string name = absl::StrCat(std::string(field), "[", k, "]");
    if (a.layer < 0 || a.layer > c.num_layers || (a.mid && a.layer == c.num_layers)) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": layer ", a.layer,
                                                     a.mid ? " (mid)" : "", " is outside [0, ",
                                                     c.num_layers, a.mid ? ")" : "]"));
    }
    if (static_cast<int64_t>(a.delta.size()) != c.dim) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", a.delta.size(), " values, the model's dim is ", c.dim));
    }
    if (a.from_position < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": from position ", a.from_position, " is negative"));
    }
    for (float x : a.delta) {
      if (!std::isfinite(x)) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": a value is ", x, ", not finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvlens

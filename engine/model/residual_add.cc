#include "engine/model/residual_add.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvlens {

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
    for (float x : a.delta) {
      if (!std::isfinite(x)) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": a value is ", x, ", not finite"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvlens

#include "clients/cli/logit_bias_flag.h"

#include <cmath>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvlens::cli {

absl::StatusOr<std::vector<std::pair<int32_t, float>>> ParseLogitBiasFlag(const std::string& flag) {
  std::vector<std::pair<int32_t, float>> bias;
  std::set<int32_t> seen;
  for (absl::string_view entry : absl::StrSplit(flag, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    const std::vector<absl::string_view> parts = absl::StrSplit(entry, ':');
    int32_t id = 0;
    float value = 0.0f;
    if (parts.size() != 2 || !absl::SimpleAtoi(parts[0], &id) ||
        !absl::SimpleAtof(parts[1], &value) || !std::isfinite(value)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--logit-bias: \"", entry, "\" is not ID:BIAS (a token id and a number, e.g. 2:-100)"));
    }
    if (!seen.insert(id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--logit-bias: token ", id, " is given twice"));
    }
    bias.emplace_back(id, value);
  }
  return bias;
}

}  // namespace kvlens::cli

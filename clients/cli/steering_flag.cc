#include "clients/cli/steering_flag.h"

#include <cmath>
#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvlens::cli {

absl::Status AddSteeringFlag(const std::string& flag, v1::GenerateRequest* request) {
  for (absl::string_view spec : absl::StrSplit(flag, ';', absl::SkipWhitespace())) {
    auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(
          absl::StrCat("--steer \"", std::string(spec), "\": ", why,
                       " (HOOK:PATH[:COEF] or sae:NAME:FEATURE[:COEF])"));
    };
    const std::vector<std::string> parts = absl::StrSplit(spec, ':');
    const bool sae = parts[0] == "sae";
    const size_t fixed = sae ? 3 : 2;  // fields before the optional coefficient
    if (parts.size() != fixed && parts.size() != fixed + 1) return bad("wrong number of fields");
    v1::SteeringVector* s = request->add_steering();
    if (parts.size() == fixed + 1) {
      double coefficient = 0;
      if (!absl::SimpleAtod(parts[fixed], &coefficient) || !std::isfinite(coefficient)) {
        return bad(absl::StrCat("coefficient \"", parts[fixed], "\" is not a finite number"));
      }
      s->set_coefficient(static_cast<float>(coefficient));
    }
    if (sae) {
      int feature = 0;
      if (parts[1].empty()) return bad("no SAE name");
      if (!absl::SimpleAtoi(parts[2], &feature)) {
        return bad(absl::StrCat("feature \"", parts[2], "\" is not an integer"));
      }
      s->set_sae(parts[1]);
      s->set_feature(feature);
      continue;
    }
    s->set_hook(parts[0]);
    std::ifstream in(parts[1]);
    if (!in) return bad(absl::StrCat("cannot read ", parts[1]));
    std::string word;
    while (in >> word) {
      double x = 0;
      if (!absl::SimpleAtod(word, &x)) {
        return bad(absl::StrCat(parts[1], " holds \"", word, "\", not a number"));
      }
      s->add_vector(static_cast<float>(x));
    }
    if (s->vector().empty()) return bad(absl::StrCat(parts[1], " holds no numbers"));
  }
  return absl::OkStatus();
}

}  // namespace kvlens::cli

#include "clients/cli/steering_flag.h"

#include <cmath>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "engine/interpret/steering_hook.h"

namespace kvlens::cli {
namespace {

absl::Status Bad(const std::string& spec, const std::string& why) {
  return absl::InvalidArgumentError(absl::StrCat("--steer \"", spec, "\": ", why,
                                                 " (HOOK:PATH[:COEF][@START] or "
                                                 "sae:NAME:FEATURE[:COEF][@START])"));
}

}  // namespace

absl::StatusOr<std::vector<SteeringSpec>> ParseSteeringFlag(const std::string& flag) {
  std::vector<SteeringSpec> out;
  for (absl::string_view piece : absl::StrSplit(flag, ';', absl::SkipWhitespace())) {
    SteeringSpec spec;
    spec.text = std::string(piece);
    // @START: a trailing integer (an '@' elsewhere may belong to a file name); negative
    // counts from the end of the prompt, resolved where the prompt is known.
    if (const size_t at = piece.rfind('@'); at != absl::string_view::npos) {
      const absl::string_view start = piece.substr(at + 1);
      int value = 0;
      if (absl::SimpleAtoi(start, &value)) {
        spec.start = value;
        piece = piece.substr(0, at);
      }
    }
    const std::vector<std::string> parts = absl::StrSplit(piece, ':');
    const bool sae = parts[0] == "sae";
    const size_t fixed = sae ? 3 : 2;  // fields before the optional coefficient
    if (parts.size() != fixed && parts.size() != fixed + 1) {
      return Bad(spec.text, "wrong number of fields");
    }
    if (parts.size() == fixed + 1) {
      double coefficient = 0;
      if (!absl::SimpleAtod(parts[fixed], &coefficient) || !std::isfinite(coefficient)) {
        return Bad(spec.text,
                   absl::StrCat("coefficient \"", parts[fixed], "\" is not a finite number"));
      }
      spec.coefficient = coefficient;
    }
    if (sae) {
      if (parts[1].empty()) return Bad(spec.text, "no SAE name");
      if (!absl::SimpleAtoi(parts[2], &spec.feature)) {
        return Bad(spec.text, absl::StrCat("feature \"", parts[2], "\" is not an integer"));
      }
      spec.sae = parts[1];
      out.push_back(std::move(spec));
      continue;
    }
    spec.hook = parts[0];
    std::ifstream in(parts[1]);
    if (!in) return Bad(spec.text, absl::StrCat("cannot read ", parts[1]));
    std::string word;
    while (in >> word) {
      double x = 0;
      if (!absl::SimpleAtod(word, &x)) {
        return Bad(spec.text, absl::StrCat(parts[1], " holds \"", word, "\", not a number"));
      }
      spec.vector.push_back(static_cast<float>(x));
    }
    if (spec.vector.empty()) return Bad(spec.text, absl::StrCat(parts[1], " holds no numbers"));
    out.push_back(std::move(spec));
  }
  return out;
}

void AddSteering(const std::vector<SteeringSpec>& specs, v1::GenerateRequest* request) {
  for (const SteeringSpec& spec : specs) {
    v1::SteeringVector* s = request->add_steering();
    s->set_hook(spec.hook);
    for (float x : spec.vector) s->add_vector(x);
    s->set_sae(spec.sae);
    s->set_feature(spec.feature);
    if (spec.coefficient) s->set_coefficient(static_cast<float>(*spec.coefficient));
    s->set_start_position(spec.start);
  }
}

absl::StatusOr<std::vector<ResidualAdd>> ToResidualAdds(const std::vector<SteeringSpec>& specs,
                                                        const ModelConfig& c, int prompt_length) {
  std::vector<ResidualAdd> out;
  for (const SteeringSpec& spec : specs) {
    if (!spec.sae.empty()) return Bad(spec.text, "SAE features need --server (its --sae)");
    absl::StatusOr<ResidualAdd> add = interpret::SteeringPoint(spec.hook, c.num_layers);
    if (!add.ok()) return Bad(spec.text, std::string(add.status().message()));
    if (static_cast<int64_t>(spec.vector.size()) != c.dim) {
      return Bad(spec.text, absl::StrCat("the file holds ", spec.vector.size(),
                                         " numbers, the model's d_model is ", c.dim));
    }
    // As the server: the coefficient (as a float on the wire) times each value, in double.
    const double coefficient = static_cast<float>(spec.coefficient.value_or(1.0));
    for (float x : spec.vector) add->delta.push_back(static_cast<float>(coefficient * x));
    const absl::StatusOr<int> start = ResolveFromPosition(spec.start, prompt_length);
    if (!start.ok()) return Bad(spec.text, absl::StrCat("start", start.status().message()));
    add->from_position = *start;
    out.push_back(*std::move(add));
  }
  return out;
}

}  // namespace kvlens::cli

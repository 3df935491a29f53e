#include "engine/model/generation_config.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace kvlens {

absl::StatusOr<GenerationConfig> ReadGenerationConfig(const std::string& path) {
  GenerationConfig out;
  if (!std::filesystem::exists(path)) return out;
  std::ifstream in(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": invalid JSON: ", e.what()));
  }
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not an object"));
  if (j.contains("repetition_penalty") && !j["repetition_penalty"].is_null()) {
    const nlohmann::json& v = j["repetition_penalty"];
    const double rep = v.is_number() ? v.get<double>() : -1.0;
    if (!v.is_number() || !(rep > 0 && rep <= 10)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": repetition_penalty = ", v.dump(), " must be a number in (0, 10]"));
    }
    out.repetition_penalty = rep;
  }
  return out;
}

}  // namespace kvlens

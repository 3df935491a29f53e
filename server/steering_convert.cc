#include "server/steering_convert.h"

#include <cmath>
#include <string>

#include "absl/strings/str_cat.h"
#include "engine/interpret/steering_hook.h"

namespace kvlens::server {
namespace {

absl::Status Invalid(int k, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("steering[", k, "]", what));
}

}  // namespace

absl::StatusOr<std::vector<ResidualAdd>> ToResidualAdds(
    const google::protobuf::RepeatedPtrField<v1::SteeringVector>& steering, const ModelConfig& c,
    SaeList saes, int prompt_length) {
  if (steering.size() > kMaxSteeringVectors) {
    return absl::InvalidArgumentError(
        absl::StrCat("steering: ", steering.size(), " vectors, at most ", kMaxSteeringVectors));
  }
  std::vector<ResidualAdd> out;
  for (int k = 0; k < steering.size(); ++k) {
    const v1::SteeringVector& s = steering[k];
    const double coefficient = s.has_coefficient() ? s.coefficient() : 1.0;
    if (!std::isfinite(coefficient)) {
      return Invalid(k, absl::StrCat(".coefficient = ", coefficient, " must be finite"));
    }
    const absl::StatusOr<int> start = ResolveFromPosition(s.start_position(), prompt_length);
    if (!start.ok()) return Invalid(k, absl::StrCat(".start_position", start.status().message()));
    if (s.sae().empty() == s.vector().empty()) {
      return Invalid(k, ": give either vector (d_model values at hook) or sae and feature");
    }
    absl::StatusOr<ResidualAdd> at;  // the point of `hook`, when given
    if (!s.hook().empty()) {
      at = interpret::SteeringPoint(s.hook(), c.num_layers);
      if (!at.ok()) return Invalid(k, absl::StrCat(".", at.status().message()));
    }
    if (s.sae().empty()) {
      if (s.hook().empty()) return Invalid(k, ".hook: required with vector");
      if (s.vector_size() != c.dim) {
        return Invalid(k, absl::StrCat(".vector has ", s.vector_size(),
                                       " values, the model's d_model is ", c.dim));
      }
      ResidualAdd add = *std::move(at);
      add.delta.resize(static_cast<size_t>(c.dim));
      for (int i = 0; i < s.vector_size(); ++i) {
        if (!std::isfinite(s.vector(i))) {
          return Invalid(k, absl::StrCat(".vector[", i, "] = ", s.vector(i), " must be finite"));
        }
        add.delta[static_cast<size_t>(i)] = static_cast<float>(coefficient * s.vector(i));
      }
      add.from_position = *start;
      out.push_back(std::move(add));
      continue;
    }
    const interpret::Sae* sae = nullptr;
    for (const auto& candidate : saes) {
      if (candidate->name == s.sae()) sae = candidate.get();
    }
    if (sae == nullptr) {
      return Invalid(k, absl::StrCat(".sae = \"", s.sae(),
                                     "\" is not an SAE this server loaded (Interpret.ListSaes; "
                                     "kvlens-server --sae)"));
    }
    absl::StatusOr<ResidualAdd> sae_at = interpret::SteeringPoint(sae->hook_name, c.num_layers);
    if (!sae_at.ok() || sae->d_in != c.dim) {
      return Invalid(k, absl::StrCat(".sae: \"", sae->name, "\" reads ", sae->hook_name,
                                     "; steering takes an SAE on a residual-stream hook"));
    }
    if (at.ok() && (at->layer != sae_at->layer || at->mid != sae_at->mid)) {
      return Invalid(k, absl::StrCat(".hook = \"", s.hook(), "\" is not the hook of SAE \"",
                                     sae->name, "\" (", sae->hook_name, "); leave it empty"));
    }
    if (s.feature() < 0 || s.feature() >= sae->d_sae) {
      return Invalid(k, absl::StrCat(".feature = ", s.feature(), " must be in [0, ", sae->d_sae,
                                     ") (SAE \"", sae->name, "\")"));
    }
    ResidualAdd add = *std::move(sae_at);
    add.delta.resize(static_cast<size_t>(c.dim));
    for (int i = 0; i < sae->d_in; ++i) {  // dec is W_decᵀ: [d_in, d_sae]
      add.delta[static_cast<size_t>(i)] = static_cast<float>(
          coefficient * sae->dec[static_cast<size_t>(i) * sae->d_sae + s.feature()]);
    }
    add.from_position = *start;
    out.push_back(std::move(add));
  }
  return out;
}

}  // namespace kvlens::server

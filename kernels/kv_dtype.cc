#include "kernels/kv_dtype.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvlens::kernels {

std::string_view KvDtypeName(KvDtype d) {
  switch (d) {
    case KvDtype::kActivation:
      return "auto";
    case KvDtype::kBF16:
      return "bf16";
  }
  return "unknown";
}

absl::StatusOr<KvDtype> ParseKvDtype(std::string_view name) {
  if (name == "auto") return KvDtype::kActivation;
  if (name == "bf16" || name == "bfloat16") return KvDtype::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("kv_cache_dtype: unknown type \"",
                                                 std::string(name), "\" (expected auto or bf16)"));
}

}  // namespace kvlens::kernels

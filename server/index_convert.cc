#include "server/index_convert.h"

#include "absl/strings/str_cat.h"

namespace kvlens::server {

absl::StatusOr<int> ToIndex(int64_t value, int64_t n, const std::string& field) {
  if (value < -n || value >= n) {
    return absl::InvalidArgumentError(absl::StrCat(field, " = ", value, " must be in [-", n, ", ",
                                                   n, ") (negative: from the end, -1 the last)"));
  }
  return static_cast<int>(value < 0 ? value + n : value);
}

absl::StatusOr<std::vector<int>> ToIndexList(const google::protobuf::RepeatedField<int32_t>& ids,
                                             int n, const std::string& field) {
  std::vector<int> out;
  if (ids.empty()) {
    for (int i = 0; i < n; ++i) out.push_back(i);
    return out;
  }
  std::vector<bool> seen(n, false);
  for (int k = 0; k < ids.size(); ++k) {
    const std::string name = absl::StrCat(field, "[", k, "]");
    absl::StatusOr<int> id = ToIndex(ids[k], n, name);
    if (!id.ok()) return id.status();
    if (seen[*id]) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, " = ", ids[k], *id != ids[k] ? absl::StrCat(" (", *id, ")") : "", " is repeated"));
    }
    seen[*id] = true;
    out.push_back(*id);
  }
  return out;
}

}  // namespace kvlens::server

#include "engine/model/weights.h"

#include "absl/strings/str_cat.h"

namespace kvlens {

absl::Status CheckShape(absl::string_view tensor_name, const WeightView& w, int64_t rows,
                        int64_t cols) {
  if (w.empty()) return absl::NotFoundError(absl::StrCat("missing tensor ", tensor_name));
  if (w.rows != rows || w.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", tensor_name, ": expected shape [",
                                                   rows, ", ", cols, "], got [", w.rows, ", ",
                                                   w.cols, "]"));
  }
  return absl::OkStatus();
}

}  // namespace kvlens

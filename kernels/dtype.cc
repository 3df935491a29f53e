#include "kernels/dtype.h"

namespace kvlens::kernels {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
    case DType::kQ8_0:
      return "q8_0";
  }
  return "unknown";
}

}  // namespace kvlens::kernels

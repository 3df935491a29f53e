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
    case DType::kQ4_0:
      return "q4_0";
    case DType::kQ4_1:
      return "q4_1";
    case DType::kQ5_0:
      return "q5_0";
    case DType::kQ5_1:
      return "q5_1";
    case DType::kQ2_K:
      return "q2_K";
    case DType::kQ3_K:
      return "q3_K";
    case DType::kQ4_K:
      return "q4_K";
    case DType::kQ5_K:
      return "q5_K";
    case DType::kQ6_K:
      return "q6_K";
    case DType::kIQ4_NL:
      return "iq4_nl";
    case DType::kIQ4_XS:
      return "iq4_xs";
  }
  return "unknown";
}

}  // namespace kvlens::kernels

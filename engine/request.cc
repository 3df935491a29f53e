#include "engine/request.h"

namespace kvlens {

const char* FinishReasonName(FinishReason r) {
  switch (r) {
    case FinishReason::kLength:
      return "length";
    case FinishReason::kEos:
      return "eos";
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kContext:
      return "context";
    case FinishReason::kError:
      return "error";
  }
  return "unknown";
}

}  // namespace kvlens

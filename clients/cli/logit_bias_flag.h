// kvlens-cli generate --logit-bias: "ID:BIAS[,ID:BIAS…]" (the flag given more than once:
// its values joined by commas), each entry a token id and the
// number added to its logit before the draw (OpenAI's and vLLM's logit_bias; llama.cpp's
// --logit-bias), e.g. "2:-100" never draws token 2, "2:100" always does. The range checks
// (ids in the vocabulary, biases in [-100, 100]) are the engine's or the server's.
#ifndef KVLENS_CLIENTS_CLI_LOGIT_BIAS_FLAG_H_
#define KVLENS_CLIENTS_CLI_LOGIT_BIAS_FLAG_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace kvlens::cli {

// INVALID_ARGUMENT naming --logit-bias and the entry for one that is not ID:BIAS (an
// integer id, a finite number) or an id given twice.
absl::StatusOr<std::vector<std::pair<int32_t, float>>> ParseLogitBiasFlag(const std::string& flag);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_LOGIT_BIAS_FLAG_H_

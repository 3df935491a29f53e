// kvlens-cli generate --prompt-logprobs: the prompt's scores as a table on stderr, for a
// server's (GenerateResponse.prompt_logprobs) and a local model's (GenerateOptions).
#ifndef KVLENS_CLIENTS_CLI_PROMPT_LOGPROBS_PRINT_H_
#define KVLENS_CLIENTS_CLI_PROMPT_LOGPROBS_PRINT_H_

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace kvlens::cli {

struct ScoredToken {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// One line a position, from position 1 (position 0, with nothing before it, has none):
// position, token id, its spelling (piece(id), quoted and escaped), log-probability, then
// the most likely tokens; then the sum and the perplexity exp(−sum / count).
void PrintPromptLogprobs(std::ostream& out, absl::Span<const ScoredToken> scored,
                         const std::function<std::string(int32_t)>& piece);

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_PROMPT_LOGPROBS_PRINT_H_

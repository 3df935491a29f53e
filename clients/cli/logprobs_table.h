// kvlens-cli generate --prompt-logprobs and --logprobs: the prompt's scores, or the
// generated tokens' log-probabilities, as a table on stderr, for a server's
// (GenerateResponse.prompt_logprobs, .logprobs) and a local model's (GenerateOptions,
// GenerateResult).
#ifndef KVLENS_CLIENTS_CLI_LOGPROBS_TABLE_H_
#define KVLENS_CLIENTS_CLI_LOGPROBS_TABLE_H_

#include <cstdint>
#include <functional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace kvlens::cli {

struct ScoredToken {
  int32_t token = 0;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// One line a position, from first_position on: position, token id, its spelling
// (piece(id), quoted and escaped), log-probability, then the most likely tokens; then
// "WHAT: N tokens scored, sum S, perplexity P" (exp(−S / N)).
void PrintLogprobsTable(std::ostream& out, absl::Span<const ScoredToken> scored, int first_position,
                        std::string_view what, const std::function<std::string(int32_t)>& piece);

// The prompt's (--prompt-logprobs): from position 1 (position 0, with nothing before it,
// has none), WHAT "prompt".
inline void PrintPromptLogprobs(std::ostream& out, absl::Span<const ScoredToken> scored,
                                const std::function<std::string(int32_t)>& piece) {
  PrintLogprobsTable(out, scored, 1, "prompt", piece);
}

}  // namespace kvlens::cli

#endif  // KVLENS_CLIENTS_CLI_LOGPROBS_TABLE_H_

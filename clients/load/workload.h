// What kvlens-load sends: prompt and output lengths (fixed, uniform, or prompts from a
// file), the kind of each request (generation, or a share of interpretability calls),
// all drawn from one seeded generator so a run is reproducible; and, with turns > 1,
// conversations: a generate request's next turn is its prompt, the token ids it
// generated and a new user message, sent once it has ended (as a chat client resends the
// conversation, so the server's prefix cache holds the earlier turns).
#ifndef KVLENS_CLIENTS_LOAD_WORKLOAD_H_
#define KVLENS_CLIENTS_LOAD_WORKLOAD_H_

#include <cstdint>
#include <deque>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvlens/v1/generation.pb.h"

namespace kvlens::load {

// "N" (always N) or "A:B" (uniform integers in [A, B]).
struct LengthDist {
  int min = 0;
  int max = 0;
  static absl::StatusOr<LengthDist> Parse(const std::string& spec, const std::string& flag);
  int Draw(std::mt19937_64& rng) const;
};

enum class Kind { kGenerate, kAttention, kProbe, kActivations, kAttribution, kPatch };
const char* KindName(Kind kind);

struct WorkloadOptions {
  LengthDist prompt_tokens;          // synthetic prompts (ignored with prompts)
  LengthDist output_tokens;          // max_new_tokens of every request
  std::vector<std::string> prompts;  // from --prompts-file: text prompts, used in turn
  int shared_prefix_tokens = 0;      // leading tokens every synthetic prompt shares
  int vocab_size = 0;                // from GetModelInfo: synthetic ids are in [0, vocab_size)
  double temperature = 0;
  bool ignore_eos = true;
  int prompt_logprobs = -1;    // >= 0: generate requests score their prompt (prompt_logprobs)
  double attention_share = 0;  // of all requests, in [0, 1]
  double probe_share = 0;
  double activations_share = 0;
  double attribution_share = 0;
  double patch_share = 0;
  // Turns of a conversation (synthetic prompts only): each after the first appends the
  // previous turn's output and turn_tokens new ids to its prompt. A conversation whose
  // next turn could pass context_length (prompt + turn_tokens max + output_tokens max)
  // ends early.
  int turns = 1;
  LengthDist turn_tokens{16, 16};
  int context_length = 0;  // 0: unbounded
  uint64_t seed = 1;
};

// One request's parameters: either text or synthetic token ids, and the output length.
struct RequestSpec {
  Kind kind = Kind::kGenerate;
  std::string text;                // non-empty for file prompts
  std::vector<int32_t> token_ids;  // synthetic prompts
  int max_new_tokens = 0;
  int64_t conversation = -1;  // with turns > 1, generate requests: which, and its turn
  int turn = 0;
};

class Workload {
 public:
  explicit Workload(WorkloadOptions options);

  // The next request (not thread-safe; the runner draws from one thread): a ready turn
  // of a conversation when there is one and the request is a generation, else a new
  // prompt (a conversation's first turn with turns > 1).
  RequestSpec Next();
  // Whether `spec`'s generated token ids are needed: a turn with turns to come.
  bool WantsOutput(const RequestSpec& spec) const;
  // `spec` (WantsOutput) has ended: with `ok`, its next turn is ready (unless it could pass
  // the context); a failed turn ends its conversation.
  void Finished(const RequestSpec& spec, bool ok, const std::vector<int32_t>& output_ids);
  int64_t ready_turns() const { return static_cast<int64_t>(ready_.size()); }
  v1::GenerateRequest ToGenerateRequest(const RequestSpec& spec, uint64_t request_seed) const;
  const WorkloadOptions& options() const { return options_; }

 private:
  WorkloadOptions options_;
  std::mt19937_64 rng_;
  // A conversation's turn, ready to go: its id, the turn's index and the tokens so far.
  struct ReadyTurn {
    int64_t conversation;
    int turn;
    std::vector<int32_t> history;
  };
  std::vector<int32_t> RandomIds(int count);

  std::vector<int32_t> shared_prefix_;
  size_t next_prompt_ = 0;
  std::deque<ReadyTurn> ready_;
  int64_t next_conversation_ = 0;
};

// Non-empty lines of `path`, in order (a line is one prompt; "\n" inside it is written \n).
absl::StatusOr<std::vector<std::string>> ReadPromptsFile(const std::string& path);

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_WORKLOAD_H_

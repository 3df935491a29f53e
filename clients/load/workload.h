// What kvlens-load sends: prompt and output lengths (fixed, uniform, or prompts from a
// file), the kind of each request (generation, or a share of interpretability calls),
// all drawn from one seeded generator so a run is reproducible.
#ifndef KVLENS_CLIENTS_LOAD_WORKLOAD_H_
#define KVLENS_CLIENTS_LOAD_WORKLOAD_H_

#include <cstdint>
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

enum class Kind { kGenerate, kAttention, kProbe, kActivations, kAttribution };
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
  uint64_t seed = 1;
};

// One request's parameters: either text or synthetic token ids, and the output length.
struct RequestSpec {
  Kind kind = Kind::kGenerate;
  std::string text;                // non-empty for file prompts
  std::vector<int32_t> token_ids;  // synthetic prompts
  int max_new_tokens = 0;
};

class Workload {
 public:
  explicit Workload(WorkloadOptions options);

  // The next request (not thread-safe; the runner draws from one thread).
  RequestSpec Next();
  v1::GenerateRequest ToGenerateRequest(const RequestSpec& spec, uint64_t request_seed) const;
  const WorkloadOptions& options() const { return options_; }

 private:
  WorkloadOptions options_;
  std::mt19937_64 rng_;
  std::vector<int32_t> shared_prefix_;
  size_t next_prompt_ = 0;
};

// Non-empty lines of `path`, in order (a line is one prompt; "\n" inside it is written \n).
absl::StatusOr<std::vector<std::string>> ReadPromptsFile(const std::string& path);

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_WORKLOAD_H_

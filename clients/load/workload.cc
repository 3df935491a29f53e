#include "clients/load/workload.h"

#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "engine/tokenizer/unicode.h"

namespace kvlens::load {

absl::StatusOr<LengthDist> LengthDist::Parse(const std::string& spec, const std::string& flag) {
  LengthDist d;
  const size_t colon = spec.find(':');
  const bool ok = colon == std::string::npos
                      ? absl::SimpleAtoi(spec, &d.min) && (d.max = d.min, true)
                      : absl::SimpleAtoi(spec.substr(0, colon), &d.min) &&
                            absl::SimpleAtoi(spec.substr(colon + 1), &d.max);
  if (!ok || d.min < 1 || d.max < d.min) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, " = '", spec, "' must be N or MIN:MAX with 1 <= MIN <= MAX (tokens)"));
  }
  return d;
}

int LengthDist::Draw(std::mt19937_64& rng) const {
  if (min == max) return min;
  return std::uniform_int_distribution<int>(min, max)(rng);
}

const char* KindName(Kind kind) {
  switch (kind) {
    case Kind::kGenerate:
      return "generate";
    case Kind::kAttention:
      return "attention";
    case Kind::kProbe:
      return "probe";
    case Kind::kActivations:
      return "activations";
    case Kind::kAttribution:
      return "attribution";
    case Kind::kPatch:
      return "patch";
  }
  return "generate";
}

Workload::Workload(WorkloadOptions options) : options_(std::move(options)), rng_(options_.seed) {
  shared_prefix_ = RandomIds(options_.shared_prefix_tokens);
}

std::vector<int32_t> Workload::RandomIds(int count) {
  std::uniform_int_distribution<int32_t> id(0, std::max(options_.vocab_size - 1, 0));
  std::vector<int32_t> ids;
  for (int i = 0; i < count; ++i) ids.push_back(id(rng_));
  return ids;
}

bool Workload::WantsOutput(const RequestSpec& spec) const {
  return spec.conversation >= 0 && spec.turn + 1 < options_.turns;
}

void Workload::Finished(const RequestSpec& spec, bool ok, const std::vector<int32_t>& output_ids) {
  if (!ok || !WantsOutput(spec)) return;
  ReadyTurn next{spec.conversation, spec.turn + 1, spec.token_ids};
  next.history.insert(next.history.end(), output_ids.begin(), output_ids.end());
  const int64_t longest = static_cast<int64_t>(next.history.size()) + options_.turn_tokens.max +
                          options_.output_tokens.max;
  if (options_.context_length > 0 && longest > options_.context_length) return;
  ready_.push_back(std::move(next));
}

RequestSpec Workload::Next() {
  RequestSpec spec;
  // Cumulative shares: [0, a) attention, [a, a + p) probe, and so on; the rest generate.
  const double u = std::uniform_real_distribution<double>(0, 1)(rng_);
  double edge = 0;
  for (const auto& [share, kind] : {std::pair{options_.attention_share, Kind::kAttention},
                                    {options_.probe_share, Kind::kProbe},
                                    {options_.activations_share, Kind::kActivations},
                                    {options_.attribution_share, Kind::kAttribution},
                                    {options_.patch_share, Kind::kPatch}}) {
    edge += share;
    if (u < edge) {
      spec.kind = kind;
      break;
    }
  }
  spec.max_new_tokens = options_.output_tokens.Draw(rng_);
  if (spec.kind == Kind::kGenerate && !ready_.empty()) {  // (only with turns > 1)
    ReadyTurn next = std::move(ready_.front());
    ready_.pop_front();
    spec.conversation = next.conversation;
    spec.turn = next.turn;
    spec.token_ids = std::move(next.history);
    for (int32_t id : RandomIds(options_.turn_tokens.Draw(rng_))) spec.token_ids.push_back(id);
    return spec;
  }
  if (spec.kind == Kind::kGenerate && options_.turns > 1) spec.conversation = next_conversation_++;
  if (!options_.prompts.empty()) {
    spec.text = options_.prompts[next_prompt_++ % options_.prompts.size()];
    return spec;
  }
  const int length = options_.prompt_tokens.Draw(rng_);
  spec.token_ids.assign(shared_prefix_.begin(),
                        shared_prefix_.begin() + std::min<int>(length, shared_prefix_.size()));
  for (int32_t id : RandomIds(length - static_cast<int>(spec.token_ids.size()))) {
    spec.token_ids.push_back(id);
  }
  return spec;
}

v1::GenerateRequest Workload::ToGenerateRequest(const RequestSpec& spec,
                                                uint64_t request_seed) const {
  v1::GenerateRequest request;
  if (spec.text.empty()) {
    request.mutable_token_ids()->mutable_ids()->Assign(spec.token_ids.begin(),
                                                       spec.token_ids.end());
  } else {
    request.set_text(spec.text);
  }
  request.mutable_sampling()->set_temperature(options_.temperature);
  request.mutable_sampling()->set_seed(request_seed);
  request.mutable_stopping()->set_max_new_tokens(spec.max_new_tokens);
  request.mutable_stopping()->set_ignore_eos(options_.ignore_eos);
  if (options_.prompt_logprobs >= 0) request.set_prompt_logprobs(options_.prompt_logprobs);
  return request;
}

absl::StatusOr<std::vector<std::string>> ReadPromptsFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--prompts-file '", path, "' cannot be read"));
  std::vector<std::string> prompts;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty()) continue;
    // Generate's text must be UTF-8: else every request fails in gRPC, UNIMPLEMENTED and
    // without a message.
    if (const size_t bad = unicode::FindInvalidUtf8(line); bad != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "--prompts-file '%s' line %d is not valid UTF-8: byte 0x%02x at offset %d", path, number,
          static_cast<unsigned char>(line[bad]), bad));
    }
    prompts.push_back(absl::StrReplaceAll(line, {{"\\n", "\n"}}));
  }
  if (prompts.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--prompts-file '", path, "' has no prompts"));
  }
  return prompts;
}

}  // namespace kvlens::load

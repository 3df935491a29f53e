// generation_config.json: the sampling defaults a Hugging Face model directory ships.
//
// kvlens reads what it can apply when a request leaves the field unset, as Hugging Face
// generate() and vLLM (--generation-config auto) do:
//   repetition_penalty   number in (0, 10]   (CTRL-style; applies to greedy decoding too)
// Other keys (bos/eos ids, do_sample, temperature, top_k, top_p, max_length, …) are
// ignored: the tokenizer defines BOS/EOS, and kvlens' requests always carry their own
// temperature and top-k (0 = greedy / off).
#ifndef KVLENS_ENGINE_MODEL_GENERATION_CONFIG_H_
#define KVLENS_ENGINE_MODEL_GENERATION_CONFIG_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"

namespace kvlens {

struct GenerationConfig {
  std::optional<double> repetition_penalty;
};

// An absent file is an empty config; malformed JSON or a value out of range is
// INVALID_ARGUMENT naming the file, the field and the allowed range.
absl::StatusOr<GenerationConfig> ReadGenerationConfig(const std::string& path);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_GENERATION_CONFIG_H_

// Model: config + weights + tokenizer, loaded from any supported file format.
#ifndef KVLENS_ENGINE_MODEL_MODEL_H_
#define KVLENS_ENGINE_MODEL_MODEL_H_

#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/generation_config.h"
#include "engine/model/model_config.h"
#include "engine/model/weights.h"
#include "engine/tokenizer/chat_template.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvlens {

struct Model {
  ModelConfig config;
  Weights weights;
  std::unique_ptr<Tokenizer> tokenizer;  // null when the file brings none
  std::string format;                    // "gguf", "llama2c", "safetensors"
  // Sampling defaults for requests that leave a field unset (generation_config.json).
  GenerationConfig generation_config;
  // How a conversation becomes a prompt: the family of the tokenizer's chat template
  // (DetectChatFormat, at load), or what a server's --chat-template names; none when the
  // template is missing or none kvlens writes.
  std::optional<ChatFormat> chat_format;

  // Every weight present with the shape the config implies (errors name the tensor).
  absl::Status ValidateWeights() const;
};

struct LoadOptions {
  // A .gguf file, a llama2.c .bin checkpoint, or a Hugging Face model directory.
  std::string path;
  // llama2.c only: its tokenizer .bin (default: tokenizer.bin / tok<V>.bin beside it).
  std::string tokenizer_path;
};

absl::StatusOr<std::unique_ptr<Model>> LoadModel(const LoadOptions& options);

// Only the tokenizer of a model file: a GGUF (a vocabulary-only one is enough), or a
// llama2.c tokenizer .bin given as options.tokenizer_path (or options.path).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const LoadOptions& options);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_MODEL_H_

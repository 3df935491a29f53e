// Hugging Face model directories: config.json + *.safetensors (one file, or shards named
// by model.safetensors.index.json) + tokenizer.json, for the GPT-2 family
// (model_type "gpt2", transformer.h.N.* names, or h.N.* from a bare GPT2Model; Conv1D
// weights stored [in, out]) and the Llama family (model_type "llama", model.layers.N.*
// names, half-split RoPE). An optional generation_config.json gives sampling defaults
// (engine/model/generation_config.h).
#ifndef KVLENS_ENGINE_MODEL_HF_MODEL_H_
#define KVLENS_ENGINE_MODEL_HF_MODEL_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/model.h"

namespace kvlens {

absl::StatusOr<std::unique_ptr<Model>> LoadHfModel(const std::string& dir);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_HF_MODEL_H_

// GGUF → Model for the "llama" and "gpt2" architectures (llama.cpp's tensor names).
#ifndef KVLENS_ENGINE_MODEL_GGUF_MODEL_H_
#define KVLENS_ENGINE_MODEL_GGUF_MODEL_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/model/gguf.h"
#include "engine/model/model.h"

namespace kvlens {

// Config from the metadata, weights as views into the mapping, the embedded tokenizer.
absl::StatusOr<std::unique_ptr<Model>> LoadGgufModel(std::unique_ptr<GgufFile> gguf);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_MODEL_GGUF_MODEL_H_

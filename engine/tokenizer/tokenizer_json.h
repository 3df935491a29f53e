// Hugging Face tokenizer.json → Tokenizer. Supports the two BPE flavours kvlens serves:
// byte-level BPE (GPT-2: ByteLevel pre-tokenizer/decoder) and sentencepiece-style BPE with
// byte fallback (Llama: ▁ for spaces, <0xNN> byte tokens), plus added/special tokens.
#ifndef KVLENS_ENGINE_TOKENIZER_TOKENIZER_JSON_H_
#define KVLENS_ENGINE_TOKENIZER_TOKENIZER_JSON_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvlens {

// INVALID_ARGUMENT naming the field for malformed content; UNIMPLEMENTED for model types
// other than BPE.
absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromJson(const std::string& path);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_TOKENIZER_JSON_H_

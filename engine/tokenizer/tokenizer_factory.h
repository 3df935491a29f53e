// Builds a Tokenizer from the vocabulary a model file carries.
#ifndef KVLENS_ENGINE_TOKENIZER_TOKENIZER_FACTORY_H_
#define KVLENS_ENGINE_TOKENIZER_TOKENIZER_FACTORY_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "engine/model/gguf.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvlens {

// From GGUF metadata: tokenizer.ggml.model ("llama" → SpmTokenizer, "gpt2" →
// Gpt2Tokenizer), .tokens, .scores (llama), .token_type (optional: all normal when absent),
// .merges (gpt2), .bos_token_id / .eos_token_id / .unknown_token_id (optional) and
// .add_space_prefix (llama, default true). NOT_FOUND when the file has no tokenizer,
// UNIMPLEMENTED for another model kind, INVALID_ARGUMENT naming the key when something is
// missing or inconsistent.
absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromGguf(const GgufFile& gguf);

// From llama2.c's tokenizer.bin: i32 max_token_length, then per token f32 score, i32 length,
// bytes. Pieces there spell a space as ' '; they are stored with ▁ like sentencepiece's.
// Ids 0/1/2 are <unk>/BOS/EOS, <0xNN> pieces are byte tokens. `vocab_size` > 0 must match
// the file exactly (llama2.c takes it from the checkpoint); ≤ 0 reads to the end of the file.
absl::StatusOr<std::unique_ptr<Tokenizer>> TokenizerFromLlama2c(const std::string& path,
                                                                int vocab_size);

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_TOKENIZER_FACTORY_H_

// Sentencepiece-style BPE with byte fallback: Llama's tokenizer (GGUF tokenizer.ggml.model
// "llama") and llama2.c's tokenizer.bin.
//
// Encode: spaces become ▁ (U+2581), a dummy ▁ is prefixed (add_space_prefix), the text is
// split into characters, and the adjacent pair whose concatenation is the highest-scoring
// vocabulary piece is merged until none is left (leftmost on ties). A character with no
// piece of its own falls back to its bytes' <0xNN> tokens.
#ifndef KVLENS_ENGINE_TOKENIZER_SPM_TOKENIZER_H_
#define KVLENS_ENGINE_TOKENIZER_SPM_TOKENIZER_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvlens {

class SpmTokenizer : public Tokenizer {
 public:
  struct Vocab {
    std::vector<std::string> pieces;  // spaces spelled ▁
    std::vector<float> scores;        // same length as pieces; higher merges first
    std::vector<TokenType> types;     // same length as pieces
    int32_t bos_id = -1;
    int32_t eos_id = -1;
    int32_t unk_id = -1;  // emitted for a character whose bytes have no <0xNN> tokens
    bool add_space_prefix = true;
  };
  // INVALID_ARGUMENT when lengths disagree or a special id is out of range.
  static absl::StatusOr<std::unique_ptr<SpmTokenizer>> Create(Vocab vocab);

  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const override;
  std::string TokenBytes(int32_t id, int32_t prev) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(vocab_.pieces.size()); }
  int32_t bos_id() const override { return vocab_.bos_id; }
  int32_t eos_id() const override { return vocab_.eos_id; }
  int32_t unk_id() const { return vocab_.unk_id; }
  std::string_view Piece(int32_t id) const override;
  TokenType token_type(int32_t id) const override;
  float score(int32_t id) const;

 private:
  explicit SpmTokenizer(Vocab vocab);
  bool InRange(int32_t id) const { return id >= 0 && id < vocab_size(); }

  Vocab vocab_;
  // Pieces Encode may produce (normal and user-defined), viewing vocab_.pieces.
  absl::flat_hash_map<std::string_view, int32_t> piece_to_id_;
  std::array<int32_t, 256> byte_to_id_;  // <0xNN> tokens; -1 when missing
  std::vector<int16_t> byte_value_;      // per id: the byte of a <0xNN> token, else -1
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_SPM_TOKENIZER_H_

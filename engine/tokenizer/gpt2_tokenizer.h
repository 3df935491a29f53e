// GPT-2's byte-level BPE (GGUF tokenizer.ggml.model "gpt2"), the tokenizer of GPT-2 and,
// with their own pre-tokenizers, of Llama 3 and Qwen2.
//
// Encode: split the text with the pre-tokenizer's regex (implemented by hand, PreTokenizer
// below), map each piece's bytes to printable characters (GPT-2's bytes_to_unicode: a space
// becomes "Ġ"), then apply the merges in rank order.
#ifndef KVLENS_ENGINE_TOKENIZER_GPT2_TOKENIZER_H_
#define KVLENS_ENGINE_TOKENIZER_GPT2_TOKENIZER_H_

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/tokenizer/tokenizer.h"

namespace kvlens {

class Gpt2Tokenizer : public Tokenizer {
 public:
  // The pre-tokenizer regexes (GGUF tokenizer.ggml.pre):
  //   kGpt2 ("gpt-2", "default"):
  //     's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  //   kLlama3 ("llama-bpe", Llama 3):
  //     (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
  //     ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
  //   kQwen2 ("qwen2"): kLlama3's with \p{N} for \p{N}{1,3} (one digit a piece).
  enum class PreTokenizer { kGpt2, kLlama3, kQwen2 };

  struct Vocab {
    std::vector<std::string> pieces;  // byte-level spelling ("Ġthe")
    std::vector<TokenType> types;     // same length as pieces
    std::vector<std::string> merges;  // "left right", best (rank 0) first
    int32_t bos_id = -1;
    int32_t eos_id = -1;
    PreTokenizer pre = PreTokenizer::kGpt2;
    // A piece whose byte-level spelling is itself a token becomes that token without the
    // merges (Llama 3's tokenizer: "ignore_merges").
    bool ignore_merges = false;
  };
  // INVALID_ARGUMENT for mismatched lengths, a malformed merge, or an id out of range.
  static absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Create(Vocab vocab);

  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const override;
  std::string TokenBytes(int32_t id, int32_t prev) const override;
  int32_t vocab_size() const override { return static_cast<int32_t>(vocab_.pieces.size()); }
  int32_t bos_id() const override { return vocab_.bos_id; }
  int32_t eos_id() const override { return vocab_.eos_id; }
  std::string_view Piece(int32_t id) const override;
  TokenType token_type(int32_t id) const override;

  // The pre-tokenizer alone: `text` cut into the regex's matches, in order (exposed for
  // tests; concatenated they give back `text`).
  static std::vector<std::string_view> PreTokenize(std::string_view text,
                                                   PreTokenizer pre = PreTokenizer::kGpt2);

 private:
  explicit Gpt2Tokenizer(Vocab vocab);
  bool InRange(int32_t id) const { return id >= 0 && id < vocab_size(); }
  void EncodeWord(std::string_view word, std::vector<int32_t>& ids) const;

  Vocab vocab_;
  absl::flat_hash_map<std::string_view, int32_t> piece_to_id_;  // normal + user-defined
  // (left, right) → rank; views into vocab_.merges.
  absl::flat_hash_map<std::pair<std::string_view, std::string_view>, int32_t> merge_rank_;
  std::array<std::string, 256> byte_to_chars_;  // UTF-8 of bytes_to_unicode()[b]
  std::vector<int16_t> char_to_byte_;           // inverse, indexed by code point; -1 if none
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_GPT2_TOKENIZER_H_

// The tokenizer interface: text ⇄ token ids. Implementations: SpmTokenizer
// (sentencepiece-style BPE with byte fallback) and Gpt2Tokenizer (byte-level BPE).
#ifndef KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_
#define KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_

#include <algorithm>
#include <array>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace kvlens {

// Token kinds, numbered as GGUF's tokenizer.ggml.token_type (sentencepiece's piece types).
enum class TokenType : int32_t {
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,      // BOS, EOS, …: never produced by Encode, decode to ""
  kUserDefined = 4,  // added tokens: decode to their text as written
  kUnused = 5,
  kByte = 6,  // <0xNN> byte-fallback tokens
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids for `text`. With add_bos, the BOS id comes first (when the vocabulary has
  // one). Special-token strings in the text are treated as plain text.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos) const = 0;
  // The bytes token `id` stands for (byte tokens give their single byte; the SPM space
  // marker ▁ becomes ' '; control tokens such as BOS/EOS give ""). `prev` is the token
  // before it or -1: SPM drops the leading space of the first piece of a sequence (prev -1
  // or BOS), which is the dummy prefix Encode added, as sentencepiece and llama2.c do.
  virtual std::string TokenBytes(int32_t id, int32_t prev) const = 0;
  // Like Encode, but where the text spells a control or user-defined token of the
  // vocabulary ("<|endoftext|>", "<s>", …) that token is emitted, as Hugging Face
  // tokenizers and llama.cpp's parse_special do (longest match first, scanning left to
  // right). The text between such tokens is encoded with Encode (no BOS), so an SPM
  // fragment after a special token gets its dummy-prefix space, as in llama.cpp.
  std::vector<int32_t> EncodeWithSpecialTokens(std::string_view text, bool add_bos) const;

  // All tokens' bytes concatenated (may end in an incomplete UTF-8 sequence only if the
  // ids themselves do).
  std::string Decode(absl::Span<const int32_t> ids) const;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when absent
  // Whether a text prompt gets BOS when its request does not say: the model's own setting
  // (GGUF tokenizer.ggml.add_bos_token: true for Llama 3, false for Qwen2; tokenizer_config
  // .json's add_bos_token, or false for a null bos_token), true when the files have none.
  bool adds_bos() const { return adds_bos_; }
  void set_adds_bos(bool adds) { adds_bos_ = adds; }
  // Whether `id` ends a generation: EOS, or another end-of-generation token the model names
  // (GGUF tokenizer.ggml.eot_token_id and eom_token_id: Llama 3's <|eot_id|>, <|eom_id|>),
  // as llama.cpp stops on any of them.
  bool IsEndOfGeneration(int32_t id) const {
    return id >= 0 &&
           (id == eos_id() || std::find(end_ids_.begin(), end_ids_.end(), id) != end_ids_.end());
  }
  void AddEndOfGeneration(int32_t id) { end_ids_.push_back(id); }
  // Every id IsEndOfGeneration accepts.
  std::vector<int32_t> EndOfGenerationIds() const {
    std::vector<int32_t> ids = end_ids_;
    if (eos_id() >= 0) ids.insert(ids.begin(), eos_id());
    return ids;
  }
  // The model's Jinja chat template (GGUF tokenizer.chat_template, tokenizer_config.json's
  // chat_template); "" when it has none. chat_template.h reads its family.
  const std::string& chat_template() const { return chat_template_; }
  void set_chat_template(std::string t) { chat_template_ = std::move(t); }
  virtual int32_t eos_id() const = 0;  // -1 when absent
  // The vocabulary's own spelling of a token (e.g. "▁the", "<0x0A>", "Ġthe"); "" for an id
  // outside [0, vocab_size). TokenBytes also gives "" for such ids.
  virtual std::string_view Piece(int32_t id) const = 0;
  // kNormal unless the implementation knows better (ours all do); kUnused out of range.
  virtual TokenType token_type(int32_t /*id*/) const { return TokenType::kNormal; }

 private:
  // (spelling, id) of every control and user-defined token, longest first, and which
  // bytes start one; built on first use.
  void BuildSpecials() const;
  mutable std::once_flag specials_once_;
  mutable std::vector<std::pair<std::string, int32_t>> specials_;
  mutable std::array<bool, 256> special_first_byte_{};
  std::string chat_template_;
  bool adds_bos_ = true;
  std::vector<int32_t> end_ids_;  // besides EOS
};

// Turns a stream of token ids into UTF-8 text without ever emitting a broken character:
// bytes of a multi-byte character split across tokens are held back until complete. Bytes
// that can never form valid UTF-8 are emitted as U+FFFD.
class IncrementalDecoder {
 public:
  // `prev` is the token before the first one pushed (e.g. the last prompt token, so that
  // SPM does not drop the leading space of the first generated word); -1 for none.
  explicit IncrementalDecoder(const Tokenizer& tokenizer, int32_t prev = -1)
      : tokenizer_(tokenizer), prev_(prev) {}
  // Appends a token; returns the text that became complete.
  std::string Push(int32_t id);
  // Whatever is still held back (an incomplete trailing sequence becomes U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  int32_t prev_;
  std::string pending_;  // bytes of a character not yet complete (at most 3)
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_

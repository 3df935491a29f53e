// The tokenizer interface: text ⇄ token ids. Implementations: SpmTokenizer
// (sentencepiece-style BPE with byte fallback) and Gpt2Tokenizer (byte-level BPE).
#ifndef KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_
#define KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace kvlens {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Token ids for `text`. With add_bos, the BOS id comes first (when the vocabulary has
  // one). Special-token strings in the text are treated as plain text.
  virtual std::vector<int32_t> Encode(std::string_view text, bool add_bos) const = 0;
  // The bytes token `id` stands for (byte tokens give their single byte; the SPM space
  // marker ▁ becomes ' '; control tokens such as BOS/EOS give ""). `prev` is the token
  // before it or -1: SPM drops the leading space of the first piece after BOS, as
  // sentencepiece's decoder does.
  virtual std::string TokenBytes(int32_t id, int32_t prev) const = 0;
  // All tokens' bytes concatenated (may end in an incomplete UTF-8 sequence only if the
  // ids themselves do).
  std::string Decode(absl::Span<const int32_t> ids) const;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;  // -1 when absent
  virtual int32_t eos_id() const = 0;  // -1 when absent
  // The vocabulary's own spelling of a token (e.g. "▁the", "<0x0A>", "Ġthe").
  virtual std::string_view Piece(int32_t id) const = 0;
};

// Turns a stream of token ids into UTF-8 text without ever emitting a broken character:
// bytes of a multi-byte character split across tokens are held back until complete. Bytes
// that can never form valid UTF-8 are emitted as U+FFFD.
class IncrementalDecoder {
 public:
  explicit IncrementalDecoder(const Tokenizer& tokenizer) : tokenizer_(tokenizer) {}
  // Appends a token; returns the text that became complete.
  std::string Push(int32_t id);
  // Whatever is still held back (an incomplete trailing sequence becomes U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  int32_t prev_ = -1;
  std::string pending_;
};

}  // namespace kvlens

#endif  // KVLENS_ENGINE_TOKENIZER_TOKENIZER_H_

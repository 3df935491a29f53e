#include "engine/tokenizer/tokenizer.h"

#include "engine/tokenizer/unicode.h"

namespace kvlens {

std::string Tokenizer::Decode(absl::Span<const int32_t> ids) const {
  std::string out;
  int32_t prev = -1;
  for (int32_t id : ids) {
    out += TokenBytes(id, prev);
    prev = id;
  }
  return out;
}

std::string IncrementalDecoder::Push(int32_t id) {
  pending_ += tokenizer_.TokenBytes(id, prev_);
  prev_ = id;
  // Hold back only a tail that may still become a valid character; everything before it
  // is final (complete characters, or invalid bytes that no later byte can repair).
  const size_t hold = unicode::IncompleteUtf8Suffix(pending_);
  std::string out =
      unicode::SanitizeUtf8(std::string_view(pending_).substr(0, pending_.size() - hold));
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string IncrementalDecoder::Flush() {
  std::string out = unicode::SanitizeUtf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvlens

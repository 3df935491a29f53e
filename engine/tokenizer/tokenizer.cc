#include "engine/tokenizer/tokenizer.h"

#include <algorithm>

#include "engine/tokenizer/unicode.h"

namespace kvlens {

void Tokenizer::BuildSpecials() const {
  for (int32_t id = 0; id < vocab_size(); ++id) {
    const TokenType t = token_type(id);
    const std::string_view piece = Piece(id);
    if ((t == TokenType::kControl || t == TokenType::kUserDefined) && !piece.empty()) {
      specials_.emplace_back(std::string(piece), id);
      special_first_byte_[static_cast<uint8_t>(piece[0])] = true;
    }
  }
  // Longest first, so that at one position the longest spelling wins.
  std::stable_sort(specials_.begin(), specials_.end(),
                   [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
}

std::vector<int32_t> Tokenizer::EncodeWithSpecialTokens(std::string_view text, bool add_bos) const {
  std::call_once(specials_once_, [this] { BuildSpecials(); });
  std::vector<int32_t> out;
  if (add_bos && bos_id() >= 0) out.push_back(bos_id());
  size_t fragment = 0;  // start of the text not yet encoded
  auto flush = [&](size_t end) {
    if (end > fragment) {
      const std::vector<int32_t> ids = Encode(text.substr(fragment, end - fragment), false);
      out.insert(out.end(), ids.begin(), ids.end());
    }
  };
  for (size_t i = 0; i < text.size();) {
    const std::pair<std::string, int32_t>* hit = nullptr;
    if (special_first_byte_[static_cast<uint8_t>(text[i])]) {
      for (const auto& sp : specials_) {
        if (text.compare(i, sp.first.size(), sp.first) == 0) {
          hit = &sp;
          break;
        }
      }
    }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    flush(i);
    out.push_back(hit->second);
    i += hit->first.size();
    fragment = i;
  }
  flush(text.size());
  return out;
}

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

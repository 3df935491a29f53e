#include "engine/tokenizer/spm_tokenizer.h"

#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/bpe_merge.h"
#include "engine/tokenizer/unicode.h"

namespace kvlens {

namespace {

constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";  // ▁ U+2581

// The byte of a "<0xNN>" piece (uppercase or lowercase hex), or -1.
int ParseBytePiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return -1;
  int value = 0;
  for (char c : piece.substr(3, 2)) {
    value <<= 4;
    if (c >= '0' && c <= '9') {
      value |= c - '0';
    } else if (c >= 'A' && c <= 'F') {
      value |= c - 'A' + 10;
    } else if (c >= 'a' && c <= 'f') {
      value |= c - 'a' + 10;
    } else {
      return -1;
    }
  }
  return value;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SpmTokenizer>> SpmTokenizer::Create(Vocab vocab) {
  const size_t n = vocab.pieces.size();
  if (n == 0) return absl::InvalidArgumentError("SPM vocabulary is empty");
  if (n > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("SPM vocabulary too large: ", n));
  }
  if (vocab.scores.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("SPM scores has ", vocab.scores.size(),
                                                   " entries but there are ", n, " tokens"));
  }
  if (vocab.types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("SPM token types has ", vocab.types.size(),
                                                   " entries but there are ", n, " tokens"));
  }
  const std::pair<const char*, int32_t> special_ids[] = {
      {"bos_id", vocab.bos_id}, {"eos_id", vocab.eos_id}, {"unk_id", vocab.unk_id}};
  for (const auto& special : special_ids) {
    if (special.second < -1 || special.second >= static_cast<int32_t>(n)) {
      return absl::InvalidArgumentError(absl::StrCat("SPM ", special.first, " = ", special.second,
                                                     " is outside the vocabulary of ", n));
    }
  }
  return std::unique_ptr<SpmTokenizer>(new SpmTokenizer(std::move(vocab)));
}

SpmTokenizer::SpmTokenizer(Vocab vocab) : vocab_(std::move(vocab)) {
  byte_to_id_.fill(-1);
  byte_value_.assign(vocab_.pieces.size(), -1);
  for (int32_t id = 0; id < vocab_size(); ++id) {
    const std::string_view piece = vocab_.pieces[id];
    switch (vocab_.types[id]) {
      case TokenType::kNormal:
      case TokenType::kUserDefined:
        piece_to_id_.emplace(piece, id);  // first spelling wins if a vocabulary repeats one
        break;
      case TokenType::kByte:
        if (const int b = ParseBytePiece(piece); b >= 0) {
          byte_value_[id] = static_cast<int16_t>(b);
          if (byte_to_id_[b] < 0) byte_to_id_[b] = id;
        }
        break;
      default:
        break;
    }
  }
}

std::vector<int32_t> SpmTokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  if (add_bos && vocab_.bos_id >= 0) ids.push_back(vocab_.bos_id);
  if (text.empty()) return ids;  // sentencepiece: no dummy prefix for empty input

  std::string escaped;
  escaped.reserve(3 * text.size() + 3);  // worst case: every byte a space
  if (vocab_.add_space_prefix) escaped += kSpaceMarker;
  for (char c : text) {
    if (c == ' ') {
      escaped += kSpaceMarker;
    } else {
      escaped.push_back(c);
    }
  }

  std::vector<std::string_view> chars;
  for (size_t pos = 0; pos < escaped.size();) {
    const unicode::Decoded d = unicode::DecodeUtf8(escaped, pos);
    chars.push_back(std::string_view(escaped).substr(pos, d.len));
    pos += d.len;
  }
  const auto merge_score = [this](std::string_view left,
                                  std::string_view right) -> std::optional<double> {
    const auto it = piece_to_id_.find(std::string_view(left.data(), left.size() + right.size()));
    if (it == piece_to_id_.end()) return std::nullopt;
    return vocab_.scores[it->second];
  };
  for (std::string_view sym : internal::MergeSymbols(chars, merge_score)) {
    if (const auto it = piece_to_id_.find(sym); it != piece_to_id_.end()) {
      ids.push_back(it->second);
      continue;
    }
    // Byte fallback; a character some of whose bytes have no token becomes one <unk>.
    bool all_bytes = true;
    for (char c : sym) all_bytes = all_bytes && byte_to_id_[static_cast<uint8_t>(c)] >= 0;
    if (all_bytes) {
      for (char c : sym) ids.push_back(byte_to_id_[static_cast<uint8_t>(c)]);
    } else if (vocab_.unk_id >= 0) {
      ids.push_back(vocab_.unk_id);
    }
  }
  return ids;
}

std::string SpmTokenizer::TokenBytes(int32_t id, int32_t prev) const {
  if (!InRange(id)) return "";
  switch (vocab_.types[id]) {
    case TokenType::kByte:
      if (byte_value_[id] >= 0) return std::string(1, static_cast<char>(byte_value_[id]));
      return "";
    case TokenType::kNormal:
    case TokenType::kUserDefined:
      break;
    default:
      return "";  // control, unknown and unused tokens have no text
  }
  const std::string_view piece = vocab_.pieces[id];
  std::string out;
  out.reserve(piece.size());
  for (size_t pos = 0; pos < piece.size();) {
    if (piece.substr(pos, kSpaceMarker.size()) == kSpaceMarker) {
      out.push_back(' ');
      pos += kSpaceMarker.size();
    } else {
      out.push_back(piece[pos++]);
    }
  }
  // The dummy prefix's space is not part of the text: sentencepiece drops the leading space
  // of the first piece of a sequence, and llama2.c that of the piece after BOS.
  const bool first = prev < 0 || (prev == vocab_.bos_id);
  if (vocab_.add_space_prefix && first && !out.empty() && out[0] == ' ') out.erase(0, 1);
  return out;
}

std::string_view SpmTokenizer::Piece(int32_t id) const {
  return InRange(id) ? std::string_view(vocab_.pieces[id]) : std::string_view();
}

TokenType SpmTokenizer::token_type(int32_t id) const {
  return InRange(id) ? vocab_.types[id] : TokenType::kUnused;
}

float SpmTokenizer::score(int32_t id) const { return InRange(id) ? vocab_.scores[id] : 0.0f; }

}  // namespace kvlens

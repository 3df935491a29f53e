#include "engine/tokenizer/gpt2_tokenizer.h"

#include <algorithm>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer/bpe_merge.h"
#include "engine/tokenizer/unicode.h"

namespace kvlens {

namespace {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68
// bytes to U+0100… in byte order, so every byte has a visible, non-space character.
std::array<char32_t, 256> BytesToUnicode() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

enum class CharClass { kLetter, kNumber, kSpace, kOther };

struct Char {
  size_t pos;  // byte offset in the text
  char32_t cp;
  CharClass cls;
};

CharClass Classify(char32_t cp) {
  if (unicode::IsLetter(cp)) return CharClass::kLetter;
  if (unicode::IsNumber(cp)) return CharClass::kNumber;
  if (unicode::IsWhitespace(cp)) return CharClass::kSpace;
  return CharClass::kOther;
}

// The end of the whitespace run's match from i under \s+(?!\S)|\s+: the run, less its last
// character when a non-space follows (it goes to the next word), unless that leaves nothing.
size_t SpaceRunMatch(size_t i, size_t ws_end, size_t n) {
  return (ws_end == n || ws_end - i == 1) ? ws_end : ws_end - 1;
}

bool IsNewline(char32_t c) { return c == U'\r' || c == U'\n'; }

char32_t AsciiLower(char32_t c) { return c >= U'A' && c <= U'Z' ? c + 32 : c; }

// Llama 3's and Qwen2's regex (Gpt2Tokenizer::PreTokenizer), alternatives tried in order.
size_t Llama3Match(const std::vector<Char>& chars, size_t i, size_t max_digits) {
  const size_t n = chars.size();
  const auto cls_at = [&](size_t k) { return k < n ? chars[k].cls : CharClass::kSpace; };
  const auto lower_at = [&](size_t k) { return k < n ? AsciiLower(chars[k].cp) : U'\0'; };
  const auto run_end = [&](size_t k, CharClass cls) {
    while (k < n && chars[k].cls == cls) ++k;
    return k;
  };
  const char32_t c = chars[i].cp;
  // (?i:'s|'t|'re|'ve|'m|'ll|'d)
  if (c == U'\'') {
    const char32_t a = lower_at(i + 1), b = lower_at(i + 2);
    if (a == U's' || a == U't' || a == U'm' || a == U'd') return i + 2;
    if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) {
      return i + 3;
    }
  }
  // [^\r\n\p{L}\p{N}]?\p{L}+
  const CharClass cls = chars[i].cls;
  if (cls != CharClass::kLetter && cls != CharClass::kNumber && !IsNewline(c) &&
      cls_at(i + 1) == CharClass::kLetter) {
    return run_end(i + 1, CharClass::kLetter);
  }
  if (cls == CharClass::kLetter) return run_end(i, CharClass::kLetter);
  // \p{N}{1,3} (Qwen2: \p{N})
  if (cls == CharClass::kNumber) return std::min(run_end(i, CharClass::kNumber), i + max_digits);
  // ' ?[^\s\p{L}\p{N}]+[\r\n]*'
  const size_t body = c == U' ' && cls_at(i + 1) == CharClass::kOther ? i + 1 : i;
  if (chars[body].cls == CharClass::kOther) {
    size_t end = run_end(body, CharClass::kOther);
    while (end < n && IsNewline(chars[end].cp)) ++end;
    return end;
  }
  // \s*[\r\n]+: up to the run's last newline.
  const size_t ws_end = run_end(i, CharClass::kSpace);
  for (size_t k = ws_end; k > i; --k) {
    if (IsNewline(chars[k - 1].cp)) return k;
  }
  return SpaceRunMatch(i, ws_end, n);
}

}  // namespace

std::vector<std::string_view> Gpt2Tokenizer::PreTokenize(std::string_view text, PreTokenizer pre) {
  // Invalid UTF-8 decodes as U+FFFD (class "other") but keeps its own bytes.
  std::vector<Char> chars;
  for (size_t pos = 0; pos < text.size();) {
    const unicode::Decoded d = unicode::DecodeUtf8(text, pos);
    chars.push_back({pos, d.cp, Classify(d.cp)});
    pos += d.len;
  }
  const size_t n = chars.size();
  const auto pos_of = [&](size_t i) { return i < n ? chars[i].pos : text.size(); };
  const auto cp_at = [&](size_t i) { return i < n ? chars[i].cp : U'\0'; };
  const auto run_end = [&](size_t i, CharClass cls) {
    while (i < n && chars[i].cls == cls) ++i;
    return i;
  };

  std::vector<std::string_view> words;
  if (pre != PreTokenizer::kGpt2) {
    const size_t max_digits = pre == PreTokenizer::kLlama3 ? 3 : 1;
    for (size_t i = 0; i < n;) {
      const size_t end = Llama3Match(chars, i, max_digits);
      words.push_back(text.substr(pos_of(i), pos_of(end) - pos_of(i)));
      i = end;
    }
    return words;
  }
  for (size_t i = 0; i < n;) {
    size_t end = i;
    const char32_t c = chars[i].cp;
    if (c == U'\'' && (cp_at(i + 1) == U's' || cp_at(i + 1) == U't' || cp_at(i + 1) == U'm' ||
                       cp_at(i + 1) == U'd')) {
      end = i + 2;  // 's 't 'm 'd
    } else if (c == U'\'' && ((cp_at(i + 1) == U'r' && cp_at(i + 2) == U'e') ||
                              (cp_at(i + 1) == U'v' && cp_at(i + 2) == U'e') ||
                              (cp_at(i + 1) == U'l' && cp_at(i + 2) == U'l'))) {
      end = i + 3;  // 're 've 'll
    } else {
      // " ?X+" for X in letters, numbers, other: an optional U+0020 then a run of one class.
      const size_t body =
          (c == U' ' && i + 1 < n && chars[i + 1].cls != CharClass::kSpace) ? i + 1 : i;
      if (chars[body].cls != CharClass::kSpace) {
        end = run_end(body, chars[body].cls);
      } else {
        // \s+(?!\S) takes a whitespace run but leaves its last character to the next word
        // when a non-space follows; a lone space before a non-space falls to \s+.
        end = SpaceRunMatch(i, run_end(i, CharClass::kSpace), n);
      }
    }
    words.push_back(text.substr(pos_of(i), pos_of(end) - pos_of(i)));
    i = end;
  }
  return words;
}

absl::StatusOr<std::unique_ptr<Gpt2Tokenizer>> Gpt2Tokenizer::Create(Vocab vocab) {
  const size_t n = vocab.pieces.size();
  if (n == 0) return absl::InvalidArgumentError("GPT-2 vocabulary is empty");
  if (n > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("GPT-2 vocabulary too large: ", n));
  }
  if (vocab.types.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat("GPT-2 token types has ", vocab.types.size(),
                                                   " entries but there are ", n, " tokens"));
  }
  for (size_t i = 0; i < vocab.merges.size(); ++i) {
    const std::string& m = vocab.merges[i];
    const size_t space = m.find(' ', 1);
    if (space == std::string::npos || space + 1 == m.size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("GPT-2 merge #", i, " \"", m, "\" is not \"left right\""));
    }
  }
  const std::pair<const char*, int32_t> special_ids[] = {{"bos_id", vocab.bos_id},
                                                         {"eos_id", vocab.eos_id}};
  for (const auto& special : special_ids) {
    if (special.second < -1 || special.second >= static_cast<int32_t>(n)) {
      return absl::InvalidArgumentError(absl::StrCat("GPT-2 ", special.first, " = ", special.second,
                                                     " is outside the vocabulary of ", n));
    }
  }
  return std::unique_ptr<Gpt2Tokenizer>(new Gpt2Tokenizer(std::move(vocab)));
}

Gpt2Tokenizer::Gpt2Tokenizer(Vocab vocab) : vocab_(std::move(vocab)) {
  const std::array<char32_t, 256> map = BytesToUnicode();
  char_to_byte_.assign(512, -1);
  for (int b = 0; b < 256; ++b) {
    byte_to_chars_[b] = unicode::EncodeUtf8(map[b]);
    char_to_byte_[map[b]] = static_cast<int16_t>(b);
  }
  for (int32_t id = 0; id < vocab_size(); ++id) {
    const TokenType t = vocab_.types[id];
    if (t == TokenType::kNormal || t == TokenType::kUserDefined) {
      piece_to_id_.emplace(vocab_.pieces[id], id);
    }
  }
  merge_rank_.reserve(vocab_.merges.size());
  for (size_t i = 0; i < vocab_.merges.size(); ++i) {
    const std::string_view m = vocab_.merges[i];
    const size_t space = m.find(' ', 1);
    merge_rank_.emplace(std::make_pair(m.substr(0, space), m.substr(space + 1)),
                        static_cast<int32_t>(i));  // a repeated pair keeps its best rank
  }
}

void Gpt2Tokenizer::EncodeWord(std::string_view word, std::vector<int32_t>& ids) const {
  std::string mapped;
  mapped.reserve(2 * word.size());
  for (char c : word) mapped += byte_to_chars_[static_cast<uint8_t>(c)];
  if (vocab_.ignore_merges) {
    if (const auto it = piece_to_id_.find(mapped); it != piece_to_id_.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  std::vector<std::string_view> symbols;
  for (size_t pos = 0; pos < mapped.size();) {
    const int len = unicode::DecodeUtf8(mapped, pos).len;
    symbols.push_back(std::string_view(mapped).substr(pos, len));
    pos += len;
  }
  const auto rank = [this](std::string_view left, std::string_view right) -> std::optional<double> {
    const auto it = merge_rank_.find(std::make_pair(left, right));
    if (it == merge_rank_.end()) return std::nullopt;
    return -static_cast<double>(it->second);  // lower rank merges first
  };
  for (std::string_view sym : internal::MergeSymbols(symbols, rank)) {
    if (const auto it = piece_to_id_.find(sym); it != piece_to_id_.end()) {
      ids.push_back(it->second);
      continue;
    }
    // A merge result missing from the vocabulary: fall back to its single-byte tokens.
    for (size_t pos = 0; pos < sym.size();) {
      const int len = unicode::DecodeUtf8(sym, pos).len;
      if (const auto it = piece_to_id_.find(sym.substr(pos, len)); it != piece_to_id_.end()) {
        ids.push_back(it->second);
      }
      pos += len;
    }
  }
}

std::vector<int32_t> Gpt2Tokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  if (add_bos && vocab_.bos_id >= 0) ids.push_back(vocab_.bos_id);
  for (std::string_view word : PreTokenize(text, vocab_.pre)) EncodeWord(word, ids);
  return ids;
}

std::string Gpt2Tokenizer::TokenBytes(int32_t id, int32_t /*prev*/) const {
  if (!InRange(id)) return "";
  const std::string_view piece = vocab_.pieces[id];
  switch (vocab_.types[id]) {
    case TokenType::kNormal:
    case TokenType::kByte:
      break;
    case TokenType::kUserDefined:
      return std::string(piece);  // added tokens are stored as plain text
    default:
      return "";
  }
  std::string out;
  out.reserve(piece.size());
  for (size_t pos = 0; pos < piece.size();) {
    const unicode::Decoded d = unicode::DecodeUtf8(piece, pos);
    if (d.valid && d.cp < char_to_byte_.size() && char_to_byte_[d.cp] >= 0) {
      out.push_back(static_cast<char>(char_to_byte_[d.cp]));
    } else {
      out.append(piece.substr(pos, d.len));  // not byte-level: keep as written
    }
    pos += d.len;
  }
  return out;
}

std::string_view Gpt2Tokenizer::Piece(int32_t id) const {
  return InRange(id) ? std::string_view(vocab_.pieces[id]) : std::string_view();
}

TokenType Gpt2Tokenizer::token_type(int32_t id) const {
  return InRange(id) ? vocab_.types[id] : TokenType::kUnused;
}

}  // namespace kvlens

// UTF-8 decoding/encoding and the few Unicode character classes tokenizers need.
#ifndef KVLENS_ENGINE_TOKENIZER_UNICODE_H_
#define KVLENS_ENGINE_TOKENIZER_UNICODE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kvlens::unicode {

inline constexpr char32_t kReplacementChar = 0xFFFD;

// One code point decoded from UTF-8. An invalid sequence (bad lead byte, bad or missing
// continuation, overlong form, surrogate, > U+10FFFF) decodes as {U+FFFD, n, false}, where
// n ≥ 1 is the length of its longest valid-so-far prefix (Unicode's "maximal subpart"):
// the caller may keep those n bytes as they are or replace them by one U+FFFD.
struct Decoded {
  char32_t cp;
  int len;
  bool valid;
};
Decoded DecodeUtf8(std::string_view s, size_t pos);

void AppendUtf8(char32_t cp, std::string& out);
std::string EncodeUtf8(char32_t cp);

// Bytes a sequence starting with `lead` should have: 1…4, or 0 for a byte that can never
// start one (a continuation byte, 0xC0, 0xC1, 0xF5…0xFF).
int Utf8SequenceLength(uint8_t lead);

// How many bytes at the end of `s` are the start of a sequence that is valid so far but
// incomplete (0 when `s` ends on a complete character or on invalid bytes).
size_t IncompleteUtf8Suffix(std::string_view s);

// Replaces every invalid sequence (see DecodeUtf8) with one U+FFFD.
std::string SanitizeUtf8(std::string_view s);

// The offset of the first byte of `s` that does not begin a valid sequence (see
// DecodeUtf8), or std::string_view::npos when all of `s` is UTF-8.
size_t FindInvalidUtf8(std::string_view s);

bool IsLetter(char32_t cp);      // general category L*
bool IsNumber(char32_t cp);      // general category N*
bool IsWhitespace(char32_t cp);  // the White_Space property

namespace internal {
struct CodepointRange {
  char32_t lo;
  char32_t hi;  // inclusive
};
// unicode_tables.cc (generated): sorted, disjoint.
extern const CodepointRange kLetterRanges[];
extern const size_t kLetterRangesSize;
extern const CodepointRange kNumberRanges[];
extern const size_t kNumberRangesSize;
extern const CodepointRange kWhitespaceRanges[];
extern const size_t kWhitespaceRangesSize;
}  // namespace internal

}  // namespace kvlens::unicode

#endif  // KVLENS_ENGINE_TOKENIZER_UNICODE_H_

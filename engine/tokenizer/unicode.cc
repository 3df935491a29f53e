#include "engine/tokenizer/unicode.h"

#include <algorithm>

namespace kvlens::unicode {

int Utf8SequenceLength(uint8_t lead) {
  if (lead < 0x80) return 1;
  if (lead < 0xC2) return 0;  // continuation byte, or an always-overlong 0xC0/0xC1
  if (lead < 0xE0) return 2;
  if (lead < 0xF0) return 3;
  if (lead < 0xF5) return 4;
  return 0;
}

namespace {

// The allowed range of the second byte depends on the lead byte (excludes overlong forms,
// surrogates and code points above U+10FFFF); later bytes are plain continuations.
bool SecondByteOk(uint8_t lead, uint8_t b) {
  switch (lead) {
    case 0xE0:
      return b >= 0xA0 && b <= 0xBF;
    case 0xED:
      return b >= 0x80 && b <= 0x9F;
    case 0xF0:
      return b >= 0x90 && b <= 0xBF;
    case 0xF4:
      return b >= 0x80 && b <= 0x8F;
    default:
      return b >= 0x80 && b <= 0xBF;
  }
}

bool IsContinuation(uint8_t b) { return (b & 0xC0) == 0x80; }

bool InRanges(char32_t cp, const internal::CodepointRange* ranges, size_t n) {
  const internal::CodepointRange* end = ranges + n;
  // First range whose hi >= cp.
  const auto* it = std::lower_bound(
      ranges, end, cp, [](const internal::CodepointRange& r, char32_t c) { return r.hi < c; });
  return it != end && it->lo <= cp;
}

}  // namespace

Decoded DecodeUtf8(std::string_view s, size_t pos) {
  const auto byte = [&](size_t i) { return static_cast<uint8_t>(s[i]); };
  const uint8_t lead = byte(pos);
  const int len = Utf8SequenceLength(lead);
  if (len == 1) return {lead, 1, true};
  if (len == 0) return {kReplacementChar, 1, false};
  // Count the bytes that still form a valid prefix; on failure they are consumed together
  // (the "maximal subpart" rule, so "\xE2\x82A" gives one U+FFFD, as Python does).
  int ok = 1;
  if (pos + 1 < s.size() && SecondByteOk(lead, byte(pos + 1))) {
    ok = 2;
    while (ok < len && pos + ok < s.size() && IsContinuation(byte(pos + ok))) ++ok;
  }
  if (ok < len) return {kReplacementChar, ok, false};
  char32_t cp = lead & (0x7F >> len);
  for (int i = 1; i < len; ++i) cp = (cp << 6) | (byte(pos + i) & 0x3F);
  return {cp, len, true};
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string EncodeUtf8(char32_t cp) {
  std::string out;
  AppendUtf8(cp, out);
  return out;
}

size_t IncompleteUtf8Suffix(std::string_view s) {
  // A sequence is at most 4 bytes, so only the last 3 bytes can start an incomplete one.
  const size_t n = s.size();
  for (size_t back = 1; back <= 3 && back <= n; ++back) {
    const uint8_t b = static_cast<uint8_t>(s[n - back]);
    if (IsContinuation(b)) continue;
    const int len = Utf8SequenceLength(b);
    if (len <= static_cast<int>(back)) return 0;  // complete, ASCII, or an invalid lead
    // Check that the bytes present are a valid prefix.
    if (back >= 2 && !SecondByteOk(b, static_cast<uint8_t>(s[n - back + 1]))) return 0;
    return back;
  }
  return 0;
}

size_t FindInvalidUtf8(std::string_view s) {
  for (size_t pos = 0; pos < s.size();) {
    const Decoded d = DecodeUtf8(s, pos);
    if (!d.valid) return pos;
    pos += d.len;
  }
  return std::string_view::npos;
}

std::string SanitizeUtf8(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t pos = 0; pos < s.size();) {
    const Decoded d = DecodeUtf8(s, pos);
    if (d.valid) {
      out.append(s.substr(pos, d.len));
    } else {
      AppendUtf8(kReplacementChar, out);
    }
    pos += d.len;
  }
  return out;
}

bool IsLetter(char32_t cp) {
  if (cp < 0x80) return (cp | 0x20) >= 'a' && (cp | 0x20) <= 'z';
  return InRanges(cp, internal::kLetterRanges, internal::kLetterRangesSize);
}

bool IsNumber(char32_t cp) {
  if (cp < 0x80) return cp >= '0' && cp <= '9';
  return InRanges(cp, internal::kNumberRanges, internal::kNumberRangesSize);
}

bool IsWhitespace(char32_t cp) {
  return InRanges(cp, internal::kWhitespaceRanges, internal::kWhitespaceRangesSize);
}

}  // namespace kvlens::unicode

#include "engine/tokenizer/unicode.h"

#include <string>

#include "gtest/gtest.h"

namespace kvlens::unicode {
namespace {

TEST(UnicodeTest, DecodesValidSequences) {
  const std::string s = "A\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80";  // A é € 😀
  Decoded d = DecodeUtf8(s, 0);
  EXPECT_EQ(d.cp, U'A');
  EXPECT_EQ(d.len, 1);
  d = DecodeUtf8(s, 1);
  EXPECT_EQ(d.cp, 0xE9u);
  EXPECT_EQ(d.len, 2);
  d = DecodeUtf8(s, 3);
  EXPECT_EQ(d.cp, 0x20ACu);
  EXPECT_EQ(d.len, 3);
  d = DecodeUtf8(s, 6);
  EXPECT_EQ(d.cp, 0x1F600u);
  EXPECT_EQ(d.len, 4);
  EXPECT_TRUE(d.valid);
  for (char32_t cp : {U'\0', U'x', char32_t{0x7FF}, char32_t{0xFFFF}, char32_t{0x10FFFF}}) {
    const std::string e = EncodeUtf8(cp);
    EXPECT_EQ(DecodeUtf8(e, 0).cp, cp);
    EXPECT_EQ(DecodeUtf8(e, 0).len, static_cast<int>(e.size()));
  }
}

TEST(UnicodeTest, RejectsInvalidSequencesByMaximalSubpart) {
  struct Case {
    std::string bytes;
    int len;
  };
  for (const Case& c : {Case{"\x80", 1}, Case{"\xC0\x80", 1}, Case{"\xC1\xBF", 1},
                        Case{"\xED\xA0\x80", 1},      // surrogate U+D800
                        Case{"\xF4\x90\x80\x80", 1},  // above U+10FFFF
                        Case{"\xE0\x80\x80", 1},      // overlong
                        Case{"\xE2\x82", 2},          // truncated
                        Case{"\xE2\x82"
                             "A",
                             2},  // missing last byte
                        Case{"\xF0\x9F\x98", 3}, Case{"\xFF", 1}}) {
    const Decoded d = DecodeUtf8(c.bytes, 0);
    EXPECT_FALSE(d.valid) << testing::PrintToString(c.bytes);
    EXPECT_EQ(d.cp, kReplacementChar);
    EXPECT_EQ(d.len, c.len) << testing::PrintToString(c.bytes);
  }
}

TEST(UnicodeTest, IncompleteSuffixAndSanitize) {
  EXPECT_EQ(IncompleteUtf8Suffix("abc"), 0u);
  EXPECT_EQ(IncompleteUtf8Suffix("ab\xF0"), 1u);
  EXPECT_EQ(IncompleteUtf8Suffix("ab\xF0\x9F"), 2u);
  EXPECT_EQ(IncompleteUtf8Suffix("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(IncompleteUtf8Suffix("ab\xF0\x9F\x98\x80"), 0u);
  EXPECT_EQ(IncompleteUtf8Suffix("ab\xE0\x80"), 0u);  // can never complete (overlong)
  EXPECT_EQ(IncompleteUtf8Suffix("\xFF"), 0u);
  EXPECT_EQ(IncompleteUtf8Suffix(""), 0u);
  EXPECT_EQ(SanitizeUtf8("a\xFF"
                         "b\xE2\x82"
                         "c\xC3\xA9"),
            "a\uFFFDb\uFFFDc\u00E9");
}

// RFC 3629's ill-formed sequences, each found at its first byte; every well-formed
// length (1 to 4 bytes, U+10FFFF the last) passes.
TEST(UnicodeTest, FindInvalidUtf8FindsTheFirstIllFormedByte) {
  EXPECT_EQ(FindInvalidUtf8(""), std::string_view::npos);
  EXPECT_EQ(FindInvalidUtf8("a \xC3\xA9 \xE2\x9C\x93 \xF0\x9F\x98\x80 \xF4\x8F\xBF\xBF"),
            std::string_view::npos);
  EXPECT_EQ(FindInvalidUtf8("ab\x80"), 2u);              // a lone continuation byte
  EXPECT_EQ(FindInvalidUtf8("ab\xE2\x9C"), 2u);          // a truncated sequence
  EXPECT_EQ(FindInvalidUtf8("\xC0\xAF"), 0u);            // an overlong '/'
  EXPECT_EQ(FindInvalidUtf8("x\xED\xA0\x80"), 1u);       // U+D800, a surrogate
  EXPECT_EQ(FindInvalidUtf8("\xF4\x90\x80\x80"), 0u);    // U+110000
  EXPECT_EQ(FindInvalidUtf8("ok\xC3\xA9\xFF\x80"), 4u);  // the first of two
}

TEST(UnicodeTest, CharacterClasses) {
  for (char32_t cp :
       {U'a', U'Z', char32_t{0xE9}, char32_t{0x4E2D}, char32_t{0x0416}, char32_t{0x1780}}) {
    EXPECT_TRUE(IsLetter(cp)) << static_cast<uint32_t>(cp);
  }
  for (char32_t cp : {U'0', U'9', char32_t{0xBD}, char32_t{0x0663}, char32_t{0x2167}}) {
    EXPECT_TRUE(IsNumber(cp)) << static_cast<uint32_t>(cp);  // ½, Arabic-Indic 3, Roman VIII
    EXPECT_FALSE(IsLetter(cp));
  }
  for (char32_t cp : {U' ', U'\t', U'\n', U'\r', char32_t{0x0B}, char32_t{0x0C}, char32_t{0x85},
                      char32_t{0xA0}, char32_t{0x3000}, char32_t{0x2029}}) {
    EXPECT_TRUE(IsWhitespace(cp)) << static_cast<uint32_t>(cp);
  }
  for (char32_t cp :
       {U'!', U'_', char32_t{0x1F600}, char32_t{0x200B}, char32_t{0x1C}, char32_t{0xFFFD}}) {
    EXPECT_FALSE(IsLetter(cp) || IsNumber(cp) || IsWhitespace(cp)) << static_cast<uint32_t>(cp);
  }
}

}  // namespace
}  // namespace kvlens::unicode

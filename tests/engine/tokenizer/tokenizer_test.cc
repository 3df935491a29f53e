#include "engine/tokenizer/tokenizer.h"

#include <cstdio>
#include <string>
#include <vector>

#include "engine/tokenizer/spm_tokenizer.h"
#include "gtest/gtest.h"

namespace kvlens {
namespace {

// <unk> <s> </s>, byte tokens <0x00>…<0xFF> at 3…258, then ▁ and "hi".
std::unique_ptr<SpmTokenizer> ByteVocab() {
  SpmTokenizer::Vocab v;
  const auto add = [&](std::string piece, TokenType type) {
    v.pieces.push_back(std::move(piece));
    v.scores.push_back(0);
    v.types.push_back(type);
  };
  add("<unk>", TokenType::kUnknown);
  add("<s>", TokenType::kControl);
  add("</s>", TokenType::kControl);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    add(buf, TokenType::kByte);
  }
  add("\u2581", TokenType::kNormal);    // 259
  add("\u2581hi", TokenType::kNormal);  // 260
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  auto tok = SpmTokenizer::Create(std::move(v));
  EXPECT_TRUE(tok.ok());
  return *std::move(tok);
}

int32_t Byte(uint8_t b) { return 3 + b; }

TEST(IncrementalDecoderTest, HoldsBackASplitEmoji) {
  auto tok = ByteVocab();
  IncrementalDecoder dec(*tok);
  EXPECT_EQ(dec.Push(1), "");  // BOS
  EXPECT_EQ(dec.Push(260), "hi");
  // 😀 = F0 9F 98 80, one byte token each: nothing until the last byte arrives.
  EXPECT_EQ(dec.Push(Byte(0xF0)), "");
  EXPECT_EQ(dec.Push(Byte(0x9F)), "");
  EXPECT_EQ(dec.Push(Byte(0x98)), "");
  EXPECT_EQ(dec.Push(Byte(0x80)), "\xF0\x9F\x98\x80");
  EXPECT_EQ(dec.Push(260), " hi");
  EXPECT_EQ(dec.Flush(), "");
}

TEST(IncrementalDecoderTest, InvalidBytesBecomeReplacementCharacters) {
  auto tok = ByteVocab();
  IncrementalDecoder dec(*tok);
  EXPECT_EQ(dec.Push(Byte(0xFF)), "\uFFFD");  // can never start a character
  EXPECT_EQ(dec.Push(Byte(0xE2)), "");
  EXPECT_EQ(dec.Push(Byte(0x82)), "");
  EXPECT_EQ(dec.Push(Byte('A')), "\uFFFDA");  // E2 82 cut short: one U+FFFD, then A
  EXPECT_EQ(dec.Push(Byte(0xC3)), "");
  EXPECT_EQ(dec.Flush(), "\uFFFD");  // still incomplete at the end
  EXPECT_EQ(dec.Flush(), "");
}

TEST(IncrementalDecoderTest, MatchesDecodeAndNeverSplitsACharacter) {
  auto tok = ByteVocab();
  const std::string text = "hi caf\xC3\xA9 \xE4\xB8\xAD\xF0\x9F\x98\x80!";
  const std::vector<int32_t> ids = tok->Encode(text, true);
  ASSERT_EQ(tok->Decode(ids), text);
  IncrementalDecoder dec(*tok);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string piece = dec.Push(id);
    // Each chunk on its own is valid UTF-8 (no replacement characters in this text).
    EXPECT_EQ(piece.find("\uFFFD"), std::string::npos);
    streamed += piece;
  }
  streamed += dec.Flush();
  EXPECT_EQ(streamed, text);
}

TEST(IncrementalDecoderTest, StartsAfterAPrompt) {
  auto tok = ByteVocab();
  IncrementalDecoder fresh(*tok);
  EXPECT_EQ(fresh.Push(260), "hi");  // first piece of a sequence: dummy-prefix space dropped
  IncrementalDecoder continuing(*tok, /*prev=*/260);
  EXPECT_EQ(continuing.Push(260), " hi");
}

}  // namespace
}  // namespace kvlens

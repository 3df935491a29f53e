#include "engine/tokenizer/spm_tokenizer.h"

#include <cstdio>
#include <string>
#include <vector>

#include "engine/model/gguf.h"
#include "engine/tokenizer/tokenizer_factory.h"
#include "gtest/gtest.h"
#include "tests/engine/tokenizer/conformance_util.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

std::unique_ptr<Tokenizer> LoadGguf(const std::string& path) {
  auto g = GgufFile::Open(path);
  EXPECT_TRUE(g.ok()) << g.status();
  if (!g.ok()) return nullptr;
  auto t = TokenizerFromGguf(**g);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : nullptr;
}

// Every line of llama.cpp's Llama-SPM vectors, encoded without BOS (test-tokenizer-0 calls
// the tokenizer with add_special = false; the dummy-prefix ▁ is still added).
TEST(SpmConformanceTest, LlamaSpmVocab) {
  const std::string base = testing::TestData("tokenizers/ggml-vocab-llama-spm.gguf");
  KVLENS_REQUIRE_FILE(base);
  auto tok = LoadGguf(base);
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->vocab_size(), 32000);
  EXPECT_EQ(tok->bos_id(), 1);
  EXPECT_EQ(tok->eos_id(), 2);
  const auto cases = testing::ReadConformance(base + ".inp", base + ".out");
  ASSERT_FALSE(cases.empty());
  for (const testing::ConformanceCase& c : cases) {
    const std::vector<int32_t> ids = tok->Encode(c.text, /*add_bos=*/false);
    EXPECT_EQ(testing::IdString(ids), testing::IdString(c.ids)) << "text: \"" << c.text << "\"";
    EXPECT_EQ(tok->Decode(ids), c.text);
    std::vector<int32_t> with_bos = tok->Encode(c.text, /*add_bos=*/true);
    ASSERT_FALSE(with_bos.empty());
    EXPECT_EQ(with_bos[0], 1);
    EXPECT_EQ(tok->Decode(with_bos), c.text);
  }
}

// A hand-made vocabulary: <unk> <s> </s>, the 256 byte tokens, then a few pieces.
SpmTokenizer::Vocab SmallVocab() {
  SpmTokenizer::Vocab v;
  const auto add = [&](std::string piece, float score, TokenType type) {
    v.pieces.push_back(std::move(piece));
    v.scores.push_back(score);
    v.types.push_back(type);
  };
  add("<unk>", 0, TokenType::kUnknown);
  add("<s>", 0, TokenType::kControl);
  add("</s>", 0, TokenType::kControl);
  for (int b = 0; b < 256; ++b) {
    char buf[8];
    std::snprintf(buf, sizeof(buf), "<0x%02X>", b);
    add(buf, 0, TokenType::kByte);
  }
  add("\xE2\x96\x81", -1, TokenType::kNormal);  // 259 ▁
  add("a", -1, TokenType::kNormal);             // 260
  add("b", -1, TokenType::kNormal);             // 261
  add("ab", -5, TokenType::kNormal);            // 262
  add("\u2581a", -2, TokenType::kNormal);       // 263 ▁a
  add("ba", -5, TokenType::kNormal);            // 264: ties with "ab"
  add("\u2581ab", -3, TokenType::kNormal);      // 265 ▁ab
  add("<s>x", -1, TokenType::kNormal);          // 266: only reachable through "<s>"
  v.bos_id = 1;
  v.eos_id = 2;
  v.unk_id = 0;
  return v;
}

TEST(SpmTokenizerTest, MergesByScoreLeftmostFirst) {
  auto tok = SpmTokenizer::Create(SmallVocab());
  ASSERT_TRUE(tok.ok()) << tok.status();
  // "▁ab": ▁a (-2) beats ab (-5), then ▁a+b → ▁ab (-3).
  EXPECT_EQ((*tok)->Encode("ab", false), (std::vector<int32_t>{265}));
  EXPECT_EQ((*tok)->Encode("ab", true), (std::vector<int32_t>{1, 265}));
  // "▁bab": ▁ b a b: ba and ab tie at -5, the leftmost (b,a) merges first.
  EXPECT_EQ((*tok)->Encode("bab", false), (std::vector<int32_t>{259, 264, 261}));
  // Spaces become ▁; a character without a piece falls back to bytes (é = C3 A9).
  EXPECT_EQ((*tok)->Encode("a é", false), (std::vector<int32_t>{263, 259, 3 + 0xC3, 3 + 0xA9}));
  // Control pieces are never produced from text: "<s>" is just bytes here.
  EXPECT_EQ((*tok)->Encode("<s>", false), (std::vector<int32_t>{259, 3 + '<', 3 + 's', 3 + '>'}));
  EXPECT_TRUE((*tok)->Encode("", false).empty());
  EXPECT_EQ((*tok)->Encode("", true), (std::vector<int32_t>{1}));
}

TEST(SpmTokenizerTest, DecodeDropsOnlyTheDummyPrefixSpace) {
  auto tok = SpmTokenizer::Create(SmallVocab());
  ASSERT_TRUE(tok.ok());
  const Tokenizer& t = **tok;
  EXPECT_EQ(t.TokenBytes(263, -1), "a");    // first piece of a sequence
  EXPECT_EQ(t.TokenBytes(263, 1), "a");     // first piece after BOS
  EXPECT_EQ(t.TokenBytes(263, 260), " a");  // anywhere else
  EXPECT_EQ(t.TokenBytes(1, -1), "");       // control
  EXPECT_EQ(t.TokenBytes(0, -1), "");       // unknown
  EXPECT_EQ(t.TokenBytes(3 + 0x41, -1), "A");
  EXPECT_EQ(t.TokenBytes(9999, -1), "");
  EXPECT_EQ(t.TokenBytes(-5, -1), "");
  EXPECT_EQ(t.Decode({1, 263, 259, 3 + 0xC3, 3 + 0xA9, 2}), "a \xC3\xA9");
  EXPECT_EQ(t.Piece(263), "\u2581a");
  EXPECT_EQ(t.Piece(70000), "");
  EXPECT_EQ(t.token_type(5), TokenType::kByte);
}

TEST(SpmTokenizerTest, UnknownWithoutByteTokensAndNoSpacePrefix) {
  SpmTokenizer::Vocab v = SmallVocab();
  v.types[3 + 0xA9] = TokenType::kNormal;  // byte A9 no longer a byte token
  v.add_space_prefix = false;
  auto tok = SpmTokenizer::Create(std::move(v));
  ASSERT_TRUE(tok.ok());
  EXPECT_EQ((*tok)->Encode("ab\xC3\xA9", false), (std::vector<int32_t>{262, 0}));
  EXPECT_EQ((*tok)->TokenBytes(263, -1), " a");  // no dummy prefix to remove
}

TEST(SpmTokenizerTest, CreateRejectsInconsistentVocab) {
  SpmTokenizer::Vocab v = SmallVocab();
  v.scores.pop_back();
  EXPECT_EQ(SpmTokenizer::Create(v).status().code(), absl::StatusCode::kInvalidArgument);
  v = SmallVocab();
  v.types.push_back(TokenType::kNormal);
  EXPECT_FALSE(SpmTokenizer::Create(v).ok());
  v = SmallVocab();
  v.bos_id = 100000;
  auto r = SpmTokenizer::Create(v);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("bos_id"), absl::string_view::npos);
  EXPECT_FALSE(SpmTokenizer::Create(SpmTokenizer::Vocab{}).ok());
}

// Expected ids from an independent Python transcription of llama2.c run.c's encode() over
// tok512.bin (BOS, the dummy-prefix " " token, per-character lookup with byte fallback at
// id byte + 3, then repeated best-score pair merges).
struct Llama2cCase {
  const char* text;
  std::vector<int32_t> ids;
};
const Llama2cCase kLlama2cCases[] = {
    {"Once upon a time", {1, 403, 407, 261, 378}},
    {"Lily's mom said, \"Lily, let's go to the park.\"",
     {1,   317, 439, 419, 357, 336, 432, 313, 438, 310, 432, 278,
      316, 439, 419, 298, 414, 267, 265, 282, 295, 433, 426, 436}},
    {"h\xC3\xA9llo w\xC3\xB6rld \xF0\x9F\x98\x80",
     {1, 270, 485, 306, 414, 263, 198, 185, 420, 341, 410, 243, 162, 155, 131}},
    {"  two  spaces", {1, 410, 410, 259, 424, 414, 410, 262, 427, 412, 331, 419}},
    {"", {1}},
};

TEST(SpmLlama2cTest, EncodesLikeRunC) {
  const std::string path = testing::TestData("stories260K/tok512.bin");
  KVLENS_REQUIRE_FILE(path);
  auto tok = TokenizerFromLlama2c(path, 512);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 512);
  EXPECT_EQ((*tok)->bos_id(), 1);
  EXPECT_EQ((*tok)->eos_id(), 2);
  for (const Llama2cCase& c : kLlama2cCases) {
    const std::vector<int32_t> ids = (*tok)->Encode(c.text, /*add_bos=*/true);
    EXPECT_EQ(testing::IdString(ids), testing::IdString(c.ids)) << c.text;
    EXPECT_EQ((*tok)->Decode(ids), c.text);
  }
  // llama2.c's decode: the piece after BOS loses its leading space, later ones keep it.
  EXPECT_EQ((*tok)->TokenBytes(403, 1), "Once");
  EXPECT_EQ((*tok)->TokenBytes(403, 378), " Once");
}

// The GGUF conversion of stories260K carries the same vocabulary as tok512.bin.
TEST(SpmLlama2cTest, GgufAndLlama2cTokenizersAgree) {
  const std::string bin = testing::TestData("stories260K/tok512.bin");
  const std::string gguf = testing::TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(bin);
  KVLENS_REQUIRE_FILE(gguf);
  auto a = TokenizerFromLlama2c(bin, 512);
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = LoadGguf(gguf);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ((*a)->vocab_size(), b->vocab_size());
  EXPECT_EQ((*a)->bos_id(), b->bos_id());
  EXPECT_EQ((*a)->eos_id(), b->eos_id());
  for (int32_t id = 3; id < b->vocab_size(); ++id) {
    EXPECT_EQ((*a)->Piece(id), b->Piece(id)) << id;
  }
  for (const char* text : {"Once upon a time", "The cat sat on the mat.\nIt was happy!",
                           "  leading spaces and trailing  ", "numbers 12345 and symbols #@%",
                           "Lily's mom said, \"Lily, let's go to the park.\"",
                           "caf\xC3\xA9 \xE4\xB8\xAD\xE6\x96\x87 \xF0\x9F\x98\x80"}) {
    EXPECT_EQ((*a)->Encode(text, true), b->Encode(text, true)) << text;
    EXPECT_EQ(b->Decode(b->Encode(text, true)), text);
  }
}

}  // namespace
}  // namespace kvlens

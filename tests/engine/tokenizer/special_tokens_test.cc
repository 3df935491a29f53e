// Tokenizer::EncodeWithSpecialTokens: special-token spellings in text become the tokens.
#include <string>
#include <vector>

#include "engine/model/model.h"
#include "engine/tokenizer/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

std::unique_ptr<Tokenizer> Load(const std::string& path) {
  auto m = LoadTokenizer({path, ""});
  if (m.ok()) return *std::move(m);
  auto model = LoadModel({path, ""});
  return model.ok() ? std::move((*model)->tokenizer) : nullptr;
}

std::vector<int32_t> Cat(std::initializer_list<std::vector<int32_t>> parts) {
  std::vector<int32_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

TEST(SpecialTokensTest, ByteLevelBpeSplitsOnEndOfText) {
  KVLENS_REQUIRE_FILE(testing::DefaultModelPath());
  auto tok = Load(testing::DefaultModelPath());
  ASSERT_NE(tok, nullptr);
  // "And God said" = [295, 386, 387] (models/README.md, from the training script's BPE);
  // <|endoftext|> = 4095.
  const std::vector<int32_t> and_god_said = {295, 386, 387};
  ASSERT_EQ(tok->Encode("And God said", false), and_god_said);
  EXPECT_EQ(tok->EncodeWithSpecialTokens("And God said<|endoftext|>And God said", false),
            Cat({and_god_said, {4095}, and_god_said}));
  EXPECT_EQ(tok->EncodeWithSpecialTokens("<|endoftext|><|endoftext|>", false),
            (std::vector<int32_t>{4095, 4095}));
  // BOS is <|endoftext|> too; an incomplete spelling stays text.
  EXPECT_EQ(tok->EncodeWithSpecialTokens("And God said", true), Cat({{4095}, and_god_said}));
  for (int32_t id : tok->EncodeWithSpecialTokens("<|endoftext|", false)) EXPECT_NE(id, 4095);
  // The plain encoder leaves the spelling as text.
  for (int32_t id : tok->Encode("a<|endoftext|>b", false)) EXPECT_NE(id, 4095);
  EXPECT_EQ(tok->EncodeWithSpecialTokens("", false), std::vector<int32_t>{});
}

TEST(SpecialTokensTest, SentencepieceFragmentsKeepTheirDummyPrefix) {
  const std::string gguf = testing::TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(gguf);
  auto tok = Load(gguf);
  ASSERT_NE(tok, nullptr);
  ASSERT_EQ(tok->bos_id(), 1);
  ASSERT_EQ(tok->eos_id(), 2);
  ASSERT_EQ(tok->Piece(1), "<s>");
  ASSERT_EQ(tok->Piece(2), "</s>");
  // As llama.cpp's parse_special: each text fragment is encoded on its own (with the
  // dummy-prefix space), the special tokens between them as their ids.
  EXPECT_EQ(tok->EncodeWithSpecialTokens("Once upon a time</s><s>Lily", true),
            Cat({{1}, tok->Encode("Once upon a time", false), {2, 1}, tok->Encode("Lily", false)}));
  // <unk> is not a control token: it stays text.
  EXPECT_EQ(tok->EncodeWithSpecialTokens("<unk>", false), tok->Encode("<unk>", false));
}

}  // namespace
}  // namespace kvlens

#include "engine/tokenizer/gpt2_tokenizer.h"

#include <string>
#include <vector>

#include "engine/model/gguf.h"
#include "engine/tokenizer/tokenizer_factory.h"
#include "gtest/gtest.h"
#include "tests/engine/tokenizer/conformance_util.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using Words = std::vector<std::string_view>;

TEST(Gpt2PreTokenizeTest, FollowsTheRegex) {
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("Hello world"), (Words{"Hello", " world"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("I've it's we'll they're 'M"),
            (Words{"I", "'ve", " it", "'s", " we", "'ll", " they", "'re", " '", "M"}));
  // \s+(?!\S) leaves the last space to the next word; at the end it takes them all.
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("a   b  "), (Words{"a", "  ", " b", "  "}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("x\n\ny"), (Words{"x", "\n", "\n", "y"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("x \ty"), (Words{"x", " ", "\t", "y"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("3.14 apples!!"), (Words{"3", ".", "14", " apples", "!!"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize(" ?!x"), (Words{" ?!", "x"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("Ünïcödé ½ 四"), (Words{"Ünïcödé", " ½", " 四"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize(""), Words{});
  // Invalid UTF-8 stays as bytes in an "other" run.
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("a\xff\xfe b"), (Words{"a", "\xff\xfe", " b"}));
}

// Llama 3's and Qwen2's regexes (Gpt2Tokenizer::PreTokenizer), worked by hand.
TEST(Gpt2PreTokenizeTest, FollowsLlama3sAndQwen2sRegexes) {
  using Pre = Gpt2Tokenizer::PreTokenizer;
  for (const Pre pre : {Pre::kLlama3, Pre::kQwen2}) {
    // Contractions in any case; a letter run takes one non-letter, non-digit, non-newline
    // character before it, a quote or a tab included.
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("I've it's WE'LL they'RE", pre),
              (Words{"I", "'ve", " it", "'s", " WE", "'LL", " they", "'RE"}));
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("\"Hello\" world\tx", pre),
              (Words{"\"Hello", "\"", " world", "\tx"}));
    // Punctuation takes the newlines after it; a whitespace run with newlines ends at its
    // last one; then \s+(?!\S) as GPT-2's.
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("ok!!\n\nx", pre), (Words{"ok", "!!\n\n", "x"}));
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("a  \n\n  b  ", pre),
              (Words{"a", "  \n\n", " ", " b", "  "}));
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("x\n y", pre), (Words{"x", "\n", " y"}));
    EXPECT_EQ(Gpt2Tokenizer::PreTokenize("", pre), Words{});
  }
  // Digits: runs of up to three (Llama 3), one at a time (Qwen2), never with a space.
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("12345 apples 7", Pre::kLlama3),
            (Words{"123", "45", " apples", " ", "7"}));
  EXPECT_EQ(Gpt2Tokenizer::PreTokenize("12345 apples", Pre::kQwen2),
            (Words{"1", "2", "3", "4", "5", " apples"}));
}

// llama.cpp's vectors for a vocabulary fetched by scripts/fetch-test-vocabs.sh.
void ExpectConformance(const std::string& base, int32_t vocab_size) {
  if (!testing::Exists(base)) {
    GTEST_SKIP() << "not found: " << base << " (run scripts/fetch-test-vocabs.sh)";
  }
  auto g = GgufFile::Open(base);
  ASSERT_TRUE(g.ok()) << g.status();
  auto tok = TokenizerFromGguf(**g);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), vocab_size);
  const auto cases = testing::ReadConformance(base + ".inp", base + ".out");
  ASSERT_FALSE(cases.empty());
  for (const testing::ConformanceCase& c : cases) {
    const std::vector<int32_t> ids = (*tok)->Encode(c.text, /*add_bos=*/false);
    EXPECT_EQ(testing::IdString(ids), testing::IdString(c.ids)) << "text: \"" << c.text << "\"";
    EXPECT_EQ((*tok)->Decode(ids), c.text);
  }
}

TEST(Gpt2ConformanceTest, LlamaBpeVocab) {  // Llama 3
  ExpectConformance(testing::LlamaVocab("ggml-vocab-llama-bpe.gguf"), 128256);
}

TEST(Gpt2ConformanceTest, Qwen2Vocab) {
  ExpectConformance(testing::LlamaVocab("ggml-vocab-qwen2.gguf"), 151936);
}

TEST(Gpt2ConformanceTest, Gpt2Vocab) {
  const std::string base = testing::TestData("tokenizers/ggml-vocab-gpt-2.gguf");
  KVLENS_REQUIRE_FILE(base);
  auto g = GgufFile::Open(base);
  ASSERT_TRUE(g.ok()) << g.status();
  auto tok = TokenizerFromGguf(**g);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 50257);
  EXPECT_EQ((*tok)->eos_id(), 50256);
  const auto cases = testing::ReadConformance(base + ".inp", base + ".out");
  ASSERT_FALSE(cases.empty());
  for (const testing::ConformanceCase& c : cases) {
    const std::vector<int32_t> ids = (*tok)->Encode(c.text, /*add_bos=*/false);
    EXPECT_EQ(testing::IdString(ids), testing::IdString(c.ids)) << "text: \"" << c.text << "\"";
    EXPECT_EQ((*tok)->Decode(ids), c.text);  // byte-level BPE is lossless
  }
}

}  // namespace
}  // namespace kvlens

#include "engine/tokenizer/tokenizer_factory.h"

#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "engine/model/gguf.h"
#include "gtest/gtest.h"
#include "tests/engine/model/gguf_test_writer.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using ::kvlens::testing::GgufWriter;
using ::kvlens::testing::HasSubstr;
using ::kvlens::testing::Le;
using ::kvlens::testing::WriteTempFile;

absl::StatusOr<std::unique_ptr<Tokenizer>> FromWriter(const std::string& name,
                                                      const GgufWriter& w) {
  auto g = GgufFile::Open(WriteTempFile(name + ".gguf", w.Bytes()));
  if (!g.ok()) return g.status();
  return TokenizerFromGguf(**g);
}

// A five-token llama vocabulary.
GgufWriter LlamaVocab(bool with_scores = true) {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "llama");
  w.AddStringArray("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "\u2581a", "a"});
  if (with_scores) w.AddF32Array("tokenizer.ggml.scores", {0, 0, 0, -1, -2});
  w.AddI32Array("tokenizer.ggml.token_type", {2, 3, 3, 1, 1});
  w.AddU32("tokenizer.ggml.bos_token_id", 1);
  w.AddU32("tokenizer.ggml.eos_token_id", 2);
  return w;
}

void ExpectError(const absl::StatusOr<std::unique_ptr<Tokenizer>>& r, absl::StatusCode code,
                 const std::string& what) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << what;
  EXPECT_EQ(r.status().code(), code) << r.status();
  EXPECT_TRUE(HasSubstr(std::string(r.status().message()), what));
}

TEST(TokenizerFromGgufTest, BuildsLlamaVocab) {
  auto tok = FromWriter("llama_ok", LlamaVocab());
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("a", true), (std::vector<int32_t>{1, 3}));
  EXPECT_EQ((*tok)->Decode({1, 3}), "a");
  EXPECT_EQ((*tok)->token_type(1), TokenType::kControl);
}

TEST(TokenizerFromGgufTest, RejectsMissingOrInconsistentKeys) {
  ExpectError(FromWriter("no_model", GgufWriter()), absl::StatusCode::kNotFound,
              "tokenizer.ggml.model");

  GgufWriter bert;
  bert.AddString("tokenizer.ggml.model", "bert");
  bert.AddStringArray("tokenizer.ggml.tokens", {"x"});
  ExpectError(FromWriter("bert", bert), absl::StatusCode::kUnimplemented, "\"bert\"");

  GgufWriter no_tokens;
  no_tokens.AddString("tokenizer.ggml.model", "llama");
  ExpectError(FromWriter("no_tokens", no_tokens), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.tokens");

  ExpectError(FromWriter("no_scores", LlamaVocab(false)), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.scores");

  GgufWriter short_scores = LlamaVocab(false);
  short_scores.AddF32Array("tokenizer.ggml.scores", {0, 0, 0});
  ExpectError(FromWriter("short_scores", short_scores), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.scores has 3 entries but tokenizer.ggml.tokens has 5");

  GgufWriter types;
  types.AddString("tokenizer.ggml.model", "llama");
  types.AddStringArray("tokenizer.ggml.tokens", {"a", "b"});
  types.AddF32Array("tokenizer.ggml.scores", {0, 0});
  types.AddI32Array("tokenizer.ggml.token_type", {1});
  ExpectError(FromWriter("types", types), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.token_type has 1 entries");

  GgufWriter bad_type;
  bad_type.AddString("tokenizer.ggml.model", "llama");
  bad_type.AddStringArray("tokenizer.ggml.tokens", {"a"});
  bad_type.AddF32Array("tokenizer.ggml.scores", {0});
  bad_type.AddI32Array("tokenizer.ggml.token_type", {9});
  ExpectError(FromWriter("bad_type", bad_type), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.token_type[0] = 9");

  GgufWriter bos = LlamaVocab();
  bos.AddU32("tokenizer.ggml.unknown_token_id", 5);
  ExpectError(FromWriter("unk", bos), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.unknown_token_id = 5");

  GgufWriter wrong_kind;
  wrong_kind.AddU32("tokenizer.ggml.model", 1);
  ExpectError(FromWriter("wrong_kind", wrong_kind), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.model");
}

TEST(TokenizerFromGgufTest, Gpt2NeedsWellFormedMerges) {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddStringArray("tokenizer.ggml.tokens", {"a", "b", "ab"});
  ExpectError(FromWriter("no_merges", w), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.merges");
  GgufWriter bad = w;
  bad.AddStringArray("tokenizer.ggml.merges", {"ab"});
  ExpectError(FromWriter("bad_merge", bad), absl::StatusCode::kInvalidArgument, "merge #0");
  GgufWriter ok = w;
  ok.AddStringArray("tokenizer.ggml.merges", {"a b"});
  auto tok = FromWriter("gpt2_ok", ok);
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->Encode("abba", false), (std::vector<int32_t>{2, 1, 0}));
  EXPECT_EQ((*tok)->Decode({2, 1, 0}), "abba");
}

// tokenizer.ggml.pre picks the pre-tokenizer; one kvlens does not know is refused by name
// (splitting text with another regex would give other tokens, silently).
TEST(TokenizerFromGgufTest, Gpt2PreTokenizerIsKnownOrRefused) {
  GgufWriter w;
  w.AddString("tokenizer.ggml.model", "gpt2");
  w.AddStringArray("tokenizer.ggml.tokens", {"1", "2", "12", "3", "123"});
  w.AddStringArray("tokenizer.ggml.merges", {"1 2", "12 3"});
  GgufWriter gpt2 = w, llama3 = w, unknown = w;
  gpt2.AddString("tokenizer.ggml.pre", "gpt-2");
  llama3.AddString("tokenizer.ggml.pre", "llama-bpe");
  unknown.AddString("tokenizer.ggml.pre", "tekken");
  // "1231": GPT-2 takes the digit run whole; Llama 3 cuts it after three digits.
  auto a = FromWriter("pre_gpt2", gpt2);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ((*a)->Encode("1231", false), (std::vector<int32_t>{4, 0}));
  auto b = FromWriter("pre_llama3", llama3);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->Encode("12312", false), (std::vector<int32_t>{4, 2}));
  EXPECT_TRUE((*b)->adds_bos());  // no tokenizer.ggml.add_bos_token: BOS by default
  GgufWriter no_bos = llama3;
  no_bos.AddBool("tokenizer.ggml.add_bos_token", false);
  auto c = FromWriter("pre_no_bos", no_bos);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_FALSE((*c)->adds_bos());
  // End-of-generation ids besides EOS (Llama 3's eot and eom), each inside the vocabulary.
  GgufWriter eog = llama3;
  eog.AddU32("tokenizer.ggml.eot_token_id", 3);
  eog.AddU32("tokenizer.ggml.eom_token_id", 4);
  auto d = FromWriter("eog", eog);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE((*d)->IsEndOfGeneration(3));
  EXPECT_TRUE((*d)->IsEndOfGeneration(4));
  EXPECT_FALSE((*d)->IsEndOfGeneration(2));
  EXPECT_FALSE((*b)->IsEndOfGeneration(3));
  GgufWriter bad_eog = llama3;
  bad_eog.AddU32("tokenizer.ggml.eot_token_id", 5);
  ExpectError(FromWriter("bad_eog", bad_eog), absl::StatusCode::kInvalidArgument,
              "tokenizer.ggml.eot_token_id = 5 is outside the vocabulary of 5");
  ExpectError(FromWriter("pre_unknown", unknown), absl::StatusCode::kUnimplemented,
              "tokenizer.ggml.pre = \"tekken\" is not supported");
}

TEST(TokenizerFromLlama2cTest, RejectsBadFiles) {
  const std::string path = testing::TestData("stories260K/tok512.bin");
  KVLENS_REQUIRE_FILE(path);
  std::string bytes;
  {
    std::ifstream in(path, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const std::string full = WriteTempFile("tok_full.bin", bytes);
  ASSERT_TRUE(TokenizerFromLlama2c(full, 512).ok());
  ASSERT_TRUE(TokenizerFromLlama2c(full, 0).ok());  // ≤ 0: read to the end of the file
  ASSERT_TRUE(TokenizerFromLlama2c(full, -1).ok());

  const auto expect = [](const absl::StatusOr<std::unique_ptr<Tokenizer>>& r,
                         const std::string& what) {
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_TRUE(HasSubstr(std::string(r.status().message()), what));
  };
  expect(TokenizerFromLlama2c(full, 513), "truncated");
  expect(TokenizerFromLlama2c(full, 511), "vocab_size does not match");
  for (size_t cut : {size_t{2}, size_t{4}, size_t{10}, bytes.size() / 2, bytes.size() - 1}) {
    expect(TokenizerFromLlama2c(WriteTempFile("tok_cut.bin", bytes.substr(0, cut)), 512),
           "truncated");
  }
  std::string garbage = bytes;
  std::memcpy(garbage.data() + 8, "\xff\xff\xff\xff", 4);  // token 0's length = -1
  expect(TokenizerFromLlama2c(WriteTempFile("tok_neg.bin", garbage), 512), "token 0 has length -1");
  std::string header = bytes;
  std::memcpy(header.data(), "\0\0\0\x80", 4);  // max_token_length negative
  expect(TokenizerFromLlama2c(WriteTempFile("tok_hdr.bin", header), 512), "max_token_length");
  EXPECT_EQ(TokenizerFromLlama2c("/nonexistent/tok.bin", 512).status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvlens

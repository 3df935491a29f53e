// tokenizer.json files written here by hand; every expected encoding is worked out in the
// comments from the vocabulary and merges the test itself wrote.
#include "engine/tokenizer/tokenizer_json.h"

#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/model/gguf_test_writer.h"

namespace kvlens {
namespace {

using ::kvlens::testing::HasSubstr;
using ::kvlens::testing::WriteTempFile;
using nlohmann::json;
using Ids = std::vector<int32_t>;

absl::StatusOr<std::unique_ptr<Tokenizer>> FromText(const std::string& name,
                                                    const std::string& text) {
  return TokenizerFromJson(WriteTempFile(name + ".tokenizer.json", text));
}
absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(const std::string& name, const json& j) {
  return FromText(name, j.dump());
}

void ExpectError(const absl::StatusOr<std::unique_ptr<Tokenizer>>& r, absl::StatusCode code,
                 const std::vector<std::string>& what) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << what.front();
  EXPECT_EQ(r.status().code(), code) << r.status();
  for (const std::string& w : what) EXPECT_TRUE(HasSubstr(std::string(r.status().message()), w));
}

// ---- Byte-level BPE (GPT-2). Byte-level spelling: a space is Ġ (U+0120), a newline Ċ
// (U+010A); "é" is the bytes C3 A9, spelled Ã (U+00C3) © (U+00A9).
//
// merge ranks: 0 h e · 1 l l · 2 he ll · 3 hell o · 4 Ġ w · 5 o r · 6 Ġw or · 7 Ġwor l ·
//              8 Ġworl d · 9 e l · 10 Ã ©
json Gpt2Json(bool array_merges) {
  json j = json::parse(R"({
    "version": "1.0",
    "added_tokens": [
      {"id": 23, "content": "<|endoftext|>", "special": true},
      {"id": 31, "content": "<pad>", "special": false}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {
      "h": 0, "e": 1, "l": 2, "o": 3, "\u0120": 4, "w": 5, "r": 6, "d": 7,
      "he": 8, "ll": 9, "hell": 10, "hello": 11, "\u0120w": 12, "or": 13,
      "\u0120wor": 14, "\u0120worl": 15, "\u0120world": 16, "el": 17,
      "\u00c3": 18, "\u00a9": 19, "\u00c3\u00a9": 20, "\u010a": 21, "!": 22,
      "<|endoftext|>": 23, "<": 24, "|": 25, ">": 26, "n": 27, "f": 28, "t": 29, "x": 30}}})");
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"h", "e"},          {"l", "l"}, {"he", "ll"},        {"hell", "o"},
      {"\u0120", "w"},     {"o", "r"}, {"\u0120w", "or"},   {"\u0120wor", "l"},
      {"\u0120worl", "d"}, {"e", "l"}, {"\u00c3", "\u00a9"}};
  json m = json::array();
  for (const auto& [a, b] : merges) {
    if (array_merges) {
      m.push_back(json::array({a, b}));
    } else {
      m.push_back(a + " " + b);
    }
  }
  j["model"]["merges"] = m;
  return j;
}

void ExpectGpt2Encodings(const Tokenizer& t) {
  // "hello": h e l l o → (h e) → he l l o → (l l) → he ll o → hell o → hello
  // " world": Ġ w o r l d → Ġw o r l d → Ġw or l d → Ġwor l d → Ġworl d → Ġworld
  EXPECT_EQ(t.Encode("hello world", false), (Ids{11, 16}));
  EXPECT_EQ(t.Encode("hell", false), (Ids{10}));
  // e l l: "l l" (rank 1) beats "e l" (rank 9), and "e ll" is no merge.
  EXPECT_EQ(t.Encode("ell", false), (Ids{1, 9}));
  // h e l d: he l d; "he l" and "l d" are no merges.
  EXPECT_EQ(t.Encode("held", false), (Ids{8, 2, 7}));
  EXPECT_EQ(t.Encode("\xC3\xA9", false), (Ids{20}));  // é → Ã© → merge 10
  EXPECT_EQ(t.Encode("hello\n", false), (Ids{11, 21}));
  EXPECT_EQ(t.Encode("hello!", false), (Ids{11, 22}));
  EXPECT_EQ(t.Encode("", false), Ids{});

  EXPECT_EQ(t.Decode({11, 16}), "hello world");
  EXPECT_EQ(t.Decode({1, 9, 21}), "ell\n");
  EXPECT_EQ(t.Decode({20}), "\xC3\xA9");
  EXPECT_EQ(t.TokenBytes(12, -1), " w");
  EXPECT_EQ(t.Piece(12), "\u0120w");
}

TEST(TokenizerJsonTest, ByteLevelBpeWithStringMerges) {
  auto t = FromJson("gpt2_string_merges", Gpt2Json(false));
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->vocab_size(), 32);
  ExpectGpt2Encodings(**t);
}

TEST(TokenizerJsonTest, ByteLevelBpeWithArrayMerges) {
  auto t = FromJson("gpt2_array_merges", Gpt2Json(true));
  ASSERT_TRUE(t.ok()) << t.status();
  ExpectGpt2Encodings(**t);
}

constexpr char kLlama3Split[] =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// Llama 3's pre_tokenizer: Sequence [Split (its regex), ByteLevel (use_regex false)].
json Llama3PreTokenizer(const std::string& regex) {
  return {{"type", "Sequence"},
          {"pretokenizers", json::array({json{{"type", "Split"},
                                              {"pattern", {{"Regex", regex}}},
                                              {"behavior", "Isolated"},
                                              {"invert", false}},
                                         json{{"type", "ByteLevel"}, {"use_regex", false}}})}};
}

// The ByteLevel decoder alone (no pre_tokenizer entry) also marks a byte-level vocabulary,
// as does a ByteLevel inside a Sequence.
TEST(TokenizerJsonTest, ByteLevelFoundInsideSequences) {
  json j = Gpt2Json(false);
  j["pre_tokenizer"] = Llama3PreTokenizer(kLlama3Split);
  auto seq = FromJson("gpt2_sequence", j);
  ASSERT_TRUE(seq.ok()) << seq.status();
  EXPECT_EQ((*seq)->Encode("hello world", false), (Ids{11, 16}));
  j["pre_tokenizer"] = nullptr;
  auto dec = FromJson("gpt2_decoder_only", j);
  ASSERT_TRUE(dec.ok()) << dec.status();
  EXPECT_EQ((*dec)->Encode("hello world", false), (Ids{11, 16}));
}

// A Split regex picks the pre-tokenizer: with a merge "! Ċ" (rank 11), Llama 3's regex keeps
// "!\n" in one piece (punctuation takes the newlines after it), so the merge applies;
// GPT-2's cuts "!" from "\n" and it cannot. A regex kvlens does not implement is refused.
TEST(TokenizerJsonTest, SplitRegexPicksThePreTokenizer) {
  json j = Gpt2Json(false);
  j["model"]["vocab"]["!\u010a"] = 32;
  j["model"]["merges"].push_back("! \u010a");
  auto gpt2 = FromJson("split_gpt2", j);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  EXPECT_EQ((*gpt2)->Encode("hello!\n", false), (Ids{11, 22, 21}));
  j["pre_tokenizer"] = Llama3PreTokenizer(kLlama3Split);
  auto llama3 = FromJson("split_llama3", j);
  ASSERT_TRUE(llama3.ok()) << llama3.status();
  EXPECT_EQ((*llama3)->Encode("hello!\n", false), (Ids{11, 32}));
  j["pre_tokenizer"] = Llama3PreTokenizer("\\p{L}+|\\s+");
  ExpectError(FromJson("split_unknown", j), absl::StatusCode::kUnimplemented,
              {"pre_tokenizer Split pattern", "is not supported"});
}

// model.ignore_merges (Llama 3): a piece that is a token is that token, merges or not.
// "held" has no merge path to a single token; with "held" in the vocabulary (id 32) and
// ignore_merges it becomes that token, without it h e l d → he l d as before.
TEST(TokenizerJsonTest, IgnoreMergesTakesWholePieces) {
  json j = Gpt2Json(false);
  j["model"]["vocab"]["held"] = 32;
  auto plain = FromJson("merges_kept", j);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ((*plain)->Encode("held", false), (Ids{8, 2, 7}));
  j["model"]["ignore_merges"] = true;
  auto whole = FromJson("merges_ignored", j);
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_EQ((*whole)->Encode("held", false), (Ids{32}));
  j["model"]["ignore_merges"] = "yes";
  ExpectError(FromJson("merges_bad", j), absl::StatusCode::kInvalidArgument,
              {"model.ignore_merges is not a bool"});
}

// Added tokens: <|endoftext|> is GPT-2's BOS and EOS and a control token (no text);
// <pad> (not special) decodes to itself. The Tokenizer interface parses no special tokens
// out of text: "<|endoftext|>" in text is plain text, < | e n d o f t e x t | >.
TEST(TokenizerJsonTest, ByteLevelAddedTokens) {
  auto t = FromJson("gpt2_added", Gpt2Json(false));
  ASSERT_TRUE(t.ok()) << t.status();
  const Tokenizer& tok = **t;
  EXPECT_EQ(tok.bos_id(), 23);
  EXPECT_EQ(tok.eos_id(), 23);
  EXPECT_EQ(tok.token_type(23), TokenType::kControl);
  EXPECT_EQ(tok.token_type(31), TokenType::kUserDefined);
  EXPECT_EQ(tok.token_type(11), TokenType::kNormal);
  EXPECT_EQ(tok.Encode("hello", true), (Ids{23, 11}));
  EXPECT_EQ(tok.Decode({23, 11, 23}), "hello");
  EXPECT_EQ(tok.Decode({31, 11}), "<pad>hello");
  // words "<|", "endoftext", "|>"; none of their adjacent pairs is a merge
  EXPECT_EQ(tok.Encode("<|endoftext|>", false),
            (Ids{24, 25, 1, 27, 7, 3, 28, 29, 1, 30, 29, 25, 26}));
}

// ---- Sentencepiece-style BPE with byte fallback (Llama). Spaces are ▁ (U+2581), a ▁ is
// prefixed to the text; characters without a piece fall back to <0xNN> tokens, or to
// <unk> when a byte has none.
//
// merge ranks: 0 ▁ h · 1 l l · 2 ▁h e · 3 ▁he ll · 4 ▁hell o
json SpmJson() {
  return json::parse(R"({
    "version": "1.0",
    "added_tokens": [
      {"id": 0, "content": "<unk>", "special": true},
      {"id": 1, "content": "<s>", "special": true},
      {"id": 2, "content": "</s>", "special": true}],
    "normalizer": {"type": "Sequence", "normalizers": [
      {"type": "Prepend", "prepend": "\u2581"},
      {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
    "pre_tokenizer": null,
    "decoder": {"type": "Sequence", "decoders": [
      {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
      {"type": "ByteFallback"}, {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
    "model": {"type": "BPE", "byte_fallback": true, "unk_token": "<unk>", "fuse_unk": true,
      "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0x41>": 3, "<0xC3>": 4, "<0xA9>": 5,
        "<0x0A>": 6, "\u2581": 7, "h": 8, "e": 9, "l": 10, "o": 11, "\u2581h": 12, "ll": 13,
        "\u2581he": 14, "\u2581hell": 15, "\u2581hello": 16},
      "merges": ["\u2581 h", "l l", "\u2581h e", "\u2581he ll", "\u2581hell o"]}})");
}

void ExpectSpmEncodings(const Tokenizer& t) {
  // ▁ h e l l o: (▁ h) → ▁h e l l o → (l l) → ▁h e ll o → ▁he ll o → ▁hell o → ▁hello
  EXPECT_EQ(t.Encode("hello", false), (Ids{16}));
  EXPECT_EQ(t.Encode("hello", true), (Ids{1, 16}));
  // ▁hello ▁ A: "▁A" is no piece and "A" has none: its byte 0x41
  EXPECT_EQ(t.Encode("hello A", false), (Ids{16, 7, 3}));
  EXPECT_EQ(t.Encode("\xC3\xA9", false), (Ids{7, 4, 5}));  // é: bytes C3 A9
  EXPECT_EQ(t.Encode("\n", false), (Ids{7, 6}));
  EXPECT_EQ(t.Encode("z", false), (Ids{7, 0}));  // no <0x7A>: <unk>
  EXPECT_EQ(t.Encode("", true), (Ids{1}));

  // The dummy prefix's space goes; the others stay; BOS/EOS have no text.
  EXPECT_EQ(t.Decode({16, 7, 3}), "hello A");
  EXPECT_EQ(t.Decode({1, 16, 16, 2}), "hello hello");
  EXPECT_EQ(t.Decode({7, 4, 5}), "\xC3\xA9");
}

TEST(TokenizerJsonTest, SpmBpeWithByteFallback) {
  auto t = FromJson("spm", SpmJson());
  ASSERT_TRUE(t.ok()) << t.status();
  const Tokenizer& tok = **t;
  EXPECT_EQ(tok.vocab_size(), 17);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_EQ(tok.token_type(3), TokenType::kByte);
  EXPECT_EQ(tok.token_type(1), TokenType::kControl);
  EXPECT_EQ(tok.Piece(3), "<0x41>");
  EXPECT_EQ(tok.TokenBytes(3, 16), "A");
  ExpectSpmEncodings(tok);
}

// Newer Llama files: no normalizer, a Metaspace pre-tokenizer adds the ▁ prefix.
TEST(TokenizerJsonTest, SpmBpeWithMetaspace) {
  json j = SpmJson();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {{"type", "Metaspace"},
                        {"replacement", "\u2581"},
                        {"prepend_scheme", "first"},
                        {"split", false}};
  auto t = FromJson("spm_metaspace", j);
  ASSERT_TRUE(t.ok()) << t.status();
  ExpectSpmEncodings(**t);
}

// A Metaspace that does not prepend (prepend_scheme "never", or the older
// add_prefix_space false): "hello" has no ▁, so only "l l" merges.
TEST(TokenizerJsonTest, SpmBpeWithMetaspaceThatDoesNotPrepend) {
  for (const auto& [key, value] :
       {std::pair<std::string, json>{"prepend_scheme", "never"}, {"add_prefix_space", false}}) {
    json j = SpmJson();
    j["normalizer"] = nullptr;
    j["pre_tokenizer"] = {{"type", "Metaspace"}, {"replacement", "\u2581"}, {key, value}};
    auto t = FromJson("spm_metaspace_" + key, j);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ((*t)->Encode("hello", false), (Ids{8, 9, 13, 11})) << key;
    EXPECT_EQ((*t)->Encode("hello", true), (Ids{1, 8, 9, 13, 11})) << key;
  }
  // Inside a Sequence, with the scheme that does prepend: as SpmBpeWithMetaspace.
  json j = SpmJson();
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers", json::array({{{"type", "Metaspace"}, {"prepend_scheme", "always"}}})}};
  auto t = FromJson("spm_metaspace_sequence", j);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->Encode("hello", false), (Ids{16}));
}

// Gemma's files: <pad> 0, <eos> 1, <bos> 2, and a normalizer that only turns spaces into
// ▁ (no dummy prefix): "hello" has no ▁, " hello" is the one piece ▁hello.
TEST(TokenizerJsonTest, SpmBpeAsGemmaWritesIt) {
  json j = SpmJson();
  j["added_tokens"] = json::array({{{"id", 0}, {"content", "<pad>"}, {"special", true}},
                                   {{"id", 1}, {"content", "<eos>"}, {"special", true}},
                                   {{"id", 2}, {"content", "<bos>"}, {"special", true}}});
  json& vocab = j["model"]["vocab"];
  for (const char* name : {"<unk>", "<s>", "</s>"}) vocab.erase(name);
  vocab["<pad>"] = 0;
  vocab["<eos>"] = 1;
  vocab["<bos>"] = 2;
  j["model"]["unk_token"] = nullptr;
  j["normalizer"] = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
  auto t = FromJson("gemma", j);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->bos_id(), 2);
  EXPECT_EQ((*t)->eos_id(), 1);
  EXPECT_EQ((*t)->Encode("hello", true), (Ids{2, 8, 9, 13, 11}));
  EXPECT_EQ((*t)->Encode(" hello", false), (Ids{16}));
}

// ---- Errors

TEST(TokenizerJsonTest, MissingFileOrNotJson) {
  const std::string path = ::testing::TempDir() + "/kvlens_absent.tokenizer.json";
  std::filesystem::remove(path);
  ExpectError(TokenizerFromJson(path), absl::StatusCode::kNotFound, {path});
  ExpectError(FromText("not_json", "{\"model\": "), absl::StatusCode::kInvalidArgument,
              {"kvlens_not_json.tokenizer.json", "invalid JSON"});
  ExpectError(FromText("array", "[1, 2]"), absl::StatusCode::kInvalidArgument, {"missing model"});
  ExpectError(FromText("no_vocab", R"({"model": {"type": "BPE"}})"),
              absl::StatusCode::kInvalidArgument, {"missing model.vocab"});
}

TEST(TokenizerJsonTest, OnlyBpeModels) {
  for (const char* type : {"WordPiece", "Unigram", "WordLevel"}) {
    json j = SpmJson();
    j["model"]["type"] = type;
    ExpectError(FromJson(std::string("type_") + type, j), absl::StatusCode::kUnimplemented,
                {"model.type", std::string("\"") + type + "\"", "(BPE)"});
  }
  json j = SpmJson();
  j["model"]["type"] = 3;
  ExpectError(FromJson("type_number", j), absl::StatusCode::kInvalidArgument,
              {"model.type is not a string"});
  j["model"].erase("type");  // BPE is the default
  EXPECT_TRUE(FromJson("type_absent", j).ok());
}

TEST(TokenizerJsonTest, RejectsBadVocabularies) {
  auto with_vocab = [](const json& vocab) {
    json j = SpmJson();
    j["model"]["vocab"] = vocab;
    j["model"]["merges"] = json::array();
    j["added_tokens"] = json::array();
    return j;
  };
  ExpectError(FromJson("vocab_string_id", with_vocab({{"a", "0"}})),
              absl::StatusCode::kInvalidArgument, {"model.vocab[\"a\"] is not an id"});
  ExpectError(FromJson("vocab_duplicate", with_vocab({{"a", 0}, {"b", 0}, {"c", 1}})),
              absl::StatusCode::kInvalidArgument,
              {"model.vocab[\"a\"] and model.vocab[\"b\"] both have id 0"});
  ExpectError(FromJson("vocab_negative", with_vocab({{"a", -1}})),
              absl::StatusCode::kInvalidArgument, {"token id -1", "\"a\"", "outside [0, 1)"});
  // two tokens cannot reach id 5: ids are dense
  ExpectError(FromJson("vocab_far", with_vocab({{"a", 0}, {"b", 5}})),
              absl::StatusCode::kInvalidArgument, {"token id 5", "outside [0, 2)"});
  // within range but leaving a hole at 2
  json hole = with_vocab({{"a", 0}, {"b", 1}, {"c", 3}});
  hole["added_tokens"] = json::array({json{{"id", 0}, {"content", "a"}}});
  ExpectError(FromJson("vocab_hole", hole), absl::StatusCode::kInvalidArgument,
              {"token id 2 has no piece"});
  // an added token may restate a vocabulary entry (GPT-2's <|endoftext|> does)
  json restated = with_vocab({{"a", 0}, {"<s>", 1}});
  restated["added_tokens"] = json::array({json{{"id", 1}, {"content", "<s>"}, {"special", true}}});
  auto ok = FromJson("vocab_restated", restated);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->bos_id(), 1);
}

TEST(TokenizerJsonTest, RejectsMalformedAddedTokens) {
  const std::vector<json> bad = {
      {{"id", "3"}, {"content", "x"}},
      {{"id", 3}},
      {{"id", 3}, {"content", 4}},
      {{"id", 3}, {"content", "x"}, {"special", "yes"}},
      json(5),
  };
  for (size_t i = 0; i < bad.size(); ++i) {
    json j = SpmJson();
    j["added_tokens"].push_back(bad[i]);
    ExpectError(FromJson("added_" + std::to_string(i), j), absl::StatusCode::kInvalidArgument,
                {"added_tokens[3]", "integer id"});
  }
}

TEST(TokenizerJsonTest, RejectsMergesOutsideTheVocabulary) {
  auto with_merges = [](const json& merges) {
    json j = SpmJson();
    j["model"]["merges"] = merges;
    return j;
  };
  // "z" is not a token
  ExpectError(FromJson("merge_unknown_right", with_merges(json::array({"l l", "e z"}))),
              absl::StatusCode::kInvalidArgument,
              {"model.merges[1]", "\"z\" is not in model.vocab"});
  ExpectError(FromJson("merge_unknown_array", with_merges(json::array({json::array({"q", "h"})}))),
              absl::StatusCode::kInvalidArgument,
              {"model.merges[0]", "\"q\" is not in model.vocab"});
  // both sides are tokens, but "he" (what they make) is not
  ExpectError(FromJson("merge_unknown_result", with_merges(json::array({"h e"}))),
              absl::StatusCode::kInvalidArgument,
              {"model.merges[0]", "\"he\" is not in model.vocab"});
  // byte-level too
  json g = Gpt2Json(false);
  g["model"]["merges"].push_back("h \u0120");
  ExpectError(FromJson("merge_unknown_gpt2", g), absl::StatusCode::kInvalidArgument,
              {"model.merges[11]", "\"h\u0120\" is not in model.vocab"});

  const std::vector<std::pair<json, std::string>> malformed = {
      {"ll", "\"ll\" is not \"left right\""},
      {"l l l", "\"l l l\" is not \"left right\""},
      {json::array({"l"}), "model.merges[0] is malformed"},
      {json::array({"l", 1}), "model.merges[0] is malformed"},
      {json(7), "model.merges[0] is malformed"},
  };
  for (size_t i = 0; i < malformed.size(); ++i) {
    ExpectError(FromJson("merge_malformed_" + std::to_string(i),
                         with_merges(json::array({malformed[i].first}))),
                absl::StatusCode::kInvalidArgument, {malformed[i].second});
  }
}

// Odd but harmless shapes elsewhere in the file are ignored, not thrown on.
TEST(TokenizerJsonTest, ToleratesOddOptionalFields) {
  json j = SpmJson();
  j["pre_tokenizer"] = {{"type", 5}};
  j["decoder"] = "ByteLevel";
  j["model"]["unk_token"] = 0;
  auto t = FromJson("odd_fields", j);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)->Encode("hello", false), (Ids{16}));
}

}  // namespace
}  // namespace kvlens

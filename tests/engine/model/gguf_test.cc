#include "engine/model/gguf.h"

#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "tests/engine/model/gguf_test_writer.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

using ::kvlens::testing::GgufStr;
using ::kvlens::testing::GgufWriter;
using ::kvlens::testing::HasSubstr;
using ::kvlens::testing::Le;
using ::kvlens::testing::WriteTempFile;

absl::StatusOr<std::unique_ptr<GgufFile>> OpenBytes(const std::string& name,
                                                    const std::string& bytes) {
  return GgufFile::Open(WriteTempFile(name + ".gguf", bytes));
}

// A valid little file: a few metadata types and two f32 tensors.
GgufWriter SmallFile() {
  GgufWriter w;
  w.AddString("general.architecture", "llama");
  w.AddU32("llama.block_count", 5);
  w.AddI32("neg", -3);
  w.AddF32("eps", 1e-5f);
  w.AddBool("flag", true);
  w.AddStringArray("names", {"a", "bc", ""});
  w.AddF32Array("floats", {1.5f, -2.0f});
  w.AddI32Array("ints", {7, -8, 9});
  w.AddF32Tensor("a.weight", {3, 2});  // ne = [3, 2] → shape [2, 3]
  w.AddF32Tensor("b.bias", {5});
  return w;
}

void ExpectInvalid(const absl::StatusOr<std::unique_ptr<GgufFile>>& r, const std::string& what) {
  ASSERT_FALSE(r.ok()) << "expected an error mentioning " << what;
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_TRUE(HasSubstr(std::string(r.status().message()), what));
}

TEST(GgufTest, ParsesMetadataAndTensors) {
  auto f = OpenBytes("small", SmallFile().Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUint("llama.block_count"), 5u);
  EXPECT_EQ(*g.GetInt("llama.block_count"), 5);
  EXPECT_EQ(*g.GetInt("neg"), -3);
  EXPECT_EQ(g.GetUint("neg").status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_FLOAT_EQ(static_cast<float>(*g.GetFloat("eps")), 1e-5f);
  EXPECT_TRUE(*g.GetBool("flag"));
  auto names = g.GetStringArray("names");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(std::vector<std::string_view>(names->begin(), names->end()),
            (std::vector<std::string_view>{"a", "bc", ""}));
  EXPECT_EQ(*g.GetFloatArray("floats"), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_EQ(*g.GetIntArray("ints"), (std::vector<int64_t>{7, -8, 9}));
  EXPECT_EQ(g.keys().size(), 8u);

  // Missing keys and wrong types name the key.
  EXPECT_EQ(g.GetUint("nope").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(HasSubstr(std::string(g.GetUint("nope").status().message()), "nope"));
  auto wrong = g.GetString("llama.block_count");
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(HasSubstr(std::string(wrong.status().message()), "llama.block_count"));
  EXPECT_TRUE(HasSubstr(std::string(wrong.status().message()), "uint32"));
  EXPECT_FALSE(g.GetFloat("ints").ok());
  EXPECT_FALSE(g.GetIntArray("floats").ok());

  ASSERT_EQ(g.tensors().size(), 2u);
  const GgufTensor* a = g.FindTensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 24u);
  EXPECT_EQ(a->offset, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a->data) % 32, 0u);
  const float* af = reinterpret_cast<const float*>(a->data);
  EXPECT_EQ(af[5], 5.0f);
  const GgufTensor* b = g.FindTensor("b.bias");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 32u);
  EXPECT_EQ(g.FindTensor("c"), nullptr);

  auto view = GgufWeightView(*a);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->rows, 2);
  EXPECT_EQ(view->cols, 3);
  EXPECT_EQ(view->dtype, kernels::DType::kF32);
  EXPECT_EQ(view->data, a->data);
}

TEST(GgufTest, AcceptsVersion2) {
  GgufWriter w = SmallFile();
  w.version = 2;
  auto f = OpenBytes("v2", w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->version(), 2u);
}

TEST(GgufTest, WeightViewOfHigherDimsAndTypes) {
  GgufWriter w;
  // ne = [32, 3, 2] q8_0: rows = 6, cols = 32, 34 bytes a row.
  w.tensors.push_back({"q", {32, 3, 2}, 8, std::string(6 * 34, '\1'), std::nullopt});
  w.tensors.push_back({"h", {4, 2}, 1, std::string(16, '\0'), std::nullopt});    // f16
  w.tensors.push_back({"bf", {4}, 30, std::string(8, '\0'), std::nullopt});      // bf16
  w.tensors.push_back({"k4", {512}, 12, std::string(288, '\0'), std::nullopt});  // q4_K
  w.tensors.push_back({"x4", {256}, 23, std::string(136, '\0'), std::nullopt});  // iq4_xs
  w.tensors.push_back({"x2", {256}, 16, std::string(66, '\0'), std::nullopt});   // iq2_xxs
  auto f = OpenBytes("types", w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufTensor* q = (*f)->FindTensor("q");
  EXPECT_EQ(q->shape, (std::vector<int64_t>{2, 3, 32}));
  auto v = GgufWeightView(*q);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->dtype, kernels::DType::kQ8_0);
  EXPECT_EQ(v->rows, 6);
  EXPECT_EQ(v->cols, 32);
  EXPECT_EQ(v->row_bytes() * v->rows, static_cast<int64_t>(q->nbytes));
  EXPECT_EQ(GgufWeightView(*(*f)->FindTensor("h"))->dtype, kernels::DType::kF16);
  EXPECT_EQ(GgufWeightView(*(*f)->FindTensor("bf"))->dtype, kernels::DType::kBF16);
  auto k4 = GgufWeightView(*(*f)->FindTensor("k4"));
  ASSERT_TRUE(k4.ok()) << k4.status();
  EXPECT_EQ(k4->dtype, kernels::DType::kQ4_K);
  EXPECT_EQ(k4->row_bytes(), 288);
  auto x4 = GgufWeightView(*(*f)->FindTensor("x4"));
  ASSERT_TRUE(x4.ok()) << x4.status();
  EXPECT_EQ(x4->dtype, kernels::DType::kIQ4_XS);
  EXPECT_EQ(x4->row_bytes(), 136);
  // The grid i-quants are not decoded: a clear error naming the tensor, its type and ours.
  auto x2 = GgufWeightView(*(*f)->FindTensor("x2"));
  EXPECT_EQ(x2.status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_TRUE(HasSubstr(std::string(x2.status().message()), "x2"));
  EXPECT_TRUE(HasSubstr(std::string(x2.status().message()), "iq2_xxs"));
  EXPECT_TRUE(HasSubstr(std::string(x2.status().message()), "iq4_xs"));
}

TEST(GgufTest, HonoursGeneralAlignment) {
  GgufWriter w;
  w.alignment = 64;
  w.AddU32("general.alignment", 64);
  w.AddF32Tensor("x", {3});
  w.AddF32Tensor("y", {3});
  auto f = OpenBytes("align64", w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->alignment(), 64u);
  EXPECT_EQ((*f)->FindTensor("y")->offset, 64u);

  GgufWriter bad;
  bad.AddU32("general.alignment", 48);
  ExpectInvalid(OpenBytes("align48", bad.Bytes()), "general.alignment");
}

TEST(GgufTest, RejectsBadMagic) {
  GgufWriter w = SmallFile();
  w.magic = 0x46554746;
  ExpectInvalid(OpenBytes("magic", w.Bytes()), "magic");
}

TEST(GgufTest, RejectsUnsupportedVersion) {
  for (uint32_t v : {1u, 4u, 0xffffffffu}) {
    GgufWriter w = SmallFile();
    w.version = v;
    auto f = OpenBytes("version", w.Bytes());
    ASSERT_FALSE(f.ok());
    EXPECT_EQ(f.status().code(), absl::StatusCode::kUnimplemented);
    EXPECT_TRUE(HasSubstr(std::string(f.status().message()), "version"));
  }
}

TEST(GgufTest, EveryTruncationIsAnError) {
  const std::string full = SmallFile().Bytes();
  ASSERT_TRUE(OpenBytes("full", full).ok());
  for (size_t n = 1; n < full.size(); ++n) {
    auto f = OpenBytes("trunc", full.substr(0, n));
    ASSERT_FALSE(f.ok()) << "prefix of " << n << " bytes parsed";
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << n;
    EXPECT_TRUE(HasSubstr(std::string(f.status().message()), "truncated")) << n;
  }
}

TEST(GgufTest, TruncationMessagesNameTheField) {
  const std::string full = SmallFile().Bytes();
  ExpectInvalid(OpenBytes("t_hdr", full.substr(0, 10)), "n_tensors");
  // One key with a long string value, cut inside the value.
  GgufWriter w;
  w.AddString("general.name", std::string(100, 'x'));
  const std::string one = w.Bytes();
  ExpectInvalid(OpenBytes("t_kv", one.substr(0, 24 + 8 + 12 + 4 + 8 + 50)),
                "\"general.name\" value has length 100");
  ExpectInvalid(OpenBytes("t_kvtype", one.substr(0, 24 + 8 + 12 + 2)),
                "\"general.name\" type needs 4 bytes");
}

TEST(GgufTest, RejectsStringLengthPastEnd) {
  GgufWriter w;
  w.AddRaw("s", testing::kGString, Le<uint64_t>(1000) + "abc");
  ExpectInvalid(OpenBytes("strlen", w.Bytes()), "\"s\"");
  GgufWriter k;  // a key whose own length is absurd
  k.AddRaw("", 0, "");
  std::string bytes = k.Bytes();
  std::memcpy(bytes.data() + 24, "\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  ExpectInvalid(OpenBytes("keylen", bytes), "metadata key #0 has length");
}

TEST(GgufTest, RejectsAbsurdCounts) {
  GgufWriter t = SmallFile();
  t.n_tensors_override = uint64_t{1} << 60;
  ExpectInvalid(OpenBytes("ntensors", t.Bytes()), "n_tensors");
  GgufWriter k = SmallFile();
  k.n_kv_override = ~uint64_t{0};
  ExpectInvalid(OpenBytes("nkv", k.Bytes()), "n_kv");
  GgufWriter a;
  a.AddRaw("arr", testing::kGArray, Le<uint32_t>(testing::kGU8) + Le<uint64_t>(uint64_t{1} << 62));
  ExpectInvalid(OpenBytes("arrlen", a.Bytes()), "array length");
  GgufWriter s;
  s.AddRaw("sarr", testing::kGArray,
           Le<uint32_t>(testing::kGString) + Le<uint64_t>(uint64_t{1} << 40) + GgufStr("x"));
  ExpectInvalid(OpenBytes("sarrlen", s.Bytes()), "sarr");
  // n_kv that fits the header bound but not the entries that follow.
  GgufWriter more = SmallFile();
  more.n_kv_override = 9;
  ExpectInvalid(OpenBytes("nkv9", more.Bytes()), "");
}

TEST(GgufTest, RejectsUnknownValueTypes) {
  GgufWriter w;
  w.AddRaw("weird", 13, Le<uint32_t>(0));
  ExpectInvalid(OpenBytes("vtype", w.Bytes()), "weird");
  GgufWriter a;
  a.AddRaw("weird_array", testing::kGArray, Le<uint32_t>(99) + Le<uint64_t>(0));
  ExpectInvalid(OpenBytes("atype", a.Bytes()), "weird_array");
  GgufWriter n;
  n.AddRaw("nested", testing::kGArray, Le<uint32_t>(testing::kGArray) + Le<uint64_t>(0));
  ExpectInvalid(OpenBytes("nested", n.Bytes()), "nested");
}

TEST(GgufTest, RejectsDuplicateKeys) {
  GgufWriter w;
  w.AddU32("x", 1);
  w.AddU32("x", 2);
  ExpectInvalid(OpenBytes("dupkey", w.Bytes()), "duplicate metadata key \"x\"");
}

TEST(GgufTest, RejectsMisalignedTensor) {
  GgufWriter w = SmallFile();
  w.tensors[1].offset = 36;
  ExpectInvalid(OpenBytes("misaligned", w.Bytes()), "\"b.bias\" offset 36 is not aligned");
}

TEST(GgufTest, RejectsOverlappingTensors) {
  GgufWriter w;
  w.AddF32Tensor("first", {16});  // bytes [0, 64)
  w.AddF32Tensor("second", {4});
  w.tensors[1].offset = 32;
  ExpectInvalid(OpenBytes("overlap", w.Bytes()), "overlaps tensor \"first\"");
}

TEST(GgufTest, RejectsTensorDataPastEnd) {
  GgufWriter w = SmallFile();
  w.tensors[1].offset = 4096;
  std::string bytes = w.Bytes();
  bytes.resize(bytes.size() - 4);  // the last tensor loses a float
  ExpectInvalid(OpenBytes("pastend", bytes), "\"b.bias\"");
  // A shape whose size overflows is caught before any arithmetic wraps.
  GgufWriter huge;
  huge.tensors.push_back({"huge", {1u << 20, 1u << 20, 1u << 20, 1u << 20}, 0, "", 0});
  ExpectInvalid(OpenBytes("huge", huge.Bytes()), "\"huge\"");
}

TEST(GgufTest, RejectsDuplicateTensorNames) {
  GgufWriter w;
  w.AddF32Tensor("t", {4});
  w.AddF32Tensor("t", {4});
  ExpectInvalid(OpenBytes("duptensor", w.Bytes()), "duplicate tensor name \"t\"");
}

TEST(GgufTest, RejectsTooManyDims) {
  GgufWriter w;
  w.tensors.push_back({"five", {1, 1, 1, 1, 1}, 0, std::string(4, '\0'), std::nullopt});
  ExpectInvalid(OpenBytes("dims", w.Bytes()), "\"five\" has n_dims = 5");
}

TEST(GgufTest, RejectsZeroOrNegativeDims) {
  GgufWriter z;
  z.tensors.push_back({"zero", {4, 0}, 0, "", std::nullopt});
  ExpectInvalid(OpenBytes("zerodim", z.Bytes()), "\"zero\" has dimension ne[1] = 0");
  GgufWriter n;
  n.tensors.push_back({"neg", {static_cast<uint64_t>(-2)}, 0, "", std::nullopt});
  ExpectInvalid(OpenBytes("negdim", n.Bytes()), "\"neg\" has dimension ne[0] = -2");
}

TEST(GgufTest, RejectsBadTensorTypes) {
  GgufWriter u;
  u.tensors.push_back({"u", {4}, 77, std::string(16, '\0'), std::nullopt});
  ExpectInvalid(OpenBytes("ttype", u.Bytes()), "\"u\" has unknown ggml type 77");
  GgufWriter b;  // q8_0 rows must be whole blocks of 32
  b.tensors.push_back({"partial", {40}, 8, std::string(68, '\0'), std::nullopt});
  ExpectInvalid(OpenBytes("partial", b.Bytes()), "\"partial\" has ne[0] = 40");
}

TEST(GgufTest, SurvivesRandomCorruption) {
  const std::string full = SmallFile().Bytes();
  std::mt19937 rng(1234);
  int parsed = 0;
  for (int iter = 0; iter < 400; ++iter) {
    std::string bytes = full;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) bytes[rng() % 400] = static_cast<char>(rng());
    auto f = OpenBytes("fuzz", bytes);
    if (f.ok()) {
      ++parsed;
      for (const GgufTensor& t : (*f)->tensors()) {
        ASSERT_LE(t.data + t.nbytes, (*f)->file()->data() + (*f)->file()->size());
      }
    }
  }
  SUCCEED() << parsed << " of 400 corrupted files still parsed";
}

TEST(GgufTest, MissingFileIsNotFound) {
  EXPECT_EQ(GgufFile::Open("/nonexistent/x.gguf").status().code(), absl::StatusCode::kNotFound);
}

TEST(GgufRealFileTest, Stories260K) {
  const std::string path = testing::TestData("stories260K/stories260K.gguf");
  KVLENS_REQUIRE_FILE(path);
  auto f = GgufFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const GgufFile& g = **f;
  EXPECT_EQ(g.version(), 3u);
  EXPECT_EQ(*g.GetString("general.architecture"), "llama");
  EXPECT_EQ(*g.GetUint("llama.embedding_length"), 64u);
  EXPECT_EQ(*g.GetUint("llama.block_count"), 5u);
  EXPECT_EQ(*g.GetUint("llama.attention.head_count"), 8u);
  EXPECT_EQ(*g.GetUint("llama.attention.head_count_kv"), 4u);
  EXPECT_EQ(*g.GetUint("llama.feed_forward_length"), 172u);
  EXPECT_EQ(*g.GetString("tokenizer.ggml.model"), "llama");
  EXPECT_EQ(g.GetStringArray("tokenizer.ggml.tokens")->size(), 512u);

  const GgufTensor* emb = g.FindTensor("token_embd.weight");
  ASSERT_NE(emb, nullptr);
  EXPECT_EQ(emb->shape, (std::vector<int64_t>{512, 64}));
  auto view = GgufWeightView(*emb);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->rows, 512);
  EXPECT_EQ(view->cols, 64);
  for (int l = 0; l < 5; ++l) {
    const std::string blk = "blk." + std::to_string(l) + ".";
    for (const char* name : {"attn_q.weight", "attn_k.weight", "attn_v.weight",
                             "attn_output.weight", "attn_norm.weight", "ffn_gate.weight",
                             "ffn_up.weight", "ffn_down.weight", "ffn_norm.weight"}) {
      EXPECT_NE(g.FindTensor(blk + name), nullptr) << blk + name;
    }
  }
  EXPECT_EQ(g.FindTensor("blk.0.attn_q.weight")->shape, (std::vector<int64_t>{64, 64}));
  EXPECT_EQ(g.FindTensor("blk.0.attn_k.weight")->shape, (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(g.FindTensor("blk.0.ffn_gate.weight")->shape, (std::vector<int64_t>{172, 64}));
  EXPECT_EQ(g.FindTensor("blk.0.ffn_down.weight")->shape, (std::vector<int64_t>{64, 172}));
  EXPECT_EQ(g.FindTensor("output_norm.weight")->shape, (std::vector<int64_t>{64}));
}

TEST(GgufRealFileTest, VocabOnlyFiles) {
  for (const char* name : {"ggml-vocab-gpt-2.gguf", "ggml-vocab-llama-spm.gguf"}) {
    const std::string path = testing::TestData(std::string("tokenizers/") + name);
    KVLENS_REQUIRE_FILE(path);
    auto f = GgufFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    EXPECT_TRUE((*f)->tensors().empty()) << name;
    auto tokens = (*f)->GetStringArray("tokenizer.ggml.tokens");
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    EXPECT_GT(tokens->size(), 30000u) << name;
  }
}

}  // namespace
}  // namespace kvlens

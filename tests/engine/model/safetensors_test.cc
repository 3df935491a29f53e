#include "engine/model/safetensors.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/weight.h"
#include "tests/engine/model/gguf_test_writer.h"
#include "tests/engine/model/safetensors_test_writer.h"

namespace kvlens {
namespace {

using ::kvlens::testing::HasSubstr;
using ::kvlens::testing::Le;
using ::kvlens::testing::SafetensorsWriter;
using ::kvlens::testing::WriteTempFile;

absl::StatusOr<std::unique_ptr<SafetensorsFile>> OpenBytes(const std::string& name,
                                                           const std::string& bytes) {
  return SafetensorsFile::Open(WriteTempFile(name + ".safetensors", bytes));
}

// Every failure is INVALID_ARGUMENT and names the file and each of `what`.
void ExpectInvalid(const std::string& name, const std::string& bytes,
                   const std::vector<std::string>& what) {
  auto r = OpenBytes(name, bytes);
  ASSERT_FALSE(r.ok()) << name << ": expected an error";
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  const std::string msg(r.status().message());
  EXPECT_TRUE(HasSubstr(msg, "kvlens_" + name + ".safetensors"));
  for (const std::string& w : what) EXPECT_TRUE(HasSubstr(msg, w)) << name;
}

std::string U16Bytes(const std::vector<uint16_t>& v) {
  std::string b;
  for (uint16_t x : v) b += Le(x);
  return b;
}

// One valid tensor of each supported float type, plus metadata.
SafetensorsWriter ThreeTensors() {
  SafetensorsWriter w;
  w.AddF32("a", {2, 3}, {1.5f, -2.0f, 0.25f, 3.0f, 4.0f, -0.5f});
  // f16 1, -2, 0.5, 65504 (the largest half), spelled in bits.
  w.Add("h", "F16", {4}, U16Bytes({0x3C00, 0xC000, 0x3800, 0x7BFF}));
  // bf16 1, -2, 0.5, 3 (the top halves of the floats), as a [2, 2] matrix.
  w.Add("b", "BF16", {2, 2}, U16Bytes({0x3F80, 0xC000, 0x3F00, 0x4040}));
  w.header["__metadata__"] = {{"format", "pt"}, {"note", "two words"}};
  return w;
}

std::vector<float> Row(const kernels::WeightView& v, int64_t r) {
  std::vector<float> out(v.cols);
  kernels::DequantizeRow(v, r, out.data());
  return out;
}

TEST(SafetensorsTest, RoundTripsF32F16Bf16AndMetadata) {
  auto f = OpenBytes("three", ThreeTensors().Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  const SafetensorsFile& st = **f;
  EXPECT_EQ(st.tensors().size(), 3u);
  EXPECT_EQ(st.metadata(),
            (std::map<std::string, std::string>{{"format", "pt"}, {"note", "two words"}}));
  EXPECT_EQ(st.Find("__metadata__"), nullptr);
  EXPECT_EQ(st.Find("nope"), nullptr);

  const SafetensorsTensor* a = st.Find("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->name, "a");
  EXPECT_EQ(a->dtype, "F32");
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 24u);
  float af[6];
  std::memcpy(af, a->data, sizeof(af));
  EXPECT_EQ(std::vector<float>(af, af + 6),
            (std::vector<float>{1.5f, -2.0f, 0.25f, 3.0f, 4.0f, -0.5f}));

  const SafetensorsTensor* h = st.Find("h");
  ASSERT_NE(h, nullptr);
  EXPECT_EQ(h->dtype, "F16");
  EXPECT_EQ(h->shape, (std::vector<int64_t>{4}));
  EXPECT_EQ(h->nbytes, 8u);
  EXPECT_EQ(h->data, a->data + 24);  // the data section is contiguous as written
  auto hv = SafetensorsWeightView(*h);
  ASSERT_TRUE(hv.ok()) << hv.status();
  EXPECT_EQ(hv->dtype, kernels::DType::kF16);
  EXPECT_EQ(Row(*hv, 0), (std::vector<float>{1.0f, -2.0f, 0.5f, 65504.0f}));

  const SafetensorsTensor* b = st.Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, "BF16");
  EXPECT_EQ(b->nbytes, 8u);
  auto bv = SafetensorsWeightView(*b);
  ASSERT_TRUE(bv.ok()) << bv.status();
  EXPECT_EQ(bv->dtype, kernels::DType::kBF16);
  EXPECT_EQ(Row(*bv, 0), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(Row(*bv, 1), (std::vector<float>{0.5f, 3.0f}));
}

TEST(SafetensorsTest, AcceptsAHeaderWithoutTensors) {
  auto f = OpenBytes("empty_header", SafetensorsWriter::Raw("{}", ""));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_TRUE((*f)->tensors().empty());
  EXPECT_TRUE((*f)->metadata().empty());
}

TEST(SafetensorsTest, MissingFileIsNotFound) {
  const std::string path = ::testing::TempDir() + "/kvlens_no_such.safetensors";
  std::filesystem::remove(path);
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), absl::StatusCode::kNotFound) << f.status();
  EXPECT_TRUE(HasSubstr(std::string(f.status().message()), path));
}

TEST(SafetensorsTest, RejectsTruncatedHeaderSize) {
  ExpectInvalid("short", std::string(5, '\0'), {"5 bytes", "needs 8"});
  auto empty = OpenBytes("zero", "");
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument) << empty.status();
  EXPECT_TRUE(HasSubstr(std::string(empty.status().message()), "kvlens_zero.safetensors"));
}

TEST(SafetensorsTest, RejectsHeaderSizePastTheFileOrTheLimit) {
  // 8 + 10 bytes: a header size of 11 reaches one byte past the end.
  ExpectInvalid("hdr_past_end", Le<uint64_t>(11) + "{}        ", {"header size 11", "18 bytes"});
  // 2^63: absurd; named with the 100 MiB limit.
  ExpectInvalid("hdr_absurd", Le<uint64_t>(uint64_t{1} << 63) + "{}      ",
                {"header size 9223372036854775808", "104857600"});
}

TEST(SafetensorsTest, RejectsAHeaderThatIsNotAJsonObject) {
  ExpectInvalid("not_json", SafetensorsWriter::Raw("{\"a\": ", ""), {"not valid JSON"});
  ExpectInvalid("json_array", SafetensorsWriter::Raw("[1, 2]", ""), {"not a JSON object"});
}

TEST(SafetensorsTest, RejectsAnEntryWithoutDtypeShapeOrOffsets) {
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    SafetensorsWriter w;
    w.AddF32("w", {2}, {1, 2});
    w.header["w"].erase(field);
    ExpectInvalid(std::string("no_") + field, w.Bytes(),
                  {"tensor w", "needs dtype, shape and data_offsets"});
  }
  SafetensorsWriter w;
  w.header["w"] = 5;
  ExpectInvalid("entry_not_object", w.Bytes(), {"tensor w", "needs dtype"});
}

TEST(SafetensorsTest, RejectsUnknownOrMistypedDtype) {
  SafetensorsWriter w;
  w.AddF32("w", {2}, {1, 2});
  w.header["w"]["dtype"] = "F12";
  ExpectInvalid("dtype_unknown", w.Bytes(), {"tensor w", "unknown dtype F12"});
  w.header["w"]["dtype"] = 4;
  ExpectInvalid("dtype_number", w.Bytes(), {"tensor w", "dtype is not a string"});
}

TEST(SafetensorsTest, RejectsBadShapes) {
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {nlohmann::json::array({-1, 2}), "invalid dimension -1"},
      {nlohmann::json::array({2.5}), "invalid dimension 2.5"},
      {nlohmann::json::array({"2"}), "invalid dimension \"2\""},
      {nlohmann::json::array({int64_t{1} << 41}), "invalid dimension 2199023255552"},
      {nlohmann::json(2), "shape must be an array of at most 8 dimensions"},
      {nlohmann::json::array({1, 1, 1, 1, 1, 1, 1, 1, 2}), "at most 8 dimensions"},
      // 3 · 4 = 12 elements, but the data section has 8 bytes
      {nlohmann::json::array({3, 4}), "larger than the file"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SafetensorsWriter w;
    w.AddF32("w", {2}, {1, 2});
    w.header["w"]["shape"] = cases[i].first;
    ExpectInvalid("shape_" + std::to_string(i), w.Bytes(), {"tensor w", cases[i].second});
  }
}

// A shape whose element count overflows 64 bits must not wrap around to a small number:
// [2^24, 2^40] is 2^64 elements, which wrapped to 0 and matched empty data_offsets,
// giving a 2^24 × 2^40 view of zero bytes.
TEST(SafetensorsTest, RejectsAShapeWhoseElementCountOverflows) {
  SafetensorsWriter w;
  w.Add("w", "F32", {int64_t{1} << 24, int64_t{1} << 40}, "");
  const std::string path = WriteTempFile("shape_overflow.safetensors", w.Bytes());
  // a sparse 16 MiB data section, so that the first dimension alone fits in the file
  std::filesystem::resize_file(path, std::filesystem::file_size(path) + (uint64_t{1} << 24));
  auto f = SafetensorsFile::Open(path);
  ASSERT_FALSE(f.ok()) << "accepted a shape of 2^64 elements";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
  EXPECT_TRUE(HasSubstr(std::string(f.status().message()), "tensor w"));
  EXPECT_TRUE(HasSubstr(std::string(f.status().message()), "larger than the file"));
}

TEST(SafetensorsTest, RejectsBadDataOffsets) {
  const std::vector<std::pair<nlohmann::json, std::string>> cases = {
      {nlohmann::json::array({8, 0}), "data_offsets [8, 0)"},    // begin > end
      {nlohmann::json::array({0, 16}), "data_offsets [0, 16)"},  // end past 8 data bytes
      {nlohmann::json::array({-8, 0}), "two non-negative integers"},
      {nlohmann::json::array({0, 8, 8}), "two non-negative integers"},
      {nlohmann::json::array({0.0, 8.0}), "two non-negative integers"},
      {nlohmann::json("0-8"), "two non-negative integers"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SafetensorsWriter w;
    w.AddF32("w", {2}, {1, 2});
    w.header["w"]["data_offsets"] = cases[i].first;
    ExpectInvalid("offsets_" + std::to_string(i), w.Bytes(), {"tensor w", cases[i].second});
  }
  SafetensorsWriter w;
  w.AddF32("w", {2}, {1, 2});
  w.header["w"]["data_offsets"] = {0, 16};
  ExpectInvalid("offsets_size", w.Bytes(), {"data section of 8 bytes"});
}

TEST(SafetensorsTest, RejectsSizeThatDisagreesWithDtypeAndShape) {
  SafetensorsWriter w;
  w.AddF32("w", {2, 2}, {1, 2, 3, 4});
  w.header["w"]["shape"] = {3};  // F32 × 3 = 12 bytes, the offsets span 16
  ExpectInvalid("nbytes_f32", w.Bytes(), {"tensor w", "16 bytes", "F32", "need 12"});

  SafetensorsWriter h;
  h.Add("h", "F16", {3}, std::string(8, '\0'));  // F16 × 3 = 6 bytes, not 8
  ExpectInvalid("nbytes_f16", h.Bytes(), {"tensor h", "8 bytes", "F16", "need 6"});
}

TEST(SafetensorsTest, RejectsOverlappingTensors) {
  SafetensorsWriter w;
  w.AddF32("a", {4}, {1, 2, 3, 4});  // bytes [0, 16)
  w.AddF32("b", {4}, {5, 6, 7, 8});  // bytes [16, 32)
  w.header["b"]["data_offsets"] = {8, 24};
  ExpectInvalid("overlap", w.Bytes(), {"tensors a and b overlap"});
  w.header["b"]["data_offsets"] = {0, 16};  // the very same bytes
  ExpectInvalid("overlap_same", w.Bytes(), {"overlap"});
}

// An empty tensor between two overlapping ones must not hide their overlap: sorted by
// begin, "a" [0, 16), "e" [4, 4), "c" [8, 24) — "c" overlaps "a", not its neighbour "e".
TEST(SafetensorsTest, RejectsAnOverlapBehindAnEmptyTensor) {
  SafetensorsWriter w;
  w.AddF32("a", {4}, {1, 2, 3, 4});
  w.AddF32("c", {4}, {5, 6, 7, 8});
  w.Add("e", "F32", {0}, "");
  w.header["e"]["data_offsets"] = {4, 4};
  w.header["c"]["data_offsets"] = {8, 24};
  ExpectInvalid("overlap_behind_empty", w.Bytes(), {"tensors a and c overlap"});
}

TEST(SafetensorsTest, EmptyTensorsShareNoBytes) {
  SafetensorsWriter w;
  w.AddF32("a", {4}, {1, 2, 3, 4});
  w.Add("e", "F32", {2, 0}, "");
  w.Add("s", "BF16", {0}, "");
  w.header["e"]["data_offsets"] = {4, 4};  // inside "a", but zero bytes long
  auto f = OpenBytes("empty_inside", w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Find("e")->nbytes, 0u);
  EXPECT_EQ((*f)->Find("e")->shape, (std::vector<int64_t>{2, 0}));
}

// The loader follows the reference implementation: __metadata__ is a map of string to
// string, so any other value rejects the file (naming the key) rather than being dropped.
TEST(SafetensorsTest, MetadataValuesMustBeStrings) {
  SafetensorsWriter w;
  w.AddF32("w", {1}, {1});
  w.header["__metadata__"] = {{"format", "pt"}, {"n", 3}};
  ExpectInvalid("meta_number", w.Bytes(), {"__metadata__.n is not a string"});
  w.header["__metadata__"] = "pt";
  ExpectInvalid("meta_string", w.Bytes(), {"__metadata__ is not an object"});
}

TEST(SafetensorsTest, WeightViewShapes) {
  SafetensorsWriter w;
  w.AddF32("vec", {5}, {1, 2, 3, 4, 5});
  w.AddF32("mat", {2, 3}, {1, 2, 3, 4, 5, 6});
  w.AddF32("cube", {2, 1, 2}, {1, 2, 3, 4});
  w.AddF32("scalar", {}, {7});
  w.Add("ids", "I64", {2}, Le<int64_t>(1) + Le<int64_t>(2));
  auto f = OpenBytes("views", w.Bytes());
  ASSERT_TRUE(f.ok()) << f.status();

  auto vec = SafetensorsWeightView(*(*f)->Find("vec"));
  ASSERT_TRUE(vec.ok()) << vec.status();
  EXPECT_EQ(vec->rows, 1);
  EXPECT_EQ(vec->cols, 5);
  EXPECT_EQ(vec->data, (*f)->Find("vec")->data);
  EXPECT_EQ(Row(*vec, 0), (std::vector<float>{1, 2, 3, 4, 5}));

  auto mat = SafetensorsWeightView(*(*f)->Find("mat"));
  ASSERT_TRUE(mat.ok()) << mat.status();
  EXPECT_EQ(mat->rows, 2);
  EXPECT_EQ(mat->cols, 3);
  EXPECT_EQ(mat->dtype, kernels::DType::kF32);
  EXPECT_EQ(Row(*mat, 1), (std::vector<float>{4, 5, 6}));

  auto ids = SafetensorsWeightView(*(*f)->Find("ids"));
  ASSERT_FALSE(ids.ok());
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kUnimplemented) << ids.status();
  EXPECT_TRUE(HasSubstr(std::string(ids.status().message()), "tensor ids"));
  EXPECT_TRUE(HasSubstr(std::string(ids.status().message()), "I64"));

  for (const char* name : {"cube", "scalar"}) {
    auto v = SafetensorsWeightView(*(*f)->Find(name));
    ASSERT_FALSE(v.ok()) << name;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << v.status();
    EXPECT_TRUE(HasSubstr(std::string(v.status().message()), std::string("tensor ") + name));
  }
}

}  // namespace
}  // namespace kvlens

// ggml's block quantisations decode to ggml's own floats. The expected values come from
// ggml itself (libggml-base's dequantize_row_*, through tests/kernels/testdata/
// make_ggml_quants.py): per type, ggml's quantisation of normal data and of data with
// outliers, and random blocks (every quant pattern, f16 scales of any sign and exponent,
// subnormals included).
#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "kernels/dtype.h"
#include "kernels/weight.h"
#include "tests/kernels/kernel_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::kernels {
namespace {

struct Entry {
  std::string label;  // "q4_K/random"
  DType dtype = DType::kF32;
  int64_t count = 0;
  std::vector<uint8_t> blocks;
  std::vector<float> want;
};

std::vector<Entry> ReadEntries() {
  const std::string path = ::kvlens::testing::SourcePath("tests/kernels/testdata/ggml_quants.bin");
  std::ifstream f(path, std::ios::binary);
  EXPECT_TRUE(f) << "cannot open " << path;
  auto u32 = [&] {
    uint32_t v = 0;
    f.read(reinterpret_cast<char*>(&v), 4);
    return v;
  };
  char magic[8] = {};
  f.read(magic, 8);
  EXPECT_EQ(std::string(magic, 8), "KVGGMLQ1");
  std::vector<Entry> entries(u32());
  for (Entry& e : entries) {
    e.label.resize(u32());
    f.read(e.label.data(), static_cast<std::streamsize>(e.label.size()));
    u32();  // ggml type id; the name says the same
    const std::string name = e.label.substr(0, e.label.find('/'));
    bool known = false;
    for (DType t : testing::kAllDTypes) {
      if (DTypeName(t) == name) e.dtype = t, known = true;
    }
    EXPECT_TRUE(known) << e.label;
    e.count = u32();
    e.blocks.resize(u32());
    f.read(reinterpret_cast<char*>(e.blocks.data()), static_cast<std::streamsize>(e.blocks.size()));
    e.want.resize(static_cast<size_t>(e.count));
    f.read(reinterpret_cast<char*>(e.want.data()), static_cast<std::streamsize>(4 * e.count));
  }
  EXPECT_TRUE(f) << path << " is truncated";
  return entries;
}

TEST(GgmlQuantsTest, FixtureCoversEveryBlockType) {
  const std::vector<Entry> entries = ReadEntries();
  int block_types = 0;
  for (DType t : testing::kAllDTypes) {
    if (!DTypeIsBlockQuantized(t)) continue;
    ++block_types;
    int cases = 0;
    for (const Entry& e : entries) {
      if (e.dtype != t) continue;
      ++cases;
      EXPECT_EQ(static_cast<int64_t>(e.blocks.size()), DTypeRowBytes(t, e.count)) << e.label;
    }
    EXPECT_EQ(cases, 3) << DTypeName(t);
  }
  EXPECT_EQ(block_types, 12);
}

// The float decoders, portable (DequantizeRow) and -march=native (CpuBackend's embedding
// lookup, DequantizeRowFast), give ggml's bits; the double one gives ggml's value before its
// one float rounding.
TEST(GgmlQuantsTest, DecodeToGgmlsFloats) {
  CpuBackend cpu(1);
  ReferenceBackend ref;
  for (const Entry& e : ReadEntries()) {
    SCOPED_TRACE(e.label);
    const WeightView row{e.blocks.data(), e.dtype, 1, e.count};
    std::vector<float> portable(static_cast<size_t>(e.count), std::nanf(""));
    std::vector<float> native(portable);
    std::vector<double> exact(portable.size());
    DequantizeRow(row, 0, portable.data());
    const int32_t id = 0;
    cpu.Embedding(row, &id, 1, native.data());
    ref.Embedding(row, &id, 1, exact.data());
    for (int64_t i = 0; i < e.count; ++i) {
      const uint32_t want = std::bit_cast<uint32_t>(e.want[i]);
      ASSERT_EQ(std::bit_cast<uint32_t>(portable[i]), want) << i << ": " << portable[i];
      ASSERT_EQ(std::bit_cast<uint32_t>(native[i]), want) << i << ": " << native[i];
      ASSERT_EQ(static_cast<float>(exact[i]), e.want[i]) << i << ": " << exact[i];
    }
  }
}

// A row of several blocks decodes block by block: a view of the middle rows of a matrix
// gives the same floats as the matching slice of the fixture.
TEST(GgmlQuantsTest, RowsAreWholeBlocks) {
  for (const Entry& e : ReadEntries()) {
    SCOPED_TRACE(e.label);
    const int64_t cols = DTypeBlockSize(e.dtype);
    const WeightView m{e.blocks.data(), e.dtype, e.count / cols, cols};
    EXPECT_EQ(m.row_bytes(), DTypeBlockOf(e.dtype).bytes);
    std::vector<float> out(static_cast<size_t>(cols));
    for (int64_t r = 0; r < m.rows; ++r) {
      DequantizeRow(m, r, out.data());
      for (int64_t i = 0; i < cols; ++i) ASSERT_EQ(out[i], e.want[r * cols + i]) << r << "," << i;
    }
  }
}

}  // namespace
}  // namespace kvlens::kernels

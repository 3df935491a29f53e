#include "kernels/weight.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

template <typename T>
class DequantizeRowTest : public ::testing::Test {};
using Scalars = ::testing::Types<float, double>;
TYPED_TEST_SUITE(DequantizeRowTest, Scalars);

TYPED_TEST(DequantizeRowTest, F32) {
  const float w[2][3] = {{1.5f, -2.0f, 0.25f}, {3.0f, 4.0f, -5.0f}};
  const WeightView v{w, DType::kF32, 2, 3};
  TypeParam out[3];
  DequantizeRow(v, 1, out);
  EXPECT_EQ(out[0], 3.0);
  EXPECT_EQ(out[1], 4.0);
  EXPECT_EQ(out[2], -5.0);
}

TYPED_TEST(DequantizeRowTest, F16AndBf16BitPatterns) {
  // f16: 0x3c00 = 1, 0xc000 = -2, 0x3555 = 0.333251953125, 0x0001 = 2^-24
  const uint16_t h[2][2] = {{0x3c00, 0xc000}, {0x3555, 0x0001}};
  TypeParam out[2];
  DequantizeRow(WeightView{h, DType::kF16, 2, 2}, 1, out);
  EXPECT_EQ(out[0], static_cast<TypeParam>(0.333251953125));
  EXPECT_EQ(out[1], static_cast<TypeParam>(5.9604644775390625e-08));
  // bf16: 0x3f80 = 1, 0xc0a0 = -5, 0x3e20 = 0.15625, 0x4049 = 3.140625
  const uint16_t b[2][2] = {{0x3f80, 0xc0a0}, {0x3e20, 0x4049}};
  DequantizeRow(WeightView{b, DType::kBF16, 2, 2}, 0, out);
  EXPECT_EQ(out[0], 1.0);
  EXPECT_EQ(out[1], -5.0);
  DequantizeRow(WeightView{b, DType::kBF16, 2, 2}, 1, out);
  EXPECT_EQ(out[0], 0.15625);
  EXPECT_EQ(out[1], 3.140625);
}

// ggml q8_0: each block of 32 is an f16 scale d followed by 32 int8 q; value = d · q.
TYPED_TEST(DequantizeRowTest, Q8_0Blocks) {
  constexpr int kCols = 64, kRows = 2;
  std::vector<uint8_t> bytes(kRows * 2 * 34);
  auto put_block = [&](int row, int block, uint16_t d_bits, int first_q) {
    uint8_t* p = bytes.data() + row * 68 + block * 34;
    std::memcpy(p, &d_bits, 2);
    for (int i = 0; i < 32; ++i) p[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(first_q + i));
  };
  put_block(0, 0, 0x3c00, 0);     // d = 1, q = 0..31
  put_block(0, 1, 0x3800, -128);  // d = 0.5, q = -128..-97
  put_block(1, 0, 0xb400, 96);    // d = -0.25, q = 96..127
  put_block(1, 1, 0x0000, 5);     // d = 0
  const WeightView v{bytes.data(), DType::kQ8_0, kRows, kCols};
  EXPECT_EQ(v.row_bytes(), 68);
  TypeParam out[kCols];
  DequantizeRow(v, 0, out);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], static_cast<TypeParam>(i)) << i;
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[32 + i], 0.5 * (-128 + i)) << i;
  DequantizeRow(v, 1, out);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[i], -0.25 * (96 + i)) << i;
  for (int i = 0; i < 32; ++i) EXPECT_EQ(out[32 + i], 0.0) << i;
}

TEST(WeightViewTest, RowsIsASubView) {
  const float w[3][2] = {{1, 2}, {3, 4}, {5, 6}};
  const WeightView v{w, DType::kF32, 3, 2};
  const WeightView tail = v.Rows(1, 2);
  EXPECT_EQ(tail.rows, 2);
  float out[2];
  DequantizeRow(tail, 1, out);
  EXPECT_EQ(out[0], 5.0f);
  EXPECT_EQ(out[1], 6.0f);
}

}  // namespace
}  // namespace kvlens::kernels

// F16/BF16 conversions, checked exhaustively over all 65536 bit patterns and against
// every rounding boundary between adjacent halves.
#include "kernels/dtype.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

bool IsF16Nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }

// The IEEE binary16 value of h, from the definition (not from the code under test).
double F16Value(uint16_t h) {
  const int sign = (h & 0x8000u) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) {
    return mant == 0 ? sign * std::numeric_limits<double>::infinity()
                     : std::numeric_limits<double>::quiet_NaN();
  }
  return sign * std::ldexp(1024 + mant, exp - 25);
}

TEST(DTypeTest, F16ToF32MatchesTheDefinitionForAllHalves) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = F16ToF32(static_cast<uint16_t>(h));
    const double want = F16Value(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(f)) << h;
      // The payload moves into the top of the float mantissa and the sign is kept.
      EXPECT_EQ(Bits(f), ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13)) << h;
    } else {
      EXPECT_EQ(static_cast<double>(f), want) << h;
      EXPECT_EQ(std::signbit(f), (h & 0x8000u) != 0) << h;  // -0 stays -0
    }
  }
}

TEST(DTypeTest, F16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = F32ToF16(F16ToF32(static_cast<uint16_t>(h)));
    if (IsF16Nan(static_cast<uint16_t>(h))) {
      EXPECT_TRUE(IsF16Nan(back)) << h;
      EXPECT_EQ(back & 0x8000u, h & 0x8000u) << h;
    } else {
      EXPECT_EQ(back, h) << h;
    }
  }
}

// Between every pair of adjacent finite halves a < b: the midpoint goes to the one with
// an even mantissa, and the floats just beside it go to the nearer half.
TEST(DTypeTest, F32ToF16RoundsToNearestEvenAtEveryBoundary) {
  for (uint32_t sign : {0u, 0x8000u}) {
    for (uint32_t a = 0; a < 0x7bffu; ++a) {  // 0x7bff is the largest finite half
      const uint16_t lo = static_cast<uint16_t>(sign | a),
                     hi = static_cast<uint16_t>(sign | (a + 1));
      const double mid = (F16Value(lo) + F16Value(hi)) / 2;  // exact in float
      const float m = static_cast<float>(mid);
      ASSERT_EQ(static_cast<double>(m), mid);
      const uint16_t even = (a & 1u) ? hi : lo;
      EXPECT_EQ(F32ToF16(m), even) << a;
      const float toward_lo = std::nextafter(m, 0.0f);  // |lo| < |m| < |hi|
      const float toward_hi = std::nextafter(m, 2 * m);
      EXPECT_EQ(F32ToF16(toward_lo), lo) << a;
      EXPECT_EQ(F32ToF16(toward_hi), hi) << a;
    }
  }
}

TEST(DTypeTest, F32ToF16Edges) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(F32ToF16(0.0f), 0x0000);
  EXPECT_EQ(F32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(F32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(F32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(F32ToF16(65504.0f), 0x7bff);                        // largest finite
  EXPECT_EQ(F32ToF16(std::nextafter(65520.0f, 0.0f)), 0x7bff);  // below the tie
  EXPECT_EQ(F32ToF16(65520.0f), 0x7c00);                        // tie → even → inf
  EXPECT_EQ(F32ToF16(-65520.0f), 0xfc00);
  EXPECT_EQ(F32ToF16(1e10f), 0x7c00);
  EXPECT_EQ(F32ToF16(inf), 0x7c00);
  EXPECT_EQ(F32ToF16(-inf), 0xfc00);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie with 0 → even (0)
  EXPECT_EQ(F32ToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(F32ToF16(-std::ldexp(1.0f, -26)), 0x8000);
  EXPECT_EQ(F32ToF16(std::ldexp(1.0f, -14)), 0x0400);  // smallest normal
  EXPECT_EQ(F32ToF16(std::numeric_limits<float>::denorm_min()), 0x0000);
  EXPECT_TRUE(IsF16Nan(F32ToF16(std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(IsF16Nan(F32ToF16(FromBits(0x7f800001u))));  // low payload must not become inf
  EXPECT_EQ(F32ToF16(FromBits(0xff800001u)) & 0x8000u, 0x8000u);
}

#if defined(__FLT16_MAX__)
// The compiler's own _Float16 conversion (round to nearest even) as a second oracle.
TEST(DTypeTest, F32ToF16AgreesWithCompilerFloat16) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000000; ++i) {
    const float f = FromBits(static_cast<uint32_t>(rng()));
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(F32ToF16(f), want) << std::hexfloat << f;
  }
}
#endif

TEST(DTypeTest, Bf16RoundTripsEveryPattern) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = BF16ToF32(static_cast<uint16_t>(b));
    EXPECT_EQ(Bits(f), b << 16) << b;
    const uint16_t back = F32ToBF16(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BF16ToF32(back))) << b;
      EXPECT_EQ(back & 0x8000u, b & 0x8000u) << b;
    } else {
      EXPECT_EQ(back, b) << b;
    }
  }
}

TEST(DTypeTest, F32ToBf16RoundsToNearestEven) {
  for (uint32_t b = 0; b < 0x7f7fu; ++b) {  // 0x7f7f is the largest finite bf16
    const uint32_t mid = (b << 16) | 0x8000u;
    const uint16_t even = (b & 1u) ? static_cast<uint16_t>(b + 1) : static_cast<uint16_t>(b);
    EXPECT_EQ(F32ToBF16(FromBits(mid)), even) << b;
    EXPECT_EQ(F32ToBF16(FromBits(mid - 1)), b) << b;
    EXPECT_EQ(F32ToBF16(FromBits(mid + 1)), b + 1) << b;
  }
  EXPECT_EQ(F32ToBF16(std::numeric_limits<float>::max()), 0x7f80);  // rounds up to inf
  EXPECT_TRUE(std::isnan(BF16ToF32(F32ToBF16(FromBits(0x7f800001u)))));
  EXPECT_EQ(F32ToBF16(-std::numeric_limits<float>::infinity()), 0xff80);
}

TEST(DTypeTest, RowBytesAndNames) {
  EXPECT_EQ(DTypeRowBytes(DType::kF32, 10), 40);
  EXPECT_EQ(DTypeRowBytes(DType::kF16, 10), 20);
  EXPECT_EQ(DTypeRowBytes(DType::kBF16, 10), 20);
  EXPECT_EQ(DTypeRowBytes(DType::kQ8_0, 64), 68);
  EXPECT_EQ(DTypeName(DType::kF32), "f32");
  EXPECT_EQ(DTypeName(DType::kF16), "f16");
  EXPECT_EQ(DTypeName(DType::kBF16), "bf16");
  EXPECT_EQ(DTypeName(DType::kQ8_0), "q8_0");
}

}  // namespace
}  // namespace kvlens::kernels

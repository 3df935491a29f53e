// ExpNegated against std::exp in double, and its exact zeros.
#include "kernels/fast_exp.h"

#include <cmath>
#include <limits>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

TEST(FastExpTest, WithinTwoTenthsOfAMillionthOfStdExp) {
  double worst = 0.0;
  for (int i = 0; i <= 873000; ++i) {
    const float y = static_cast<float>(i) * 1e-4f;  // 0 … 87.3, past 2^-k steps of every size
    const double want = std::exp(-static_cast<double>(y));
    worst = std::max(worst, std::abs(ExpNegated(y) - want) / want);
  }
  EXPECT_LE(worst, 3e-7);
  EXPECT_EQ(ExpNegated(0.0f), 1.0f);
}

// A masked score (y = +inf), NaN and everything from 87.3 on give exactly 0.
TEST(FastExpTest, ZeroPastTheCap) {
  EXPECT_EQ(ExpNegated(std::numeric_limits<float>::infinity()), 0.0f);
  EXPECT_EQ(ExpNegated(std::numeric_limits<float>::quiet_NaN()), 0.0f);
  EXPECT_EQ(ExpNegated(87.3f), 0.0f);
  EXPECT_EQ(ExpNegated(1e30f), 0.0f);
  EXPECT_GT(ExpNegated(87.2f), 0.0f);
}

// −inf − −inf is a NaN with the sign bit set on x86 (the default NaN): 0 all the same,
// as is the positive one; −0 is 0.
TEST(FastExpTest, NegativeNanIsZeroAndNegativeZeroIsOne) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  volatile float minus_inf = -inf;
  const float default_nan = minus_inf - minus_inf;
  EXPECT_TRUE(std::isnan(default_nan));
  EXPECT_EQ(ExpNegated(default_nan), 0.0f);
  EXPECT_EQ(ExpNegated(std::copysign(nan, -1.0f)), 0.0f);
  EXPECT_EQ(ExpNegated(-0.0f), 1.0f);
}

}  // namespace
}  // namespace kvlens::kernels

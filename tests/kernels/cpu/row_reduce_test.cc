// kernels::LogSumExp, ArgMax and TemperatureWeights against values worked out by hand,
// against std::exp in double, and against std::max_element.
#include "kernels/cpu/row_reduce.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(LogSumExpTest, HandComputedValues) {
  // log(e^0 + e^(log 3)) = log 4; a −inf logit adds nothing.
  EXPECT_NEAR(LogSumExp(std::vector<float>{0.0f, static_cast<float>(std::log(3.0))}), std::log(4.0),
              1e-7);
  EXPECT_NEAR(LogSumExp(std::vector<float>{-kInf, 2.0f, -kInf}), 2.0, 1e-7);
  // Nine equal logits of 5 (past the 8-lane loop's tail): 5 + log 9.
  EXPECT_NEAR(LogSumExp(std::vector<float>(9, 5.0f)), 5.0 + std::log(9.0), 1e-6);
}

TEST(LogSumExpTest, EmptyOrAllMinusInfinityIsMinusInfinity) {
  EXPECT_EQ(LogSumExp({}), -std::numeric_limits<double>::infinity());
  EXPECT_EQ(LogSumExp(std::vector<float>{-kInf, -kInf}), -std::numeric_limits<double>::infinity());
}

// 32000 logits spread over ~200 nats (most of the e^x underflow float) with one far below
// the rest: within 1e-6 of the sum of std::exp in double.
TEST(LogSumExpTest, MatchesDoubleExpOnALargeRow) {
  std::mt19937 rng(4);
  std::normal_distribution<float> g(0.0f, 100.0f);
  std::vector<float> logits(32001);
  for (float& l : logits) l = g(rng);
  logits[3] = -1e5f;
  double max_l = -std::numeric_limits<double>::infinity();
  for (float l : logits) max_l = std::max(max_l, static_cast<double>(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(static_cast<double>(l) - max_l);
  EXPECT_NEAR(LogSumExp(logits), max_l + std::log(sum), 1e-6);
}

// e^((l − max) / T) at T = 2: logits 1, 1 − 2 ln 2, 1 − 400 and −inf give 1, 1/2, e^−200
// (below e^−87.3: 0) and 0.
TEST(TemperatureWeightsTest, HandComputedValues) {
  const std::vector<float> logits = {1.0f, static_cast<float>(1.0 - 2.0 * std::log(2.0)),
                                     1.0f - 400.0f, -kInf};
  std::vector<float> w(logits.size(), -1.0f);
  TemperatureWeights(logits, 1.0f, 2.0, w.data());
  EXPECT_EQ(w[0], 1.0f);
  EXPECT_NEAR(w[1], 0.5f, 1e-6);
  EXPECT_EQ(w[2], 0.0f);
  EXPECT_EQ(w[3], 0.0f);
}

// The first of tied maxima (as std::max_element), past and inside the eight-lane loop's
// tail; NaN never picked; −inf only or empty: 0.
TEST(ArgMaxTest, FirstLargestLogit) {
  std::vector<float> row(37, 1.0f);
  row[20] = 3.0f;
  row[35] = 3.0f;
  EXPECT_EQ(ArgMax(row), 20);
  row[36] = 4.0f;  // in the tail
  EXPECT_EQ(ArgMax(row), 36);
  row[2] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(ArgMax(row), 36);
  EXPECT_EQ(ArgMax(std::vector<float>{-kInf, -kInf}), 0);
  EXPECT_EQ(ArgMax({}), 0);
}

TEST(ArgMaxTest, EqualsMaxElementOnRandomRows) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> small(-20, 20);  // integers: many ties
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> row(1000 + trial);
    for (float& l : row) l = static_cast<float>(small(rng));
    EXPECT_EQ(ArgMax(row), std::max_element(row.begin(), row.end()) - row.begin()) << trial;
  }
}

}  // namespace
}  // namespace kvlens::kernels

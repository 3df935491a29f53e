#include "clients/load/stats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace kvlens::load {
namespace {

TEST(PercentileTest, InterpolatesBetweenClosestRanksLikeNumpy) {
  const std::vector<double> v = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  // rank = p/100 · (n − 1): p50 → 4.5, p90 → 8.1, p99 → 8.91 (0-based).
  EXPECT_DOUBLE_EQ(Percentile(v, 50), 5.5);
  EXPECT_DOUBLE_EQ(Percentile(v, 90), 9.1);
  EXPECT_DOUBLE_EQ(Percentile(v, 99), 9.91);
  EXPECT_DOUBLE_EQ(Percentile(v, 0), 1);
  EXPECT_DOUBLE_EQ(Percentile(v, 100), 10);
  // numpy.percentile([15, 20, 35, 40, 50], 40) = 29.
  EXPECT_DOUBLE_EQ(Percentile({15, 20, 35, 40, 50}, 40), 29);
}

TEST(PercentileTest, EdgeCases) {
  EXPECT_EQ(Percentile({}, 50), 0);
  EXPECT_EQ(Percentile({7}, 99), 7);
  EXPECT_EQ(Percentile({1, 3}, 150), 3);  // clamped to [0, 100]
  EXPECT_EQ(Percentile({1, 3}, -5), 1);
}

TEST(SummarizeTest, SortsAndSummarizes) {
  const Summary s = Summarize({0.3, 0.1, 0.4, 0.2});  // sorted: .1 .2 .3 .4
  EXPECT_EQ(s.count, 4);
  EXPECT_DOUBLE_EQ(s.mean, 0.25);
  EXPECT_DOUBLE_EQ(s.p50, 0.25);     // rank 1.5
  EXPECT_NEAR(s.p90, 0.37, 1e-12);   // rank 2.7
  EXPECT_NEAR(s.p99, 0.397, 1e-12);  // rank 2.97
  EXPECT_DOUBLE_EQ(s.max, 0.4);
  EXPECT_EQ(Summarize({}).count, 0);
}

TEST(PoissonArrivalsTest, GapsAreExponentialWithMeanOneOverRate) {
  constexpr double kRate = 5;
  constexpr int kN = 200000;
  PoissonArrivals arrivals(kRate, 42);
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < kN; ++i) {
    const double g = arrivals.NextGap();
    ASSERT_GE(g, 0);
    sum += g;
    sum_sq += g * g;
  }
  const double mean = sum / kN;
  const double var = sum_sq / kN - mean * mean;
  // The sample mean's standard error is (1/rate)/√N ≈ 0.00045; 1% is > 4 of them.
  EXPECT_NEAR(mean, 1 / kRate, 0.01 / kRate);
  // Exponential: standard deviation = mean.
  EXPECT_NEAR(std::sqrt(var) / mean, 1.0, 0.02);
}

TEST(PoissonArrivalsTest, SameSeedSameSchedule) {
  PoissonArrivals a(3, 7), b(3, 7), c(3, 8);
  bool all_equal_c = true;
  for (int i = 0; i < 100; ++i) {
    const double x = a.NextGap();
    EXPECT_EQ(x, b.NextGap());
    all_equal_c &= x == c.NextGap();
  }
  EXPECT_FALSE(all_equal_c);
}

}  // namespace
}  // namespace kvlens::load

#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens {
namespace {

TEST(SamplerTest, GreedyTakesTheArgmax) {
  Sampler s(SamplingParams{});
  std::vector<float> logits = {0.5f, 2.0f, -1.0f, 1.9f};
  EXPECT_EQ(s.Sample(absl::MakeSpan(logits), {}), 1);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferent) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 42;
  std::vector<int32_t> a, b, c;
  Sampler s1(p), s2(p);
  p.seed = 43;
  Sampler s3(p);
  for (int i = 0; i < 200; ++i) {
    std::vector<float> l(16, 0.0f);
    auto l2 = l, l3 = l;
    a.push_back(s1.Sample(absl::MakeSpan(l), {}));
    b.push_back(s2.Sample(absl::MakeSpan(l2), {}));
    c.push_back(s3.Sample(absl::MakeSpan(l3), {}));
  }
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
}

// Logits ln(1), ln(2), ln(3), ln(4) at temperature 1 give probabilities 1/10 … 4/10.
TEST(SamplerTest, TemperatureOneSamplesTheSoftmax) {
  SamplingParams p;
  p.temperature = 1.0;
  p.seed = 7;
  Sampler s(p);
  std::map<int, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) {
    std::vector<float> l = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
    ++counts[s.Sample(absl::MakeSpan(l), {})];
  }
  for (int k = 0; k < 4; ++k) {
    const double expected = (k + 1) / 10.0;
    const double sd = std::sqrt(expected * (1 - expected) / n);
    EXPECT_NEAR(counts[k] / static_cast<double>(n), expected, 5 * sd) << "token " << k;
  }
}

TEST(SamplerTest, TopKAndTopPAndMinPTruncate) {
  // probabilities 0.1, 0.2, 0.3, 0.4 (ids 0…3)
  const std::vector<float> base = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  auto draws = [&](SamplingParams p) {
    p.temperature = 1.0;
    Sampler s(p);
    std::map<int, int> c;
    for (int i = 0; i < 3000; ++i) {
      auto l = base;
      ++c[s.Sample(absl::MakeSpan(l), {})];
    }
    return c;
  };
  SamplingParams k2;
  k2.top_k = 2;  // keeps ids 3 and 2
  auto c = draws(k2);
  EXPECT_EQ(c.count(0) + c.count(1), 0u);
  EXPECT_GT(c[2], 0);
  SamplingParams p05;
  p05.top_p = 0.5;  // 0.4 < 0.5, 0.4 + 0.3 ≥ 0.5: keeps ids 3 and 2
  c = draws(p05);
  EXPECT_EQ(c.count(0) + c.count(1), 0u);
  EXPECT_GT(c[2], 0);
  SamplingParams m;
  m.min_p = 0.6;  // threshold 0.24: keeps 0.4 and 0.3
  c = draws(m);
  EXPECT_EQ(c.count(0) + c.count(1), 0u);
  EXPECT_GT(c[2], 0);
}

// The filters and the draw by their definitions: every candidate's probability, all of
// them sorted by (probability desc, id asc), top-k, top-p and min-p cutting that order,
// then u = 53 random bits × the kept mass walked down it. The sampler sorts only as far
// as it looks (bucket by bucket); it must pick the same tokens (same seed, same rng draws)
// over a 32000-token vocabulary, peaked and flat, with runs of tied weights and with most
// weights 0, and over tiny vocabularies, for every filter and none.
int32_t SampleByDefinition(std::vector<float> logits, const SamplingParams& p,
                           std::mt19937_64& rng) {
  const float max_l = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<float, int32_t>> c;
  for (size_t i = 0; i < logits.size(); ++i) {
    c.push_back(
        {static_cast<float>(std::exp((static_cast<double>(logits[i]) - max_l) / p.temperature)),
         static_cast<int32_t>(i)});
  }
  std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  if (p.top_k > 0 && static_cast<size_t>(p.top_k) < c.size()) c.resize(p.top_k);
  double sum = 0.0;
  for (const auto& x : c) sum += x.first;
  if (p.top_p < 1.0) {
    double mass = 0.0;
    size_t k = 0;
    while (k < c.size()) {
      mass += c[k++].first / sum;
      if (mass >= p.top_p) break;
    }
    c.resize(k);
  }
  if (p.min_p > 0.0) {
    const float threshold = static_cast<float>(p.min_p) * c.front().first;
    size_t k = 1;
    while (k < c.size() && c[k].first >= threshold) ++k;
    c.resize(k);
  }
  double total = 0.0;
  for (const auto& x : c) total += x.first;
  const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53 * total;
  double acc = 0.0;
  for (const auto& x : c) {
    acc += x.first;
    if (u < acc) return x.second;
  }
  return c.back().second;
}

TEST(SamplerTest, SortingOnlyAsFarAsNeededPicksWhatTheDefinitionPicks) {
  std::mt19937 gen(5);
  struct Row {
    int vocab;
    float spread;
    bool ties;  // logits rounded to quarters: runs of equal weights, lower id first
  };
  for (const Row& row : {Row{32000, 1.0f, false}, Row{32000, 4.0f, false},  // flat-ish, peaked
                         Row{32000, 1.0f, true}, Row{32000, 30.0f, false},  // ties, zeros
                         Row{7, 1.0f, true}, Row{2, 0.0f, false}}) {
    const float spread = row.spread;
    std::normal_distribution<float> normal(0.0f, std::max(spread, 1e-6f));
    std::vector<float> logits(row.vocab);
    for (float& l : logits) l = row.ties ? std::round(normal(gen) * 4.0f) / 4.0f : normal(gen);
    if (spread == 0.0f) std::fill(logits.begin(), logits.end(), 0.5f);
    for (int variant = 0; variant < 5; ++variant) {
      SamplingParams p;
      p.temperature = 0.8;
      p.seed = 11 + variant;
      if (variant == 1) p.top_k = 50;
      if (variant == 2) p.top_p = 0.9;
      if (variant == 3) p.min_p = 0.05;
      if (variant == 4) p.top_k = 2000, p.top_p = 0.95, p.min_p = 0.001;
      Sampler sampler(p);
      std::mt19937_64 rng(p.seed);
      for (int draw = 0; draw < 20; ++draw) {
        std::vector<float> l = logits;
        const int32_t want = SampleByDefinition(logits, p, rng);
        EXPECT_EQ(sampler.Sample(absl::MakeSpan(l), {}), want)
            << "vocab " << row.vocab << ", spread " << spread << ", ties " << row.ties
            << ", variant " << variant << ", draw " << draw;
      }
    }
  }
}

TEST(SamplerTest, PenaltiesFollowTheirDefinitions) {
  SamplingParams p;
  p.repetition_penalty = 2.0;
  p.frequency_penalty = 0.5;
  p.presence_penalty = 0.25;
  p.logit_bias = {{0, 10.0f}};
  Sampler s(p);
  // token 1 seen twice: 3 / 2 − 0.5·2 − 0.25 = 0.25; token 2 seen once: −1·2 − 0.5 − 0.25
  // = −2.75; token 0 unseen gets its bias: 1 + 10 = 11.
  std::vector<float> l = {1.0f, 3.0f, -1.0f};
  const std::vector<int32_t> history = {1, 2, 1};
  EXPECT_EQ(s.Sample(absl::MakeSpan(l), history), 0);
  EXPECT_FLOAT_EQ(l[0], 11.0f);
  EXPECT_FLOAT_EQ(l[1], 0.25f);
  EXPECT_FLOAT_EQ(l[2], -2.75f);
}

// ReserveDraw hands a backend the draw Sample would make: its token counts are the
// history's, kept from call to call, and DrawRow with them (DrawRows, then the
// reservation cleared) gives SampleRow's token, log-probability and top 3 (with the same
// uniform number), step by step as a 40-token history of a 24-token vocabulary grows (so
// tokens repeat and the penalties bite), under each penalty and filter.
TEST(SamplerTest, ReservedDrawsWithPenaltiesPickWhatSamplePicks) {
  SamplingParams p;
  p.repetition_penalty = 1.5;
  p.frequency_penalty = 0.3;
  p.presence_penalty = -0.2;
  p.logit_bias = {{4, 1.0f}};
  p.temperature = 0.9;
  p.top_p = 0.9;
  p.seed = 11;
  for (const double temperature : {0.9, 0.0}) {
    p.temperature = temperature;
    Sampler sample(p), reserve(p), plain(SamplingParams{.temperature = temperature, .seed = 11});
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    std::vector<int32_t> history = {3, 3, 7};
    int moved = 0;  // steps where the penalties changed the pick
    for (int step = 0; step < 40; ++step) {
      std::vector<float> logits(24);
      for (float& l : logits) l = normal(rng);
      const kernels::TokenDraw d = reserve.ReserveDraw(history);
      ASSERT_TRUE(d.HasPenalties());
      std::map<int32_t, int32_t> want_counts;
      for (int32_t t : history) ++want_counts[t];
      const std::map<int32_t, int32_t> counts(d.token_counts.begin(), d.token_counts.end());
      EXPECT_EQ(counts, want_counts);
      EXPECT_EQ(d.token_counts.size(), want_counts.size());  // each token once
      kernels::TokenDraw with_top = d;
      with_top.top_logprobs = 3;
      const RowSample got = DrawRow(reserve, logits, with_top);
      const RowSample sampled = SampleRow(sample, logits, history, 3);
      const int32_t want = sampled.token;
      EXPECT_EQ(got.token, want) << "step " << step;
      EXPECT_EQ(got.logprob, sampled.logprob);
      ASSERT_EQ(got.top_logprobs.size(), 3u);
      for (int i = 0; i < 3; ++i) {
        EXPECT_EQ(got.top_logprobs[i].token, sampled.top_logprobs[i].token);
        EXPECT_EQ(got.top_logprobs[i].logprob, sampled.top_logprobs[i].logprob);
      }
      std::vector<float> copy = logits;
      moved += plain.Sample(absl::MakeSpan(copy), history) != want;
      history.push_back(want);
    }
    EXPECT_GT(moved, 0);
  }
}

TEST(SamplerTest, ValidateNamesTheField) {
  SamplingParams p;
  p.top_p = 0.0;
  absl::Status s = p.Validate(10);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("top_p"), std::string::npos) << s;
  p = SamplingParams{};
  p.temperature = -1;
  EXPECT_NE(p.Validate(10).message().find("temperature"), std::string::npos);
  p = SamplingParams{};
  p.logit_bias = {{10, 1.0f}};
  EXPECT_NE(p.Validate(10).message().find("logit_bias token id 10"), std::string::npos);
}

TEST(LogSoftmaxTest, MatchesHandComputedValues) {
  std::vector<double> out;
  LogSoftmax(std::vector<float>{0.0f, static_cast<float>(std::log(3.0))}, out);
  EXPECT_NEAR(out[0], std::log(0.25), 1e-7);
  EXPECT_NEAR(out[1], std::log(0.75), 1e-7);
}

// The float exponentials summed in double against std::exp in double throughout, on a
// 32000-token row: logits spread over ~2, ~20 and ~200 nats, with −inf (a logit bias)
// and logits far below the rest (whose e^x underflows float).
TEST(LogSoftmaxTest, MatchesDoubleExpOnLargeRows) {
  std::mt19937 rng(3);
  for (float spread : {1.0f, 10.0f, 100.0f}) {
    std::normal_distribution<float> g(0.0f, spread);
    std::vector<float> logits(32000);
    for (float& l : logits) l = g(rng) + 7.0f;
    logits[5] = -std::numeric_limits<float>::infinity();
    logits[6] = -1e4f;
    logits[7] = logits[8] - 90.0f;
    double max_l = -std::numeric_limits<double>::infinity();
    for (float l : logits) max_l = std::max(max_l, static_cast<double>(l));
    double sum = 0.0;
    for (float l : logits) sum += std::exp(static_cast<double>(l) - max_l);
    const double lse = max_l + std::log(sum);
    std::vector<double> out;
    LogSoftmax(logits, out);
    ASSERT_EQ(out.size(), logits.size());
    EXPECT_EQ(out[5], -std::numeric_limits<double>::infinity());
    for (size_t i = 0; i < logits.size(); ++i) {
      if (i == 5) continue;
      ASSERT_NEAR(out[i], static_cast<double>(logits[i]) - lse, 1e-6)
          << "spread " << spread << " token " << i;
    }
  }
}

}  // namespace
}  // namespace kvlens

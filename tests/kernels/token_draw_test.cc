// DrawToken and DrawRows on rows worked by hand. engine/sampler_test checks DrawToken
// (through Sampler) against the definition over large rows; the CUDA parity suite checks
// the device's draws against DrawRows.
#include "kernels/token_draw.h"

#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::kernels {
namespace {

// Logits log 1 … log 4 at temperature 1: weights 1/4, 1/2, 3/4, 1 (to ExpNegated's 2e-7),
// so the sorted candidates are 3, 2, 1, 0 with running masses 1, 1.75, 2.25, 2.5.
const std::vector<float> kQuarters = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};

int32_t Draw(const std::vector<float>& logits, TokenDraw d) { return DrawToken(logits, d); }

TEST(TokenDrawTest, WalksTheCandidatesByWeight) {
  TokenDraw d;
  d.temperature = 1.0;
  const struct {
    double u01;
    int32_t want;
  } cases[] = {{0.0, 3},  {0.1, 3},     {0.39, 3},  // u < 1
               {0.41, 2}, {0.69, 2},                // 1 <= u < 1.75
               {0.71, 1}, {0.89, 1},                // 1.75 <= u < 2.25
               {0.91, 0}, {0.999999, 0}};           // 2.25 <= u < 2.5
  for (const auto& c : cases) {
    d.u01 = c.u01;
    EXPECT_EQ(Draw(kQuarters, d), c.want) << "u01 " << c.u01;
  }
}

TEST(TokenDrawTest, TopKTopPAndMinPCutTheSortedOrder) {
  TokenDraw d;
  d.temperature = 1.0;
  d.top_k = 2;  // {3, 2}, mass 1.75: u = 1.05 lands on 2, u = 0.875 on 3
  d.u01 = 0.6;
  EXPECT_EQ(Draw(kQuarters, d), 2);
  d.u01 = 0.5;
  EXPECT_EQ(Draw(kQuarters, d), 3);
  d.top_k = 0;
  d.top_p = 0.41;  // shares 0.4, 0.7: two kept, as with top_k = 2
  d.u01 = 0.6;
  EXPECT_EQ(Draw(kQuarters, d), 2);
  d.top_p = 0.39;  // the first share, 0.4, reaches it: only 3
  d.u01 = 0.999;
  EXPECT_EQ(Draw(kQuarters, d), 3);
  d.top_p = 1.0;
  d.min_p = 0.3;  // weights >= 0.3: {3, 2, 1}, mass 2.25; u = 2.2275 lands on 1, never 0
  d.u01 = 0.99;
  EXPECT_EQ(Draw(kQuarters, d), 1);
  d.min_p = 0.6;  // {3, 2}
  EXPECT_EQ(Draw(kQuarters, d), 2);
}

// A lower temperature sharpens: at T = 0.5 the weights are squared (1, 9/16, 1/4, 1/16 for
// candidates 3, 2, 1, 0: running masses 1, 1.5625, 1.8125, 1.875).
TEST(TokenDrawTest, TemperatureSharpens) {
  TokenDraw d;
  d.temperature = 0.5;
  d.u01 = 0.6;  // u = 1.125
  EXPECT_EQ(Draw(kQuarters, d), 2);
  d.u01 = 0.9;  // u = 1.6875
  EXPECT_EQ(Draw(kQuarters, d), 1);
  d.u01 = 0.52;  // u = 0.975 lands on 3; at T = 1, u = 1.3 lands on 2
  EXPECT_EQ(Draw(kQuarters, d), 3);
  d.temperature = 1.0;
  EXPECT_EQ(Draw(kQuarters, d), 2);
}

// Equal weights go by id; greedy takes the first largest logit.
TEST(TokenDrawTest, TiesGoByIdAndGreedyTakesTheFirstMax) {
  TokenDraw d;
  d.temperature = 1.0;
  d.u01 = 0.5;  // u = 1.5 over three weights of 1: the second, id 1
  EXPECT_EQ(Draw({0.0f, 0.0f, 0.0f}, d), 1);
  d.temperature = 0.0;
  EXPECT_EQ(Draw({1.0f, 3.0f, 2.0f, 3.0f}, d), 1);
  // 1/T past float's range: greedy too (not 0 · inf = NaN weights, which drew the last id)
  d.temperature = 1e-40;
  d.u01 = 0.999;
  EXPECT_EQ(Draw({1.0f, 3.0f, 2.0f, 3.0f}, d), 1);
  // 1/T = 1e30 is a float: a draw, between the two maxima (weight 1 each, the others 0):
  // u = 0.999 · 2 lands on the second
  d.temperature = 1e-30;
  EXPECT_EQ(Draw({1.0f, 3.0f, 2.0f, 3.0f}, d), 3);
}

// No mass at all (every logit −inf): the draw finds no candidate whose running mass
// exceeds u = 0 and takes the last kept one in (weight, id) order: the last id, or the
// top_k-th.
TEST(TokenDrawTest, ARowWithoutMassTakesTheLastKeptCandidate) {
  const float inf = std::numeric_limits<float>::infinity();
  TokenDraw d;
  d.temperature = 1.0;
  d.u01 = 0.5;
  EXPECT_EQ(Draw({-inf, -inf, -inf}, d), 2);
  d.top_k = 2;
  EXPECT_EQ(Draw({-inf, -inf, -inf}, d), 1);
}

// DrawRows: each row's token and its log-probability l − log Σ e^l.
TEST(TokenDrawTest, DrawRowsReportsTheModelsLogProbability) {
  std::vector<float> rows = kQuarters;
  rows.insert(rows.end(), {5.0f, 1.0f, 5.0f, 0.0f});
  TokenDraw draws[2];
  draws[0].temperature = 1.0;
  draws[0].u01 = 0.5;  // token 2
  // draws[1]: greedy, the first 5
  draws[1].top_logprobs = 3;  // ids 0 and 2 (tied at 5: lower id first), then 1
  int32_t token[2] = {-1, -1};
  float logprob[2] = {0.0f, 0.0f};
  int32_t top[2 * kMaxTopLogprobs];
  float top_lp[2 * kMaxTopLogprobs];
  DrawRows(rows.data(), 2, 4, draws, token, logprob, top, top_lp);
  EXPECT_EQ(token[0], 2);
  EXPECT_NEAR(logprob[0], std::log(3.0 / 10.0), 1e-6);  // e^l = 1, 2, 3, 4
  EXPECT_EQ(token[1], 0);
  const double z = 2 * std::exp(5.0) + std::exp(1.0) + 1.0;
  EXPECT_NEAR(logprob[1], 5.0 - std::log(z), 1e-6);
  EXPECT_EQ(top[kMaxTopLogprobs + 0], 0);
  EXPECT_EQ(top[kMaxTopLogprobs + 1], 2);
  EXPECT_EQ(top[kMaxTopLogprobs + 2], 1);
  EXPECT_NEAR(top_lp[kMaxTopLogprobs + 2], 1.0 - std::log(z), 1e-6);
}

// DrawRows applies a row's logit bias, entry by entry, before the draw but not before the
// reported log-probabilities: +2 on id 0 (log 1 + 2 = 2 beats log 4) makes it greedy's
// pick, reported at its raw log(1/10); two −1s on id 3 add up (log 4 − 2 < log 3).
TEST(TokenDrawTest, DrawRowsAppliesTheLogitBiasToTheDrawOnly) {
  const std::vector<std::pair<int32_t, float>> raise = {{0, 2.0f}};
  const std::vector<std::pair<int32_t, float>> lower = {{3, -1.0f}, {3, -1.0f}};
  TokenDraw draws[2];
  draws[0].logit_bias = raise;
  draws[1].logit_bias = lower;
  int32_t token[2] = {-1, -1};
  float logprob[2];
  std::vector<float> rows = kQuarters;
  rows.insert(rows.end(), kQuarters.begin(), kQuarters.end());
  DrawRows(rows.data(), 2, 4, draws, token, logprob, nullptr, nullptr);
  EXPECT_EQ(token[0], 0);
  EXPECT_NEAR(logprob[0], std::log(0.1), 1e-6);
  EXPECT_EQ(token[1], 2);
  EXPECT_NEAR(logprob[1], std::log(0.3), 1e-6);
  // DrawToken itself leaves the bias to its caller.
  EXPECT_EQ(DrawToken(kQuarters, draws[0]), 3);
}

// A forced token (a prompt being scored) is the row's token whatever the draw would pick,
// reported with its log-probability and the row's top tokens; the bias and penalties that
// would have moved a draw are unused: e^l = 1, 2, 3, 4, token 0 at log(1/10), top 2: ids 3
// and 2 at log(4/10) and log(3/10).
TEST(TokenDrawTest, DrawRowsReportsAForcedTokenAsIs) {
  const std::vector<std::pair<int32_t, float>> raise = {{1, 50.0f}};
  const std::pair<int32_t, int32_t> counted[] = {{0, 3}};
  TokenDraw draws[2];
  draws[0].forced_token = 0;
  draws[0].temperature = 1.0;
  draws[0].u01 = 0.99;  // would draw token 3
  draws[0].logit_bias = raise;
  draws[0].presence_penalty = 5.0;
  draws[0].token_counts = counted;
  draws[0].top_logprobs = 2;
  draws[1].forced_token = 3;  // the greedy pick anyway
  int32_t token[2] = {-1, -1};
  float logprob[2];
  int32_t top[2 * kMaxTopLogprobs];
  float top_lp[2 * kMaxTopLogprobs];
  std::vector<float> rows = kQuarters;
  rows.insert(rows.end(), kQuarters.begin(), kQuarters.end());
  DrawRows(rows.data(), 2, 4, draws, token, logprob, top, top_lp);
  EXPECT_EQ(token[0], 0);
  EXPECT_NEAR(logprob[0], std::log(0.1), 1e-6);
  EXPECT_EQ(top[0], 3);
  EXPECT_NEAR(top_lp[0], std::log(0.4), 1e-6);
  EXPECT_EQ(top[1], 2);
  EXPECT_NEAR(top_lp[1], std::log(0.3), 1e-6);
  EXPECT_EQ(token[1], 3);
  EXPECT_NEAR(logprob[1], std::log(0.4), 1e-6);
}

// PenalizedLogit by hand: 3 seen twice under repetition 2, frequency 0.5, presence 0.25:
// 3 / 2 − (0.5 · 2 + 0.25) = 0.25; −1 seen once: −1 · 2 − 0.75 = −2.75; a negative
// frequency raises.
TEST(TokenDrawTest, PenalizedLogitFollowsItsDefinition) {
  EXPECT_EQ(PenalizedLogit(3.0f, 2, 2.0, 0.5, 0.25), 0.25f);
  EXPECT_EQ(PenalizedLogit(-1.0f, 1, 2.0, 0.5, 0.25), -2.75f);
  EXPECT_EQ(PenalizedLogit(0.0f, 4, 1.0, -0.5, 0.0), 2.0f);
  EXPECT_EQ(PenalizedLogit(6.0f, 1, 3.0, 0.0, 0.0), 2.0f);
}

// DrawRows applies the penalties over a row's token counts after the bias, before the
// draw but not before the reported log-probabilities. Greedy over log 1 … log 4:
// presence 1 on id 3 (log 4 − 1 < log 3) picks 2; repetition 3 on ids 2 and 3 (log 3 / 3,
// log 4 / 3 < log 2) picks 1; frequency 0.25 on id 3 counted twice (log 4 − 0.5 < log 3)
// picks 2, counted once (log 4 − 0.25 > log 3) keeps 3; a bias of +2 on id 0 and then
// repetition 4 there (2 / 4 < log 4; the other order, 0 · 4 + 2, would pick 0) keeps 3.
// Penalties with no counts, or counts with no penalty, change nothing.
TEST(TokenDrawTest, DrawRowsAppliesThePenaltiesToTheDrawOnly) {
  const std::vector<std::pair<int32_t, int32_t>> three_once = {{3, 1}};
  const std::vector<std::pair<int32_t, int32_t>> two_and_three = {{2, 1}, {3, 1}};
  const std::vector<std::pair<int32_t, int32_t>> three_twice = {{3, 2}};
  const std::vector<std::pair<int32_t, int32_t>> zero_once = {{0, 1}};
  const std::vector<std::pair<int32_t, float>> raise = {{0, 2.0f}};
  constexpr int kRows = 7;
  TokenDraw draws[kRows];
  draws[0].presence_penalty = 1.0, draws[0].token_counts = three_once;
  draws[1].repetition_penalty = 3.0, draws[1].token_counts = two_and_three;
  draws[2].frequency_penalty = 0.25, draws[2].token_counts = three_twice;
  draws[3].frequency_penalty = 0.25, draws[3].token_counts = three_once;
  draws[4].logit_bias = raise, draws[4].repetition_penalty = 4.0, draws[4].token_counts = zero_once;
  draws[5].presence_penalty = 1.0;     // no counts
  draws[6].token_counts = three_once;  // no penalty
  std::vector<float> rows;
  for (int r = 0; r < kRows; ++r) rows.insert(rows.end(), kQuarters.begin(), kQuarters.end());
  int32_t token[kRows];
  float logprob[kRows];
  DrawRows(rows.data(), kRows, 4, draws, token, logprob, nullptr, nullptr);
  const int32_t want[kRows] = {2, 1, 2, 3, 3, 3, 3};
  for (int r = 0; r < kRows; ++r) {
    EXPECT_EQ(token[r], want[r]) << "row " << r;
    EXPECT_NEAR(logprob[r], std::log((want[r] + 1) / 10.0), 1e-6) << "row " << r;
  }
  EXPECT_FALSE(draws[5].HasPenalties());
  EXPECT_FALSE(draws[6].HasPenalties());
}

}  // namespace
}  // namespace kvlens::kernels

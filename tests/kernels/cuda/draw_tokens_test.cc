// CudaBackend::DrawTokens (kernels/cuda/draw_tokens.cu) against DrawRows on the host:
// greedy picks, seeded draws with every filter, top log-probabilities and logit biases.
// Suites named CudaBackend* (ctest label `gpu`); without a device they skip with the
// reason.
#include "gtest/gtest.h"

#ifdef KVLENS_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/token_draw.h"
#include "tests/kernels/cuda/cuda_backend_fixture.h"
#include "tests/kernels/cuda/cuda_parity.h"

namespace kvlens::kernels::cuda {
namespace {

// Greedy draws on the device against DrawRows on the host (ops_test checks the host's by
// hand): rows of 8192, 32000 and 1000 (not a multiple of the block), with ties, NaN and
// −inf placed in different threads' shares, and rows of −inf or NaN only. 8192 first: a
// row of 32 KiB kept in shared memory, under the 48 KiB a kernel may use without opting
// in, but not with the kernel's 27 KiB of static shared memory (its histograms); a
// 32000-token row's opt-in would still hold for it (it belongs to the kernel).
TEST_F(CudaBackendTest, GreedyDrawsEqualTheHostsPick) {
  std::mt19937_64 rng(9);
  for (int vocab : {8192, 32000, 1000}) {
    SCOPED_TRACE(vocab);
    constexpr int kRows = 6;
    std::normal_distribution<double> normal(0.0, 3.0);
    std::vector<double> logits(static_cast<size_t>(kRows) * vocab);
    for (double& l : logits) l = static_cast<float>(normal(rng));
    const double inf = std::numeric_limits<double>::infinity();
    auto row = [&](int r) { return logits.begin() + static_cast<ptrdiff_t>(r) * vocab; };
    row(1)[vocab - 1] = row(1)[37] = row(1)[900] = 20.0;  // tie: 37 is the first
    row(2)[5] = std::nan(""), row(2)[6] = inf * -1, row(2)[vocab / 2] = 30.0;
    std::fill(row(3), row(3) + vocab, -inf);
    std::fill(row(4), row(4) + vocab, std::nan(""));
    row(5)[0] = -inf, row(5)[vocab - 1] = 40.0;  // the last index
    auto d = parity::ToDevice(logits);
    ASSERT_TRUE(d.ok()) << d.status();
    std::vector<int32_t> token(kRows, -1), want_token(kRows, -2);
    std::vector<float> logprob(kRows), want_logprob(kRows);
    const std::vector<kernels::TokenDraw> greedy(kRows);
    ASSERT_TRUE(backend_
                    ->DrawTokens(d->as<float>(), kRows, vocab, greedy.data(), token.data(),
                                 logprob.data(), nullptr, nullptr)
                    .ok());
    const std::vector<float> host(logits.begin(), logits.end());
    kernels::DrawRows(host.data(), kRows, vocab, greedy.data(), want_token.data(),
                      want_logprob.data(), nullptr, nullptr);
    EXPECT_EQ(token, want_token);
    EXPECT_EQ(want_token[1], 37);
    EXPECT_EQ(want_token[5], vocab - 1);
    for (int r = 0; r < kRows; ++r) {
      if (std::isnan(want_logprob[r])) {
        EXPECT_TRUE(std::isnan(logprob[r])) << r;
      } else {
        EXPECT_NEAR(logprob[r], want_logprob[r], 1e-5 * (1 + std::abs(want_logprob[r]))) << r;
      }
    }
  }
}

// DrawTokens on the device against DrawRows on the host (kernels/token_draw.h, checked by
// hand in token_draw_test and against the definition in sampler_test), the same draws and
// uniform numbers: rows of 32000 (Gaussian logits σ = 1 and 3, quarters with runs of tied
// weights, σ = 30 where most weights are 0), 1000 and 12 tokens (their weights kept in
// shared memory), 50000 (recomputed each pass; a biased or penalized row adjusted in
// global scratch), a row of −inf only and one with NaN and −inf; each under greedy,
// temperatures 1e-40 (greedy too) and 0.3 … 100, top-k (1, 50, past the vocabulary),
// top-p, min-p and all three, some with top-20 or top-5 log-probabilities, logit biases
// (one raising a token, a ban list with a repeated id), and penalties (repetition,
// frequency and presence, over the row's ten most likely tokens and others, counted 1 …
// 10 times; one greedy with a bias too), and forced tokens (a prompt's scored rows; a bias
// and penalties present and unused), at uniform numbers from 0 to just under 1. The
// tokens must be equal: the weights are the host's bit for bit, and the masses differ by
// at most vocab · 2^−43, which no draw here lands that close to a boundary.
TEST_F(CudaBackendTest, DrawTokensEqualTheHostsDraws) {
  std::mt19937_64 rng(17);
  const double inf = std::numeric_limits<double>::infinity();
  struct RowKind {
    int vocab;
    double sigma;
    bool quarters;
  };
  const RowKind kinds[] = {{32000, 1.0, false},  {32000, 3.0, false}, {32000, 1.0, true},
                           {32000, 30.0, false}, {1000, 2.0, false},  {12, 1.0, true},
                           {50000, 2.0, true}};
  std::vector<kernels::TokenDraw> variants;
  for (double t : {0.0, 1e-40, 0.3, 0.8, 1.0, 100.0}) {
    kernels::TokenDraw d;
    d.temperature = t;
    variants.push_back(d);
  }
  auto with = [](double t, int k, double p, double min_p) {
    kernels::TokenDraw d;
    d.temperature = t, d.top_k = k, d.top_p = p, d.min_p = min_p;
    return d;
  };
  variants.push_back(with(0.8, 1, 1.0, 0.0));
  variants.push_back(with(0.8, 50, 1.0, 0.0));
  variants.push_back(with(0.8, 40000, 1.0, 0.0));
  variants.push_back(with(0.8, 0, 0.9, 0.0));
  variants.push_back(with(1.0, 0, 0.5, 0.0));
  variants.push_back(with(0.8, 0, 1.0, 0.05));
  variants.push_back(with(1.5, 2000, 0.95, 0.001));
  variants.push_back(with(100.0, 0, 0.3, 0.0));
  variants[0].top_logprobs = 20;  // greedy, with the top log-probabilities
  variants[3].top_logprobs = 5;   // T 0.8
  // Logit biases: +30 on token 5 (greedy's pick then), and a ban list with a repeated id
  // (−100 on tokens 0 … 9, −1 twice more on 3) under a top-p draw.
  const std::vector<std::pair<int32_t, float>> raise = {{5, 30.0f}};
  std::vector<std::pair<int32_t, float>> bans;
  for (int32_t id = 0; id < 10; ++id) bans.push_back({id, -100.0f});
  bans.push_back({3, -1.0f});
  bans.push_back({3, -1.0f});
  variants.push_back(with(0.0, 0, 1.0, 0.0));
  variants.back().logit_bias = raise;
  variants.push_back(with(0.8, 0, 0.9, 0.0));
  variants.back().logit_bias = bans;
  // Penalties (their token counts are the row's, below): greedy with a repetition penalty
  // of 10 (the most likely tokens are all counted, so the pick must move off the argmax),
  // then with a bias on token 5 as well, and all three penalties under a top-p draw.
  const size_t first_penalized = variants.size();
  variants.push_back(with(0.0, 0, 1.0, 0.0));
  variants.back().repetition_penalty = 10.0;
  variants.push_back(with(0.0, 0, 1.0, 0.0));
  variants.back().repetition_penalty = 1.3, variants.back().frequency_penalty = 0.4;
  variants.back().presence_penalty = 0.3, variants.back().logit_bias = raise;
  variants.push_back(with(0.9, 0, 0.95, 0.0));
  variants.back().repetition_penalty = 1.3, variants.back().frequency_penalty = -0.4;
  variants.back().presence_penalty = 0.7, variants.back().top_logprobs = 5;
  // Forced tokens (a prompt being scored): with top-5 log-probabilities and a bias and
  // penalties that must not apply, at token 7, and greedy-like at token 0.
  variants.push_back(with(0.9, 0, 0.95, 0.0));
  variants.back().forced_token = 7, variants.back().top_logprobs = 5;
  variants.back().logit_bias = raise, variants.back().repetition_penalty = 1.3;
  variants.push_back(with(0.0, 0, 1.0, 0.0));
  variants.back().forced_token = 0;
  const double u01s[] = {0.0, 0.25, 0.5, 0.75, 0.999999};
  for (const RowKind& kind : kinds) {
    SCOPED_TRACE(::testing::Message() << "vocab " << kind.vocab << ", sigma " << kind.sigma
                                      << (kind.quarters ? ", quarters" : ""));
    std::normal_distribution<double> normal(0.0, kind.sigma);
    std::vector<double> row(static_cast<size_t>(kind.vocab));
    for (double& l : row) {
      l = kind.quarters ? std::round(normal(rng) * 4.0) / 4.0 : static_cast<float>(normal(rng));
    }
    // The counted tokens: the ten most likely (counted 1 … 10 times) and every 7th id
    // after them, distinct.
    std::vector<int32_t> order(row.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
    const size_t likely = std::min<size_t>(10, order.size());
    std::partial_sort(
        order.begin(), order.begin() + static_cast<ptrdiff_t>(likely), order.end(),
        [&](int32_t a, int32_t b) { return row[a] != row[b] ? row[a] > row[b] : a < b; });
    std::vector<std::pair<int32_t, int32_t>> counts;
    for (size_t i = 0; i < likely; ++i) counts.push_back({order[i], static_cast<int32_t>(i + 1)});
    for (size_t i = likely; i < order.size(); i += 7) counts.push_back({order[i], 2});
    // One row per (variant, u01): the same logits each time.
    {
      std::vector<double> logits;
      std::vector<kernels::TokenDraw> draws;
      for (size_t v = 0; v < variants.size(); ++v) {
        for (double u : u01s) {
          logits.insert(logits.end(), row.begin(), row.end());
          draws.push_back(variants[v]);
          draws.back().u01 = u;
          if (v >= first_penalized) draws.back().token_counts = counts;
        }
      }
      const int rows = static_cast<int>(draws.size());
      auto d = parity::ToDevice(logits);
      ASSERT_TRUE(d.ok()) << d.status();
      std::vector<int32_t> token(rows, -1), want_token(rows, -2);
      std::vector<float> logprob(rows), want_logprob(rows);
      const size_t tops = static_cast<size_t>(rows) * kernels::kMaxTopLogprobs;
      std::vector<int32_t> top(tops, -1), want_top(tops, -2);
      std::vector<float> top_lp(tops), want_top_lp(tops);
      ASSERT_TRUE(backend_
                      ->DrawTokens(d->as<float>(), rows, kind.vocab, draws.data(), token.data(),
                                   logprob.data(), top.data(), top_lp.data())
                      .ok());
      const std::vector<float> host(logits.begin(), logits.end());
      kernels::DrawRows(host.data(), rows, kind.vocab, draws.data(), want_token.data(),
                        want_logprob.data(), want_top.data(), want_top_lp.data());
      for (int r = 0; r < rows; ++r) {
        const kernels::TokenDraw& v = draws[static_cast<size_t>(r)];
        EXPECT_EQ(token[r], want_token[r])
            << "T " << v.temperature << ", top_k " << v.top_k << ", top_p " << v.top_p << ", min_p "
            << v.min_p << ", u01 " << v.u01;
        EXPECT_NEAR(logprob[r], want_logprob[r], 1e-5 * (1 + std::abs(want_logprob[r]))) << r;
        for (int i = 0; i < std::min(v.top_logprobs, kind.vocab); ++i) {
          const size_t at = static_cast<size_t>(r) * kernels::kMaxTopLogprobs + i;
          EXPECT_EQ(top[at], want_top[at]) << "row " << r << ", top " << i;
          EXPECT_NEAR(top_lp[at], want_top_lp[at], 1e-5 * (1 + std::abs(want_top_lp[at])));
        }
      }
      // The greedy draw with a repetition penalty of 10 leaves the argmax (every one of
      // the most likely tokens is counted) on rows long enough for a better one.
      const int32_t penalized_pick = want_token[first_penalized * std::size(u01s)];
      if (kind.vocab >= 1000) {
        EXPECT_NE(penalized_pick, order[0]);
      }
      // The forced rows report their tokens.
      EXPECT_EQ(token[static_cast<size_t>(rows) - 1], 0);
      EXPECT_EQ(token[static_cast<size_t>(rows) - 1 - std::size(u01s)], 7);
    }
  }
  // Rows without mass: −inf only (the last kept candidate: the last id, or the top_k-th),
  // and NaN with −inf (greedy takes the first −inf, as ArgMax does).
  std::vector<double> degenerate(2 * 5, -inf);
  degenerate[5] = std::nan("");
  auto d = parity::ToDevice(degenerate);
  ASSERT_TRUE(d.ok()) << d.status();
  const kernels::TokenDraw draws[2] = {with(1.0, 3, 1.0, 0.0), with(0.0, 0, 1.0, 0.0)};
  int32_t token[2] = {-1, -1};
  float logprob[2];
  ASSERT_TRUE(
      backend_->DrawTokens(d->as<float>(), 2, 5, draws, token, logprob, nullptr, nullptr).ok());
  // Top log-probabilities asked for without arrays to hold them: refused, naming the field.
  kernels::TokenDraw asks_top;
  asks_top.top_logprobs = 3;
  const absl::Status refused =
      backend_->DrawTokens(d->as<float>(), 1, 5, &asks_top, token, logprob, nullptr, nullptr);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.message().find("top_logprobs"), std::string::npos) << refused;
  // A penalty counting a token past the vocabulary: refused, naming the field and the id.
  kernels::TokenDraw past;
  past.presence_penalty = 0.5;
  const std::pair<int32_t, int32_t> counted[] = {{1, 1}, {5, 2}};
  past.token_counts = counted;
  const absl::Status outside =
      backend_->DrawTokens(d->as<float>(), 1, 5, &past, token, logprob, nullptr, nullptr);
  EXPECT_EQ(outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(outside.message().find("token_counts has token 5"), std::string::npos) << outside;
  // A forced token past the vocabulary: refused, naming the field.
  kernels::TokenDraw forced_past;
  forced_past.forced_token = 5;
  const absl::Status forced_outside =
      backend_->DrawTokens(d->as<float>(), 1, 5, &forced_past, token, logprob, nullptr, nullptr);
  EXPECT_EQ(forced_outside.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(forced_outside.message().find("draws[0].forced_token = 5"), std::string::npos)
      << forced_outside;
  EXPECT_EQ(token[0], 2);
  EXPECT_EQ(token[1], 1);
}

#ifdef KVLENS_CUDA_EMULATOR
// Past kDrawCachedVocab a row with a bias or penalties draws from an adjusted copy in
// device scratch, which holds those rows only: one biased draw among 64 rows of a
// 50000-token vocabulary (plain and forced draws, a forced one with a bias that does not
// apply) grows the device's memory by that one row, 50000 × 4 bytes (with the scratch's
// growth headroom of 1.5× at most), not by 64 rows' 12.8 MB. On the emulator, whose
// memory accounting is exact (a GPU's also counts other processes).
TEST_F(CudaBackendTest, AdjustedRowsScratchHoldsOnlyTheAdjustedRows) {
  constexpr int kRows = 64, kVocab = 50000;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> normal(0.0, 2.0);
  std::vector<double> logits(static_cast<size_t>(kRows) * kVocab);
  for (double& l : logits) l = static_cast<float>(normal(rng));
  auto d = parity::ToDevice(logits);
  ASSERT_TRUE(d.ok()) << d.status();
  std::vector<kernels::TokenDraw> draws(kRows);
  for (int r = 0; r < kRows; ++r) {
    draws[r].temperature = 0.8;
    draws[r].u01 = (r + 0.5) / kRows;
    if (r % 2 == 0) draws[r].forced_token = r;
  }
  std::vector<int32_t> token(kRows), want_token(kRows);
  std::vector<float> logprob(kRows), want_logprob(kRows);
  auto in_use = [&] {
    absl::StatusOr<Memory::Usage> u = backend_->memory().usage();
    EXPECT_TRUE(u.ok()) << u.status();
    return u.ok() ? static_cast<int64_t>(u->total - u->free) : 0;
  };
  // The draws without a bias first: the picks' scratch is sized, nothing is adjusted.
  ASSERT_TRUE(backend_
                  ->DrawTokens(d->as<float>(), kRows, kVocab, draws.data(), token.data(),
                               logprob.data(), nullptr, nullptr)
                  .ok());
  const int64_t before = in_use();
  const std::vector<std::pair<int32_t, float>> bias = {{7, 4.0f}};
  draws[37].logit_bias = bias;
  draws[10].logit_bias = bias;  // forced: no bias applies
  ASSERT_TRUE(backend_
                  ->DrawTokens(d->as<float>(), kRows, kVocab, draws.data(), token.data(),
                               logprob.data(), nullptr, nullptr)
                  .ok());
  const int64_t grown = in_use() - before;
  const int64_t row_bytes = int64_t{kVocab} * 4;
  EXPECT_GE(grown, row_bytes);
  EXPECT_LE(grown, row_bytes * 3 / 2 + 256);
  const std::vector<float> host(logits.begin(), logits.end());
  kernels::DrawRows(host.data(), kRows, kVocab, draws.data(), want_token.data(),
                    want_logprob.data(), nullptr, nullptr);
  EXPECT_EQ(token, want_token);
}
#endif  // KVLENS_CUDA_EMULATOR

}  // namespace
}  // namespace kvlens::kernels::cuda

#else  // !KVLENS_HAVE_CUDA

TEST(CudaBackendDrawTokensTest, SkippedInThisBuild) {
  GTEST_SKIP() << "built without the CUDA backend (KVLENS_CUDA=OFF or no nvcc)";
}

#endif  // KVLENS_HAVE_CUDA

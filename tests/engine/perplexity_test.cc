// EvaluatePerplexity against the PyTorch float64 oracle: each window's logits come from the
// oracle's own forward pass over the window, and the negative log-likelihoods are computed
// here from them (log-sum-exp in double).
#include "engine/perplexity.h"

#include <cmath>
#include <string>
#include <vector>

#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/kernels/fake_device_backend.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

std::string StoriesGguf() { return testing::TestData("stories260K/stories260K.gguf"); }

// The text both oracle tests score (stories260K's own style; 40-odd tokens).
constexpr char kStory[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park with her friends. One day, it was raining and she could not go out.";

// Σ over the window's positions first … (all but its last token) of −log softmax(oracle
// logits)[next token].
double OracleWindowNll(const std::string& model, const std::vector<int32_t>& window, int vocab,
                       size_t first = 0) {
  const std::vector<int32_t> inputs(window.begin(), window.end() - 1);
  const testing::OracleResult r = testing::RunOracle(model, inputs, /*attention=*/false);
  EXPECT_TRUE(r.error.empty()) << r.error;
  if (!r.error.empty()) return NAN;
  const std::vector<double>& logits = r.arrays.at("logits").data;
  double sum = 0.0;
  for (size_t t = first; t < inputs.size(); ++t) {
    const double* row = logits.data() + t * vocab;
    double max = row[0];
    for (int v = 1; v < vocab; ++v) max = std::max(max, row[v]);
    double z = 0.0;
    for (int v = 0; v < vocab; ++v) z += std::exp(row[v] - max);
    sum += std::log(z) + max - row[window[t + 1]];
  }
  return sum;
}

TEST(PerplexityTest, MatchesTheOracleWindowByWindow) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> tokens = (*model)->tokenizer->Encode(kStory, true);
  constexpr int kCtx = 12;
  const int vocab = (*model)->config.vocab_size;
  ASSERT_GE(tokens.size(), 3u * kCtx + 1);
  std::vector<double> want;
  for (int w = 0; w < 3; ++w) {
    want.push_back(OracleWindowNll(
        StoriesGguf(),
        std::vector<int32_t>(tokens.begin() + w * kCtx, tokens.begin() + (w + 1) * kCtx + 1),
        vocab));
  }
  PerplexityOptions options;
  options.context = kCtx;
  options.max_windows = 3;
  options.chunk = 5;  // a window in three forward steps
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  auto exact = EvaluatePerplexity<double>(**model, ref, tokens, options);
  auto fp32 = EvaluatePerplexity<float>(**model, fast, tokens, options);
  ASSERT_TRUE(exact.ok()) << exact.status();
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  double want_sum = 0.0;
  for (int w = 0; w < 3; ++w) {
    want_sum += want[w];
    EXPECT_NEAR(exact->window_nll[w], want[w] / kCtx, 1e-9 * want[w] / kCtx) << "window " << w;
    EXPECT_NEAR(fp32->window_nll[w], want[w] / kCtx, 1e-5 * want[w] / kCtx) << "window " << w;
  }
  EXPECT_EQ(exact->windows, 3);
  EXPECT_EQ(exact->tokens, 3 * kCtx);
  EXPECT_NEAR(exact->perplexity(), std::exp(want_sum / (3 * kCtx)), 1e-9 * exact->perplexity());
}

// llama.cpp's llama-perplexity (tools/perplexity): disjoint windows of C tokens, each one's
// first token replaced by BOS, and of each window's logits only rows C/2 … C − 2 scored
// (predicting tokens C/2 + 1 … C − 1).
TEST(PerplexityTest, SecondHalfScoringIsLlamaPerplexitys) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  ASSERT_TRUE(testing::OracleAvailable()) << "PyTorch missing: run scripts/install-deps.sh";
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<int32_t> tokens = (*model)->tokenizer->Encode(kStory, true);
  constexpr int kCtx = 13;  // rows 6 … 11 scored: 6 tokens a window
  const int vocab = (*model)->config.vocab_size;
  const int32_t bos = (*model)->tokenizer->bos_id();
  ASSERT_GE(bos, 0);
  ASSERT_GE(tokens.size(), 3u * kCtx);
  double want_sum = 0.0;
  std::vector<double> want;
  for (int w = 0; w < 3; ++w) {
    std::vector<int32_t> window(tokens.begin() + w * kCtx, tokens.begin() + (w + 1) * kCtx);
    window[0] = bos;
    want.push_back(OracleWindowNll(StoriesGguf(), window, vocab, kCtx / 2));
    want_sum += want.back();
  }
  PerplexityOptions options;
  options.context = kCtx;
  options.max_windows = 3;
  options.chunk = 4;  // the first scored row in the middle of a step
  options.scoring = PerplexityScoring::kSecondHalf;
  options.bos_token = bos;
  kernels::ReferenceBackend ref;
  kernels::CpuBackend fast(2);
  auto exact = EvaluatePerplexity<double>(**model, ref, tokens, options);
  auto fp32 = EvaluatePerplexity<float>(**model, fast, tokens, options);
  ASSERT_TRUE(exact.ok()) << exact.status();
  ASSERT_TRUE(fp32.ok()) << fp32.status();
  for (int w = 0; w < 3; ++w) {
    EXPECT_NEAR(exact->window_nll[w], want[w] / 6, 1e-9 * want[w] / 6) << "window " << w;
    EXPECT_NEAR(fp32->window_nll[w], want[w] / 6, 1e-5 * want[w] / 6) << "window " << w;
  }
  EXPECT_EQ(exact->tokens, 3 * 6);
  EXPECT_NEAR(exact->mean_nll(), want_sum / 18, 1e-9 * want_sum / 18);
  // Without max_windows: every whole window of C (the text's last partial one dropped).
  options.max_windows = 0;
  auto all = EvaluatePerplexity<double>(**model, ref, tokens, options);
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->windows, static_cast<int>(tokens.size()) / kCtx);
}

TEST(PerplexityTest, ChunksAndWindowsDoNotChangeAWindowsResult) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 101; ++i) tokens.push_back((i * 37 + 11) % (*model)->config.vocab_size);
  kernels::ReferenceBackend ref;
  PerplexityOptions whole;
  whole.context = 25;
  PerplexityOptions chunked = whole;
  chunked.chunk = 4;
  auto a = EvaluatePerplexity<double>(**model, ref, tokens, whole);
  auto b = EvaluatePerplexity<double>(**model, ref, tokens, chunked);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->windows, 4);  // (101 − 1) / 25
  ASSERT_EQ(b->windows, 4);
  for (int w = 0; w < 4; ++w) EXPECT_NEAR(a->window_nll[w], b->window_nll[w], 1e-12);
  // A window alone (tokens 50 … 75) gives its third window's value.
  const std::vector<int32_t> third(tokens.begin() + 50, tokens.begin() + 76);
  auto c = EvaluatePerplexity<double>(**model, ref, third, whole);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_NEAR(c->window_nll[0], a->window_nll[2], 1e-12);
}

// On a device backend (memory the host cannot read) each row's log-probability of the next
// token is read where the logits are (Backend::DrawTokens, a forced token a row) instead
// of copying the rows out: the fp64 reference's window values within 1e-5 relative (the
// fp32 forward), chunks of 7 in windows of 25, second-half scoring; one forced row per
// row computed.
TEST(PerplexityTest, OnADeviceTheRowsAreScoredWhereTheLogitsAre) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  std::vector<int32_t> tokens;
  for (int i = 0; i < 101; ++i) tokens.push_back((i * 37 + 11) % (*model)->config.vocab_size);
  PerplexityOptions o;
  o.context = 25;
  o.chunk = 7;
  o.scoring = PerplexityScoring::kSecondHalf;
  kernels::ReferenceBackend ref;
  testing::FakeDeviceBackend device(1);
  auto want = EvaluatePerplexity<double>(**model, ref, tokens, o);
  auto got = EvaluatePerplexity<float>(**model, device, tokens, o);
  ASSERT_TRUE(want.ok()) << want.status();
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->windows, want->windows);
  ASSERT_GT(got->windows, 2);
  for (int w = 0; w < got->windows; ++w) {
    EXPECT_NEAR(got->window_nll[w], want->window_nll[w], 1e-5 * want->window_nll[w]) << w;
  }
  EXPECT_EQ(device.forced_rows.load(), got->windows * 24);  // every input row of a window
}

TEST(PerplexityTest, BadArgumentsNameTheField) {
  KVLENS_REQUIRE_FILE(StoriesGguf());
  auto model = LoadModel({StoriesGguf(), ""});
  ASSERT_TRUE(model.ok()) << model.status();
  const int max_len = (*model)->config.max_seq_len;
  kernels::ReferenceBackend ref;
  const std::vector<int32_t> tokens(40, 5);
  struct Case {
    PerplexityOptions options;
    std::vector<int32_t> tokens;
    std::string message;
  };
  std::vector<Case> cases;
  cases.push_back({PerplexityOptions{0}, tokens, "context = 0 must be in [1, "});
  cases.push_back({PerplexityOptions{max_len + 1}, tokens, "(the model's context length)"});
  cases.push_back({PerplexityOptions{39, 0, 0}, tokens, "chunk = 0 must be > 0"});
  cases.push_back({PerplexityOptions{40}, tokens,
                   "the text has 40 tokens; a context of 40 needs "
                   "at least 41"});
  PerplexityOptions halves{2};
  halves.scoring = PerplexityScoring::kSecondHalf;
  cases.push_back({halves, tokens, "context = 2 must be at least 3"});
  halves.context = 41;
  cases.push_back({halves, tokens, "the text has 40 tokens; a context of 41 needs at least 41"});
  halves.context = 8;
  halves.bos_token = 100000;
  cases.push_back({halves, tokens, "bos_token = 100000 is outside the vocabulary"});
  std::vector<int32_t> bad = tokens;
  bad[7] = -3;
  cases.push_back({PerplexityOptions{8}, bad, "token 7 = -3 is outside the vocabulary"});
  for (const Case& c : cases) {
    auto r = EvaluatePerplexity<double>(**model, ref, c.tokens, c.options);
    ASSERT_FALSE(r.ok()) << c.message;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(c.message), std::string::npos) << r.status();
  }
}

}  // namespace
}  // namespace kvlens

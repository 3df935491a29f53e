// Generate's prompt_logprobs end to end against the PyTorch float64 oracle: on the default
// model (GPT-2) and stories260K (Llama), each prompt token's log-probability given the
// tokens before it is the oracle's log-softmax of its logits at the position before, and
// the top 3 its most likely tokens; they arrive in order, split over messages of at most
// kPromptLogprobsPerMessage, before the first token. Malformed values are refused naming
// the field. kvlens-cli generate --prompt-logprobs prints them.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "server/generate_stream.h"
#include "tests/oracle/oracle_runner.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

class PromptLogprobsRpc : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!OracleAvailable()) GTEST_SKIP() << "python3 with torch not available";
  }
};

TEST_F(PromptLogprobsRpc, EveryPromptTokenIsTheOraclesInOrderOverMessages) {
  struct Case {
    std::string model, text;
  };
  std::vector<Case> cases;
  if (Exists(DefaultModelPath() + "/config.json")) {
    cases.push_back({DefaultModelPath(),
                     "In the beginning God created the heaven and the earth. And the earth was "
                     "without form, and void; and darkness was upon the face of the deep."});
  }
  if (Exists(Stories260KPath())) cases.push_back({Stories260KPath(), kReferenceText});
  if (cases.empty()) GTEST_SKIP() << "no test model";
  constexpr int kTop = 3;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.model);
    TestServer server(c.model, TestServer::DefaultOptions());
    ASSERT_TRUE(server.ok()) << server.error();
    // Past one message's worth of positions where the context allows (the default model's
    // 256; stories260K.gguf has 128).
    const size_t length = std::min<size_t>(server::kPromptLogprobsPerMessage + 40,
                                           server.model().config.max_seq_len - 8);
    std::vector<int32_t> prompt;
    while (prompt.size() < length) {
      const std::vector<int32_t> more = server.model().tokenizer->Encode(c.text, prompt.empty());
      prompt.insert(prompt.end(), more.begin(), more.end());
    }
    prompt.resize(length);
    v1::GenerateRequest r;
    for (int32_t t : prompt) r.mutable_token_ids()->add_ids(t);
    r.mutable_stopping()->set_max_new_tokens(3);
    r.set_prompt_logprobs(kTop);
    const StreamResult got = RunGenerate(server.stub(), r);
    ASSERT_TRUE(got.status.ok()) << got.status.error_message();
    EXPECT_EQ(got.tokens.size(), 3u);
    EXPECT_FALSE(got.prompt_logprobs_after_tokens);
    ASSERT_EQ(got.prompt_logprobs.size(), prompt.size() - 1);
    // Messages continue one another from position 1, none over the limit.
    if (length > server::kPromptLogprobsPerMessage + 1) {
      ASSERT_GE(got.prompt_logprobs_messages.size(), 2u);
    }
    int next = 1;
    for (const auto& [position, count] : got.prompt_logprobs_messages) {
      EXPECT_EQ(position, next);
      EXPECT_LE(count, static_cast<int>(server::kPromptLogprobsPerMessage));
      next += count;
    }
    const OracleResult o = RunOracleWith(c.model, prompt, "");
    ASSERT_TRUE(o.error.empty()) << o.error;
    const OracleArray& logits = o.arrays.at("logits");
    const int64_t V = logits.dims[1];
    for (size_t p = 1; p < prompt.size(); ++p) {
      SCOPED_TRACE(::testing::Message() << "position " << p);
      const v1::TokenLogprob& lp = got.prompt_logprobs[p - 1];
      EXPECT_EQ(lp.token(), prompt[p]);
      const double* row = logits.data.data() + (p - 1) * V;
      const double m = *std::max_element(row, row + V);
      double z = 0;
      for (int64_t t = 0; t < V; ++t) z += std::exp(row[t] - m);
      const double lse = m + std::log(z);
      EXPECT_NEAR(lp.logprob(), row[prompt[p]] - lse, 2e-4);
      std::vector<int32_t> order(V);
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + kTop + 1, order.end(),
                        [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      ASSERT_EQ(lp.top_size(), kTop);
      for (int k = 0; k < kTop; ++k) {
        EXPECT_NEAR(lp.top(k).logprob(), row[order[k]] - lse, 2e-4) << k;
        const bool tie = (k > 0 && row[order[k - 1]] - row[order[k]] < 1e-4) ||
                         row[order[k]] - row[order[k + 1]] < 1e-4;
        if (!tie) {
          EXPECT_EQ(lp.top(k).token(), order[k]) << k;
        }
      }
    }
  }
}

TEST(PromptLogprobsRpcErrors, RefusedNamingTheFieldAndAbsentByDefault) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  for (int bad : {-1, 21}) {
    v1::GenerateRequest r = GreedyRequest(kReferenceText, 2);
    r.set_prompt_logprobs(bad);
    const StreamResult got = RunGenerate(server.stub(), r);
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_NE(got.status.error_message().find("prompt_logprobs"), std::string::npos)
        << got.status.error_message();
  }
  v1::GenerateRequest on_session = GreedyRequest(kReferenceText, 2);
  on_session.set_prompt_logprobs(0);
  on_session.set_session_id(1);
  const StreamResult refused = RunGenerate(server.stub(), on_session);
  EXPECT_EQ(refused.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.status.error_message().find("prompt_logprobs: not with session_id"),
            std::string::npos)
      << refused.status.error_message();
  const StreamResult plain = RunGenerate(server.stub(), GreedyRequest(kReferenceText, 2));
  ASSERT_TRUE(plain.status.ok());
  EXPECT_TRUE(plain.prompt_logprobs.empty());
  // 0: the log-probabilities alone.
  v1::GenerateRequest zero = GreedyRequest(kReferenceText, 2);
  zero.set_prompt_logprobs(0);
  const StreamResult z = RunGenerate(server.stub(), zero);
  ASSERT_TRUE(z.status.ok());
  ASSERT_FALSE(z.prompt_logprobs.empty());
  for (const v1::TokenLogprob& lp : z.prompt_logprobs) EXPECT_EQ(lp.top_size(), 0);
  EXPECT_EQ(z.tokens, plain.tokens);
}

// kvlens-cli generate --prompt-logprobs prints the RPC's entries (stderr), one line a
// position, then their sum and perplexity, through the server and on the local model
// (the offline generator's scoring, chunks of 3 tokens).
TEST(PromptLogprobsCli, PrintsTheRpcsEntriesAndTheirSum) {
  TestServer server;
  ASSERT_TRUE(server.ok()) << server.error();
  v1::GenerateRequest r = GreedyRequest("Once upon a time", 2);
  r.set_prompt_logprobs(2);
  const StreamResult want = RunGenerate(server.stub(), r);
  ASSERT_TRUE(want.status.ok()) << want.status.error_message();
  ASSERT_GE(want.prompt_logprobs.size(), 3u);
  const std::string flags =
      " --prompt 'Once upon a time' --max-new-tokens 2 --prompt-logprobs 2 2>&1 >/dev/null";
  for (const std::string& where :
       {absl::StrCat("--server ", server.address()),
        absl::StrCat("--model ", Stories260KPath(), " --prefill-chunk 3")}) {
    SCOPED_TRACE(where);
    const auto [code, printed] =
        RunCommand(absl::StrCat("timeout 60 ", KVLENS_CLI_PATH, " generate ", where, flags));
    ASSERT_EQ(code, 0) << printed;
    const std::vector<std::string> lines = absl::StrSplit(printed, '\n', absl::SkipEmpty());
    ASSERT_EQ(lines.size(), want.prompt_logprobs.size() + 2) << printed;
    double sum = 0;
    for (size_t i = 0; i < want.prompt_logprobs.size(); ++i) {
      const v1::TokenLogprob& lp = want.prompt_logprobs[i];
      const std::vector<std::string> f = absl::StrSplit(lines[i + 1], '\t');
      ASSERT_EQ(f.size(), 5u) << lines[i + 1];
      EXPECT_EQ(f[0], std::to_string(i + 1));
      EXPECT_EQ(f[1], std::to_string(lp.token()));
      EXPECT_NEAR(std::stod(f[3]), lp.logprob(), 2e-6) << lines[i + 1];
      // The top entries: two spellings and log-probabilities, the first the RPC's.
      const std::vector<std::string> top = absl::StrSplit(f[4], "  ");
      ASSERT_EQ(top.size(), 2u) << f[4];
      EXPECT_NEAR(std::stod(top[0].substr(top[0].rfind(' ') + 1)), lp.top(0).logprob(), 2e-6);
      sum += lp.logprob();
    }
    // "prompt: N tokens scored, sum S, perplexity P"
    double got_sum = 0, got_ppl = 0;
    int count = 0;
    ASSERT_EQ(std::sscanf(lines.back().c_str(), "prompt: %d tokens scored, sum %lf, perplexity %lf",
                          &count, &got_sum, &got_ppl),
              3)
        << lines.back();
    EXPECT_EQ(count, static_cast<int>(want.prompt_logprobs.size()));
    EXPECT_NEAR(got_sum, sum, 1e-5);
    EXPECT_NEAR(got_ppl, std::exp(-sum / count), 1e-4 * got_ppl);
  }
}

}  // namespace
}  // namespace kvlens::testing

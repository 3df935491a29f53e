// StopParams::min_new_tokens on stories260K: until that many tokens were generated the
// tokens that would end the output (EOS unless ignore_eos, and stop_token_ids) are never
// drawn; the other tokens, and every reported log-probability, are what they are without
// it. A logit bias of +100 on EOS makes EOS the certain next token, so where it comes is
// known in advance.
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/engine.h"
#include "engine/generator.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/engine/run_request.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

using testing::RunOne;
using testing::Start;
using Result = testing::Streamed;

class MinNewTokensTest : public testing::StoriesModelTest {
 protected:
  GenerationRequest Request(int min_new, bool eos_certain) const {
    GenerationRequest r;
    r.prompt = model_->tokenizer->Encode("Once upon a time", true);
    r.stop.max_new_tokens = 12;
    r.stop.min_new_tokens = min_new;
    r.top_logprobs = 2;
    if (eos_certain) r.sampling.logit_bias = {{model_->tokenizer->eos_id(), 100.0f}};
    return r;
  }
  kernels::CpuBackend backend_{2};
};

TEST_F(MinNewTokensTest, EosWaitsForTheMinimumAndTheTokensBeforeItAreUnbiased) {
  Engine engine(*model_, backend_, EngineOptions{});
  const int32_t eos = model_->tokenizer->eos_id();
  ASSERT_GE(eos, 0);
  GenerationRequest free_run = Request(0, false);
  free_run.stop.ignore_eos = true;
  const Result plain = RunOne(engine, std::move(free_run));
  ASSERT_EQ(plain.tokens.size(), 12u);
  for (int i = 0; i < 5; ++i) ASSERT_NE(plain.tokens[i], eos);
  const Result at_once = RunOne(engine, Request(0, true));
  EXPECT_EQ(at_once.tokens, std::vector<int32_t>{eos});
  EXPECT_EQ(at_once.finish.reason, FinishReason::kEos);
  for (bool greedy : {true, false}) {
    SCOPED_TRACE(greedy ? "greedy" : "temperature 1");
    GenerationRequest r = Request(5, true);
    if (!greedy) {
      r.sampling.temperature = 1.0;
      r.sampling.seed = 11;
    }
    const Result late = RunOne(engine, std::move(r));
    ASSERT_EQ(late.tokens.size(), 6u);
    EXPECT_EQ(late.tokens.back(), eos);
    EXPECT_EQ(late.finish.reason, FinishReason::kEos);
    for (int i = 0; i < 5; ++i) {
      EXPECT_NE(late.tokens[i], eos) << i;
      if (greedy) {
        EXPECT_EQ(late.tokens[i], plain.tokens[i]) << i;
        EXPECT_EQ(late.logprobs[i], plain.logprobs[i]) << i;  // the model's, no bias
      }
    }
  }
}

// The first token is the plain run's; banned as a stop token for one token it gives way
// to the plain run's second most likely, reported with that token's log-probability.
TEST_F(MinNewTokensTest, AStopTokenGivesWayToTheNextMostLikely) {
  Engine engine(*model_, backend_, EngineOptions{});
  const Result plain = RunOne(engine, Request(0, false));
  ASSERT_FALSE(plain.top.empty());
  ASSERT_EQ(plain.top[0].size(), 2u);
  ASSERT_GT(plain.top[0][0].logprob - plain.top[0][1].logprob, 1e-4);  // no tie
  GenerationRequest r = Request(1, false);
  r.stop.stop_token_ids = {plain.tokens[0]};
  const Result banned = RunOne(engine, std::move(r));
  ASSERT_FALSE(banned.tokens.empty());
  EXPECT_EQ(banned.tokens[0], plain.top[0][1].token);
  EXPECT_EQ(banned.logprobs[0], plain.top[0][1].logprob);
  // The top log-probabilities stay the model's: the banned token is still listed first.
  EXPECT_EQ(banned.top[0][0].token, plain.tokens[0]);
}

// With ignore_eos, EOS ends nothing, so it is not held back (vLLM's rule).
TEST_F(MinNewTokensTest, IgnoreEosLeavesEosDrawable) {
  Engine engine(*model_, backend_, EngineOptions{});
  GenerationRequest r = Request(5, true);
  r.stop.ignore_eos = true;
  const Result got = RunOne(engine, std::move(r));
  ASSERT_EQ(got.tokens.size(), 12u);
  EXPECT_EQ(got.tokens[0], model_->tokenizer->eos_id());
}

TEST_F(MinNewTokensTest, RefusedBelowZeroOrAboveTheMaximum) {
  Engine engine(*model_, backend_, EngineOptions{});
  for (int bad : {-1, 13}) {
    const absl::Status s = engine.Submit(Request(bad, false)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("min_new_tokens = " + std::to_string(bad)), std::string::npos) << s;
  }
  // max_new_tokens 0: the room the context leaves, which the minimum may not pass.
  const int room = model_->config.max_seq_len - static_cast<int>(Request(0, false).prompt.size());
  GenerationRequest to_context = Request(room + 1, false);
  to_context.stop.max_new_tokens = 0;
  const absl::Status s = engine.Submit(std::move(to_context)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(absl::StrCat("max_new_tokens = ", room, "]")), std::string::npos) << s;
}

// The offline generator (kvlens-cli generate --model … --min-new-tokens) holds EOS back the
// same way, on a host backend and on a device's draws: with EOS certain, a minimum of 5
// gives the engine's five unbiased greedy tokens, then EOS; without it, EOS at once; a
// stop token banned for one token gives way to the next most likely; bounds named.
TEST_F(MinNewTokensTest, TheOfflineGeneratorHoldsEosBackAsTheEngine) {
  Engine engine(*model_, backend_, EngineOptions{});
  const int32_t eos = model_->tokenizer->eos_id();
  GenerationRequest free_run = Request(0, false);
  free_run.stop.ignore_eos = true;
  const Result plain = RunOne(engine, std::move(free_run));
  ASSERT_EQ(plain.tokens.size(), 12u);
  const std::vector<int32_t> prompt = Request(0, false).prompt;
  GenerateOptions o;
  o.max_new_tokens = 12;
  o.sampling.logit_bias = {{eos, 100.0f}};
  ::kvlens::testing::FakeDeviceBackend device(1);
  for (kernels::Backend<float>* backend : {static_cast<kernels::Backend<float>*>(&backend_),
                                           static_cast<kernels::Backend<float>*>(&device)}) {
    SCOPED_TRACE(std::string(backend->name()));
    o.min_new_tokens = 0;
    auto at_once = Generate<float>(*model_, *backend, prompt, o);
    ASSERT_TRUE(at_once.ok()) << at_once.status();
    EXPECT_EQ(at_once->tokens, std::vector<int32_t>{eos});
    o.min_new_tokens = 5;
    auto late = Generate<float>(*model_, *backend, prompt, o);
    ASSERT_TRUE(late.ok()) << late.status();
    std::vector<int32_t> want(plain.tokens.begin(), plain.tokens.begin() + 5);
    want.push_back(eos);
    EXPECT_EQ(late->tokens, want);
    EXPECT_EQ(late->finish_reason, FinishReason::kEos);
  }
  EXPECT_GT(device.biased_rows.load(), 0);  // the device drew with the ban
  GenerateOptions stop;
  stop.max_new_tokens = 3;
  stop.min_new_tokens = 1;
  stop.stop_token_ids = {plain.tokens[0]};
  GenerationRequest ranked = Request(0, false);
  const Result top = RunOne(engine, std::move(ranked));
  auto banned = Generate<float>(*model_, backend_, prompt, stop);
  ASSERT_TRUE(banned.ok()) << banned.status();
  ASSERT_FALSE(banned->tokens.empty());
  EXPECT_EQ(banned->tokens[0], top.top[0][1].token);
  for (int bad : {-1, 13}) {
    o.min_new_tokens = bad;
    const absl::Status s = Generate<float>(*model_, backend_, prompt, o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("min_new_tokens = " + std::to_string(bad)), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace kvlens

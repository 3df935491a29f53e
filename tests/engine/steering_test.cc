// Activation steering in the serving engine (GenerationRequest::steering, ResidualAdd) on
// stories260K: a vector added entering block 0 that turns one token's embedding into
// another's gives that other token's prediction; a steered request neither reuses nor
// fills the prefix cache, and batched with others changes none of their results; bad
// vectors are refused naming the field. The numbers at every hook against PyTorch are
// tests/server/steering_test.cc's (through the RPC).
#include <cmath>
#include <future>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/weight.h"
#include "tests/engine/run_request.h"
#include "tests/engine/stories_model_test.h"

namespace kvlens {
namespace {

using testing::RunOne;
using testing::Start;
using Result = testing::Streamed;

class SteeringTest : public testing::StoriesModelTest {
 protected:
  GenerationRequest Greedy(std::vector<int32_t> prompt, int max_new) const {
    GenerationRequest r;
    r.prompt = std::move(prompt);
    r.stop.max_new_tokens = max_new;
    r.stop.ignore_eos = true;
    r.top_logprobs = 5;
    return r;
  }
  std::vector<float> Embedding(int32_t token) const {
    std::vector<float> row(static_cast<size_t>(model_->config.dim));
    kernels::DequantizeRow(model_->weights.token_embedding, token, row.data());
    return row;
  }
  // A random vector of norm `norm` (fixed seed) entering block `layer`.
  ResidualAdd RandomAdd(int layer, bool mid, double norm, uint64_t seed) const {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> normal;
    std::vector<double> v(static_cast<size_t>(model_->config.dim));
    double sq = 0;
    for (double& x : v) {
      x = normal(rng);
      sq += x * x;
    }
    ResidualAdd add{layer, mid, {}};
    for (double x : v) add.delta.push_back(static_cast<float>(x * norm / std::sqrt(sq)));
    return add;
  }
  std::vector<int32_t> Prompt() const {
    return model_->tokenizer->Encode("Once upon a time, there was a little girl named Lily.", true);
  }
  kernels::CpuBackend backend_{2};
};

// Prompt [a] (one token, no BOS) with E[b] − E[a] added entering block 0: the only row
// the forward computes is E[b], so the prediction is prompt [b]'s (to float rounding of
// E[a] + (E[b] − E[a])). stories260K has no embedding scale.
TEST_F(SteeringTest, AddingAnEmbeddingDifferenceAtBlockZeroSwapsTheToken) {
  ASSERT_EQ(model_->config.embedding_scale, 1.0);
  Engine engine(*model_, backend_, EngineOptions{});
  const std::vector<int32_t> a = {403}, b = {261};  // two tokens of stories260K's 512
  const std::vector<float> ea = Embedding(a[0]), eb = Embedding(b[0]);
  ResidualAdd swap{0, false, {}};
  for (size_t d = 0; d < ea.size(); ++d) swap.delta.push_back(eb[d] - ea[d]);

  const Result plain_a = RunOne(engine, Greedy(a, 1));
  const Result plain_b = RunOne(engine, Greedy(b, 1));
  GenerationRequest steered = Greedy(a, 1);
  steered.steering = {swap};
  const Result steered_a = RunOne(engine, std::move(steered));
  ASSERT_EQ(steered_a.top.size(), 1u);
  ASSERT_EQ(plain_b.top.size(), 1u);
  // The two prompts predict differently, and the steered one predicts as [b].
  EXPECT_NE(plain_a.top[0][0].token, plain_b.top[0][0].token);
  for (size_t k = 0; k < plain_b.top[0].size(); ++k) {
    EXPECT_EQ(steered_a.top[0][k].token, plain_b.top[0][k].token) << k;
    EXPECT_NEAR(steered_a.top[0][k].logprob, plain_b.top[0][k].logprob, 1e-5) << k;
  }
}

// Two adds at one point are their sum; an add of zeros changes nothing; resid_mid and
// the stream entering the final norm (layer L) are steering points of their own.
TEST_F(SteeringTest, AddsAtOnePointSumAndZeroChangesNothing) {
  Engine engine(*model_, backend_, EngineOptions{});
  const int L = model_->config.num_layers;
  const Result plain = RunOne(engine, Greedy(Prompt(), 6));
  for (const auto& [layer, mid] : {std::pair{0, false}, {1, true}, {L, false}}) {
    SCOPED_TRACE(::testing::Message() << "layer " << layer << (mid ? " mid" : ""));
    GenerationRequest zero = Greedy(Prompt(), 6);
    zero.steering = {ResidualAdd{layer, mid, std::vector<float>(model_->config.dim, 0.0f)}};
    const Result z = RunOne(engine, std::move(zero));
    EXPECT_EQ(z.tokens, plain.tokens);
    for (size_t i = 0; i < plain.logprobs.size(); ++i) {
      EXPECT_EQ(z.logprobs[i], plain.logprobs[i]) << i;  // x + 0 is x
    }
    const ResidualAdd v = RandomAdd(layer, mid, 4.0, 7);
    GenerationRequest once = Greedy(Prompt(), 6);
    ResidualAdd twice = v;
    for (float& x : twice.delta) x *= 2.0f;
    once.steering = {twice};
    GenerationRequest halves = Greedy(Prompt(), 6);
    halves.steering = {v, v};
    const Result a = RunOne(engine, std::move(once));
    const Result b = RunOne(engine, std::move(halves));
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_NE(a.tokens, plain.tokens);  // a norm of 8 moves stories260K's stream
    for (size_t i = 0; i < a.logprobs.size() && i < b.logprobs.size(); ++i) {
      EXPECT_NEAR(a.logprobs[i], b.logprobs[i], 1e-5) << i;
    }
  }
}

// A steered request's keys and values are its own: it reuses no cached prefix and leaves
// none behind, so an unsteered request after it still finds the unsteered prefix; and
// batched with unsteered requests, every request gets what it gets alone.
TEST_F(SteeringTest, SteeredRequestsShareNoPrefixAndBatchWithoutChangingOthers) {
  EngineOptions o;
  o.block_size = 4;
  const GenerationRequest plain = Greedy(Prompt(), 8);
  GenerationRequest steered = Greedy(Prompt(), 8);
  steered.steering = {RandomAdd(2, false, 6.0, 3)};

  Engine alone(*model_, backend_, o);
  const Result steered_alone = RunOne(alone, steered);
  EXPECT_EQ(steered_alone.finish.usage.cached_tokens, 0);
  EXPECT_EQ(alone.Stats().blocks_cached, 0);  // it registered no block

  Engine engine(*model_, backend_, o);
  const Result first = RunOne(engine, plain);
  const Result s = RunOne(engine, steered);
  EXPECT_EQ(s.finish.usage.cached_tokens, 0);
  EXPECT_EQ(s.tokens, steered_alone.tokens);
  EXPECT_NE(s.tokens, first.tokens);
  const Result again = RunOne(engine, plain);
  const int n = static_cast<int>(plain.prompt.size());
  EXPECT_EQ(again.finish.usage.cached_tokens, (n - 1) / 4 * 4);
  EXPECT_EQ(again.tokens, first.tokens);

  // Together: two unsteered, two steered (one at resid_mid), submitted at once.
  GenerationRequest mid = Greedy(Prompt(), 8);
  mid.steering = {RandomAdd(1, true, 6.0, 5)};
  const Result mid_alone = RunOne(alone, mid);
  std::vector<GenerationRequest> reqs = {plain, steered, plain, mid};
  std::vector<std::future<Result>> runs;
  for (GenerationRequest& r : reqs) {
    absl::Status st;
    runs.push_back(Start(engine, r, &st));
    ASSERT_TRUE(st.ok()) << st;
  }
  const std::vector<std::vector<int32_t>> want = {first.tokens, steered_alone.tokens, first.tokens,
                                                  mid_alone.tokens};
  for (size_t k = 0; k < runs.size(); ++k) EXPECT_EQ(runs[k].get().tokens, want[k]) << k;
}

// ResidualAdd::from_position: the rows before it are the unsteered model's, so the prefix
// cache serves (and is filled with) the blocks wholly before a request's first steered
// position. Steering from the prompt's length (the generated tokens only) leaves the first
// token's prediction as it was; from past every position, the whole run.
TEST_F(SteeringTest, FromAPositionOnTheRowsBeforeItAndTheirBlocksAreShared) {
  EngineOptions o;
  o.block_size = 4;
  const GenerationRequest plain = Greedy(Prompt(), 8);
  const int n = static_cast<int>(plain.prompt.size());
  auto steered_from = [&](int position) {
    GenerationRequest r = Greedy(Prompt(), 8);
    r.steering = {RandomAdd(0, false, 8.0, 9)};
    r.steering[0].from_position = position;
    return r;
  };
  Engine engine(*model_, backend_, o);
  const Result first = RunOne(engine, plain);
  const Result generated_only = RunOne(engine, steered_from(n));
  EXPECT_EQ(generated_only.finish.usage.cached_tokens, (n - 1) / 4 * 4);
  ASSERT_FALSE(generated_only.top.empty());
  for (size_t k = 0; k < first.top[0].size(); ++k) {  // read from row n − 1: unsteered
    EXPECT_EQ(generated_only.top[0][k].token, first.top[0][k].token) << k;
    EXPECT_NEAR(generated_only.top[0][k].logprob, first.top[0][k].logprob, 1e-5) << k;
  }
  EXPECT_NE(generated_only.tokens, first.tokens);
  const Result from_zero = RunOne(engine, steered_from(0));
  EXPECT_EQ(from_zero.finish.usage.cached_tokens, 0);
  const Result past_all = RunOne(engine, steered_from(1000));
  EXPECT_EQ(past_all.tokens, first.tokens);

  // On a fresh engine a request steered from position 6 registers block 0 (positions 0–3)
  // and no later one: a plain request then finds 4 cached tokens, and its own tokens.
  Engine fresh(*model_, backend_, o);
  const Result from_six = RunOne(fresh, steered_from(6));
  EXPECT_EQ(from_six.finish.usage.cached_tokens, 0);
  const Result after = RunOne(fresh, plain);
  EXPECT_EQ(after.finish.usage.cached_tokens, 4);
  EXPECT_EQ(after.tokens, first.tokens);
}

TEST_F(SteeringTest, RejectsBadVectorsNamingTheField) {
  Engine engine(*model_, backend_, EngineOptions{});
  const int L = model_->config.num_layers, D = static_cast<int>(model_->config.dim);
  auto submit = [&](ResidualAdd add, SessionId session = 0) {
    GenerationRequest r = Greedy(Prompt(), 2);
    r.steering = {std::move(add)};
    r.session = session;
    return engine.Submit(std::move(r)).status();
  };
  const std::vector<float> ok(D, 0.5f);
  struct Case {
    ResidualAdd add;
    std::string message;
  };
  std::vector<float> nan = ok;
  nan[3] = std::numeric_limits<float>::quiet_NaN();
  std::vector<Case> cases;
  auto add = [&](int layer, bool mid, const std::vector<float>& delta, std::string message) {
    cases.push_back(Case{ResidualAdd{layer, mid, delta}, std::move(message)});
  };
  add(L + 1, false, ok, "steering[0]: layer " + std::to_string(L + 1) + " is outside");
  add(-1, false, ok, "steering[0]: layer -1 is outside");
  add(L, true, ok, "steering[0]: layer " + std::to_string(L) + " (mid) is outside");
  add(0, false, std::vector<float>(D - 1, 0.0f), "the model's dim is");
  add(0, false, nan, "not finite");
  cases.push_back(Case{ResidualAdd{0, false, ok, -1}, "steering[0]: from position -1 is negative"});
  for (const Case& c : cases) {
    const absl::Status s = submit(c.add);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(c.message), std::string::npos) << s;
  }
  auto session = engine.OpenSession();
  ASSERT_TRUE(session.ok()) << session.status();
  const absl::Status s = submit({0, false, ok}, *session);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not with a session"), std::string::npos) << s;
  EXPECT_TRUE(submit({L, false, ok}).ok());  // the stream entering the final norm
}

}  // namespace
}  // namespace kvlens

// Scoring the prompt in the serving engine (GenerationRequest::prompt_logprobs) on
// stories260K: every prompt position's log-probability and most likely tokens equal the
// double-precision reference backend's logits over the whole prompt in one forward,
// log-softmaxed here, however the engine chunks, batches, captures, preempts or caches
// it; the generated tokens are those of the same request unscored. Against PyTorch through
// the RPC: tests/server/prompt_logprobs_test.cc.
#include <algorithm>
#include <cmath>
#include <future>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "engine/generator.h"
#include "engine/model/transformer.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/reference_backend.h"
#include "tests/engine/run_request.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

using testing::RunOne;
using testing::Start;
using Result = testing::Streamed;

class CountingObserver : public EngineObserver {
 public:
  void OnStep(const StepStats&) override {}
  void OnPreemption() override { ++preemptions; }
  void OnPrefixLookup(int, int) override {}
  std::atomic<int> preemptions{0};
};

class PromptLogprobsTest : public testing::StoriesModelTest {
 protected:
  void SetUp() override {
    StoriesModelTest::SetUp();
    if (NoModel()) return;
    prompt_ = model_->tokenizer->Encode(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in "
        "the park with her dog, who was big and brown.",
        true);
    ASSERT_GT(prompt_.size(), 30u);
    // The reference: fp64 logits of every prompt position from one forward, contiguous
    // cache rows (no engine, no chunks, no prefix cache).
    const int n = static_cast<int>(prompt_.size());
    KvCacheStorage<double> cache(model_->config.num_layers, 1, n, model_->config.kv_dim(), true);
    const std::vector<int32_t> table = {0};
    Transformer<double> tr(*model_, reference_);
    BatchEntry e{prompt_, 0, table, /*all_logits=*/true};
    ForwardOutput<double> out;
    ASSERT_TRUE(tr.Forward({&e, 1}, cache, out).ok());
    ref_ = std::move(out.logits);
  }

  GenerationRequest Request(int top, int max_new = 4) const {
    GenerationRequest r;
    r.prompt = prompt_;
    r.stop.max_new_tokens = max_new;
    r.stop.ignore_eos = true;
    r.prompt_logprobs = top;
    return r;
  }

  // A request decoding 30 tokens, to share steps with a scored prompt.
  static GenerationRequest Decoding() {
    GenerationRequest other;
    other.prompt = {1, 403, 407};
    other.stop.max_new_tokens = 30;
    other.stop.ignore_eos = true;
    return other;
  }

  // The offline generator's run over the prompt, scored with `top` in chunks of `chunk`:
  // its events, its tokens in *tokens.
  Result GenerateScored(kernels::Backend<float>& backend, int chunk, int top, int max_new,
                        std::vector<int32_t>* tokens) const {
    GenerateOptions options;
    options.max_new_tokens = max_new;
    options.stop_at_eos = false;
    options.prefill_chunk = chunk;
    options.prompt_logprobs = top;
    Result r;
    options.on_prompt_logprobs = [&r](const PromptLogprobsEvent& e) { r.scored.push_back(e); };
    auto got = Generate<float>(*model_, backend, prompt_, options);
    EXPECT_TRUE(got.ok()) << got.status();
    if (got.ok()) *tokens = got->tokens;
    return r;
  }

  // The events cover positions 1 … n − 1 once each, in order, before any token; each
  // token is the prompt's, its log-probability the reference's log-softmax within 5e-5
  // (an fp32 forward), and its top `top` the reference's most likely tokens (ties: lower
  // id), compared while the reference's neighbours are more than 1e-4 apart.
  void ExpectReference(const Result& r, int top) const {
    EXPECT_FALSE(r.scored_after_token);
    const int64_t V = model_->config.vocab_size;
    int next = 1;
    for (const PromptLogprobsEvent& ev : r.scored) {
      ASSERT_EQ(ev.first_position, next);
      ASSERT_EQ(ev.tokens.size(), ev.logprobs.size());
      ASSERT_EQ(ev.top.size(), top > 0 ? ev.tokens.size() : 0u);
      for (size_t i = 0; i < ev.tokens.size(); ++i, ++next) {
        SCOPED_TRACE(::testing::Message() << "position " << next);
        ASSERT_LT(next, static_cast<int>(prompt_.size()));
        EXPECT_EQ(ev.tokens[i], prompt_[next]);
        const double* row = ref_.data() + (next - 1) * V;
        const double m = *std::max_element(row, row + V);
        long double z = 0;
        for (int64_t t = 0; t < V; ++t) z += std::exp(static_cast<long double>(row[t] - m));
        const double lse = m + static_cast<double>(std::log(z));
        EXPECT_NEAR(ev.logprobs[i], row[prompt_[next]] - lse, 5e-5);
        if (top == 0) continue;
        std::vector<int32_t> order(V);
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(),
                         [&](int32_t a, int32_t b) { return row[a] > row[b]; });
        ASSERT_EQ(ev.top[i].size(), static_cast<size_t>(top));
        for (int k = 0; k < top; ++k) {
          EXPECT_NEAR(ev.top[i][k].logprob, row[order[k]] - lse, 5e-5) << k;
          const bool tie_before = k > 0 && row[order[k - 1]] - row[order[k]] < 1e-4;
          const bool tie_after = row[order[k]] - row[order[k + 1]] < 1e-4;
          if (!tie_before && !tie_after) {
            EXPECT_EQ(ev.top[i][k].token, order[k]) << k;
          }
        }
      }
    }
    EXPECT_EQ(next, static_cast<int>(prompt_.size()));
  }

  kernels::CpuBackend backend_{2};
  kernels::ReferenceBackend reference_;
  std::vector<int32_t> prompt_;
  std::vector<double> ref_;
};

// Chunks of 7 tokens (the prompt over several steps, some with another request's decode
// rows in the batch): every position scored once, as the reference; the generation is the
// unscored request's.
TEST_F(PromptLogprobsTest, EveryPositionInChunksBatchedWithOthersIsTheReferences) {
  EngineOptions o;
  o.max_batch_tokens = 7;
  Engine engine(*model_, backend_, o);
  const Result plain = RunOne(engine, Request(-1, 6));
  EXPECT_TRUE(plain.scored.empty());
  for (int top : {0, 5}) {
    SCOPED_TRACE(::testing::Message() << "top " << top);
    absl::Status s1, s2;  // (one decoding while the scored prompt is prefilled)
    auto f_other = Start(engine, Decoding(), &s1);
    auto f = Start(engine, Request(top, 6), &s2);
    ASSERT_TRUE(s1.ok() && s2.ok()) << s1 << s2;
    const Result r = f.get();
    f_other.get();
    EXPECT_GT(r.scored.size(), 2u);  // one event a chunk
    ExpectReference(r, top);
    EXPECT_EQ(r.tokens, plain.tokens);
    ASSERT_EQ(r.logprobs.size(), plain.logprobs.size());
    for (size_t i = 0; i < r.logprobs.size(); ++i) EXPECT_EQ(r.logprobs[i], plain.logprobs[i]);
    EXPECT_EQ(r.finish.usage.cached_tokens, 0);
  }
}

// A prompt whose blocks sit in the prefix cache is computed again to be scored (nothing
// cached), and the scored request fills the cache for the next.
TEST_F(PromptLogprobsTest, ComputesACachedPromptAndFillsTheCache) {
  EngineOptions o;
  o.block_size = 4;
  Engine engine(*model_, backend_, o);
  const Result scored_first = RunOne(engine, Request(3));
  ExpectReference(scored_first, 3);
  const Result plain = RunOne(engine, Request(-1));
  EXPECT_GT(plain.finish.usage.cached_tokens, 20);  // the scored request's blocks
  const Result scored_again = RunOne(engine, Request(3));
  EXPECT_EQ(scored_again.finish.usage.cached_tokens, 0);
  ExpectReference(scored_again, 3);
  EXPECT_EQ(scored_again.tokens, plain.tokens);
}

// Streaming attention rows captures them in the step (a second attention call of the
// entry's last query a chosen layer): a short request streaming rows decodes while the long
// prompt is scored chunk by chunk beside it. The scored rows and the sampled row stay
// each entry's own: the long one's as the reference, the short one's (itself scored in
// its captured first step) as when it runs alone without rows.
TEST_F(PromptLogprobsTest, BesideARequestStreamingAttentionRows) {
  EngineOptions o;
  o.max_batch_tokens = 8;
  Engine engine(*model_, backend_, o);
  const Result plain = RunOne(engine, Request(-1));
  GenerationRequest short_one = Request(2, 20);
  short_one.prompt.resize(6);
  const Result short_alone = RunOne(engine, short_one);
  short_one.attention_rows.layers = {0, 1};
  short_one.attention_rows.heads = {0};
  absl::Status s1, s2;
  auto f_short = Start(engine, std::move(short_one), &s1);
  auto f = Start(engine, Request(2), &s2);
  ASSERT_TRUE(s1.ok() && s2.ok()) << s1 << s2;
  const Result r = f.get();
  const Result rs = f_short.get();
  ExpectReference(r, 2);
  EXPECT_EQ(r.tokens, plain.tokens);
  EXPECT_EQ(rs.tokens, short_alone.tokens);
  ASSERT_EQ(rs.scored.size(), 1u);
  ASSERT_EQ(short_alone.scored.size(), 1u);
  EXPECT_EQ(rs.scored[0].logprobs, short_alone.scored[0].logprobs);
}

// A cache too small for two prompts at once: the later admitted is preempted in the middle
// of its prompt and recomputed, taking back from the prefix cache only the blocks it had
// scored; each position is still sent once, as the reference.
TEST_F(PromptLogprobsTest, PreemptedInThePromptSendsEachPositionOnce) {
  CountingObserver observer;
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 16;  // 64 tokens; each request needs prompt + 8
  o.max_batch_tokens = 8;
  Engine engine(*model_, backend_, o, &observer);
  absl::Status s1, s2;
  auto f1 = Start(engine, Request(1, 8), &s1);
  auto f2 = Start(engine, Request(1, 8), &s2);
  ASSERT_TRUE(s1.ok() && s2.ok()) << s1 << s2;
  const Result r1 = f1.get(), r2 = f2.get();
  ASSERT_GT(observer.preemptions.load(), 0) << "the test needs a preemption";
  ExpectReference(r1, 1);
  ExpectReference(r2, 1);
  EXPECT_EQ(r1.tokens, r2.tokens);
}

// The offline generator (kvlens-cli generate --model … --prompt-logprobs) scores the same
// way: chunks of 5, fp32, as the reference; and its tokens are the engine's.
TEST_F(PromptLogprobsTest, TheOfflineGeneratorScoresAsTheReference) {
  std::vector<int32_t> tokens;
  const Result r = GenerateScored(backend_, 5, 4, 4, &tokens);
  EXPECT_GT(r.scored.size(), 5u);
  ExpectReference(r, 4);
  Engine engine(*model_, backend_, EngineOptions{});
  EXPECT_EQ(tokens, RunOne(engine, Request(-1)).tokens);
  GenerateOptions options;
  options.prompt_logprobs = 21;
  EXPECT_EQ(Generate<float>(*model_, backend_, prompt_, options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// On a device backend (memory the host cannot read) the scored rows stay where the logits
// are: each row's log-probability of the next prompt token and its top tokens come back
// from Backend::DrawTokens (a forced token a row), not the rows; the chunk that samples
// draws its last row there too. The engine in chunks of 7 beside another request's decode
// rows (the last chunk 7 rows), and the offline generator in chunks of 5: as the
// reference, the same tokens as the unscored request, every position a forced row.
TEST_F(PromptLogprobsTest, OnADeviceTheRowsAreScoredWhereTheLogitsAre) {
  const int scored_rows = static_cast<int>(prompt_.size()) - 1;
  Result plain;
  {
    Engine engine(*model_, backend_, EngineOptions{});
    plain = RunOne(engine, Request(-1, 6));
  }
  {
    ::kvlens::testing::FakeDeviceBackend device(2);
    EngineOptions o;
    o.max_batch_tokens = 8;  // (the first chunk 5 beside the other's prompt of 3)
    Engine engine(*model_, device, o);
    absl::Status s1, s2;
    auto f_other = Start(engine, Decoding(), &s1);
    auto f = Start(engine, Request(5, 6), &s2);
    ASSERT_TRUE(s1.ok() && s2.ok()) << s1 << s2;
    const Result r = f.get();
    f_other.get();
    EXPECT_GT(r.scored.size(), 2u);
    ExpectReference(r, 5);
    EXPECT_EQ(r.tokens, plain.tokens);
    EXPECT_EQ(device.forced_rows.load(), scored_rows);
  }
  ::kvlens::testing::FakeDeviceBackend device(1);
  std::vector<int32_t> tokens;
  ExpectReference(GenerateScored(device, 5, 2, 6, &tokens), 2);
  EXPECT_EQ(tokens, plain.tokens);
  EXPECT_EQ(device.forced_rows.load(), scored_rows);
}

TEST_F(PromptLogprobsTest, RefusedOutOfRangeOrWithASessionAndNoneForOneToken) {
  Engine engine(*model_, backend_, EngineOptions{});
  for (int bad : {-2, 21}) {
    const absl::Status s = engine.Submit(Request(bad)).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("prompt_logprobs"), std::string::npos) << s;
  }
  absl::StatusOr<SessionId> session = engine.OpenSession();
  ASSERT_TRUE(session.ok());
  GenerationRequest on_session = Request(0);
  on_session.session = *session;
  const absl::Status s = engine.Submit(std::move(on_session)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("prompt_logprobs: not with a session"), std::string::npos) << s;
  GenerationRequest one = Request(5);
  one.prompt = {1};
  const Result r = RunOne(engine, std::move(one));
  EXPECT_TRUE(r.scored.empty());
  EXPECT_EQ(r.tokens.size(), 4u);
}

}  // namespace
}  // namespace kvlens

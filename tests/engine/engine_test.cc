// The continuous-batching engine on a real model (stories260K): its results equal offline
// generation alone, among many concurrent requests, across preemptions, with prefix
// caching and sessions; cancellation and finishing free every block; bad requests get
// errors naming the field.
#include "engine/engine.h"

#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/generator.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/engine/stories_model_test.h"
#include "tests/test_paths.h"

namespace kvlens {
namespace {

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  FinishEvent finish;
};

// Submits and returns a future of the whole outcome.
std::future<Outcome> Start(Engine& engine, GenerationRequest req, absl::Status* submit_status,
                           RequestId* id = nullptr) {
  auto outcome = std::make_shared<Outcome>();
  auto promise = std::make_shared<std::promise<Outcome>>();
  std::future<Outcome> f = promise->get_future();
  req.callbacks.on_token = [outcome](const TokenEvent& e) {
    outcome->tokens.push_back(e.token);
    outcome->text += e.text;
  };
  req.callbacks.on_finish = [outcome, promise](const FinishEvent& e) {
    outcome->finish = e;
    outcome->text += e.text;
    promise->set_value(*outcome);
  };
  auto r = engine.Submit(std::move(req));
  *submit_status = r.status();
  if (r.ok() && id != nullptr) *id = *r;
  return f;
}

// Blocks are released on the step thread right after the finish callback: wait for it.
// The most KV-cache blocks the engine's steps held.
struct MaxBlocksUsed : EngineObserver {
  std::atomic<int> max_used{0};
  void OnStep(const StepStats& s) override { max_used = std::max(max_used.load(), s.blocks_used); }
  void OnPreemption() override {}
  void OnPrefixLookup(int, int) override {}
};

int BlocksUsedWhenIdle(const Engine& engine) {
  for (int i = 0; i < 400 && engine.Stats().blocks_used != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return engine.Stats().blocks_used;
}

Outcome RunOne(Engine& engine, GenerationRequest req) {
  absl::Status s;
  auto f = Start(engine, std::move(req), &s);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? f.get() : Outcome{};
}

class EngineTest : public testing::StoriesModelTest {
 protected:
  GenerationRequest Greedy(const std::string& text, int max_new) const {
    GenerationRequest r;
    r.prompt = model_->tokenizer->Encode(text, true);
    r.stop.max_new_tokens = max_new;
    r.stop.ignore_eos = true;
    return r;
  }
  std::vector<int32_t> Offline(const std::vector<int32_t>& prompt, int max_new) {
    GenerateOptions o;
    o.max_new_tokens = max_new;
    o.stop_at_eos = false;
    auto r = Generate<float>(*model_, backend_, prompt, o);
    EXPECT_TRUE(r.ok());
    return r->tokens;
  }
  // Offline generation in prompt chunks of 3 and blocks of 4 (under a window every layer
  // keeps, a ring of blocks: SequenceCache); no tokens when it fails.
  std::vector<int32_t> OfflineInChunksOf3(const std::vector<int32_t>& prompt, int max_new) {
    GenerateOptions o;
    o.max_new_tokens = max_new;
    o.stop_at_eos = false;
    o.prefill_chunk = 3;
    o.block_size = 4;
    auto r = Generate<float>(*model_, backend_, prompt, o);
    EXPECT_TRUE(r.ok()) << r.status();
    return r.ok() ? r->tokens : std::vector<int32_t>{};
  }
  kernels::CpuBackend backend_{2};
};

TEST_F(EngineTest, GreedyMatchesOfflineGenerationAndTheReferenceText) {
  Engine engine(*model_, backend_, EngineOptions{});
  GenerationRequest req = Greedy("Once upon a time", 20);
  const std::vector<int32_t> want = Offline(req.prompt, 20);
  const Outcome got = RunOne(engine, req);
  EXPECT_EQ(got.tokens, want);
  // run.c's reference continuation (../shared/testdata/README.md) starts with the text
  const std::string reference =
      ", there was a little girl named Lily. She loved to play outside in the park. One day,";
  EXPECT_GT(got.text.size(), 30u);
  EXPECT_EQ(reference.substr(0, got.text.size()), got.text);
  EXPECT_EQ(got.finish.reason, FinishReason::kLength);
  EXPECT_EQ(got.finish.usage.prompt_tokens, 5);
  EXPECT_EQ(got.finish.usage.generated_tokens, 20);
  EXPECT_GT(got.finish.timings.first_token_seconds, 0.0);
}

TEST_F(EngineTest, BatchingNeverChangesResults) {
  EngineOptions o;
  o.max_batch_tokens = 64;  // forces chunked prefills interleaved with decodes
  Engine engine(*model_, backend_, o);
  const std::vector<std::string> prompts = {
      "Once upon a time",       "The cat",
      "Lily and Ben went to",   "One day, a big dog",
      "Tom had a red ball. He", "The sun was shining and the birds were singing. A"};
  std::vector<std::future<Outcome>> futures;
  std::vector<std::vector<int32_t>> want;
  std::vector<GenerationRequest> reqs;
  for (int rep = 0; rep < 32; ++rep) {
    reqs.push_back(Greedy(prompts[rep % prompts.size()], 12 + rep % 7));
    want.push_back(Offline(reqs.back().prompt, reqs.back().stop.max_new_tokens));
  }
  for (const GenerationRequest& r : reqs) {  // all at once: they share steps
    absl::Status s;
    futures.push_back(Start(engine, r, &s));
    ASSERT_TRUE(s.ok()) << s;
  }
  for (size_t i = 0; i < futures.size(); ++i) EXPECT_EQ(futures[i].get().tokens, want[i]) << i;
  EXPECT_EQ(BlocksUsedWhenIdle(engine), 0);
}

TEST_F(EngineTest, PreemptionRecomputesWithoutChangingResults) {
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 14;  // 56 tokens for four requests of ~30 tokens each
  o.prefix_caching = false;
  // The step thread waits after its first step until all four requests are in, so they
  // run together however the threads are scheduled (else, on a loaded machine, the first
  // could finish before the last arrives and nothing would be preempted).
  struct Counter : EngineObserver {
    std::atomic<int> preemptions{0};
    std::mutex mu;
    std::condition_variable cv;
    bool all_submitted = false;
    void OnStep(const StepStats&) override {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return all_submitted; });
    }
    void OnPreemption() override { ++preemptions; }
    void OnPrefixLookup(int, int) override {}
    void Open() {
      {
        std::lock_guard<std::mutex> lock(mu);
        all_submitted = true;
      }
      cv.notify_all();
    }
  } counter;
  Engine engine(*model_, backend_, o, &counter);
  std::vector<std::future<Outcome>> futures;
  std::vector<std::vector<int32_t>> want;
  std::vector<GenerationRequest> reqs;
  for (const char* p : {"Once upon a time", "The dog ran", "A little bird", "Mom said"}) {
    reqs.push_back(Greedy(p, 24));
    want.push_back(Offline(reqs.back().prompt, 24));
  }
  for (const GenerationRequest& r : reqs) {
    absl::Status s;
    futures.push_back(Start(engine, r, &s));
    if (!s.ok()) counter.Open();
    ASSERT_TRUE(s.ok()) << s;
  }
  counter.Open();
  for (size_t i = 0; i < futures.size(); ++i) EXPECT_EQ(futures[i].get().tokens, want[i]) << i;
  EXPECT_GT(counter.preemptions.load(), 0);
  EXPECT_EQ(BlocksUsedWhenIdle(engine), 0);
}

TEST_F(EngineTest, PrefixCacheReusesFullBlocks) {
  EngineOptions o;
  o.block_size = 4;
  Engine engine(*model_, backend_, o);
  GenerationRequest r = Greedy("Once upon a time, there was a little girl named Lily.", 8);
  const int n = static_cast<int>(r.prompt.size());
  const Outcome first = RunOne(engine, r);
  EXPECT_EQ(first.finish.usage.cached_tokens, 0);
  const Outcome second = RunOne(engine, r);
  EXPECT_EQ(second.finish.usage.cached_tokens, (n - 1) / 4 * 4);
  EXPECT_EQ(second.tokens, first.tokens);
  EXPECT_GT(engine.Stats().blocks_cached, 0);
  EXPECT_EQ(BlocksUsedWhenIdle(engine), 0);
}

TEST_F(EngineTest, SessionSecondTurnPrefillsOnlyNewTokens) {
  Engine engine(*model_, backend_, EngineOptions{});
  auto session = engine.OpenSession();
  ASSERT_TRUE(session.ok());
  GenerationRequest t1 = Greedy("Once upon a time", 10);
  t1.session = *session;
  const Outcome a = RunOne(engine, t1);
  GenerationRequest t2;
  t2.prompt = model_->tokenizer->Encode(" Then", false);
  t2.stop.max_new_tokens = 10;
  t2.stop.ignore_eos = true;
  t2.session = *session;
  const Outcome b = RunOne(engine, t2);
  // the whole history except the last generated token (not yet computed) was cached
  EXPECT_EQ(b.finish.usage.cached_tokens, static_cast<int>(t1.prompt.size()) + 10 - 1);
  EXPECT_EQ(b.finish.usage.prompt_tokens,
            static_cast<int>(t1.prompt.size()) + 10 + static_cast<int>(t2.prompt.size()));
  // and the continuation equals recomputing everything offline
  std::vector<int32_t> history = t1.prompt;
  history.insert(history.end(), a.tokens.begin(), a.tokens.end());
  history.insert(history.end(), t2.prompt.begin(), t2.prompt.end());
  EXPECT_EQ(b.tokens, Offline(history, 10));
  EXPECT_GT(engine.Stats().blocks_used, 0);  // the session holds its blocks
  ASSERT_TRUE(engine.CloseSession(*session).ok());
  EXPECT_EQ(engine.CloseSession(*session).code(), absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, CancelFinishesAndFreesBlocks) {
  Engine engine(*model_, backend_, EngineOptions{});
  GenerationRequest r = Greedy("Once upon a time", 400);
  absl::Status s;
  RequestId id = 0;
  auto f = Start(engine, r, &s, &id);
  ASSERT_TRUE(s.ok());
  engine.Cancel(id);
  const Outcome o = f.get();
  EXPECT_EQ(o.finish.reason, FinishReason::kCancelled);
  EXPECT_LT(o.tokens.size(), 400u);
  EXPECT_EQ(BlocksUsedWhenIdle(engine), 0);
}

TEST_F(EngineTest, StopStringsAndStopTokens) {
  Engine engine(*model_, backend_, EngineOptions{});
  GenerationRequest r = Greedy("Once upon a time", 40);
  r.stop.stop_strings = {"Lily"};
  Outcome o = RunOne(engine, r);
  EXPECT_EQ(o.finish.reason, FinishReason::kStop);
  EXPECT_EQ(o.text, ", there was a little girl named ");
  r = Greedy("Once upon a time", 40);
  const std::vector<int32_t> all = Offline(r.prompt, 40);
  r.stop.stop_token_ids = {all[3]};
  o = RunOne(engine, r);
  EXPECT_EQ(o.finish.reason, FinishReason::kStop);
  EXPECT_EQ(o.tokens, std::vector<int32_t>(all.begin(), all.begin() + 4));
}

// A model's other end-of-generation tokens (GGUF eot/eom ids, Llama 3's <|eot_id|>) end a
// generation as EOS does, in the engine and offline, unless the request ignores EOS.
TEST_F(EngineTest, EndOfGenerationTokensStopLikeEos) {
  GenerationRequest r = Greedy("Once upon a time", 40);
  const std::vector<int32_t> all = Offline(r.prompt, 40);
  ASSERT_NE(all[3], model_->tokenizer->eos_id());
  model_->tokenizer->AddEndOfGeneration(all[3]);
  Engine engine(*model_, backend_, EngineOptions{});
  r.stop.ignore_eos = false;
  Outcome o = RunOne(engine, r);
  EXPECT_EQ(o.finish.reason, FinishReason::kEos);
  EXPECT_EQ(o.tokens, std::vector<int32_t>(all.begin(), all.begin() + 4));
  GenerateOptions opts;
  opts.max_new_tokens = 40;
  auto offline = Generate<float>(*model_, backend_, r.prompt, opts);
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(offline->finish_reason, FinishReason::kEos);
  EXPECT_EQ(offline->tokens, o.tokens);
  r.stop.ignore_eos = true;
  EXPECT_EQ(RunOne(engine, r).tokens, all);
}

TEST_F(EngineTest, RejectsBadRequestsNamingTheField) {
  EngineOptions o;
  o.num_blocks = 4;
  o.block_size = 16;
  o.max_waiting = 1;
  Engine engine(*model_, backend_, o);
  GenerationRequest r = Greedy("Hi", 8);
  r.prompt.push_back(512);
  EXPECT_NE(engine.Submit(r).status().message().find("prompt token"), std::string::npos);
  r = Greedy("Hi", 8);
  r.sampling.top_p = 2;
  EXPECT_NE(engine.Submit(r).status().message().find("top_p"), std::string::npos);
  r = Greedy("Hi", -1);
  EXPECT_NE(engine.Submit(r).status().message().find("max_new_tokens"), std::string::npos);
  r = Greedy("Hi", 0);  // "up to the context" = 512 − 2 tokens: 32 blocks > 4
  EXPECT_EQ(engine.Submit(r).status().code(), absl::StatusCode::kResourceExhausted);
  r = Greedy("Hi", 600);
  EXPECT_EQ(engine.Submit(r).status().code(), absl::StatusCode::kOutOfRange);
  r = Greedy("Hi", 100);  // 103 tokens need 7 blocks of 16; the cache has 4
  absl::Status s = engine.Submit(r).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("holds only 4 blocks"), std::string::npos) << s;
  r = Greedy("Hi", 8);
  r.session = 99;
  EXPECT_NE(engine.Submit(r).status().message().find("session_id 99"), std::string::npos);
  r = Greedy("Hi", 8);
  r.top_logprobs = 21;
  EXPECT_NE(engine.Submit(r).status().message().find("top_logprobs"), std::string::npos);
}

TEST_F(EngineTest, LogprobsAreTheModelsLogSoftmax) {
  Engine engine(*model_, backend_, EngineOptions{});
  GenerationRequest r = Greedy("Once upon a time", 3);
  r.top_logprobs = 5;
  std::vector<TokenEvent> events;
  std::promise<void> done;
  r.callbacks.on_token = [&](const TokenEvent& e) { events.push_back(e); };
  r.callbacks.on_finish = [&](const FinishEvent&) { done.set_value(); };
  ASSERT_TRUE(engine.Submit(r).ok());
  done.get_future().wait();
  ASSERT_EQ(events.size(), 3u);
  for (const TokenEvent& e : events) {
    ASSERT_EQ(e.top_logprobs.size(), 5u);
    EXPECT_EQ(e.top_logprobs[0].token, e.token);  // greedy picks the most likely
    EXPECT_FLOAT_EQ(e.top_logprobs[0].logprob, e.logprob);
    EXPECT_LT(e.logprob, 0.0f);
    for (int k = 1; k < 5; ++k) EXPECT_LE(e.top_logprobs[k].logprob, e.top_logprobs[k - 1].logprob);
  }
}

// A step's rows are sampled on several threads (EngineOptions::sampling_threads): seeded
// sampling with penalties and filters, eight requests in one batch on four threads, gives
// every request the tokens and log-probabilities it gets alone on the step thread.
TEST_F(EngineTest, ParallelSamplingEqualsEachRequestSampledAlone) {
  auto request = [&](int i) {
    GenerationRequest r = Greedy(i % 2 == 0 ? "Once upon a time" : "The cat sat", 16);
    r.sampling.temperature = 0.9;
    r.sampling.top_p = 0.9;
    r.sampling.repetition_penalty = 1.2;
    r.sampling.seed = 100 + i;
    r.top_logprobs = 2;
    return r;
  };
  auto run = [&](Engine& engine, const std::vector<int>& which) {
    std::vector<std::vector<TokenEvent>> events(which.size());
    std::vector<std::promise<void>> done(which.size());
    for (size_t j = 0; j < which.size(); ++j) {
      GenerationRequest r = request(which[j]);
      r.callbacks.on_token = [&events, j](const TokenEvent& e) { events[j].push_back(e); };
      r.callbacks.on_finish = [&done, j](const FinishEvent&) { done[j].set_value(); };
      EXPECT_TRUE(engine.Submit(std::move(r)).ok());
    }
    for (auto& d : done) d.get_future().wait();
    return events;
  };
  EngineOptions parallel;
  parallel.sampling_threads = 4;
  Engine together(*model_, backend_, parallel);
  const std::vector<std::vector<TokenEvent>> got = run(together, {0, 1, 2, 3, 4, 5, 6, 7});
  EngineOptions serial;
  serial.sampling_threads = 1;
  Engine alone(*model_, backend_, serial);
  for (int i = 0; i < 8; ++i) {
    const std::vector<TokenEvent> want = run(alone, {i}).front();
    ASSERT_EQ(got[i].size(), want.size()) << i;
    for (size_t t = 0; t < want.size(); ++t) {
      EXPECT_EQ(got[i][t].token, want[t].token) << "request " << i << ", token " << t;
      EXPECT_FLOAT_EQ(got[i][t].logprob, want[t].logprob);
      ASSERT_EQ(got[i][t].top_logprobs.size(), 2u);
      EXPECT_EQ(got[i][t].top_logprobs[1].token, want[t].top_logprobs[1].token);
    }
  }
}

// Under a sliding window (stories260K given one of 16 positions, blocks of 4), a sequence
// gives back each block once no query still to come can see it. A request of 65 tokens in
// a 40-token pool, which needs 17 blocks kept whole (refused, naming them, with the release
// off), runs holding at most 7 (a window, a step's chunk of 8 and a block either side:
// ceil((8 + 15) / 4) + 1) and streams the tokens offline generation gives, its cache
// never released (and again in a ring of blocks). A long prompt found in the prefix cache
// (its released blocks stay there) is adopted, its blocks before the window given back at
// once, and continues as offline generation does.
TEST_F(EngineTest, SlidingWindowReleasesBlocksAsTheyLeaveIt) {
  model_->config.sliding_window = 16;
  MaxBlocksUsed observer;
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.max_batch_tokens = 8;
  GenerationRequest r = Greedy("Once upon a time", 60);
  const int total = static_cast<int>(r.prompt.size()) + 60;
  ASSERT_GT((total + 3) / 4, o.num_blocks);
  {
    EngineOptions kept = o;
    kept.release_out_of_window_blocks = false;
    Engine engine(*model_, backend_, kept);
    const absl::Status s = engine.Submit(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find(absl::StrCat("needs ", (total + 3) / 4, " KV-cache blocks")),
              std::string::npos)
        << s;
  }
  Engine engine(*model_, backend_, o, &observer);
  const Outcome got = RunOne(engine, r);
  const std::vector<int32_t> offline = Offline(r.prompt, 60);
  EXPECT_EQ(got.tokens, offline);
  // Offline generation in prompt chunks of 3 and blocks of 4 keeps its cache in a ring of
  // ceil((3 + 15) / 4) = 5 blocks (SequenceCache): the same tokens.
  EXPECT_EQ(OfflineInChunksOf3(r.prompt, 60), offline);
  EXPECT_GT(observer.max_used.load(), 0);
  EXPECT_LE(observer.max_used.load(), 7);
  EXPECT_EQ(BlocksUsedWhenIdle(engine), 0);

  // 45 prompt tokens (BOS included) twice in a pool of 64 blocks: the second finds 44 of
  // them cached (never the block of the last one), and gives 7 of those 11 blocks back
  // at once.
  o.num_blocks = 64;
  o.max_batch_tokens = 512;
  Engine cached(*model_, backend_, o, &observer);
  GenerationRequest longer;
  longer.prompt = model_->tokenizer->Encode(
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park. One day, she saw a big, red ball.",
      true);
  longer.stop.max_new_tokens = 12;
  longer.stop.ignore_eos = true;
  ASSERT_EQ(longer.prompt.size(), 45u);
  const std::vector<int32_t> want = Offline(longer.prompt, 12);
  EXPECT_EQ(RunOne(cached, longer).tokens, want);
  // Its prompt chunks of 3 go round the ring of 5 blocks (20 positions) twice and more:
  // the same tokens (a ring of 4 would overwrite keys the chunks' first queries see).
  EXPECT_EQ(OfflineInChunksOf3(longer.prompt, 12), want);
  const Outcome again = RunOne(cached, longer);
  EXPECT_EQ(again.tokens, want);
  EXPECT_EQ(again.finish.usage.cached_tokens, (static_cast<int>(longer.prompt.size()) - 1) / 4 * 4);
  EXPECT_EQ(BlocksUsedWhenIdle(cached), 0);
}

// A model whose last layer sees the whole context (Gemma 3's pattern: stories260K with
// layers 0–3 windowed to 16 positions, layer 4 not) keeps every block of a sequence: the
// 65-token request is refused by a 10-block pool (naming its 17 blocks), and in a pool of
// 20 holds all it stores at once (16: the last token's keys never are) and streams offline
// generation's tokens, whose cache is no ring.
TEST_F(EngineTest, AWindowNotEveryLayerKeepsReleasesNothing) {
  model_->config.sliding_window = 16;
  model_->config.windowed_layers = {true, true, true, true, false};
  MaxBlocksUsed observer;
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.max_batch_tokens = 8;
  GenerationRequest r = Greedy("Once upon a time", 60);
  const int total = static_cast<int>(r.prompt.size()) + 60;
  ASSERT_EQ((total + 3) / 4, 17);
  {
    Engine engine(*model_, backend_, o);
    const absl::Status s = engine.Submit(r).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("needs 17 KV-cache blocks"), std::string::npos) << s;
  }
  o.num_blocks = 20;
  Engine engine(*model_, backend_, o, &observer);
  const std::vector<int32_t> offline = Offline(r.prompt, 60);
  EXPECT_EQ(RunOne(engine, r).tokens, offline);
  EXPECT_EQ(observer.max_used.load(), 16);  // the last token's keys are never stored
  EXPECT_EQ(OfflineInChunksOf3(r.prompt, 60), offline);
  // The windowed layers alone would have changed them: the same model windowed everywhere.
  model_->config.windowed_layers.clear();
  EXPECT_NE(Offline(r.prompt, 60), offline);
}

// Released blocks' table entries alias a live block, so a kernel that reads keys just
// before a window (the CPU's split-key spans, the GPU's first tile) reads finite rows it
// masks. The streamed attention rows are exactly 0 before each query's window (position
// p − 1 sees keys p − 16 … p − 1) and the very rows an engine that keeps every block
// streams; among four windowed requests sharing steps in a pool they outgrow (preempted
// and recomputed as needed), every one streams the tokens offline generation gives.
TEST_F(EngineTest, SlidingWindowRowsAndTokensEqualAnEngineThatKeepsEveryBlock) {
  model_->config.sliding_window = 16;
  auto rows_of = [&](Engine& engine, GenerationRequest r) {
    std::vector<TokenEvent> events;
    std::promise<void> done;
    r.attention_rows = {{0, 4}, {1, 6}};
    r.callbacks.on_token = [&](const TokenEvent& e) { events.push_back(e); };
    r.callbacks.on_finish = [&](const FinishEvent&) { done.set_value(); };
    EXPECT_TRUE(engine.Submit(r).ok());
    done.get_future().wait();
    return events;
  };
  EngineOptions o;
  o.block_size = 4;
  o.num_blocks = 10;
  o.max_batch_tokens = 8;
  Engine released(*model_, backend_, o);
  EngineOptions kept_options;
  kept_options.block_size = 4;
  kept_options.release_out_of_window_blocks = false;
  Engine kept(*model_, backend_, kept_options);
  const GenerationRequest r = Greedy("Once upon a time", 40);
  const std::vector<TokenEvent> got = rows_of(released, r), want = rows_of(kept, r);
  ASSERT_EQ(got.size(), 40u);
  ASSERT_EQ(want.size(), 40u);
  for (size_t t = 0; t < got.size(); ++t) {
    EXPECT_EQ(got[t].token, want[t].token) << t;
    const int keys = got[t].attention_keys;  // the query at position keys − 1
    ASSERT_EQ(keys, want[t].attention_keys);
    ASSERT_EQ(got[t].attention.size(), size_t{4} * keys);
    EXPECT_EQ(got[t].attention, want[t].attention) << "token " << t;
    for (int row = 0; row < 4; ++row) {
      double sum = 0;
      for (int j = 0; j < keys; ++j) {
        const float p = got[t].attention[size_t(row) * keys + j];
        if (j < keys - 16) {
          EXPECT_EQ(p, 0.0f) << "token " << t << " row " << row << " key " << j;
        }
        sum += p;
      }
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }

  std::vector<std::future<Outcome>> futures;
  std::vector<GenerationRequest> reqs;
  for (const char* p : {"Once upon a time", "The dog ran", "A little bird", "Mom said"}) {
    reqs.push_back(Greedy(p, 36));
  }
  for (const GenerationRequest& q : reqs) {
    absl::Status s;
    futures.push_back(Start(released, q, &s));
    ASSERT_TRUE(s.ok()) << s;
  }
  for (size_t i = 0; i < futures.size(); ++i) {
    EXPECT_EQ(futures[i].get().tokens, Offline(reqs[i].prompt, 36)) << i;
  }
  EXPECT_EQ(BlocksUsedWhenIdle(released), 0);
}

TEST_F(EngineTest, ShutdownDrainsThenRefuses) {
  Engine engine(*model_, backend_, EngineOptions{});
  absl::Status s;
  auto f = Start(engine, Greedy("Once upon a time", 30), &s);
  ASSERT_TRUE(s.ok());
  engine.Shutdown(std::chrono::seconds(30));
  EXPECT_EQ(f.get().finish.reason, FinishReason::kLength);
  EXPECT_EQ(engine.Submit(Greedy("x", 2)).status().code(), absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace kvlens

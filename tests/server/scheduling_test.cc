// The engine's scheduling behaviour as a client sees it through the server: cancellation
// frees blocks, sessions prefill only new tokens, prefix-cache hits, batching invariance,
// and RESOURCE_EXHAUSTED for a request that can never fit or a full queue.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "engine/generator.h"
#include "tests/server/server_test_util.h"
#include "tests/test_paths.h"

namespace kvlens::testing {
namespace {

#define START_SERVER(server, ...)         \
  KVLENS_REQUIRE_FILE(Stories260KPath()); \
  TestServer server{__VA_ARGS__};         \
  ASSERT_TRUE(server.ok()) << server.error()

// Polls `done` every 10 ms for up to 10 s.
template <typename Fn>
bool Eventually(Fn done) {
  for (int i = 0; i < 1000; ++i) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return done();
}

// A long greedy stream: ignore EOS and fill most of stories260K's 128-token context.
v1::GenerateRequest LongRequest(const std::string& text) {
  v1::GenerateRequest request = GreedyRequest(text, 110);
  request.mutable_stopping()->set_ignore_eos(true);
  return request;
}

// Runs `n` long streams on their own threads until `stop` is set (or they end), so that
// each engine step carries many sequences and a test's own request runs long enough to
// be cancelled mid-stream.
class Background {
 public:
  Background(v1::Generation::Stub& stub, int n) {
    for (int i = 0; i < n; ++i) {
      threads_.emplace_back([this, &stub, i] {
        while (!stop_.load()) RunGenerate(stub, LongRequest("Story " + std::to_string(i)));
      });
    }
  }
  ~Background() {
    stop_.store(true);
    for (std::thread& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

TEST(SchedulingTest, CancelRpcEndsTheStreamAndFreesItsBlocks) {
  START_SERVER(server);
  bool cancelled = false;
  {
    Background load(server.stub(), 8);
    // Bounded retries: on a fast machine the stream may finish before Cancel arrives.
    for (int attempt = 0; attempt < 10 && !cancelled; ++attempt) {
      grpc::ClientContext context;
      SetDeadline(context);
      auto reader = server.stub().Generate(&context, LongRequest("Once upon a time"));
      v1::GenerateResponse chunk;
      ASSERT_TRUE(reader->Read(&chunk));
      const int64_t id = chunk.request_id();
      grpc::ClientContext cancel_context;
      SetDeadline(cancel_context);
      v1::CancelRequest cancel;
      cancel.set_request_id(id);
      v1::CancelResponse cancel_response;
      const grpc::Status cs = server.stub().Cancel(&cancel_context, cancel, &cancel_response);
      v1::GenerateFinal final;
      while (reader->Read(&chunk)) {
        if (chunk.has_final()) final = chunk.final();
      }
      ASSERT_TRUE(reader->Finish().ok());
      if (cs.ok()) {
        EXPECT_EQ(final.finish_reason(), v1::FINISH_REASON_CANCELLED);
        EXPECT_LT(final.usage().generated_tokens(), 110);
        cancelled = true;
      } else {
        EXPECT_EQ(cs.error_code(), grpc::StatusCode::NOT_FOUND);  // it had finished
      }
    }
  }
  EXPECT_TRUE(cancelled);
  // Nothing runs any more: every block is back in the pool (free or cached prefix).
  EXPECT_TRUE(Eventually([&] {
    const EngineStats s = server.engine().Stats();
    return s.running == 0 && s.waiting == 0 && s.blocks_used == 0;
  })) << "blocks still used: "
      << server.engine().Stats().blocks_used;
}

TEST(SchedulingTest, ClientCancelFreesBlocksVisibleInMetrics) {
  START_SERVER(server);
  const std::string cancelled_series = R"(kvlens_requests_total{code="CANCELLED",rpc="Generate"})";
  {
    Background load(server.stub(), 8);
    for (int attempt = 0; attempt < 10; ++attempt) {
      grpc::ClientContext context;
      SetDeadline(context);
      auto reader = server.stub().Generate(&context, LongRequest("Once upon a time"));
      v1::GenerateResponse chunk;
      ASSERT_TRUE(reader->Read(&chunk));
      context.TryCancel();  // as a client that disconnects
      while (reader->Read(&chunk)) {
      }
      EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
      // The server saw the cancel before the stream ended (else it counted OK): done.
      if (Eventually([&] {
            return MetricValue(ScrapeMetrics(server.metrics_port()), cancelled_series) >= 1;
          })) {
        break;
      }
    }
  }
  EXPECT_GE(MetricValue(ScrapeMetrics(server.metrics_port()), cancelled_series), 1);
  EXPECT_TRUE(Eventually([&] { return server.engine().Stats().blocks_used == 0; }));
  // The exposer reports the pool as of the engine's last step: nothing used, all blocks
  // free or cached.
  EXPECT_TRUE(Eventually([&] {
    const std::string m = ScrapeMetrics(server.metrics_port());
    return MetricValue(m, R"(kvlens_kv_cache_blocks{state="used"})") == 0 &&
           MetricValue(m, R"(kvlens_kv_cache_blocks{state="free"})") +
                   MetricValue(m, R"(kvlens_kv_cache_blocks{state="cached"})") ==
               256;
  })) << ScrapeMetrics(server.metrics_port());
}

TEST(SchedulingTest, SessionSecondTurnPrefillsOnlyTheNewTokens) {
  START_SERVER(server);
  const Tokenizer& tok = *server.model().tokenizer;
  grpc::ClientContext open_context;
  SetDeadline(open_context);
  v1::OpenSessionResponse session;
  ASSERT_TRUE(server.stub().OpenSession(&open_context, {}, &session).ok());
  ASSERT_GT(session.session_id(), 0);

  v1::GenerateRequest turn1 = GreedyRequest("Once upon a time", 10);
  turn1.set_session_id(session.session_id());
  const StreamResult r1 = RunGenerate(server.stub(), turn1);
  ASSERT_TRUE(r1.status.ok()) << r1.status.error_message();
  EXPECT_EQ(r1.final.usage().prompt_tokens(), 5);
  EXPECT_EQ(r1.final.usage().cached_tokens(), 0);

  const std::vector<int32_t> added = tok.Encode("She", false);
  v1::GenerateRequest turn2 = GreedyRequest("", 10);
  for (int32_t id : added) turn2.mutable_token_ids()->add_ids(id);
  turn2.set_session_id(session.session_id());
  const StreamResult r2 = RunGenerate(server.stub(), turn2);
  ASSERT_TRUE(r2.status.ok()) << r2.status.error_message();
  const int history = 5 + 10;
  // The prompt is the whole conversation; all of it but the new tokens is cached, except
  // turn 1's last generated token, whose K/V no forward pass has computed yet.
  EXPECT_EQ(r2.final.usage().prompt_tokens(), history + static_cast<int>(added.size()));
  EXPECT_EQ(r2.final.usage().cached_tokens(), history - 1);

  // The continuation is the offline greedy continuation of the whole conversation.
  std::vector<int32_t> conversation = tok.Encode("Once upon a time", true);
  conversation.insert(conversation.end(), r1.tokens.begin(), r1.tokens.end());
  conversation.insert(conversation.end(), added.begin(), added.end());
  kernels::CpuBackend backend(1);
  GenerateOptions options;
  options.max_new_tokens = 10;
  auto offline = Generate<float>(server.model(), backend, conversation, options);
  ASSERT_TRUE(offline.ok()) << offline.status();
  EXPECT_EQ(r2.tokens, offline->tokens);

  for (grpc::StatusCode expected : {grpc::StatusCode::OK, grpc::StatusCode::NOT_FOUND}) {
    grpc::ClientContext context;
    SetDeadline(context);
    v1::CloseSessionRequest close;
    close.set_session_id(session.session_id());
    v1::CloseSessionResponse closed;
    EXPECT_EQ(server.stub().CloseSession(&context, close, &closed).error_code(), expected);
  }
  EXPECT_EQ(server.engine().Stats().sessions, 0);
}

TEST(SchedulingTest, RepeatedPromptHitsThePrefixCache) {
  START_SERVER(server);
  const std::string prompt =
      "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
      "park. One day, she saw a big red ball.";
  ASSERT_GE(server.model().tokenizer->Encode(prompt, true).size(), 33u);  // 2 full blocks
  const std::string hits = "kvlens_prefix_cache_hits_total";
  const double hits_before = MetricValue(ScrapeMetrics(server.metrics_port()), hits);
  const StreamResult first = RunGenerate(server.stub(), GreedyRequest(prompt, 8));
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  EXPECT_EQ(first.final.usage().cached_tokens(), 0);
  const StreamResult second = RunGenerate(server.stub(), GreedyRequest(prompt, 8));
  ASSERT_TRUE(second.status.ok()) << second.status.error_message();
  const int cached = second.final.usage().cached_tokens();
  EXPECT_GE(cached, 32);
  EXPECT_EQ(cached % 16, 0) << "whole blocks only";
  EXPECT_EQ(second.tokens, first.tokens);
  EXPECT_EQ(MetricValue(ScrapeMetrics(server.metrics_port()), hits), hits_before + cached);
}

TEST(SchedulingTest, GreedyTokensDoNotDependOnTheBatch) {
  START_SERVER(server);
  constexpr int kStreams = 32;
  std::vector<v1::GenerateRequest> requests;
  std::vector<StreamResult> alone;
  for (int i = 0; i < kStreams; ++i) {
    requests.push_back(GreedyRequest(
        i == 0 ? std::string("Once upon a time") : "Lily and Tom number " + std::to_string(i), 40));
    alone.push_back(RunGenerate(server.stub(), requests.back()));
    ASSERT_TRUE(alone.back().status.ok()) << alone.back().status.error_message();
  }
  std::vector<StreamResult> together(kStreams);
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kStreams; ++i) {
    threads.emplace_back([&, i] {
      ready.fetch_add(1);
      // Start together (bounded spin) so the engine batches them.
      for (int spin = 0; spin < 100000 && ready.load() < kStreams; ++spin)
        std::this_thread::yield();
      together[i] = RunGenerate(server.stub(), requests[i]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kStreams; ++i) {
    ASSERT_TRUE(together[i].status.ok()) << together[i].status.error_message();
    EXPECT_EQ(together[i].tokens, alone[i].tokens) << "stream " << i;
    EXPECT_EQ(together[i].text, alone[i].text) << "stream " << i;
  }
}

TEST(SchedulingTest, RequestThatCanNeverFitIsResourceExhausted) {
  EngineOptions options = TestServer::DefaultOptions();
  options.num_blocks = 4;  // 64 tokens
  START_SERVER(server, options);
  const StreamResult r = RunGenerate(server.stub(), GreedyRequest("Once upon a time", 100));
  EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(r.status.error_message().find("4 blocks"), std::string::npos)
      << r.status.error_message();
  // One that fits still runs.
  EXPECT_TRUE(RunGenerate(server.stub(), GreedyRequest("Once upon a time", 20)).status.ok());
}

TEST(SchedulingTest, FullQueueIsResourceExhausted) {
  EngineOptions options = TestServer::DefaultOptions();
  options.max_running = 1;
  options.max_waiting = 2;
  START_SERVER(server, options);
  constexpr int kStreams = 16;
  int exhausted = 0, ok = 0;
  for (int round = 0; round < 5 && exhausted == 0; ++round) {
    std::vector<StreamResult> results(kStreams);
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < kStreams; ++i) {
      threads.emplace_back([&, i] {
        ready.fetch_add(1);
        for (int spin = 0; spin < 100000 && ready.load() < kStreams; ++spin)
          std::this_thread::yield();
        results[i] = RunGenerate(server.stub(), LongRequest("Once upon a time"));
      });
    }
    for (std::thread& t : threads) t.join();
    for (const StreamResult& r : results) {
      if (r.status.ok()) {
        ++ok;
      } else {
        EXPECT_EQ(r.status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
        EXPECT_NE(r.status.error_message().find("max_waiting = 2"), std::string::npos)
            << r.status.error_message();
        ++exhausted;
      }
    }
  }
  EXPECT_GT(exhausted, 0);
  EXPECT_GT(ok, 0);
}

}  // namespace
}  // namespace kvlens::testing

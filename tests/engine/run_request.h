// The engine tests' harness: submits a GenerationRequest to an Engine and collects what it
// streams (prompt log-probabilities, tokens, the finish), one request at a time (RunOne)
// or several in flight (Start).
#ifndef KVLENS_TESTS_ENGINE_RUN_REQUEST_H_
#define KVLENS_TESTS_ENGINE_RUN_REQUEST_H_

#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "gtest/gtest.h"

namespace kvlens::testing {

struct Streamed {
  std::vector<PromptLogprobsEvent> scored;
  bool scored_after_token = false;  // a prompt event came after a token (it must not)
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;
  FinishEvent finish;
};

// Submits `req` (its callbacks replaced); *status is Submit's. The future is ready at the
// request's finish (never, when Submit failed).
inline std::future<Streamed> Start(Engine& engine, GenerationRequest req, absl::Status* status) {
  auto run = std::make_shared<Streamed>();
  auto promise = std::make_shared<std::promise<Streamed>>();
  std::future<Streamed> f = promise->get_future();
  req.callbacks.on_prompt_logprobs = [run](const PromptLogprobsEvent& e) {
    run->scored.push_back(e);
    run->scored_after_token = run->scored_after_token || !run->tokens.empty();
  };
  req.callbacks.on_token = [run](const TokenEvent& e) {
    run->tokens.push_back(e.token);
    run->logprobs.push_back(e.logprob);
    run->top.push_back(e.top_logprobs);
  };
  req.callbacks.on_finish = [run, promise](const FinishEvent& e) {
    run->finish = e;
    promise->set_value(*run);
  };
  *status = engine.Submit(std::move(req)).status();
  return f;
}

// Start, then waits for the finish; a failed Submit fails the test and gives nothing.
inline Streamed RunOne(Engine& engine, GenerationRequest req) {
  absl::Status s;
  auto f = Start(engine, std::move(req), &s);
  EXPECT_TRUE(s.ok()) << s;
  return s.ok() ? f.get() : Streamed{};
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_RUN_REQUEST_H_

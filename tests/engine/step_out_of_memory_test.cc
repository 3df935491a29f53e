// A step that runs out of device memory loses nothing (Engine, engine.h): on the device
// path's test double with a memory budget (FakeDeviceMemory::set_budget: allocations past
// it are RESOURCE_EXHAUSTED, as a cudaMalloc that does not fit), the step runs again in
// halves until it fits, and every request streams what it streams served alone on the CPU
// backend, a seeded draw at a temperature included (its reserved number is kept for the
// rerun). Only a lone token that does not fit twice in a row fails its request, and the
// budget comes back.
#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "tests/engine/serve_together.h"
#include "tests/engine/stories_model_test.h"
#include "tests/kernels/fake_device_backend.h"

namespace kvlens {
namespace {

class StepOutOfMemoryTest : public testing::StoriesModelTest {
 protected:
  GenerationRequest Request(const std::string& prompt, int max_new_tokens,
                            double temperature = 0.0) const {
    GenerationRequest r;
    r.prompt = model_->tokenizer->Encode(prompt, true);
    r.stop.max_new_tokens = max_new_tokens;
    r.stop.ignore_eos = true;
    r.sampling.temperature = temperature;
    r.sampling.seed = 7;
    return r;
  }
  // `request` on `engine` with no device memory to spare (the budget at what is in use: no
  // step's activations fit): it fails, RESOURCE_EXHAUSTED, before any token.
  testing::Served ServeOutOfMemory(Engine& engine, testing::FakeDeviceBackend& device,
                                   const GenerationRequest& request) {
    device.fake_memory().set_budget(device.fake_memory().in_use());
    const testing::Served failed = testing::ServeOn(engine, {request})[0];
    EXPECT_EQ(failed.finish.reason, FinishReason::kError);
    EXPECT_EQ(failed.finish.status.code(), absl::StatusCode::kResourceExhausted)
        << failed.finish.status;
    EXPECT_NE(failed.finish.status.message().find("out of memory"), std::string::npos)
        << failed.finish.status;
    EXPECT_TRUE(failed.tokens.empty());
    return failed;
  }
  // What the request streams alone on the CPU backend.
  testing::Served Alone(const GenerationRequest& r) {
    return testing::ServeTogether(*model_, cpu_, {r})[0];
  }
  kernels::CpuBackend cpu_{2};
};

TEST_F(StepOutOfMemoryTest, AStepThatRunsOutRunsAgainInHalvesAndEveryRequestCompletes) {
  std::vector<GenerationRequest> requests = {
      Request("Once upon a time, there was a little dog named Max.", 8),
      Request("The sun was shining and the birds were singing in the park.", 8, 0.8),
      Request("Lily and Tom went to the beach with their mom and dad.", 8),
      Request("One day, a big red ball rolled down the hill to the river.", 8),
      Request("The little cat sat on the mat and looked at the moon.", 4),
  };
  // The last scores its prompt too: its rows' events, however the steps split it, are what
  // they are in one chunk.
  requests.back().prompt_logprobs = 2;
  testing::FakeDeviceBackend device;
  Engine engine(*model_, device, EngineOptions{});
  ASSERT_TRUE(engine.status().ok()) << engine.status();
  // One prompt alone sizes the activation buffers for its tokens; then nothing more fits.
  const testing::Served warm = testing::ServeOn(engine, {requests[0]})[0];
  ASSERT_EQ(warm.tokens, Alone(requests[0]).tokens);
  ASSERT_EQ(testing::StatsWhenIdle(engine).steps_out_of_memory, 0);
  device.fake_memory().set_budget(device.fake_memory().in_use());

  const std::vector<testing::Served> served = testing::ServeOn(engine, requests);
  for (size_t i = 0; i < requests.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "request " << i);
    EXPECT_EQ(served[i].finish.reason, FinishReason::kLength) << served[i].finish.status;
    const testing::Served want = Alone(requests[i]);
    EXPECT_EQ(served[i].tokens, want.tokens);
    ASSERT_EQ(served[i].logprobs.size(), want.logprobs.size());
    for (size_t t = 0; t < want.logprobs.size(); ++t) {
      EXPECT_NEAR(served[i].logprobs[t], want.logprobs[t], 1e-5) << "token " << t;
    }
    ASSERT_EQ(served[i].prompt_logprobs.size(), want.prompt_logprobs.size());
    for (size_t t = 0; t < want.prompt_logprobs.size(); ++t) {
      EXPECT_NEAR(served[i].prompt_logprobs[t], want.prompt_logprobs[t], 1e-5) << "position " << t;
    }
    EXPECT_EQ(served[i].prompt_top.size(), want.prompt_top.size());
  }
  const EngineStats stats = testing::StatsWhenIdle(engine);
  // Four prompts together are more tokens than the one that sized the buffers.
  EXPECT_GE(stats.steps_out_of_memory, 1);
  EXPECT_LT(stats.step_token_limit, EngineOptions{}.max_batch_tokens);
  EXPECT_EQ(stats.blocks_used, 0);
  EXPECT_EQ(stats.blocks_free + stats.blocks_cached, stats.num_blocks);
}

TEST_F(StepOutOfMemoryTest, ALoneTokenThatDoesNotFitFailsItsRequestAndTheBudgetComesBack) {
  const GenerationRequest request = Request("Once upon a time, there was a little dog.", 28);
  const int prompt_tokens = static_cast<int>(request.prompt.size());
  // At one token a step, the prompt's T steps and one for each generated token after the
  // first: enough that the budget doubles once (below), not twice.
  const int steps = prompt_tokens + request.stop.max_new_tokens - 1;
  ASSERT_GE(steps, Engine::kStepsToRegrow);
  ASSERT_LT(steps, 2 * Engine::kStepsToRegrow);
  testing::FakeDeviceBackend device;
  Engine engine(*model_, device, EngineOptions{});
  ASSERT_TRUE(engine.status().ok()) << engine.status();
  ServeOutOfMemory(engine, device, request);
  EngineStats stats = testing::StatsWhenIdle(engine);
  // Its prompt ran out at T tokens, then ⌊T/2⌋, … down to 2 (⌊log2 T⌋ steps run again),
  // then at one token right after, which failed it.
  int halvings = 0;
  for (int t = prompt_tokens; t > 1; t /= 2) ++halvings;
  EXPECT_EQ(stats.steps_out_of_memory, halvings);
  EXPECT_EQ(stats.step_token_limit, 1);
  EXPECT_EQ(stats.blocks_used, 0);
  EXPECT_EQ(stats.blocks_free + stats.blocks_cached, stats.num_blocks);

  // Memory to spare again: the same request runs one token a step, and the
  // kStepsToRegrow-th step that ran doubles the budget.
  device.fake_memory().set_budget(0);
  const testing::Served after = testing::ServeOn(engine, {request})[0];
  EXPECT_EQ(after.finish.reason, FinishReason::kLength) << after.finish.status;
  EXPECT_EQ(after.tokens, Alone(request).tokens);
  stats = testing::StatsWhenIdle(engine);
  EXPECT_EQ(stats.steps_out_of_memory, halvings);
  EXPECT_EQ(stats.step_token_limit, 2);
}

// What the observer hears of the steps that ran out (on the step thread).
class OutOfMemoryEvents final : public EngineObserver {
 public:
  void OnStep(const StepStats&) override {}
  void OnPreemption() override {}
  void OnPrefixLookup(int, int) override {}
  void OnOutOfMemory(const OutOfMemory& event) override {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(event);
  }
  std::vector<OutOfMemory> events() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_;
  }

 private:
  mutable std::mutex mu_;
  std::vector<OutOfMemory> events_;
};

TEST_F(StepOutOfMemoryTest, AOneTokenStepRunsAgainOnceBeforeItFailsItsRequest) {
  GenerationRequest request = Request("", 4);
  request.prompt = {model_->tokenizer->bos_id()};
  testing::FakeDeviceBackend device;
  OutOfMemoryEvents observer;
  Engine engine(*model_, device, EngineOptions{}, &observer);
  ASSERT_TRUE(engine.status().ok()) << engine.status();
  const testing::Served failed = ServeOutOfMemory(engine, device, request);
  const EngineStats stats = testing::StatsWhenIdle(engine);
  EXPECT_EQ(stats.steps_out_of_memory, 1);
  EXPECT_EQ(stats.step_token_limit, 1);
  // Its one token ran out (run again, under a budget of 1), then again (its request failed).
  const std::vector<EngineObserver::OutOfMemory> events = observer.events();
  ASSERT_EQ(events.size(), 2u);
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(events[i].batch_tokens, 1);
    EXPECT_EQ(events[i].step_token_limit, 1);
    EXPECT_EQ(events[i].request_failed, i == 1);
    EXPECT_EQ(events[i].status, failed.finish.status);
  }
}

}  // namespace
}  // namespace kvlens

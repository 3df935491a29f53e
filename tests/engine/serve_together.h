// Serves requests together through one Engine on a backend and collects what each
// streamed: the engine tests that compare a device path with the CPU's (device_memory_path,
// cuda_engine) run the same requests through both.
#ifndef KVLENS_TESTS_ENGINE_SERVE_TOGETHER_H_
#define KVLENS_TESTS_ENGINE_SERVE_TOGETHER_H_

#include <chrono>
#include <future>
#include <thread>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/model/model.h"
#include "gtest/gtest.h"
#include "kernels/backend.h"

namespace kvlens::testing {

struct Served {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  std::vector<std::vector<TokenLogprob>> top;  // each token's top log-probabilities
  std::vector<std::vector<float>> attention;   // each token's attention rows, when asked
  // With prompt_logprobs: positions 1 … of the prompt, concatenated over the events.
  std::vector<float> prompt_logprobs;
  std::vector<std::vector<TokenLogprob>> prompt_top;
  FinishEvent finish;
};

// Submits every request (their callbacks replaced) to `engine` and waits until all have
// finished.
inline std::vector<Served> ServeOn(Engine& engine, std::vector<GenerationRequest> requests) {
  std::vector<Served> outs(requests.size());
  std::vector<std::promise<void>> done(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    GenerationRequest& r = requests[i];
    r.callbacks.on_token = [&outs, i](const TokenEvent& e) {
      outs[i].tokens.push_back(e.token);
      outs[i].logprobs.push_back(e.logprob);
      outs[i].top.push_back(e.top_logprobs);
      outs[i].attention.push_back(e.attention);
    };
    r.callbacks.on_prompt_logprobs = [&outs, i](const PromptLogprobsEvent& e) {
      Served& o = outs[i];
      EXPECT_EQ(e.first_position, static_cast<int>(o.prompt_logprobs.size()) + 1);
      o.prompt_logprobs.insert(o.prompt_logprobs.end(), e.logprobs.begin(), e.logprobs.end());
      o.prompt_top.insert(o.prompt_top.end(), e.top.begin(), e.top.end());
    };
    r.callbacks.on_finish = [&outs, &done, i](const FinishEvent& e) {
      outs[i].finish = e;
      done[i].set_value();
    };
    const auto id = engine.Submit(std::move(r));
    EXPECT_TRUE(id.ok()) << id.status();
    if (!id.ok()) done[i].set_value();
  }
  for (auto& d : done) d.get_future().wait();
  return outs;
}

// The engine's statistics once its step thread has published the last step's (they are
// published at a step's end, after its requests' on_finish: a test that waited for
// on_finish may read the step before), or after 2 s.
inline EngineStats StatsWhenIdle(const Engine& engine) {
  for (int i = 0; i < 400 && engine.Stats().blocks_used != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return engine.Stats();
}

// ServeOn a new Engine with `options`.
inline std::vector<Served> ServeTogether(const Model& model, kernels::Backend<float>& backend,
                                         std::vector<GenerationRequest> requests,
                                         const EngineOptions& options = EngineOptions{}) {
  Engine engine(model, backend, options);
  EXPECT_TRUE(engine.status().ok()) << engine.status();
  return ServeOn(engine, std::move(requests));
}

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_ENGINE_SERVE_TOGETHER_H_

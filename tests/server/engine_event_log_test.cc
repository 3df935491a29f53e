// EngineEventLog: the engine's events go on to the next observer unchanged, and a step
// that ran out of device memory is one line of the log, with the step's tokens, the
// allocation's error and what happens next.
#include "server/engine_event_log.h"

#include <cstdio>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace kvlens::server {
namespace {

class Recorder final : public EngineObserver {
 public:
  void OnStep(const StepStats& stats) override { steps.push_back(stats.batch_tokens); }
  void OnPreemption() override { ++preemptions; }
  void OnPrefixLookup(int queried_tokens, int hit_tokens) override {
    lookups.push_back({queried_tokens, hit_tokens});
  }
  void OnOutOfMemory(const OutOfMemory& event) override { out_of_memory.push_back(event); }

  std::vector<int> steps;
  int preemptions = 0;
  std::vector<std::pair<int, int>> lookups;
  std::vector<OutOfMemory> out_of_memory;
};

std::string Contents(std::FILE* f) {
  std::rewind(f);
  std::string text;
  for (int c = std::fgetc(f); c != EOF; c = std::fgetc(f)) text.push_back(static_cast<char>(c));
  return text;
}

TEST(EngineEventLogTest, EveryEventGoesOnAndRunningOutOfMemoryIsALogLine) {
  std::FILE* log = std::tmpfile();
  ASSERT_NE(log, nullptr);
  Recorder next;
  EngineEventLog events(next, log);

  EngineObserver::StepStats step;
  step.batch_tokens = 37;
  events.OnStep(step);
  events.OnPreemption();
  events.OnPrefixLookup(48, 32);
  EXPECT_EQ(next.steps, std::vector<int>{37});
  EXPECT_EQ(next.preemptions, 1);
  EXPECT_EQ(next.lookups, (std::vector<std::pair<int, int>>{{48, 32}}));
  EXPECT_EQ(Contents(log), "");  // nothing the metrics count is logged

  const absl::Status error = absl::ResourceExhaustedError("cudaMalloc of 4096 bytes failed");
  events.OnOutOfMemory({96, 48, false, error});
  events.OnOutOfMemory({1, 1, true, error});
  ASSERT_EQ(next.out_of_memory.size(), 2u);
  EXPECT_EQ(next.out_of_memory[0].batch_tokens, 96);
  EXPECT_EQ(next.out_of_memory[1].request_failed, true);
  EXPECT_EQ(Contents(log),
            "kvlens-server: a step of 96 tokens ran out of device memory (cudaMalloc of 4096 "
            "bytes failed); it runs again, steps taking at most 48 tokens for now\n"
            "kvlens-server: a step of 1 token ran out of device memory twice in a row; its "
            "request failed: cudaMalloc of 4096 bytes failed\n");
  std::fclose(log);
}

}  // namespace
}  // namespace kvlens::server

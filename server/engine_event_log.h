// The engine's observer in the server: every event goes on to the metrics, and what an
// operator must hear of that no contract metric counts goes to a log (stderr in
// kvlens-server), one line an event: a step that ran out of device memory (Engine runs it
// again in halves; the line says the budget the steps after it take), or the request a lone
// token that ran out twice failed.
#ifndef KVLENS_SERVER_ENGINE_EVENT_LOG_H_
#define KVLENS_SERVER_ENGINE_EVENT_LOG_H_

#include <cstdio>

#include "engine/engine.h"

namespace kvlens::server {

class EngineEventLog final : public EngineObserver {
 public:
  // `next` (the metrics) and `log` outlive this.
  EngineEventLog(EngineObserver& next, std::FILE* log) : next_(next), log_(log) {}

  void OnStep(const StepStats& stats) override { next_.OnStep(stats); }
  void OnPreemption() override { next_.OnPreemption(); }
  void OnPrefixLookup(int queried_tokens, int hit_tokens) override {
    next_.OnPrefixLookup(queried_tokens, hit_tokens);
  }
  void OnOutOfMemory(const OutOfMemory& event) override;

 private:
  EngineObserver& next_;
  std::FILE* log_;
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_ENGINE_EVENT_LOG_H_

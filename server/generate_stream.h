// GenerateStream: the reactor of one Generate call. Engine events arrive on the engine's
// step thread (never blocked: they are queued under a short mutex); the reactor writes
// them one message at a time, merging tokens that arrived while a write was in flight.
//
//   engine thread: OnToken/OnFinish ─▶ queue ─▶ TryWrite ─▶ StartWrite ┐
//   gRPC thread:   OnWriteDone ─────────────────▶ TryWrite ◀───────────┘
//   gRPC thread:   OnCancel (client gone / deadline) ─▶ Engine::Cancel ─▶ blocks freed
//
// Lifetime: two references, one held by gRPC until OnDone, one by the engine until its
// on_finish callback has returned; whichever drops last deletes the reactor, so neither
// side ever calls into a dead object.
#ifndef KVLENS_SERVER_GENERATE_STREAM_H_
#define KVLENS_SERVER_GENERATE_STREAM_H_

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <optional>

#include "engine/request.h"
#include "kvlens/v1/generation.pb.h"
#include "server/generation_service.h"

namespace kvlens::server {

inline constexpr size_t kPromptLogprobsPerMessage = 128;

class GenerateStream final : public grpc::ServerWriteReactor<v1::GenerateResponse> {
 public:
  GenerateStream(GenerationService& service, Clock::time_point arrival);

  // Validates, submits to the engine, and sends the first message (the request id), or
  // finishes the call with the error.
  void Start(const v1::GenerateRequest& request);

  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  void OnEnginePromptLogprobs(const PromptLogprobsEvent& event);
  void OnEngineToken(const TokenEvent& event);
  void OnEngineFinish(const FinishEvent& event);
  // Starts the next write (or the Finish) if none is in flight. Call without mu_ held.
  void TryWrite();
  // Marks the call finished with `status` and records its metrics; mu_ held.
  void RecordFinish(const grpc::Status& status);
  void Unref();

  GenerationService& service_;
  const Clock::time_point arrival_;
  std::atomic<int> refs_{1};  // gRPC's; the engine's is added at Submit

  std::mutex mu_;
  std::deque<TokenEvent> tokens_;  // not yet written
  // Prompt log-probabilities not yet written; the front one's first prompt_done_ entries
  // were. A message carries at most kPromptLogprobsPerMessage of them (about 25 KB with
  // top-20; a long prompt's in one would pass gRPC's 4 MB message limit), and no token
  // while some wait.
  std::deque<PromptLogprobsEvent> prompt_logprobs_;
  size_t prompt_done_ = 0;
  std::optional<FinishEvent> finish_;  // the engine's last event, once it came
  RequestId id_ = 0;
  bool submitted_ = false;         // id_ is known; writes may start
  bool writing_ = false;           // a StartWrite is in flight
  bool finish_called_ = false;     // Finish / StartWriteAndFinish was called
  bool client_cancelled_ = false;  // OnCancel or a failed write
  bool with_logprobs_ = false;
  AttentionRowsRequest attention_rows_;  // resolved: echoed with every row
  bool header_sent_ = false;
  bool first_token_seen_ = false;
  Clock::time_point last_token_time_;
  v1::GenerateResponse message_;  // the one in flight
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_GENERATE_STREAM_H_

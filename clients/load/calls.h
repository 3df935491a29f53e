// In-flight RPCs of kvlens-load on gRPC's callback API: one reactor per request, no
// thread per stream. Each call measures itself (time to first token, gaps between token
// chunks, end-to-end latency, bytes) and reports exactly once, from OnDone.
#ifndef KVLENS_CLIENTS_LOAD_CALLS_H_
#define KVLENS_CLIENTS_LOAD_CALLS_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "clients/load/workload.h"
#include "kvlens/v1/generation.grpc.pb.h"

namespace kvlens::load {

using Clock = std::chrono::steady_clock;

struct CallResult {
  Kind kind = Kind::kGenerate;
  grpc::StatusCode code = grpc::StatusCode::OK;
  std::string message;              // the error message when code != OK
  double e2e_seconds = 0;           // start → final status
  double ttft_seconds = -1;         // start → first chunk with tokens (-1: none)
  std::vector<double> itl_seconds;  // per generated token after the first (see GenerateCall)
  int prompt_tokens = 0;            // from the final message's usage
  int cached_tokens = 0;
  int output_tokens = 0;            // token ids received
  int64_t response_bytes = 0;       // serialized size of every response message
  std::vector<int32_t> output_ids;  // the ids themselves, when the call was asked to keep them
};

class Call {
 public:
  using DoneFn = std::function<void(Call*, CallResult)>;
  virtual ~Call() = default;
  // Starts the RPC; `done` runs once on a gRPC thread when it has ended.
  virtual void Start(DoneFn done) = 0;
  // Asks the RPC to end now (CANCELLED); `done` still runs.
  virtual void Cancel() = 0;
};

// Chunks may carry several tokens (those produced while the previous chunk was in flight);
// a gap of g before a chunk of k tokens counts as k inter-token samples of g / k, so the
// mean inter-token latency is decode time ÷ tokens after the first, as the server's.
// With keep_ids the result carries the generated token ids (a conversation's next turn
// needs them).
std::unique_ptr<Call> MakeGenerateCall(v1::Generation::Stub* stub, v1::GenerateRequest request,
                                       std::chrono::milliseconds timeout, bool keep_ids = false);

// A stub set for one server address. Interpret is absent where kvlens_proto was built
// without interpret.proto (see CMakeLists.txt).
struct ServerStubs {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Generation::Stub> generation;
  std::shared_ptr<void> interpret;  // v1::Interpret::Stub when KVLENS_LOAD_INTERPRET
};
ServerStubs MakeStubs(const std::string& address);

// Whether interpretability traffic can be sent (compiled with interpret.proto).
bool InterpretSupported();
// An AttentionMaps (all layers and heads of the prompt) or GradientProbe (log p of the
// prompt's last token; gradients w.r.t. the input embeddings) call on `spec`'s prompt.
// Returns null when !InterpretSupported().
std::unique_ptr<Call> MakeInterpretCall(const ServerStubs& stubs, const RequestSpec& spec,
                                        std::chrono::milliseconds timeout);

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_CALLS_H_

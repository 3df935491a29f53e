// An in-process kvlens server over the stories260K test model on 127.0.0.1 (gRPC and the
// metrics exposer on ephemeral ports), with helpers to stream a Generate call and to
// scrape /metrics. Every client call carries a deadline, so no test can hang.
#ifndef KVLENS_TESTS_SERVER_SERVER_TEST_UTIL_H_
#define KVLENS_TESTS_SERVER_SERVER_TEST_UTIL_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine.h"
#include "engine/model/model.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "kernels/cpu/cpu_backend.h"
#include "kvlens/v1/generation.grpc.pb.h"
#include "server/grpc_server.h"
#include "server/metrics.h"

namespace kvlens::testing {

std::string Stories260KPath();

// The greedy continuation of "Once upon a time" by stories260K (llama2.c's reference).
inline constexpr char kReferenceText[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park.";

class TestServer {
 public:
  // Loads stories260K and starts engine, metrics exposer and gRPC server; check ok().
  explicit TestServer(EngineOptions options = DefaultOptions(), int threads = 1,
                      server::InterpretOptions interpret = {});
  // The same over the model at `model_path` (any format LoadModel reads).
  TestServer(const std::string& model_path, EngineOptions options, int threads = 1,
             server::InterpretOptions interpret = {});
  ~TestServer();

  static EngineOptions DefaultOptions();

  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }
  const Model& model() const { return *model_; }
  Engine& engine() { return *engine_; }
  server::GrpcServer& server() { return *server_; }
  v1::Generation::Stub& stub() { return *stub_; }
  grpc::health::v1::Health::Stub& health() { return *health_; }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  std::string address() const;
  int metrics_port() const { return metrics_->exposer_port(); }

 private:
  std::string error_;
  std::unique_ptr<Model> model_;
  std::unique_ptr<kernels::CpuBackend> backend_;
  std::unique_ptr<server::Metrics> metrics_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<server::GrpcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Generation::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

// A deadline for every client call: generous, but bounded.
void SetDeadline(grpc::ClientContext& context, std::chrono::seconds s = std::chrono::seconds(60));

struct StreamResult {
  grpc::Status status;
  int64_t request_id = 0;
  int messages = 0;
  std::vector<int32_t> tokens;
  std::string text;  // concatenated deltas
  std::vector<v1::TokenLogprob> logprobs;
  // GenerateResponse.prompt_logprobs, concatenated; per message that carried some, its
  // prompt_logprobs_position and count; whether any came after a token.
  std::vector<v1::TokenLogprob> prompt_logprobs;
  std::vector<std::pair<int, int>> prompt_logprobs_messages;
  bool prompt_logprobs_after_tokens = false;
  v1::GenerateFinal final;
  bool has_final = false;
};

// Runs a Generate call to the end and collects what it streamed.
StreamResult RunGenerate(v1::Generation::Stub& stub, const v1::GenerateRequest& request);

// A greedy request for `text` with max_new_tokens.
v1::GenerateRequest GreedyRequest(const std::string& text, int max_new_tokens);

// Sends `raw` to 127.0.0.1:port; everything the server wrote before closing ("" when the
// connection fails). 10 s timeouts.
std::string HttpExchange(int port, const std::string& raw);

// GET /metrics from 127.0.0.1:port with a plain socket ("" on failure).
std::string ScrapeMetrics(int port);
// The value of the sample whose name (with labels, as exposed) is `series`; -1 if absent.
double MetricValue(const std::string& exposition, const std::string& series);

// Runs `command` through the shell: its exit code (-1 when it did not exit) and stdout.
std::pair<int, std::string> RunCommand(const std::string& command);

// kvlens-load (KVLENS_LOAD_PATH) against `address` with `flags`, its --json-out report read
// back (empty when none was written) and removed.
struct LoadRun {
  int code = -1;
  std::string output;  // stdout and stderr
  std::string report;  // the JSON report
};
LoadRun RunLoad(const std::string& address, const std::string& flags);

}  // namespace kvlens::testing

#endif  // KVLENS_TESTS_SERVER_SERVER_TEST_UTIL_H_

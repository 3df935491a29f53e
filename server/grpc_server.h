// GrpcServer: builds and owns the grpc::Server with the Generation and Interpret services,
// the standard grpc.health.v1 service and server reflection, and runs the graceful shutdown:
//
//   Shutdown(drain): health NOT_SERVING ─▶ new calls UNAVAILABLE ─▶ Engine::Shutdown(drain)
//                    (running requests finish, or are cancelled when the drain runs out)
//                    ─▶ grpc::Server::Shutdown ─▶ Wait returns
#ifndef KVLENS_SERVER_GRPC_SERVER_H_
#define KVLENS_SERVER_GRPC_SERVER_H_

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "server/generation_service.h"
#include "server/interpret_service.h"
#include "server/metrics.h"

namespace kvlens::server {

struct GrpcServerOptions {
  std::string address = "127.0.0.1:0";  // host:port; port 0 picks a free one
  std::string backend_name;             // reported by GetModelInfo
  int max_message_bytes = 64 << 20;
  InterpretOptions interpret;  // limits and workers of kvlens.v1.Interpret
};

class GrpcServer {
 public:
  // Starts serving. `engine` and `metrics` must outlive the server.
  static absl::StatusOr<std::unique_ptr<GrpcServer>> Start(const GrpcServerOptions& options,
                                                           Engine& engine, Metrics& metrics);
  ~GrpcServer();  // Shutdown(0) if not yet done

  int port() const { return port_; }
  // Where fp32 interpretability requests run: "cpu" or e.g. "cuda:0 (NVIDIA H200)".
  const std::string& interp_device() const { return interpret_service_.device_description(); }
  // A channel to this server that bypasses the network (tests, benchmarks).
  std::shared_ptr<grpc::Channel> InProcessChannel();

  // The first half of Shutdown: health NOT_SERVING and new calls refused with UNAVAILABLE,
  // while running streams go on. Idempotent.
  void BeginDrain();
  // The graceful shutdown above; idempotent, thread-safe, blocks until it is done.
  void Shutdown(std::chrono::milliseconds drain);
  // Blocks until Shutdown has stopped the server.
  void Wait();

 private:
  GrpcServer(Engine& engine, Metrics& metrics, const GrpcServerOptions& options);

  Engine& engine_;
  GenerationService service_;
  InterpretService interpret_service_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::mutex shutdown_mu_;
  bool shut_down_ = false;  // guarded by shutdown_mu_
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_GRPC_SERVER_H_

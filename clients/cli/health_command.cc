// `kvlens-cli health --server HOST:PORT`: asks grpc.health.v1.Health/Check and exits 0
// only when the answer is SERVING. Container HEALTHCHECKs and scripts use it in place of
// grpc_health_probe.
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <iostream>

#include "clients/cli/args.h"
#include "clients/cli/commands.h"
#include "clients/cli/rpc_call.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace kvlens::cli {

int HealthCommand(int argc, char** argv) {
  const std::vector<FlagSpec> specs = {
      {"server", "127.0.0.1:50051", "kvlens-server gRPC address HOST:PORT"},
      {"service", "", "service to ask about (\"\": the whole server; or kvlens.v1.Generation)"},
      {"timeout", "2", "seconds to wait for the answer (connecting included)"},
      {"quiet", "", "print nothing; the exit code says it", true},
  };
  auto args = Args::Parse(argc, argv, 2, specs);
  if (!args.ok()) {
    std::cerr << "kvlens-cli health: " << args.status().message() << "\n";
    return 2;
  }
  if (args->help()) {
    std::cout << Args::Usage("health",
                             "Exits 0 when the server answers grpc.health.v1 Check with "
                             "SERVING, 1 otherwise (NOT_SERVING, draining, unreachable).",
                             specs);
    return 0;
  }
  auto timeout = args->Double("timeout", 0.001, 3600);
  if (!timeout.ok()) {
    std::cerr << "kvlens-cli health: " << timeout.status().message() << "\n";
    return 2;
  }
  auto channel = grpc::CreateChannel(args->Str("server"), grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  context.set_wait_for_ready(true);  // ride out the first connection attempt
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::milliseconds(static_cast<int64_t>(*timeout * 1e3)));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(args->Str("service"));
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status status = stub->Check(&context, request, &response);
  const bool serving =
      status.ok() && response.status() == grpc::health::v1::HealthCheckResponse::SERVING;
  if (!args->Switch("quiet")) {
    if (!status.ok()) {
      std::cerr << args->Str("server") << ": " << RpcErrorText(status) << "\n";
    } else {
      std::cout << args->Str("server") << ": "
                << grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status())
                << "\n";
    }
  }
  return serving ? 0 : 1;
}

}  // namespace kvlens::cli

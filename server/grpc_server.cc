#include "server/grpc_server.h"

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"

namespace kvlens::server {
namespace {

// The service name clients may ask grpc.health.v1 about ("" is the whole server).
constexpr char kServiceName[] = "kvlens.v1.Generation";

}  // namespace

GrpcServer::GrpcServer(Engine& engine, Metrics& metrics, const GrpcServerOptions& options)
    : engine_(engine),
      service_(engine, metrics, options.backend_name, options.interpret.saes),
      interpret_service_(engine, metrics, options.interpret) {}

absl::StatusOr<std::unique_ptr<GrpcServer>> GrpcServer::Start(const GrpcServerOptions& options,
                                                              Engine& engine, Metrics& metrics) {
  // Both are process-wide switches read when a ServerBuilder is created.
  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();

  std::unique_ptr<GrpcServer> server(new GrpcServer(engine, metrics, options));
  if (!server->interpret_service_.status().ok()) return server->interpret_service_.status();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.address, grpc::InsecureServerCredentials(), &server->port_);
  builder.RegisterService(&server->service_);
  builder.RegisterService(&server->interpret_service_);
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.SetMaxSendMessageSize(options.max_message_bytes);
  server->server_ = builder.BuildAndStart();
  if (server->server_ == nullptr || server->port_ == 0) {
    return absl::UnavailableError(
        absl::StrCat("grpc: cannot listen on ", options.address, " (address in use?)"));
  }
  grpc::HealthCheckServiceInterface* health = server->server_->GetHealthCheckService();
  health->SetServingStatus(true);
  health->SetServingStatus(kServiceName, true);
  return server;
}

GrpcServer::~GrpcServer() { Shutdown(std::chrono::milliseconds(0)); }

std::shared_ptr<grpc::Channel> GrpcServer::InProcessChannel() {
  return server_->InProcessChannel(grpc::ChannelArguments());
}

void GrpcServer::BeginDrain() {
  // Load balancers stop sending first; then refuse what still arrives.
  if (server_ != nullptr) server_->GetHealthCheckService()->SetServingStatus(false);
  service_.StartDraining();
  interpret_service_.StartDraining();
}

void GrpcServer::Shutdown(std::chrono::milliseconds drain) {
  std::lock_guard<std::mutex> lock(shutdown_mu_);
  if (shut_down_) return;
  shut_down_ = true;
  if (server_ == nullptr) {  // Start failed: nothing was served, the engine is the caller's
    interpret_service_.Stop();
    return;
  }
  BeginDrain();
  // Every running stream gets its final message (finished, or CANCELLED at the deadline).
  engine_.Shutdown(drain);
  // Probes in progress finish (their reactors must be done before the server stops).
  interpret_service_.Stop();
  // The streams' last writes need a moment to flush; after that gRPC cancels what is left.
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

void GrpcServer::Wait() {
  if (server_ != nullptr) server_->Wait();
}

}  // namespace kvlens::server

// kvlens.v1.Interpret on gRPC's callback API. Each method hands its request to the
// interpretability workers (interpret_workers.h: bounded, apart from generation); the
// worker validates, converts and computes (interpret_runner.h), the status is converted
// once (status_util.h), and kvlens_requests_total{rpc,code} and
// kvlens_interp_*{kind} are recorded. AttentionMaps streams its chunks through a small
// write reactor.
#ifndef KVLENS_SERVER_INTERPRET_SERVICE_H_
#define KVLENS_SERVER_INTERPRET_SERVICE_H_

#include <atomic>
#include <functional>
#include <memory>
#include <vector>

#include "engine/engine.h"
#include "kvlens/v1/interpret.grpc.pb.h"
#include "server/interpret_convert.h"
#include "server/interpret_workers.h"
#include "server/metrics.h"

namespace kvlens::server {

struct InterpretOptions {
  InterpLimits limits;
  InterpretWorkerOptions workers;
  // --sae: the sparse autoencoders SaeFeatures serves (each checked against the model).
  std::vector<std::shared_ptr<const interpret::Sae>> saes;
};

class InterpretService final : public v1::Interpret::CallbackService {
 public:
  // `engine` and `metrics` outlive the service.
  InterpretService(Engine& engine, Metrics& metrics, const InterpretOptions& options);

  // Whether every worker got its --interp-device backend.
  const absl::Status& status() const { return workers_.status(); }
  const std::string& device_description() const { return workers_.device_description(); }
  // New calls get UNAVAILABLE from now on.
  void StartDraining() { draining_.store(true); }
  // Finishes running probes, answers queued ones UNAVAILABLE, joins the workers. Call
  // before the grpc::Server shuts down (their reactors must finish first).
  void Stop() { workers_.Stop(); }

  grpc::ServerWriteReactor<v1::AttentionMapsResponse>* AttentionMaps(
      grpc::CallbackServerContext* context, const v1::AttentionMapsRequest* request) override;
  grpc::ServerUnaryReactor* GradientProbe(grpc::CallbackServerContext* context,
                                          const v1::GradientProbeRequest* request,
                                          v1::GradientProbeResponse* response) override;
  grpc::ServerUnaryReactor* CachedKvProbe(grpc::CallbackServerContext* context,
                                          const v1::CachedKvProbeRequest* request,
                                          v1::CachedKvProbeResponse* response) override;
  grpc::ServerUnaryReactor* Intervene(grpc::CallbackServerContext* context,
                                      const v1::InterveneRequest* request,
                                      v1::InterveneResponse* response) override;
  grpc::ServerUnaryReactor* PatchSweep(grpc::CallbackServerContext* context,
                                       const v1::PatchSweepRequest* request,
                                       v1::PatchSweepResponse* response) override;
  grpc::ServerUnaryReactor* LogitLens(grpc::CallbackServerContext* context,
                                      const v1::LogitLensRequest* request,
                                      v1::LogitLensResponse* response) override;
  grpc::ServerUnaryReactor* Activations(grpc::CallbackServerContext* context,
                                        const v1::ActivationsRequest* request,
                                        v1::ActivationsResponse* response) override;
  grpc::ServerUnaryReactor* LogitAttribution(grpc::CallbackServerContext* context,
                                             const v1::LogitAttributionRequest* request,
                                             v1::LogitAttributionResponse* response) override;
  grpc::ServerUnaryReactor* ListSaes(grpc::CallbackServerContext* context,
                                     const v1::ListSaesRequest* request,
                                     v1::ListSaesResponse* response) override;
  grpc::ServerUnaryReactor* SaeFeatures(grpc::CallbackServerContext* context,
                                        const v1::SaeFeaturesRequest* request,
                                        v1::SaeFeaturesResponse* response) override;

  // Used by the AttentionMaps reactor.
  absl::Status Submit(InterpretWorkers::Task task);
  InterpContext ContextFor(InterpBackends& backends) {
    return InterpContext{engine_, options_.limits, backends, &options_.saes};
  }
  void Record(const char* rpc, const char* kind, const grpc::Status& status, double seconds,
              int64_t bytes);
  bool draining() const { return draining_.load(); }

 private:
  // Runs `fn` on a worker and finishes the unary call with its status.
  grpc::ServerUnaryReactor* RunUnary(grpc::CallbackServerContext* context, const char* rpc,
                                     const char* kind,
                                     std::function<absl::Status(const InterpContext&)> fn,
                                     const google::protobuf::Message* response);

  Engine& engine_;
  Metrics& metrics_;
  const InterpretOptions options_;
  InterpretWorkers workers_;
  std::atomic<bool> draining_{false};
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_INTERPRET_SERVICE_H_

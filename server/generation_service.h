// kvlens.v1.Generation on gRPC's callback API. Each method validates and converts its
// request (request_convert.h), calls the engine, converts the status once
// (status_util.h) and records metrics; Generate streams through a GenerateStream reactor.
#ifndef KVLENS_SERVER_GENERATION_SERVICE_H_
#define KVLENS_SERVER_GENERATION_SERVICE_H_

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "engine/engine.h"
#include "engine/interpret/sae.h"
#include "kvlens/v1/generation.grpc.pb.h"
#include "server/metrics.h"

namespace kvlens::server {

class GenerationService final : public v1::Generation::CallbackService {
 public:
  // `engine` and `metrics` outlive the service. `backend_name` is reported by GetModelInfo;
  // `saes` (kvlens-server --sae) are those Generate's steering vectors may name.
  GenerationService(Engine& engine, Metrics& metrics, std::string backend_name,
                    std::vector<std::shared_ptr<const interpret::Sae>> saes = {});

  // From now on every new call is refused with UNAVAILABLE (streams already running go on).
  void StartDraining() { draining_.store(true); }

  grpc::ServerWriteReactor<v1::GenerateResponse>* Generate(
      grpc::CallbackServerContext* context, const v1::GenerateRequest* request) override;
  grpc::ServerUnaryReactor* Cancel(grpc::CallbackServerContext* context,
                                   const v1::CancelRequest* request,
                                   v1::CancelResponse* response) override;
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const v1::TokenizeRequest* request,
                                     v1::TokenizeResponse* response) override;
  grpc::ServerUnaryReactor* Detokenize(grpc::CallbackServerContext* context,
                                       const v1::DetokenizeRequest* request,
                                       v1::DetokenizeResponse* response) override;
  grpc::ServerUnaryReactor* GetModelInfo(grpc::CallbackServerContext* context,
                                         const v1::GetModelInfoRequest* request,
                                         v1::ModelInfo* response) override;
  grpc::ServerUnaryReactor* OpenSession(grpc::CallbackServerContext* context,
                                        const v1::OpenSessionRequest* request,
                                        v1::OpenSessionResponse* response) override;
  grpc::ServerUnaryReactor* CloseSession(grpc::CallbackServerContext* context,
                                         const v1::CloseSessionRequest* request,
                                         v1::CloseSessionResponse* response) override;

  // Generate streams register their engine request id while it runs, so Cancel can tell
  // a running request from an unknown one.
  void AddActive(RequestId id);
  void RemoveActive(RequestId id);

  Engine& engine() { return engine_; }
  Metrics& metrics() { return metrics_; }
  const std::vector<std::shared_ptr<const interpret::Sae>>& saes() const { return saes_; }
  bool draining() const { return draining_.load(); }

 private:
  // Finishes a unary call with `status` and counts it in kvlens_requests_total.
  grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, const char* rpc,
                                        const absl::Status& status);

  Engine& engine_;
  Metrics& metrics_;
  const std::string backend_name_;
  const std::vector<std::shared_ptr<const interpret::Sae>> saes_;
  std::atomic<bool> draining_{false};
  std::mutex active_mu_;
  absl::flat_hash_set<RequestId> active_;  // guarded by active_mu_
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_GENERATION_SERVICE_H_

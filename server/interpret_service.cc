#include "server/interpret_service.h"

#include <chrono>
#include <mutex>
#include <utility>
#include <vector>

#include "server/interpret_runner.h"
#include "server/status_util.h"

namespace kvlens::server {
namespace {

// The metric `kind` labels (ARCHITECTURE.md's contract).
constexpr char kAttention[] = "attention";
constexpr char kProbe[] = "probe";
constexpr char kIntervene[] = "intervene";
constexpr char kLens[] = "lens";
constexpr char kActivations[] = "activations";
constexpr char kAttribution[] = "attribution";
constexpr char kSae[] = "sae";
constexpr char kPatch[] = "patch";

absl::Status Draining() { return absl::UnavailableError("the server is shutting down"); }

double SecondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One AttentionMaps call: the worker computes every message, then they are written one at
// a time (OnWriteDone → next). gRPC calls OnDone only after Finish, which only this object
// calls, so the worker's pointer stays valid; OnDone deletes it.
class AttentionMapsStream final : public grpc::ServerWriteReactor<v1::AttentionMapsResponse> {
 public:
  AttentionMapsStream(InterpretService& service, const v1::AttentionMapsRequest* request)
      : service_(service), request_(request), arrival_(Clock::now()) {}

  void Start() {
    if (service_.draining()) return Done(Draining());
    absl::Status submitted = service_.Submit([this](InterpBackends* backends) {
      if (backends == nullptr) return Done(Draining());
      auto messages = RunAttentionMaps(service_.ContextFor(*backends), *request_);
      if (!messages.ok()) return Done(messages.status());
      messages_ = *std::move(messages);
      for (const auto& m : messages_) bytes_ += static_cast<int64_t>(m.ByteSizeLong());
      WriteNext();
    });
    if (!submitted.ok()) Done(submitted);
  }

  void OnWriteDone(bool ok) override {
    if (!ok) return Done(absl::CancelledError("the client went away"));
    WriteNext();
  }
  void OnDone() override { delete this; }

 private:
  void WriteNext() {
    if (next_ < messages_.size()) {
      StartWrite(&messages_[next_++]);
    } else {
      Done(absl::OkStatus());
    }
  }
  void Done(const absl::Status& status) {
    const grpc::Status s = ToGrpcStatus(status);
    service_.Record("AttentionMaps", kAttention, s, SecondsSince(arrival_), s.ok() ? bytes_ : 0);
    Finish(s);
  }

  InterpretService& service_;
  const v1::AttentionMapsRequest* request_;
  const Clock::time_point arrival_;
  std::vector<v1::AttentionMapsResponse> messages_;
  size_t next_ = 0;
  int64_t bytes_ = 0;
};

}  // namespace

InterpretService::InterpretService(Engine& engine, Metrics& metrics,
                                   const InterpretOptions& options)
    : engine_(engine), metrics_(metrics), options_(options), workers_(options.workers) {}

absl::Status InterpretService::Submit(InterpretWorkers::Task task) {
  return workers_.Submit(std::move(task));
}

void InterpretService::Record(const char* rpc, const char* kind, const grpc::Status& status,
                              double seconds, int64_t bytes) {
  metrics_.RecordRpc(rpc, status.error_code());
  metrics_.RecordInterp(kind, seconds, bytes);
}

grpc::ServerUnaryReactor* InterpretService::RunUnary(
    grpc::CallbackServerContext* context, const char* rpc, const char* kind,
    std::function<absl::Status(const InterpContext&)> fn,
    const google::protobuf::Message* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  const Clock::time_point arrival = Clock::now();
  auto finish = [this, reactor, rpc, kind, arrival, response](const absl::Status& status) {
    const grpc::Status s = ToGrpcStatus(status);
    Record(rpc, kind, s, SecondsSince(arrival),
           s.ok() ? static_cast<int64_t>(response->ByteSizeLong()) : 0);
    reactor->Finish(s);
  };
  if (draining()) {
    finish(Draining());
    return reactor;
  }
  absl::Status submitted =
      workers_.Submit([this, fn = std::move(fn), finish](InterpBackends* backends) {
        finish(backends == nullptr ? Draining() : fn(ContextFor(*backends)));
      });
  if (!submitted.ok()) finish(submitted);
  return reactor;
}

grpc::ServerWriteReactor<v1::AttentionMapsResponse>* InterpretService::AttentionMaps(
    grpc::CallbackServerContext* /*context*/, const v1::AttentionMapsRequest* request) {
  auto* stream = new AttentionMapsStream(*this, request);  // deletes itself in OnDone
  stream->Start();
  return stream;
}

grpc::ServerUnaryReactor* InterpretService::GradientProbe(grpc::CallbackServerContext* context,
                                                          const v1::GradientProbeRequest* request,
                                                          v1::GradientProbeResponse* response) {
  return RunUnary(
      context, "GradientProbe", kProbe,
      [request, response](const InterpContext& ctx) {
        return RunGradientProbe(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::CachedKvProbe(grpc::CallbackServerContext* context,
                                                          const v1::CachedKvProbeRequest* request,
                                                          v1::CachedKvProbeResponse* response) {
  return RunUnary(
      context, "CachedKvProbe", kProbe,
      [request, response](const InterpContext& ctx) {
        return RunCachedKvProbe(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::Intervene(grpc::CallbackServerContext* context,
                                                      const v1::InterveneRequest* request,
                                                      v1::InterveneResponse* response) {
  return RunUnary(
      context, "Intervene", kIntervene,
      [request, response](const InterpContext& ctx) {
        return RunIntervene(ctx, *request, response);
      },
      response);
}

// An intervention, counted under Intervene's kind.
grpc::ServerUnaryReactor* InterpretService::PatchSweep(grpc::CallbackServerContext* context,
                                                       const v1::PatchSweepRequest* request,
                                                       v1::PatchSweepResponse* response) {
  return RunUnary(
      context, "PatchSweep", kPatch,
      [request, response](const InterpContext& ctx) {
        return RunPatchSweep(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::LogitLens(grpc::CallbackServerContext* context,
                                                      const v1::LogitLensRequest* request,
                                                      v1::LogitLensResponse* response) {
  return RunUnary(
      context, "LogitLens", kLens,
      [request, response](const InterpContext& ctx) {
        return RunLogitLens(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::Activations(grpc::CallbackServerContext* context,
                                                        const v1::ActivationsRequest* request,
                                                        v1::ActivationsResponse* response) {
  return RunUnary(
      context, "Activations", kActivations,
      [request, response](const InterpContext& ctx) {
        return RunActivations(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::LogitAttribution(
    grpc::CallbackServerContext* context, const v1::LogitAttributionRequest* request,
    v1::LogitAttributionResponse* response) {
  return RunUnary(
      context, "LogitAttribution", kAttribution,
      [request, response](const InterpContext& ctx) {
        return RunLogitAttribution(ctx, *request, response);
      },
      response);
}

grpc::ServerUnaryReactor* InterpretService::ListSaes(grpc::CallbackServerContext* context,
                                                     const v1::ListSaesRequest* /*request*/,
                                                     v1::ListSaesResponse* response) {
  return RunUnary(
      context, "ListSaes", kSae,
      [response](const InterpContext& ctx) { return RunListSaes(ctx, response); }, response);
}

grpc::ServerUnaryReactor* InterpretService::SaeFeatures(grpc::CallbackServerContext* context,
                                                        const v1::SaeFeaturesRequest* request,
                                                        v1::SaeFeaturesResponse* response) {
  return RunUnary(
      context, "SaeFeatures", kSae,
      [request, response](const InterpContext& ctx) {
        return RunSaeFeatures(ctx, *request, response);
      },
      response);
}

}  // namespace kvlens::server

// Prometheus metrics with the exact names of ARCHITECTURE.md's table (a contract:
// dashboards and alerts depend on them), rendered by prometheus-cpp's text serializer and
// served on their own HTTP port by MetricsHttpServer (server/metrics_http.h says why not
// prometheus-cpp's civetweb exposer). The engine reports through EngineObserver (step thread); the
// services record request-level metrics from the engine's events.
#ifndef KVLENS_SERVER_METRICS_H_
#define KVLENS_SERVER_METRICS_H_

#include <grpcpp/support/status.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "engine/engine.h"
#include "server/metrics_http.h"

namespace kvlens::server {

class Metrics final : public EngineObserver {
 public:
  // Registers every contract metric. No HTTP listener yet (see StartExposer).
  Metrics();
  ~Metrics() override;

  // Serves GET /metrics on host:port (port 0: an ephemeral one; see exposer_port()).
  absl::Status StartExposer(const std::string& host, int port);
  int exposer_port() const { return exposer_port_; }
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // EngineObserver (called on the engine's step thread; prometheus-cpp updates are
  // lock-free counters/gauges or a short mutex for histograms).
  void OnStep(const StepStats& stats) override;
  void OnPreemption() override;
  void OnPrefixLookup(int queried_tokens, int hit_tokens) override;

  // kvlens_requests_total{rpc, code}: one per finished RPC.
  void RecordRpc(std::string_view rpc, grpc::StatusCode code);
  void RecordTimeToFirstToken(double seconds) { ttft_->Observe(seconds); }
  void RecordInterTokenLatency(double seconds) { itl_->Observe(seconds); }
  void RecordRequestDuration(double seconds) { request_duration_->Observe(seconds); }
  void RecordQueueDuration(double seconds) { queue_duration_->Observe(seconds); }
  void RecordTokens(int prompt, int generated);
  // kvlens_interp_{requests_total, duration_seconds, response_bytes_total}{kind}; kind is
  // one of attention, probe, intervene, lens.
  void RecordInterp(std::string_view kind, double seconds, int64_t bytes);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<MetricsHttpServer> exposer_;
  int exposer_port_ = 0;

  prometheus::Family<prometheus::Counter>* requests_ = nullptr;
  prometheus::Histogram* ttft_ = nullptr;
  prometheus::Histogram* itl_ = nullptr;
  prometheus::Histogram* request_duration_ = nullptr;
  prometheus::Histogram* queue_duration_ = nullptr;
  prometheus::Counter* prompt_tokens_ = nullptr;
  prometheus::Counter* generated_tokens_ = nullptr;
  prometheus::Gauge* running_ = nullptr;
  prometheus::Gauge* waiting_ = nullptr;
  prometheus::Gauge* cache_usage_ = nullptr;
  prometheus::Gauge* blocks_used_ = nullptr;
  prometheus::Gauge* blocks_cached_ = nullptr;
  prometheus::Gauge* blocks_free_ = nullptr;
  prometheus::Counter* prefix_queries_ = nullptr;
  prometheus::Counter* prefix_hits_ = nullptr;
  prometheus::Counter* preemptions_ = nullptr;
  prometheus::Histogram* batch_tokens_ = nullptr;
  prometheus::Family<prometheus::Counter>* interp_requests_ = nullptr;
  prometheus::Family<prometheus::Histogram>* interp_duration_ = nullptr;
  prometheus::Family<prometheus::Counter>* interp_bytes_ = nullptr;
};

}  // namespace kvlens::server

#endif  // KVLENS_SERVER_METRICS_H_

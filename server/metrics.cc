#include "server/metrics.h"

#include <prometheus/text_serializer.h>

#include <exception>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "server/status_util.h"

namespace kvlens::server {
namespace {

using prometheus::Histogram;

// Latencies from sub-millisecond (a decode step of a small model) to a minute.
const Histogram::BucketBoundaries& LatencyBuckets() {
  static const Histogram::BucketBoundaries b = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                0.5,   1,      2.5,   5,    10,    30,   60};
  return b;
}

const Histogram::BucketBoundaries& TokenBuckets() {
  static const Histogram::BucketBoundaries b = {1,   2,   4,   8,    16,   32,   64,
                                                128, 256, 512, 1024, 2048, 4096, 8192};
  return b;
}

// The RPCs of kvlens.v1.Generation; their OK series exist from the start so that a
// dashboard sees zeros rather than "no data".
constexpr const char* kRpcs[] = {"Generate",     "Cancel",      "Tokenize",    "Detokenize",
                                 "GetModelInfo", "OpenSession", "CloseSession"};
constexpr const char* kInterpKinds[] = {"attention",   "probe",       "intervene", "lens",
                                        "activations", "attribution", "sae",       "patch"};

}  // namespace

Metrics::Metrics() : registry_(std::make_shared<prometheus::Registry>()) {
  auto& r = *registry_;
  requests_ = &prometheus::BuildCounter()
                   .Name("kvlens_requests_total")
                   .Help("Finished RPCs by method and gRPC status code.")
                   .Register(r);
  for (const char* rpc : kRpcs) requests_->Add({{"rpc", rpc}, {"code", "OK"}});

  auto histogram = [&](const char* name, const char* help,
                       const Histogram::BucketBoundaries& buckets) {
    return &prometheus::BuildHistogram().Name(name).Help(help).Register(r).Add({}, buckets);
  };
  ttft_ = histogram("kvlens_time_to_first_token_seconds",
                    "Seconds from a Generate call's arrival to its first generated token.",
                    LatencyBuckets());
  itl_ = histogram("kvlens_inter_token_latency_seconds",
                   "Seconds between consecutive generated tokens of one stream.", LatencyBuckets());
  request_duration_ =
      histogram("kvlens_request_duration_seconds",
                "Seconds from a Generate call's arrival to its final message.", LatencyBuckets());
  queue_duration_ = histogram("kvlens_queue_duration_seconds",
                              "Seconds from a Generate call's arrival to its first scheduled "
                              "engine step.",
                              LatencyBuckets());
  batch_tokens_ = histogram("kvlens_batch_tokens",
                            "Tokens (decode + prefill chunks) in one engine step.", TokenBuckets());

  auto counter = [&](const char* name, const char* help) {
    return &prometheus::BuildCounter().Name(name).Help(help).Register(r).Add({});
  };
  prompt_tokens_ = counter("kvlens_prompt_tokens_total", "Prompt tokens of finished requests.");
  generated_tokens_ =
      counter("kvlens_generated_tokens_total", "Tokens generated for finished requests.");
  prefix_queries_ =
      counter("kvlens_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.");
  prefix_hits_ = counter("kvlens_prefix_cache_hits_total",
                         "Prompt tokens found in the prefix cache (not prefilled again).");
  preemptions_ = counter("kvlens_preemptions_total",
                         "Running sequences preempted for lack of KV-cache blocks.");

  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(r).Add({});
  };
  running_ = gauge("kvlens_running_requests", "Sequences the scheduler is running.");
  waiting_ = gauge("kvlens_waiting_requests", "Requests waiting to be scheduled.");
  cache_usage_ = gauge("kvlens_kv_cache_usage_ratio",
                       "KV-cache blocks in use by live sequences and sessions / all blocks.");
  auto& blocks = prometheus::BuildGauge()
                     .Name("kvlens_kv_cache_blocks")
                     .Help(
                         "KV-cache block pool by state: used (referenced), cached "
                         "(unreferenced, holding a reusable prefix), free.")
                     .Register(r);
  blocks_used_ = &blocks.Add({{"state", "used"}});
  blocks_cached_ = &blocks.Add({{"state", "cached"}});
  blocks_free_ = &blocks.Add({{"state", "free"}});

  // Every kind's series exists from the start (at zero), so dashboards see all seven.
  auto& interp_requests = prometheus::BuildCounter()
                              .Name("kvlens_interp_requests_total")
                              .Help("Interpretability calls by kind.")
                              .Register(r);
  auto& interp_duration = prometheus::BuildHistogram()
                              .Name("kvlens_interp_duration_seconds")
                              .Help("Seconds per interpretability call, by kind.")
                              .Register(r);
  auto& interp_bytes = prometheus::BuildCounter()
                           .Name("kvlens_interp_response_bytes_total")
                           .Help("Bytes of interpretability responses, by kind.")
                           .Register(r);
  for (const char* kind : kInterpKinds) {
    interp_requests.Add({{"kind", kind}});
    interp_duration.Add({{"kind", kind}}, LatencyBuckets());
    interp_bytes.Add({{"kind", kind}});
  }
  interp_requests_ = &interp_requests;
  interp_duration_ = &interp_duration;
  interp_bytes_ = &interp_bytes;
}

void Metrics::RecordInterp(std::string_view kind, double seconds, int64_t bytes) {
  // Family::Add returns the existing series for known labels (thread-safe).
  const std::map<std::string, std::string> labels = {{"kind", std::string(kind)}};
  interp_requests_->Add(labels).Increment();
  interp_duration_->Add(labels, LatencyBuckets()).Observe(seconds);
  interp_bytes_->Add(labels).Increment(static_cast<double>(bytes));
}

Metrics::~Metrics() = default;

absl::Status Metrics::StartExposer(const std::string& host, int port) {
  auto server = MetricsHttpServer::Start(host, port, [registry = registry_] {
    return prometheus::TextSerializer().Serialize(registry->Collect());
  });
  if (!server.ok()) return server.status();
  exposer_ = std::move(*server);
  exposer_port_ = exposer_->port();
  return absl::OkStatus();
}

void Metrics::OnStep(const StepStats& stats) {
  if (stats.batch_tokens > 0) batch_tokens_->Observe(stats.batch_tokens);
  running_->Set(stats.running);
  waiting_->Set(stats.waiting);
  blocks_used_->Set(stats.blocks_used);
  blocks_cached_->Set(stats.blocks_cached);
  blocks_free_->Set(stats.blocks_free);
  const int total = stats.blocks_used + stats.blocks_cached + stats.blocks_free;
  cache_usage_->Set(total > 0 ? static_cast<double>(stats.blocks_used) / total : 0.0);
}

void Metrics::OnPreemption() { preemptions_->Increment(); }

void Metrics::OnPrefixLookup(int queried_tokens, int hit_tokens) {
  prefix_queries_->Increment(queried_tokens);
  prefix_hits_->Increment(hit_tokens);
}

void Metrics::RecordRpc(std::string_view rpc, grpc::StatusCode code) {
  requests_->Add({{"rpc", std::string(rpc)}, {"code", std::string(GrpcCodeName(code))}})
      .Increment();
}

void Metrics::RecordTokens(int prompt, int generated) {
  prompt_tokens_->Increment(prompt);
  generated_tokens_->Increment(generated);
}

}  // namespace kvlens::server

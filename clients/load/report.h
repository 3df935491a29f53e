// kvlens-load's report: client-side latency and throughput of the measured phase, and the
// server's own metrics scraped before and after it (counter deltas, gauges now and at
// their peak), printed as a table and as one JSON object.
#ifndef KVLENS_CLIENTS_LOAD_REPORT_H_
#define KVLENS_CLIENTS_LOAD_REPORT_H_

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "clients/load/prom_text.h"
#include "clients/load/runner.h"
#include "clients/load/stats.h"

namespace kvlens::load {

// Gauges sampled during the run (about once a second), for their peaks.
struct GaugePeaks {
  double running = 0;
  double waiting = 0;
  double kv_cache_usage = 0;
  int samples = 0;
  void Observe(const MetricSnapshot& m);
};

struct KindStats {
  int64_t ok = 0;
  int64_t errors = 0;
  Summary latency;         // seconds, successful calls
  Summary first_response;  // seconds, streamed kinds
  int64_t response_bytes = 0;
};

struct Report {
  nlohmann::json config;  // what was run (flags as used)
  double elapsed_seconds = 0;
  int64_t started = 0;
  int64_t dropped = 0;
  int64_t cancelled_at_drain = 0;
  int64_t ok = 0;                                 // successful generate calls
  int64_t errors = 0;                             // failed calls of every kind
  std::map<std::string, int64_t> errors_by_code;  // "RESOURCE_EXHAUSTED" → count
  std::string first_error;                        // one message, for the operator
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;
  int64_t output_tokens = 0;
  double requests_per_second = 0;  // every successful call
  double output_tokens_per_second = 0;
  double total_tokens_per_second = 0;          // prompt + output
  Summary ttft, itl, e2e;                      // seconds, successful generate calls
  std::map<std::string, KindStats> interpret;  // "attention", "probe"
  bool server_metrics = false;
  nlohmann::json server;  // see BuildServerSection
};

std::string GrpcCodeName(grpc::StatusCode code);

Report BuildReport(const PhaseResult& phase, nlohmann::json config);

// The server section: deltas of the contract counters between the snapshots, histogram
// means (sum delta ÷ count delta), gauges after the run and their sampled peaks.
nlohmann::json BuildServerSection(const MetricSnapshot& before, const MetricSnapshot& after,
                                  const GaugePeaks& peaks);

nlohmann::json ToJson(const Report& report);
// The human-readable table (latencies in milliseconds).
std::string FormatTable(const Report& report);

}  // namespace kvlens::load

#endif  // KVLENS_CLIENTS_LOAD_REPORT_H_
